"""Batched-LoRA kernels: Triton for CUDA, a torch reference with the same contract."""
