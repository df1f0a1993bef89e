"""transformers Trainer's checkpoint-N folders, continued by the trainer (run.py)."""
