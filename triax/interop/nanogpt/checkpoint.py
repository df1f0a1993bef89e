"""nanoGPT's `ckpt.pt`, read and written: what its train.py saves (`model`, `optimizer`,
`model_args`, `iter_num`, `best_val_loss`, `config`) and its sample.py loads.

nanoGPT's GPT is triax's gpt2 architecture with the exact GELU (nn.GELU()), LayerNorm eps 1e-5,
an MLP of 4 x n_embd, the head tied to the token embedding, and biases or none (`bias`). Its
names differ: `transformer.wte/wpe/h.<i>/ln_f`, one fused `attn.c_attn` Linear holding the query,
key and value rows in that order (triax keeps q_proj, k_proj, v_proj), `mlp.c_fc`/`mlp.c_proj`
(triax's up_proj/down_proj). Its Linear weights are stored (out, in) as triax's, so nothing is
transposed. A model saved after torch.compile carries `_orig_mod.` before every name.

The file is a pickle: it is read through torch's weights-only loader only
(triax.interop.shared.pickled), and everything in it is checked before it is used.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

from triax.interop.shared.pickled import PickledFileError, read_pickled
from triax.interop.hf.files import Source, TensorDict

# model_args keys nanoGPT's GPTConfig has, and what each must be.
MODEL_ARGS = {"n_layer": int, "n_head": int, "n_embd": int, "block_size": int, "vocab_size": int, "bias": bool}
MAX_SIZE = 2**31  # no dimension of a real model comes near; a larger one is a damaged file
COMPILED_PREFIX = "_orig_mod."
TRIAX_TO_NANOGPT = {"attn.out_proj": "attn.c_proj", "mlp.up_proj": "mlp.c_fc", "mlp.down_proj": "mlp.c_proj"}
FUSED = ("attn.q_proj", "attn.k_proj", "attn.v_proj")  # c_attn's rows, in this order


class NanoGPTCheckpoint:
    """A validated ckpt.pt: `model_args`, the model's tensors by nanoGPT name (no `_orig_mod.`),
    `iter_num`, `best_val_loss`, the raw `optimizer` state (or None) and `config` (or {})."""

    def __init__(self, path: str):
        self.path = path
        data = read_pickled(path, "a nanoGPT checkpoint")
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict) \
                or not isinstance(data.get("model_args"), dict):
            raise PickledFileError(f"{path} is not a nanoGPT ckpt.pt: it lacks the 'model' and 'model_args' "
                                   "dictionaries nanoGPT's train.py saves")
        self.model_args = _checked_args(data["model_args"], path)
        self.tensors = {}
        for name, tensor in data["model"].items():
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise PickledFileError(f"{path}: the model holds {name!r:.60}, which is not a named tensor")
            self.tensors[name.removeprefix(COMPILED_PREFIX)] = tensor
        self.iter_num = data.get("iter_num", 0)
        self.best_val_loss = data.get("best_val_loss")
        if not (isinstance(self.iter_num, int) and 0 <= self.iter_num < 2**48):
            raise PickledFileError(f"{path}: iter_num={self.iter_num!r:.40} is not a step count")
        if isinstance(self.best_val_loss, torch.Tensor) and self.best_val_loss.numel() == 1:
            self.best_val_loss = float(self.best_val_loss)  # train.py saves the tensor estimate_loss made
        if self.best_val_loss is not None and not isinstance(self.best_val_loss, (int, float)):
            raise PickledFileError(f"{path}: best_val_loss={self.best_val_loss!r:.40} is not a number")
        self.optimizer = data.get("optimizer")
        self.config = data.get("config") if isinstance(data.get("config"), dict) else {}
        self.dropout = data["model_args"].get("dropout")

    def architecture(self) -> dict:
        """triax's GPTConfig fields for this model (dropout stays the new run's choice)."""
        args = self.model_args
        return {"arch": "gpt2", "vocab_size": args["vocab_size"], "block_size": args["block_size"],
                "n_layer": args["n_layer"], "n_head": args["n_head"], "n_embd": args["n_embd"],
                "intermediate_size": 4 * args["n_embd"], "norm_eps": 1e-5, "bias": args["bias"],
                "tie_embeddings": True, "gelu": "exact"}


def _checked_args(args: dict, path: str) -> dict:
    checked = {}
    for key, kind in MODEL_ARGS.items():
        value = args.get(key)
        if key == "bias" and value is None:
            value = True  # nanoGPT's default
        good = isinstance(value, bool) if kind is bool else (
            isinstance(value, int) and not isinstance(value, bool) and 0 < value < MAX_SIZE)
        if not good:
            raise PickledFileError(f"{path}: model_args {key}={value!r:.40} is not a {kind.__name__} nanoGPT writes")
        checked[key] = value
    if checked["n_embd"] % checked["n_head"]:
        raise PickledFileError(f"{path}: model_args n_embd={checked['n_embd']} is not divisible by "
                               f"n_head={checked['n_head']}")
    return checked


def nanogpt_name(name: str) -> tuple[str, int]:
    """A triax GPT parameter's nanoGPT name and which third of a fused c_attn it is (-1: unfused)."""
    if name == "tok_emb.weight":
        return "transformer.wte.weight", -1
    if name == "pos_emb.weight":
        return "transformer.wpe.weight", -1
    if name == "lm_head.weight":
        return "lm_head.weight", -1
    if name.startswith("ln_f."):
        return "transformer." + name, -1
    _, number, rest = name.split(".", 2)
    layer = f"transformer.h.{number}."
    module, kind = rest.rsplit(".", 1)
    if module in FUSED:
        return f"{layer}attn.c_attn.{kind}", FUSED.index(module)
    return layer + TRIAX_TO_NANOGPT.get(module, module) + "." + kind, -1


