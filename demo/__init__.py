"""Demo: two small adapters loraplex trains on SmolLM2 and serves by default."""
