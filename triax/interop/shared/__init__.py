"""Readers the tools' rooms share: a torch.save file another tool wrote (pickled.py) and AdamW
state by parameter (adamw_state.py)."""
