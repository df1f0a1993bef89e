"""Hugging Face transformers checkpoints: the mechanics of reading and writing them (the directory's files:
files.py, safetensors_header.py (config.json's field types: triax/models/json_kinds.py, which the families' adapters share); its front door: directory.py; the export writer: export.py).
What differs per family is that family's adapter, triax/models/<family>/hf.py."""
