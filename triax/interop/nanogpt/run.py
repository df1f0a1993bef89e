"""Continuing a run nanoGPT began: `triax train trainer.continue_from=out/ckpt.pt`.

nanoGPT's train.py saves, with the weights, its AdamW state (`optimizer`), the step it stopped at
(`iter_num`: the weights are those after iter_num steps, the next step is number iter_num), the
best validation loss and its whole `config` (learning_rate, warmup_iters, lr_decay_iters, ...).
Continuing means the next step is the step nanoGPT would have taken: its learning rate from
nanoGPT's get_lr, its AdamW moments and step count, its weight-decay groups.

- `NanoGPTRun.overrides` turns the saved config into triax config keys, placed before the command line's
  (which win), so the run's config.yaml says what it trains with.
- `NanoGPTRun.load_optimizer_state` maps AdamW's state, kept by parameter index in the order nanoGPT's
  configure_optimizers listed them (the parameters of two or more dimensions, then the rest, each
  in named_parameters() order), onto triax's parameters by name, each rank copying only the slice
  of each moment it holds (FSDP and TP shards included).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from triax.interop.shared import adamw_state
from triax.interop.shared.adamw_state import MOMENTS
from triax.interop.nanogpt.checkpoint import NanoGPTCheckpoint, NanoGPTWeights
from triax.interop.shared.pickled import PickledFileError
from triax.interop.foreign_run import ForeignRun, ScheduleSettings, StoredName, same_name
from triax.models.config import GPTConfig
from triax.interop.hf.files import copy_into, copy_tensor

# nanoGPT config key -> (triax key, int or float, the smallest value it may take: 0 or 1)
SETTINGS = {
    "learning_rate": ("optim.lr", float, 0),
    "min_lr": ("optim.min_lr", float, 0),
    "warmup_iters": ("optim.warmup_steps", int, 0),
    "lr_decay_iters": ("optim.decay_steps", int, 1),
    "weight_decay": ("optim.weight_decay", float, 0),
    "grad_clip": ("trainer.grad_clip", float, 0),
    "batch_size": ("trainer.batch_size", int, 1),
    "block_size": ("data.block_size", int, 1),
    "eval_interval": ("trainer.eval_every", int, 1),
    "eval_iters": ("trainer.eval_batches", int, 1),
    "log_interval": ("trainer.log_every", int, 1),
    "max_iters": ("trainer.max_steps", int, 0),
    "gradient_accumulation_steps": ("trainer.grad_accum", int, 1),
    "beta1": ("optim.betas", float, 0),
    "beta2": ("optim.betas", float, 0),
}


def _acceptable(key: str, value: object) -> bool:
    """Whether nanoGPT's train.py could have run with `value` for config key `key`."""
    kind, least = SETTINGS[key][1], SETTINGS[key][2]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    # Counts below 2**48 (no run takes more steps or samples); a larger one is a damaged file.
    good = number and math.isfinite(value) and least <= value < 2**48 and (kind is float or isinstance(value, int))
    return good and (value < 1 if key in ("beta1", "beta2") else True)


def _setting(checkpoint: NanoGPTCheckpoint, key: str):
    value = checkpoint.config.get(key)
    if not _acceptable(key, value):
        kind, least = SETTINGS[key][1], SETTINGS[key][2]
        what = "an integer" if kind is int else "a number"
        raise PickledFileError(f"{checkpoint.path}: its config's {key}={value!r:.40} is not {what} in [{least}, 2**48) "
                               f"nanoGPT's train.py could have run with; fix it or give triax's {SETTINGS[key][0]} "
                               "on the command line")
    return value


def _overrides(checkpoint: NanoGPTCheckpoint, data_parallel: int) -> tuple[list[str], list[str]]:
    """(triax `key=value` overrides that continue the run as nanoGPT would, notes on what could not
    be carried over). `data_parallel`: the new run's data-parallel processes, which share nanoGPT's
    gradient_accumulation_steps (its total over all processes) as its train.py does."""
    config, result, notes = checkpoint.config, [], []
    present = [key for key in SETTINGS if key in config]
    for key in present:
        value = _setting(checkpoint, key)
        target = SETTINGS[key][0]
        if key in ("beta1", "beta2"):
            continue
        if key == "max_iters":
            value += 1  # train.py takes the step numbered max_iters too, then stops
        if key == "gradient_accumulation_steps":
            if value % data_parallel:
                notes.append(f"gradient_accumulation_steps={value} does not divide among {data_parallel} data-parallel "
                             "processes; trainer.grad_accum is this run's own")
                continue
            value //= data_parallel
        result.append(f"{target}={value!r}")
    if "beta1" in config and "beta2" in config:
        result.append(f"optim.betas=[{_setting(checkpoint, 'beta1')!r},{_setting(checkpoint, 'beta2')!r}]")
    decay_lr = config.get("decay_lr", True)
    if not isinstance(decay_lr, bool):
        raise PickledFileError(f"{checkpoint.path}: its config's decay_lr={decay_lr!r:.40} is not true or false")
    result.append(f"optim.schedule={'nanogpt' if decay_lr else 'constant'}")
    result.append("optim.decay=matrices")  # configure_optimizers decays every 2-D parameter
    # Token files without meta.json (nanoGPT's openwebtext has none) hold ids below the model's vocabulary.
    result.append(f"data.vocab_size={checkpoint.model_args['vocab_size']}")
    dropout = checkpoint.dropout
    if isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and 0 <= dropout < 1:
        result.append(f"model.dropout={float(dropout)!r}")
    missing = [key for key in SETTINGS if key not in config]
    if missing:
        notes.append(f"its config lacks {', '.join(missing)}: triax's values are used for those")
    return result, notes


