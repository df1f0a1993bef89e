"""nanoGPT's checkpoint contents made here (no nanoGPT checkout): a model state dict with its names
and shapes, and a pickled object that would run code if it were unpickled (hostile-file tests)."""

import os

import torch


ARGS = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16, "vocab_size": 67, "bias": True, "dropout": 0.0}


def nanogpt_state(args, seed=0):
    """A model state dict with nanoGPT's names and shapes, every tensor distinct."""
    generator = torch.Generator().manual_seed(seed)
    C, V = args["n_embd"], args["vocab_size"]

    def draw(*shape):
        return 0.1 * torch.randn(*shape, generator=generator)

    state = {"transformer.wte.weight": draw(V, C), "transformer.wpe.weight": draw(args["block_size"], C)}
    shapes = {"ln_1.weight": (C,), "attn.c_attn.weight": (3 * C, C), "attn.c_proj.weight": (C, C),
              "ln_2.weight": (C,), "mlp.c_fc.weight": (4 * C, C), "mlp.c_proj.weight": (C, 4 * C)}
    for layer in range(args["n_layer"]):
        for name, shape in shapes.items():
            state[f"transformer.h.{layer}.{name}"] = draw(*shape) + (1.0 if name.startswith("ln") else 0.0)
            if args["bias"]:
                state[f"transformer.h.{layer}.{name[:-len('weight')]}bias"] = draw(shape[0])
    state["transformer.ln_f.weight"] = 1.0 + draw(C)
    if args["bias"]:
        state["transformer.ln_f.bias"] = draw(C)
    state["lm_head.weight"] = state["transformer.wte.weight"]  # tied, as nanoGPT's state_dict() holds it
    return state


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))
