"""Llama checkpoints in Meta's layout: Meta's own folder (folder.py) and the names and rotary
order they share with torchtitan's (weights.py)."""
