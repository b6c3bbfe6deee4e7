"""Batched-LoRA kernels: Triton for CUDA and a torch reference with the same contract (lora.py);
for CPU decode, a C kernel built on the machine (cpu_lora.c, cpu_lora.py)."""