def parameter_names(model_args: dict) -> list[str]:
    """nanoGPT's GPT parameters in named_parameters() order (the tied head is the embedding's)."""
    bias = model_args["bias"]
    names = ["transformer.wte.weight", "transformer.wpe.weight"]
    for layer in range(model_args["n_layer"]):
        for module in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            names.append(f"transformer.h.{layer}.{module}.weight")
            if bias:
                names.append(f"transformer.h.{layer}.{module}.bias")
    names.append("transformer.ln_f.weight")
    if bias:
        names.append("transformer.ln_f.bias")
    return names


def optimizer_order(model_args: dict) -> list[str]:
    """The names of AdamW's parameter indices, as configure_optimizers grouped them: the
    parameters of two or more dimensions (weight-decayed), then the others."""
    names = parameter_names(model_args)
    matrices = [name for name in names if name.endswith(".weight") and ".ln_" not in name]
    return matrices + [name for name in names if name not in matrices]


def _saved_state(checkpoint: NanoGPTCheckpoint) -> tuple[dict[str, dict], float]:
    """({nanoGPT parameter name: {"exp_avg": tensor, "exp_avg_sq": tensor}}, AdamW's step count),
    checked against the model's shapes: every index in place, two groups of nanoGPT's sizes."""
    path, saved = checkpoint.path, checkpoint.optimizer
    if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict)
            and isinstance(saved.get("param_groups"), list)):
        raise PickledFileError(f"{path} holds no AdamW state ('optimizer' with 'state' and 'param_groups'); "
                               "continue from it with model.init_from (weights only) instead")
    order = optimizer_order(checkpoint.model_args)
    matrices = sum(1 for name in order if name.endswith(".weight") and ".ln_" not in name)
    groups = saved["param_groups"]
    sizes = [len(group.get("params", ())) if isinstance(group, dict) else -1 for group in groups]
    listed = [index for group in groups if isinstance(group, dict) for index in group.get("params", ())]
    if sizes != [matrices, len(order) - matrices] or sorted(listed) != list(range(len(order))):
        raise PickledFileError(f"{path}: its optimizer's parameter groups hold {sizes} parameters, not the "
                               f"[{matrices}, {len(order) - matrices}] nanoGPT's configure_optimizers makes for "
                               "this model; the optimizer is not nanoGPT's AdamW")
    if any(group.get("amsgrad") for group in groups):
        raise PickledFileError(f"{path}: its optimizer uses amsgrad, which nanoGPT's AdamW does not")
    def shape_of(name: str) -> tuple[int, ...] | None:
        return tuple(checkpoint.tensors[name].shape) if name in checkpoint.tensors else None

    return adamw_state.moments(saved["state"], order, shape_of, path)


def _load_optimizer_state(checkpoint: NanoGPTCheckpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          vocab_size: int, stored_name: StoredName) -> int:
    """Put nanoGPT's AdamW moments and step count into `optimizer` over triax's `model` (this
    rank's part of it); returns the number of values read. The optimizer's state must exist
    (torch.distributed.checkpoint's get_optimizer_state_dict creates it)."""
    moments, step = _saved_state(checkpoint)
    by_key = {key: NanoGPTWeights(checkpoint, {name: values[key] for name, values in moments.items()})
              for key in MOMENTS}
    read = 0
    for parameter_name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        name = stored_name(parameter_name)
        source = by_key[MOMENTS[0]].source_of(name)
        state = optimizer.state.get(parameter)
        if state is None or any(key not in state for key in MOMENTS):
            raise RuntimeError(f"the optimizer has no state for {name} to load nanoGPT's into")
        for key in MOMENTS:
            read += copy_tensor(state[key], name, by_key[key], source, vocab_size)
        state["step"].fill_(step)
    return read


# nanoGPT's train.py starts best_val_loss at 1e9 and keeps it until its first evaluation (so does
# triax's export, which carries no evaluation over): not a loss to report or to beat.
NANOGPT_UNSET_LOSS = 1e9


def nanogpt_best(loss: object, iter_num: int) -> tuple[float, int] | None:
    """A nanoGPT checkpoint's best validation (loss, step), or None where it has none yet."""
    if loss is None or not math.isfinite(float(loss)) or float(loss) >= NANOGPT_UNSET_LOSS:
        return None
    return float(loss), iter_num


