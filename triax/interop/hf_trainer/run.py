"""Continuing a run transformers' Trainer began: `triax train trainer.continue_from=out/checkpoint-N`.

A `checkpoint-N` folder holds the model as save_pretrained writes it (config.json,
model.safetensors: read as any transformers directory, triax/interop/hf/directory.py), and beside it:

- trainer_state.json: `global_step` (the weights are those after it; the next step is numbered
  global_step), `max_steps`, `train_batch_size` (per process), `logging_steps`, `best_metric`
  and `log_history` (read as JSON, every field type-checked);
- optimizer.pt: torch's AdamW state_dict, through the weights-only loader (triax/checkpoint/
  pickled.py). Trainer.create_optimizer makes two groups over model.named_parameters(): the
  parameters get_decay_parameter_names keeps (neither a bias nor a norm's: in transformers 5,
  names matching bias, layernorm, rmsnorm, norm, and nn.LayerNorm modules), weight-decayed, then
  the others. torch numbers the state by that order, group after group: `optimizer_order`;
- scheduler.pt: the LambdaLR's state (base_lrs, last_epoch, _last_lr: the rate of the next step).
  The lambda itself is not saved, and lr_scheduler_type and warmup_steps live only in
  training_args.bin;
- training_args.bin (a pickle of TrainingArguments, whose class the weights-only loader refuses)
  and rng_state.pth: not read.

So the settings only training_args.bin holds are TrainingArguments' defaults unless the command
line says otherwise (lr_scheduler_type linear, warmup 0, max_grad_norm 1.0, no gradient
accumulation), and `TrainerRun.check_continuation` verifies them where the checkpoint allows: the continued run's
next learning rate must be scheduler.pt's.
"""

from __future__ import annotations

import math
import os
from typing import Callable

import torch

from triax import safe_files
from triax.interop.shared import adamw_state
from triax.interop.shared.adamw_state import MOMENTS
from triax.interop.shared.pickled import PickledFileError, read_pickled
from triax.errors import printable
from triax.interop.foreign_run import ForeignRun, ScheduleSettings, StoredName, same_name
from triax.interop.hf import directory as hf
from triax.models.config import GPTConfig
from triax.interop.hf.files import CheckpointError, TensorDict, checkpoint_file, copy_tensor

STATE_FILE = "trainer_state.json"
# log_history keeps every logged step (~200 bytes each): a million-step run logged at every step
# stays under this, a file far past it is not one the Trainer wrote.
MAX_STATE_BYTES = 256 * 2**20


def trainer_adapters() -> dict:
    """model_type -> the Hugging Face adapter of the registered family whose Trainer checkpoints
    triax continues (it lists the model's parameters in the optimizer's order)."""
    return {model_type: adapter for model_type, adapter in hf.adapters().items()
            if model_type in getattr(adapter, "TRAINER_TYPES", ())}
# What training_args.bin would say, taken as TrainingArguments' defaults (docs/switching.md).
ASSUMED = ("optim.schedule=linear", "optim.warmup_steps=0", "trainer.grad_clip=1.0", "trainer.grad_accum=1")


def is_trainer_checkpoint(path: str) -> bool:
    """A folder the Trainer saved (checkpoint-N): it has trainer_state.json."""
    return os.path.isdir(path) and os.path.lexists(os.path.join(path, STATE_FILE))


