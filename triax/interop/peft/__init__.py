"""PEFT's LoRA adapter directories: read into a triax model and written from a run."""
