"""Hugging Face transformers checkpoints: each family's (gpt2.py, llama.py, moe.py) reading and writing, the
directory's files (files.py, safetensors_header.py, config_types.py) and its front door (directory.py)."""
