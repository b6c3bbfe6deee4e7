"""Batched-LoRA kernels: Triton for CUDA and a torch reference with the same contract (lora.py);
for CPU decode, a C kernel built on the machine (cpu_kernels.c, loaded by cpu_lora.py)."""