def _integer(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and least <= value < 2**53


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class TrainerCheckpoint:
    """A checked checkpoint-N folder: its config, trainer state, scheduler and optimizer state."""

    def __init__(self, path: str):
        self.path = path
        self.config = hf.read_hf_config(path)
        known = trainer_adapters()
        if self.config["model_type"] not in known:
            raise CheckpointError(f"{path}: model_type {self.config['model_type']!r}; trainer.continue_from "
                                  f"continues a Trainer's {' and '.join(known)} runs (start from its weights "
                                  "with model.init_from instead)")
        self._read_state()
        self._read_scheduler()
        self.optimizer = read_pickled(os.path.join(path, "optimizer.pt"), "the Trainer's optimizer state")

    def _read_state(self) -> None:
        where = os.path.join(self.path, STATE_FILE)
        try:
            state = safe_files.read_json(checkpoint_file(self.path, STATE_FILE, max_bytes=MAX_STATE_BYTES),
                                         MAX_STATE_BYTES)
        except CheckpointError:  # a link out of the folder, a FIFO, too large: said already
            raise
        except (OSError, ValueError, UnicodeDecodeError, RecursionError) as error:
            raise CheckpointError(f"cannot read {where} ({type(error).__name__}: {printable(str(error))[:160]}); "
                                  "it is damaged or not the Trainer's") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{where} holds a JSON {type(state).__name__}, not an object; not the Trainer's")

        def field(key: str, check: Callable[[object], bool], wanted: str, default: object = None):
            value = state.get(key, default)
            if not check(value):
                raise CheckpointError(f"{where}: {key}={printable(repr(value))[:40]} is not {wanted}; the file is "
                                      "damaged or not the Trainer's")
            return value

        self.global_step = field("global_step", lambda v: _integer(v, 1), "an integer >= 1 (a checkpoint after "
                                 "at least one step) and below 2**53")
        self.max_steps = field("max_steps", lambda v: _integer(v, self.global_step),
                               f"an integer >= global_step ({self.global_step}) and below 2**53")
        self.batch_size = field("train_batch_size", lambda v: v is None or _integer(v, 1), "an integer >= 1")
        self.logging_steps = field("logging_steps", lambda v: v is None or (_number(v) and v > 0),
                                   "a number above 0")
        best = field("best_metric", lambda v: v is None or _number(v), "a number or null")
        best_step = field("best_global_step", lambda v: v is None or _integer(v, 0), "an integer or null")
        history = field("log_history", lambda v: isinstance(v, list), "a list", [])
        # best_metric is whatever metric_for_best_model named (training_args.bin): it is the eval
        # loss only if the history logged that eval_loss, at that step.
        self.best_loss = None
        if best is not None and any(isinstance(entry, dict) and entry.get("eval_loss") == best
                                    and (best_step is None or entry.get("step") == best_step) for entry in history):
            self.best_loss = (float(best), best_step if best_step is not None else self.global_step)
        self.best_metric = best

    def _read_scheduler(self) -> None:
        where = os.path.join(self.path, "scheduler.pt")
        scheduler = read_pickled(where, "the Trainer's learning-rate schedule")
        rates = scheduler.get("_last_lr") if isinstance(scheduler, dict) else None
        bases = scheduler.get("base_lrs") if isinstance(scheduler, dict) else None
        if not (isinstance(rates, list) and isinstance(bases, list) and rates and len(rates) == len(bases)
                and all(_number(rate) and rate >= 0 for rate in rates + bases)):
            raise PickledFileError(f"{where} holds no LambdaLR state (base_lrs and _last_lr, numbers >= 0); "
                                   "not the Trainer's schedule")
        if scheduler.get("last_epoch") != self.global_step:
            raise PickledFileError(f"{where}: last_epoch={printable(repr(scheduler.get('last_epoch')))[:40]}, but "
                                   f"trainer_state.json's global_step is {self.global_step}; the files are not of "
                                   "one checkpoint")
        self.base_lr, self.next_lr = float(bases[0]), float(rates[0])


_opened: dict = {}


def open_checkpoint(path: str) -> TrainerCheckpoint:
    """The checked checkpoint at `path`, read once per process (the config is composed from it,
    then the trainer loads it); read again if its optimizer or state file changed."""
    key = [os.path.realpath(path)]
    for name in ("optimizer.pt", STATE_FILE, "scheduler.pt"):
        try:
            info = os.stat(os.path.join(path, name))
            key.append((info.st_mtime_ns, info.st_size, info.st_ino))
        except OSError:  # missing or a dangling link: the reader says so in its words
            return TrainerCheckpoint(path)
    key = tuple(key)
    if key not in _opened:
        _opened.clear()  # one at a time: the optimizer state is twice the model's size
        _opened[key] = TrainerCheckpoint(path)
    return _opened[key]


def release() -> None:
    """Forget the checkpoint read (its optimizer state is twice the model's size) once loaded."""
    _opened.clear()


# ---- the model's parameters as the Trainer's optimizer saw them ----------------------------------

def parameter_names(config: dict) -> list[str]:
    """transformers' model parameters in named_parameters() order, as the family's adapter lists
    them (a tied head is the embedding's, listed once)."""
    return trainer_adapters()[config["model_type"]].trainer_parameters(config)


def decayed(name: str) -> bool:
    """Trainer.get_decay_parameter_names' rule for these models: no bias, no norm's gain (GPT-2's
    ln_* are nn.LayerNorm; Llama's RMSNorms are named *layernorm and norm). What is left is every
    matmul weight and the embedding tables: triax's rule optim.decay=matrices."""
    last_module = name.rsplit(".", 2)[-2]
    return not name.endswith(".bias") and not last_module.startswith("ln_") and not last_module.endswith("norm")


def optimizer_order(config: dict) -> list[str]:
    """The names of AdamW's state indices: the decayed group, then the other, each in
    named_parameters() order (torch numbers the parameters group after group)."""
    names = parameter_names(config)
    return [name for name in names if decayed(name)] + [name for name in names if not decayed(name)]


# ---- the optimizer's state, checked, and its settings as triax keys --------------------------------

def _groups(checkpoint: TrainerCheckpoint) -> list[dict]:
    path, saved = os.path.join(checkpoint.path, "optimizer.pt"), checkpoint.optimizer
    if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict)
            and isinstance(saved.get("param_groups"), list)):
        raise PickledFileError(f"{path} holds no optimizer state_dict ('state' and 'param_groups'); not the "
                               "Trainer's AdamW")
    order = optimizer_order(checkpoint.config)
    decay = sum(1 for name in order if decayed(name))
    groups = saved["param_groups"]
    sizes = [len(group["params"]) if isinstance(group, dict) and isinstance(group.get("params"), list) else -1
             for group in groups]
    listed = [index for group in groups if isinstance(group, dict) for index in group.get("params", ())]
    if sizes != [decay, len(order) - decay] or listed != list(range(len(order))):
        raise PickledFileError(f"{path}: its parameter groups hold {sizes[:8]} parameters, not the [{decay}, "
                               f"{len(order) - decay}] Trainer.create_optimizer makes for this model (weight-decayed, "
                               "then biases and norms); a custom optimizer or frozen parameters cannot be continued")
    first = groups[0]
    betas, eps = first.get("betas"), first.get("eps")
    settings_ok = (isinstance(betas, (list, tuple)) and len(betas) == 2
                   and all(_number(beta) and 0 <= beta < 1 for beta in betas)
                   and _number(eps) and eps > 0 and _number(first.get("weight_decay")) and first["weight_decay"] >= 0
                   and _number(first.get("lr")) and first["lr"] >= 0)
    if not settings_ok:
        raise PickledFileError(f"{path}: its first group's betas={printable(repr(betas))[:40]}, "
                               f"eps={printable(repr(eps))[:20]}, weight_decay="
                               f"{printable(repr(first.get('weight_decay')))[:20]} are not AdamW's settings")
    for key, expected in (("amsgrad", False), ("maximize", False), ("decoupled_weight_decay", True)):
        if any(group.get(key, expected) != expected for group in groups):
            raise PickledFileError(f"{path}: its optimizer has {key}={not expected}, which triax's AdamW does not "
                                   "compute (the Trainer's adamw_torch and adamw_torch_fused do not either)")
    if groups[1].get("weight_decay") != 0 or any(groups[1].get(key) != first.get(key) for key in ("betas", "eps")):
        raise PickledFileError(f"{path}: its second group (biases and norms) has weight_decay="
                               f"{printable(repr(groups[1].get('weight_decay')))[:20]} or betas/eps of its own; "
                               "Trainer.create_optimizer gives it 0 and the first group's")
    return groups