class NanoGPTRun(ForeignRun):
    """nanoGPT's ckpt.pt as a run starts from it (its weights) or continues it (its AdamW state,
    step and settings too). Read whole when opened (a pickle cannot be read by slices), checked
    before any process group."""

    kind = "nanogpt"
    tool_name = "nanoGPT's"
    can_continue = True

    def __init__(self, path: str, checkpoint: NanoGPTCheckpoint):
        """`path`: as given (the ckpt.pt file or the out_dir holding it)."""
        super().__init__(path, checkpoint.architecture(), None)
        self.checkpoint = checkpoint

    def load_weights(self, model: torch.nn.Module, model_config: GPTConfig, stored_name: StoredName = same_name) -> None:
        weights = NanoGPTWeights(self.checkpoint)
        copy_into(model, weights, weights.source_of, model_config.vocab_size, stored_name)

    def overrides(self, data_parallel: int) -> tuple[list[str], list[str]]:
        return _overrides(self.checkpoint, data_parallel)

    def saved_state(self) -> tuple[dict[str, dict], float]:
        return _saved_state(self.checkpoint)

    def check_continuation(self, optim: ScheduleSettings, rate_at: Callable[[int], float]) -> None:
        """nanoGPT's schedule is computed from its own settings (overrides): only its state is checked."""
        _saved_state(self.checkpoint)

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_config: GPTConfig,
                             stored_name: StoredName = same_name) -> int:
        return _load_optimizer_state(self.checkpoint, model, optimizer, model_config.vocab_size, stored_name)

    @property
    def step(self) -> int:
        return self.checkpoint.iter_num

    @property
    def best(self) -> tuple[float, int] | None:
        return nanogpt_best(self.checkpoint.best_val_loss, self.checkpoint.iter_num)


# ---- the other way: a triax run's state as nanoGPT's train.py saves it (triax export --format nanogpt)

def exported_config(config: dict, data_parallel: int) -> dict:
    """nanoGPT's config keys for a triax run's config (a snapshot's), the inverse of `overrides`:
    what `trainer.continue_from` reads back, and a record for whoever resumes it on nanoGPT (whose
    train.py takes its settings from its own command line). Values nanoGPT could not run with
    (eval_every=0, say) are left out."""
    def section(name: str) -> dict:
        value = config.get(name)
        return value if isinstance(value, dict) else {}

    optim, trainer, data, model = section("optim"), section("trainer"), section("data"), section("model")
    betas = optim.get("betas") if isinstance(optim.get("betas"), list) and len(optim["betas"]) == 2 else [None, None]
    lr, max_steps, accum = optim.get("lr"), trainer.get("max_steps"), trainer.get("grad_accum")
    values = {"learning_rate": lr, "min_lr": optim.get("min_lr", None), "warmup_iters": optim.get("warmup_steps"),
              "lr_decay_iters": optim.get("decay_steps") or max_steps, "weight_decay": optim.get("weight_decay"),
              "beta1": betas[0], "beta2": betas[1], "grad_clip": trainer.get("grad_clip"),
              "batch_size": trainer.get("batch_size"), "block_size": data.get("block_size"),
              "eval_interval": trainer.get("eval_every"), "eval_iters": trainer.get("eval_batches"),
              "log_interval": trainer.get("log_every"),
              "max_iters": max_steps - 1 if isinstance(max_steps, int) and max_steps >= 1 else None,
              "gradient_accumulation_steps": accum * data_parallel if isinstance(accum, int) else None}
    if values["min_lr"] is None and _acceptable("learning_rate", lr):
        values["min_lr"] = lr / 10  # triax's rule for an unset optim.min_lr
    exported = {key: value for key, value in values.items() if _acceptable(key, value)}
    exported["decay_lr"] = optim.get("schedule", "cosine") != "constant"
    dropout = model.get("dropout")
    if isinstance(dropout, (int, float)) and not isinstance(dropout, bool):
        exported["dropout"] = float(dropout)
    return exported


def optimizer_state(moments: dict, step: float, model_args: dict, config: dict, lr: float) -> dict:
    """AdamW's state_dict as nanoGPT's configure_optimizers builds it for this model: `moments`
    {"exp_avg": {nanoGPT name: tensor}, "exp_avg_sq": {...}}, every parameter at `step`; the groups'
    settings from `config` (nanoGPT's keys), `lr` the learning rate of the last step taken."""
    order = optimizer_order(model_args)
    matrices = sum(1 for name in order if name.endswith(".weight") and ".ln_" not in name)
    betas = (config.get("beta1", 0.9), config.get("beta2", 0.95))
    # A real AdamW's group, so every setting torch's load_state_dict expects is there.
    template = torch.optim.AdamW([torch.zeros(1)], lr=lr, betas=betas).state_dict()["param_groups"][0]
    groups = [dict(template, params=list(range(matrices)), weight_decay=config.get("weight_decay", 0.1)),
              dict(template, params=list(range(matrices, len(order))), weight_decay=0.0)]
    state = {index: {"step": torch.tensor(float(step)), **{key: moments[key][name].contiguous() for key in MOMENTS}}
             for index, name in enumerate(order)}
    return {"state": state, "param_groups": groups}
