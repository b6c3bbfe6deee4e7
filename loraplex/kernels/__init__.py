"""Batched-LoRA kernels: Triton for CUDA and a torch reference with the same contract (lora.py);
for CPU decode, C kernels built on the machine (cpu/*.c, loaded by cpu_lora.py)."""