def _overrides(checkpoint: TrainerCheckpoint) -> tuple[list[str], list[str]]:
    """(triax `key=value` overrides that continue the run as the Trainer would, notes on what
    could not be carried over): the optimizer's settings from optimizer.pt, the length from
    trainer_state.json, and TrainingArguments' defaults for what only training_args.bin says."""
    group = _groups(checkpoint)[0]
    betas = [float(beta) for beta in group["betas"]]
    result = [f"optim.lr={checkpoint.base_lr!r}", "optim.min_lr=0.0", *ASSUMED,
              f"optim.decay_steps={checkpoint.max_steps}", f"trainer.max_steps={checkpoint.max_steps}",
              f"optim.betas=[{betas[0]!r},{betas[1]!r}]", f"optim.eps={float(group['eps'])!r}",
              f"optim.weight_decay={float(group['weight_decay'])!r}", "optim.decay=matrices",
              f"optim.fused={'true' if group.get('fused') else 'false'}",
              f"data.vocab_size={checkpoint.config['vocab_size']}"]
    notes = []
    if checkpoint.batch_size is not None:
        result.append(f"trainer.batch_size={checkpoint.batch_size}")
    if isinstance(checkpoint.logging_steps, int) and not isinstance(checkpoint.logging_steps, bool):
        result.append(f"trainer.log_every={checkpoint.logging_steps}")
    dropout = _dropout(checkpoint.config)
    if dropout is None:
        notes.append("its config.json's dropout rates are not one rate triax's model.dropout can apply: "
                     "model.dropout is this run's own")
    else:
        result.append(f"model.dropout={dropout!r}")
    if checkpoint.best_metric is not None and checkpoint.best_loss is None:
        notes.append(f"its best_metric {checkpoint.best_metric:.4g} is not an eval_loss it logged: not carried over")
    return result, notes


