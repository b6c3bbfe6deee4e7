"""LoRA adapters: reading PEFT directories, a host-memory cache, residency in the page pool, and
the per-step batch that applies many adapters at once."""
