"""Tiny random Phi-3 checkpoints saved by transformers itself (nothing downloaded): Phi3ForCausalLM
with the llama tests' shape (4 query heads on 2 key/value heads, heads of 8 values), its q/k/v and
gate/up fused as transformers stores them, and a rope base of its own."""

import json

import torch

from support.llama_checkpoints import SHAPE, saved

# pad/bos/eos ids inside the 301-token vocabulary (Phi3Config's defaults, 32000, lie past it).
OPTIONS = dict(rope_theta=5000.0, pad_token_id=None, bos_token_id=None, eos_token_id=None)


def hf_model(**options):
    """transformers' Phi3ForCausalLM, every weight random and distinct (norm gains too: transformers
    starts them at one, which would hide a mix-up)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**{**SHAPE, **OPTIONS, **options}))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model.eval()


def save_checkpoint(directory, corpus=None, **options):
    """save_pretrained's directory (config.json, model.safetensors) plus tokenizer.json."""
    return saved(hf_model(**options), directory, corpus)


def copy_checkpoint(source, target, change_tensors=None, change_config=None):
    """A copy of checkpoint `source` in `target`, its tensors (a dict) and config.json (a dict) changed in place."""
    from safetensors.torch import load_file, save_file

    target.mkdir()
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    if change_tensors is not None:
        change_tensors(tensors)
    if change_config is not None:
        change_config(config)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(config))