def _dropout(config: dict) -> float | None:
    """The dropout rate that makes triax's model.dropout (embeddings, attention, residuals) drop
    what the checkpoint's model drops, if there is one (the family's adapter says)."""
    return trainer_adapters()[config["model_type"]].trainer_dropout(config)


def _check_next_rate(checkpoint: TrainerCheckpoint, rate: float, optim: ScheduleSettings) -> None:
    """`rate`, the continued run's learning rate for its next step (under `optim`, its settings),
    must be the one scheduler.pt holds for that step: the Trainer's lr_scheduler_type and warmup
    are only in training_args.bin, so this is how a schedule given wrongly (or left at the assumed
    defaults) is caught before a step is taken."""
    if not math.isclose(rate, checkpoint.next_lr, rel_tol=1e-9, abs_tol=1e-300):
        raise CheckpointError(
            f"{checkpoint.path}/scheduler.pt: the Trainer's next learning rate (step {checkpoint.global_step}) is "
            f"{checkpoint.next_lr:.6g}, but optim.schedule={optim.schedule} with optim.lr={optim.lr:g}, warmup_steps="
            f"{optim.warmup_steps}, decay_steps={optim.decay_steps} and min_lr={optim.min_lr} gives {rate:.6g}; give "
            "the run's lr_scheduler_type (linear: optim.schedule=linear, cosine: cosine_hf) and warmup_steps "
            "(training_args.bin, which triax does not read)")


def _saved_state(checkpoint: TrainerCheckpoint) -> tuple[dict[str, dict], float]:
    """({transformers parameter name: {"exp_avg": tensor, "exp_avg_sq": tensor}}, AdamW's step
    count), every index checked against the shapes model.safetensors holds."""
    path = os.path.join(checkpoint.path, "optimizer.pt")
    _groups(checkpoint)
    weights = hf.HFWeights(checkpoint.path)
    return adamw_state.moments(checkpoint.optimizer["state"], optimizer_order(checkpoint.config),
                               lambda name: weights.shape(name) if weights.has(name) else None, path,
                               max_step=checkpoint.global_step)


