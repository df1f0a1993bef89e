"""Other tools' files, one room per tool, each behind one interface (foreign_run.py): Hugging Face
(hf/: config types, safetensors header checks, weights read by per-rank slices, the writer of every
family), PEFT adapters (peft/), nanoGPT's ckpt.pt (nanogpt/: read, continue, export), transformers
Trainer's checkpoint-N (hf_trainer/), Meta's Llama folder (meta/), torchtitan's DCP steps
(torchtitan/), and the readers they share (shared/: pickled files, AdamW state). Callers dispatch once
on the format (formats.py: open_foreign), never on a kind string."""