class NanoGPTWeights(TensorDict):
    """A checkpoint's tensors by the names triax's copy_into asks for (TensorDict's `has`, `entry`,
    `shape`, `slice`): c_attn's thirds are served as tensors of their own. `tensors` (default: the
    model's) may be any tensors laid out as the model's parameters, by nanoGPT name: AdamW's
    moments, say."""

    def __init__(self, checkpoint: NanoGPTCheckpoint, tensors: dict | None = None):
        self.checkpoint = checkpoint
        n_embd = checkpoint.model_args["n_embd"]
        super().__init__(dict(checkpoint.tensors if tensors is None else tensors))
        for name in list(self.tensors):
            if ".attn.c_attn." in name:
                fused = self.tensors[name]
                if fused.dim() < 1 or fused.shape[0] != 3 * n_embd:
                    raise PickledFileError(f"{checkpoint.path}: {name} has shape {list(fused.shape)}, not 3 x "
                                           f"n_embd = {3 * n_embd} rows")
                for third in range(3):
                    self.tensors[f"{name}#{third}"] = fused[third * n_embd:(third + 1) * n_embd]
        if "lm_head.weight" not in self.tensors and "transformer.wte.weight" in self.tensors:
            self.tensors["lm_head.weight"] = self.tensors["transformer.wte.weight"]  # tied

    def source_of(self, name: str) -> Source:
        stored, third = nanogpt_name(name)
        return Source(stored if third < 0 else f"{stored}#{third}")


def is_nanogpt_checkpoint(path: str) -> bool:
    """A ckpt.pt file, or a nanoGPT out_dir holding one."""
    # lexists: a link or FIFO named ckpt.pt is still this kind of source, refused by the reader.
    if os.path.isdir(path):
        return os.path.lexists(os.path.join(path, "ckpt.pt"))
    return path.endswith(".pt") and os.path.lexists(path)


_opened: dict = {}


def open_checkpoint(path: str) -> NanoGPTCheckpoint:
    """The checked ckpt.pt at `path` (a file or an out_dir), read once per process: the config is
    composed from it (trainer.continue_from), then the trainer loads it; read again only if the
    file changed."""
    path = checkpoint_file(path)
    try:
        info = os.stat(path)
    except OSError:  # missing, a dangling link: the reader says so in its words
        return NanoGPTCheckpoint(path)
    key = (os.path.realpath(path), info.st_mtime_ns, info.st_size, info.st_ino)
    if key not in _opened:
        _opened.clear()  # one at a time: a checkpoint is as large as its model and optimizer
        _opened[key] = NanoGPTCheckpoint(path)
    return _opened[key]


def checkpoint_file(path: str) -> str:
    return os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path


def to_nanogpt_state(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """triax GPT tensors by name (a mapping) -> nanoGPT's model state dict (c_attn fused again;
    the tied head stored under both names, as nanoGPT's state_dict() holds it)."""
    state, fused = {}, {}
    for name in tensors.keys():
        stored, third = nanogpt_name(name)
        if third < 0:
            state[stored] = tensors[name].contiguous()
        else:
            fused.setdefault(stored, [None, None, None])[third] = tensors[name]
    for stored, parts in fused.items():
        if any(part is None for part in parts):
            raise PickledFileError(f"the model lacks part of {stored} (query, key and value are written together)")
        state[stored] = torch.cat(parts, dim=0).contiguous()
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    return state
