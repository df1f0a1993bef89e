"""nanoGPT's ckpt.pt: read (checkpoint.py), continued (run.py) and written back (export.py)."""