@torch.no_grad()
def _load_optimizer_state(checkpoint: TrainerCheckpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          model_config: GPTConfig, stored_name: StoredName) -> int:
    """Put the Trainer's AdamW moments and step count into `optimizer` over triax's `model` (this
    rank's part of it: FSDP and TP shards, GPT-2's fused c_attn cut into q, k, v, its Conv1D
    moments transposed); returns the number of values read. The optimizer's state must exist
    (torch.distributed.checkpoint's get_optimizer_state_dict creates it)."""
    moments, step = _saved_state(checkpoint)
    family = hf.family_of(checkpoint.config)
    by_key = {key: TensorDict({name: values[key] for name, values in moments.items()}) for key in MOMENTS}
    source_of = family.sources(by_key[MOMENTS[0]], model_config)
    read = 0
    for parameter_name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        name = stored_name(parameter_name)
        state = optimizer.state.get(parameter)
        if state is None or any(key not in state for key in MOMENTS):
            raise RuntimeError(f"the optimizer has no state for {name} to load the Trainer's into")
        source = source_of(name)
        for key in MOMENTS:
            read += copy_tensor(state[key], name, by_key[key], source, model_config.vocab_size)
        state["step"].fill_(step)
    return read


class TrainerRun(ForeignRun):
    """A Trainer's checkpoint-N as a run starts from it (its weights, read as any transformers
    directory's: `directory`) or continues it (the Trainer's state, scheduler and optimizer beside
    them, read on first use: once per process, then let go once loaded). Without `directory`, its
    settings only (`overrides`), as the config is composed before the weights are opened; `opened`:
    that run of the same checkpoint, whose files already read are not read again."""

    kind = "transformers"
    tool_name = "transformers Trainer's"
    can_continue = True

    def __init__(self, path: str, directory: hf.HFDirectory | None = None, opened: TrainerRun | None = None):
        if directory is None:
            super().__init__(path, {}, None)
        else:
            super().__init__(path, directory.architecture, directory.codec, directory.context_reason,
                             directory.description)
        self.directory = directory
        self._checkpoint = None
        if opened is not None:  # handed on: one holder of its files' contents, which load lets go
            self._checkpoint, opened._checkpoint = opened._checkpoint, None
        self._continued = None  # (step, best) once the optimizer state is loaded and let go

    @property
    def checkpoint(self) -> TrainerCheckpoint:
        if self._checkpoint is None:
            self._checkpoint = open_checkpoint(self.path)
        return self._checkpoint

    def load_weights(self, model: torch.nn.Module, model_config: GPTConfig, stored_name: StoredName = same_name) -> None:
        self.directory.load_weights(model, model_config, stored_name)

    def overrides(self, data_parallel: int) -> tuple[list[str], list[str]]:
        """The Trainer's settings (`data_parallel` does not enter: train_batch_size is per process)."""
        return _overrides(self.checkpoint)

    def saved_state(self) -> tuple[dict[str, dict], float]:
        return _saved_state(self.checkpoint)

    def check_continuation(self, optim: ScheduleSettings, rate_at: Callable[[int], float]) -> None:
        checkpoint = self.checkpoint
        _saved_state(checkpoint)
        _check_next_rate(checkpoint, rate_at(checkpoint.global_step), optim)

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_config: GPTConfig,
                             stored_name: StoredName = same_name) -> int:
        checkpoint = self.checkpoint
        read = _load_optimizer_state(checkpoint, model, optimizer, model_config, stored_name)
        # This process keeps only its slices of the moments, now in its optimizer: the rest goes.
        self._continued = checkpoint.global_step, checkpoint.best_loss
        self._checkpoint = None
        release()
        return read

    @property
    def step(self) -> int:
        return self._continued[0] if self._continued is not None else self.checkpoint.global_step

    @property
    def best(self) -> tuple[float, int] | None:
        return self._continued[1] if self._continued is not None else self.checkpoint.best_loss
