"""The training configuration: typed dataclasses (the schema) composed by Hydra from YAML.

`triax train model=gpt2 trainer.max_steps=100` composes triax/conf/config.yaml, the chosen model
preset (triax.models.config.PRESETS), and the command-line overrides, then checks the result against
these dataclasses: an unknown key or a value of the wrong type fails with a message naming it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import os
import re
import textwrap
import typing
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import yaml
from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from triax.interop.formats import open_continuation
from triax.data.tokens import TOKEN_DTYPES
from triax.errors import ConfigError
from triax.models.config import PRESETS, GPTConfig, preset_fields
from triax.models.lora import LoRAConfig, check_lora
from triax.train.optim import DECAY_RULES, SCHEDULES
from triax.train.dpo_config import DPOConfig, check_dpo
from triax.runtime.place import detect_place
from triax.parallel.comm_hooks import check_compression
from triax.parallel.mesh import ACTIVATION_CHECKPOINTING, PP_SCHEDULES
from triax.runtime.precision import POLICY_NAMES
from triax.runtime.timeouts import collective_timeout
from triax.tracking.trackers import check_trackers
from triax.train.strict import check_composed, check_overrides, quote_text_values, schema_keys, unknown_key_error


def field_docs(schema: type) -> dict[str, str]:
    """{field name: its docstring} of a config dataclass: the string literal written right under
    each field (torchtitan's style). Read from the class's syntax tree, so the documentation lives
    in one place, next to the field it describes. A schema built from another class's fields
    (ModelConfig) carries them as __field_docs__."""
    if "__field_docs__" in vars(schema):
        return dict(schema.__field_docs__)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(schema)))
    except (OSError, TypeError):  # no source (a frozen build): fields stay undocumented
        return {}
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


# The model keys are GPTConfig's own fields, with its defaults and docstrings: the shape is written
# once, in triax/models/config.py. The data decides vocab_size and block_size, the layout the padding.
DERIVED_MODEL_FIELDS = ("vocab_size", "block_size", "padded_vocab_size")
_gpt_types = typing.get_type_hints(GPTConfig)
ModelConfig = dataclasses.make_dataclass(
    "ModelConfig",
    [("name", str, field(default="gpt-micro"))]
    + [(item.name, _gpt_types[item.name], field(default=item.default))
       for item in dataclasses.fields(GPTConfig) if item.name not in DERIVED_MODEL_FIELDS]
    + [("init_from", Optional[str], field(default=None)),
       ("lora", LoRAConfig, field(default_factory=LoRAConfig))],
    namespace={"__doc__": "The model's architecture and shape: start from a preset (model=NAME), then change any key.",
               "__module__": __name__,
               "__field_docs__": {"name": "The preset this started from (informational once composed).",
                                  "init_from": "Start from these weights: a transformers directory of model_type gpt2, llama, "
                                               "qwen2 or mistral (save_pretrained output or a Hugging Face cache "
                                               "snapshot), a triax run directory, nanoGPT's ckpt.pt, Meta's Llama "
                                               "folder (params.json, consolidated.00.pth) or torchtitan's DCP "
                                               "checkpoint folder (docs/switching.md). Its "
                                               "architecture replaces the shape keys (dropout aside), its tokenizer "
                                               "encodes text data; unset = random initialisation.",
                                  "lora": "LoRA adapters on a frozen base (model.lora.rank > 0): see triax/models/lora.py.",
                                  **{name: doc for name, doc in field_docs(GPTConfig).items()
                                     if name not in DERIVED_MODEL_FIELDS}}})


def gpt_config(model: ModelConfig, vocab_size: int, block_size: int,
               padded_vocab_size: int | None = None) -> GPTConfig:
    """The GPTConfig of these model.* keys, with what the data and the layout decide."""
    shape = {item.name: getattr(model, item.name) for item in dataclasses.fields(model)
             if item.name not in ("name", "init_from", "lora")}
    return GPTConfig(vocab_size=vocab_size, block_size=block_size, padded_vocab_size=padded_vocab_size, **shape)


@dataclass
class DataConfig:
    """What the model learns from and how it is cut into samples."""

    path: Optional[str] = None
    """task=char: fsspec URL of a UTF-8 text file (unset = the built-in corpus); task=tokens: a
    directory (or URL) with train.bin, val.bin and meta.json."""

    task: str = "char"
    """What to learn: char (next-character prediction) | tokens (token files, nanoGPT layout) |
    addition (minGPT's a+b task) | chat (conversations in a local .jsonl/.json/.parquet file, the
    loss on the answers only; docs/chat-lora.md) | preference (prompt/chosen/rejected pairs for
    DPO, dpo.*; docs/preference.md)."""

    block_size: int = 64
    """Context length in characters or tokens (addition: set from digits)."""

    train_split: float = 0.9
    """task=char: leading fraction of the text for training; the tail validates (task=chat: of the
    conversations, when data.val_path is unset)."""

    val_path: Optional[str] = None
    """task=chat: a second file of conversations to validate on (unset = the tail of data.path)."""

    chat_template: Optional[str] = None
    """task=chat: a built-in template (chatml) for a checkpoint without one; unset = the checkpoint's."""

    packing: bool = False
    """task=chat: several conversations per row (each attends only to itself) instead of one, padded."""

    batch_padding: bool = False
    """task=chat: pad each batch to its longest row, not to block_size (less compute on short
    conversations; the same loss)."""

    overlong: str = "truncate"
    """task=chat: a conversation longer than block_size + 1 tokens is cut (truncate) or left out (drop)."""

    truncation_mode: str = "keep_start"
    """task=preference: a sequence longer than block_size loses its end (keep_start) or its start
    (keep_end), as TRL's truncation_mode."""

    shuffle: bool = True
    """Read the samples in a new random order each epoch; false: in order (chat and preference
    files: the records' order)."""

    truncate: float = 1.0
    """task=char: use only this leading fraction of the text."""

    digits: int = 2
    """task=addition: digits of each operand."""

    vocab_size: Optional[int] = None
    """task=tokens: token ids are < this; required when the directory has no meta.json."""

    token_dtype: Optional[str] = None
    """task=tokens: uint16 | uint32 | int32 | ... of train.bin/val.bin; unset = meta.json's, else
    uint16."""


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule (linear warm-up, then cosine decay)."""

    lr: float = 1e-3
    """Peak learning rate, reached after warm-up."""

    min_lr: Optional[float] = None
    """Learning rate at the end of the cosine decay; unset = optim.lr / 10 (nanoGPT's rule), so it
    follows a learning rate given on the command line."""

    warmup_steps: int = 20
    """Linear warm-up length in optimizer steps."""

    schedule: str = "cosine"
    """cosine (warm-up to optim.lr, then cosine decay) | nanogpt (nanoGPT's get_lr: its warm-up
    reaches lr * warmup / (warmup + 1), then the same cosine) | linear, cosine_hf (transformers'
    linear and cosine schedules: warm-up from 0, then a line or the cosine to optim.min_lr) |
    constant (optim.lr throughout)."""

    decay_steps: Optional[int] = None
    """Step at which the decay (cosine or line) reaches optim.min_lr and stays (nanoGPT's
    lr_decay_iters, a Trainer's max_steps); unset = the run's length."""

    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""

    eps: float = 1e-8
    """AdamW's epsilon (torch's default; a transformers Trainer's adam_epsilon)."""

    weight_decay: float = 0.1
    """Decoupled weight decay, on the parameters optim.decay names."""

    decay: str = "linear"
    """What weight decay applies to: linear (Linear weights only) | matrices (every parameter of two
    or more dimensions, embedding tables too: nanoGPT's rule, and transformers Trainer's for these
    models) | all (every parameter: torchtitan's)."""

    fused: Optional[bool] = None
    """AdamW's fused kernel; unset = wherever torch has one (CUDA, CPU). nanoGPT fuses on CUDA only:
    optim.fused=false continues a nanoGPT run on a CPU with its exact arithmetic."""


@dataclass
class TrainerConfig:
    """The run: its length, batches, precision, evaluation, logging and snapshots."""

    max_steps: Optional[int] = 500
    """Optimizer steps; null to train by epochs only."""

    max_epochs: Optional[int] = None
    """Passes over the training set; the first limit reached ends the run."""

    batch_size: int = 32
    """Samples per data-parallel process per micro-batch."""

    grad_accum: int = 1
    """Micro-batches per optimizer step."""

    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping."""

    precision: str = "fp32"
    """fp32 | bf16 (autocast, CPU too) | fp16 (autocast + GradScaler, CUDA)."""

    seed: int = 1337
    """Seeds model init, data order and dropout."""

    device: str = "auto"
    """auto (CUDA if present, else CPU) | cpu | cuda | cuda:N."""

    run_dir: str = "runs/gpt"
    """Where metrics, TensorBoard events and snapshots go."""

    save_every: Optional[int] = None
    """Snapshot every N steps; unset = at every evaluation (trainer.eval_every), as nanoGPT checkpoints
    at each evaluation, so a crash loses at most that many steps; 0 = only at the end, at epoch ends if
    asked, and when stopped by a signal."""

    save_on_epoch_end: bool = False
    """Also snapshot when an epoch of the training set ends."""

    snapshot_dir: Optional[str] = None
    """Where snapshots go: a path or fsspec URL (s3://, memory://...); unset = <run_dir>/snapshots."""

    keep_last: int = 3
    """Complete snapshots to keep; older ones are deleted after each save (0 keeps all)."""

    resume: bool = True
    """Continue from the newest good snapshot if there is one; false starts fresh."""

    continue_from: Optional[str] = None
    """Continue a run nanoGPT began (its ckpt.pt or out_dir) or transformers' Trainer began (a
    checkpoint-N folder of a gpt2 or llama model). Its weights, AdamW state, step, best val loss
    and schedule carry on; keys given on the command line win. Once this run has a snapshot of its
    own, a restart resumes from that."""

    overwrite: bool = False
    """With resume=false, delete an existing run's snapshots instead of refusing to start."""

    max_save_failures: int = 3
    """Consecutive failed snapshot writes (full or unwritable storage) before the run stops."""

    async_save: Optional[bool] = None
    """Write snapshots in the background from a host-memory copy while training goes on (at most one
    in flight); unset = on with CUDA devices (the copy leaves the GPU's memory alone and the write
    overlaps GPU work), off on a CPU (the copy would double the host memory the model and optimizer
    take, and the writer would compete with the step for the same cores)."""

    eval_every: int = 100
    """Evaluate (and sample text) every N steps; 0 disables."""

    eval_batches: int = 0
    """Validation batches (of batch_size windows per data-parallel rank) per evaluation, taken from
    non-overlapping windows spread evenly over the whole validation split; 0 = the whole split,
    every token once."""

    log_every: int = 10
    """Log a line and a record to each tracker every N steps."""

    loggers: List[str] = field(default_factory=lambda: ["tensorboard", "jsonl"])
    """Where the logged records go, any of: tensorboard (<run_dir>/tensorboard), jsonl
    (<run_dir>/metrics.jsonl), wandb (Weights & Biases; pip install 'triax[wandb]'), mlflow
    (pip install 'triax[mlflow]'). W&B and MLflow read their usual environment (WANDB_MODE,
    WANDB_DIR, MLFLOW_TRACKING_URI...)."""

    project: str = "triax"
    """The W&B project and the MLflow experiment the run is logged to."""

    run_name: Optional[str] = None
    """The run's name in W&B and MLflow; unset = the name of run_dir."""

    sample_tokens: int = 200
    """Characters of text sampled at each evaluation."""

    peak_flops: Optional[float] = None
    """Peak FLOP/s of one device, which MFU (model FLOPs utilisation) is reported against; unset =
    the data-sheet peak of a known GPU for the run's precision (triax/tracking/throughput.py), and on a CPU or
    another GPU no MFU: tokens/s alone."""

    stop_grace: float = 30.0
    """Seconds a stop request (SIGTERM, Ctrl-C) waits for the step in progress to end; past it the
    process exits without a snapshot of that step (a restart resumes from the last one). 30 s is the
    grace torchrun and most schedulers give before they kill."""

    collective_timeout: Optional[float] = None
    """Seconds a step phase may stall before the watchdog names the silent rank, writes a report and
    exits (snapshot I/O, start-up and the first step get 5x); unset = $TRIAX_COLLECTIVE_TIMEOUT, else 120."""

    preflight: bool = False
    """Before the model is built, run the fast part of `triax doctor` on the run's own processes:
    memory, the snapshot directory's room and write rate (and that every node shares it), collective
    and per-link bandwidth, stragglers; the table is printed, the report written to
    <run_dir>/doctor.json, and a failed check stops the run before it starts."""

    return_freed_memory: Optional[bool] = None
    """Give freed buffers of 4 MiB and more straight back to the OS (glibc's malloc; per process, from
    the first trainer on): memory per rank falls back after each phase, but every large allocation
    costs fresh pages (slower CPU steps); unset = on when FSDP shards the model (dp_shard > 1).
    MALLOC_MMAP_THRESHOLD_ or GLIBC_TUNABLES malloc settings in the environment win."""


@dataclass
class ParallelConfig:
    """How the processes share the work: data, fully sharded, tensor and pipeline parallel."""

    dp_replicate: int = -1
    """Replicas of the model (DDP; with dp_shard > 1: HSDP); -1 = the rest."""

    dp_shard: int = 1
    """Ranks one copy of the model is sharded over (FSDP2); -1 = the rest."""

    tp: int = 1
    """Tensor-parallel degree (splits each layer); must divide n_head."""

    pp: int = 1
    """Pipeline-parallel stages (splits the layer stack)."""

    cp: int = 1
    """Context-parallel degree: each sequence is cut over cp ranks (long context); block_size a multiple of 2 x cp."""

    ep: int = 1
    """Expert-parallel degree (mixtures of experts): each layer's experts split over this many of the
    dp_shard ranks, tokens exchanged all-to-all; must divide dp_shard and model.num_experts."""

    pp_schedule: str = "1f1b"
    """Pipeline schedule: gpipe | 1f1b | interleaved_1f1b | zero_bubble."""

    pp_microbatches: int = 0
    """Micro-batches per pipeline step; 0 = 2 x pp."""

    pp_balance: List[int] = field(default_factory=list)
    """Layers per pipeline stage, e.g. [3,1]; empty = even."""

    activation_checkpointing: str = "none"
    """Recompute activations in backward to save memory: none | full | selective."""

    compile: bool = False
    """torch.compile each transformer block, and the loss (its fp32 logits never written whole)."""

    bucket_mb: float = 25.0
    """Gradient all-reduce bucket size in MB (DDP)."""

    grad_compression: str = "none"
    """Gradients on the wire: none | bf16 | fp16 | powersgd."""

    powersgd_rank: int = 2
    """Rank of PowerSGD's low-rank approximation."""

    cpu_offload: bool = False
    """FSDP keeps parameter shards, gradients and optimizer state in host memory (needs dp_shard > 1)."""


@dataclass
class DebugConfig:
    """Debugging and fault injection: for reproducing a failure or checking a run's data order.
    Everything here is off by default; none of it belongs in a production run."""

    sample_log: Optional[str] = None
    """Record the global sample ids each step consumed, one line per step ("step epoch id id ..."),
    in the file <sample_log>.rank<N> of each rank; unset = no record."""

    preempt_at_step: Optional[int] = None
    """Act as if SIGTERM reached rank debug.preempt_rank right after this step: every rank stops after
    it, writes a snapshot and exits 0, exactly as on a real preemption; unset = never."""

    preempt_rank: int = 0
    """The rank that receives the injected preemption of debug.preempt_at_step."""


@dataclass
class TrainConfig:
    """Everything `triax train` reads; each section below is one dataclass."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)


_registered = False


def _register_schema() -> None:
    """The schema, and the `model=<preset>` group made from triax.models.config.PRESETS (their one
    home; there are no YAML files for them)."""
    global _registered
    if not _registered:
        store = ConfigStore.instance()
        store.store(name="triax_schema", node=TrainConfig)
        for name in PRESETS:
            store.store(group="model", name=name, node={"name": name, **preset_fields(name)})
        _registered = True


def _model_presets() -> list[str]:
    return list(PRESETS)


def compose_config(overrides: list[str] | None = None) -> TrainConfig:
    """Compose the bundled YAML with `key=value` overrides into a checked TrainConfig. With
    trainer.continue_from, the checkpoint's own settings come first and the overrides win."""
    overrides = quote_text_values(list(overrides or []))
    config = _compose(overrides)
    if config.trainer.continue_from:
        config = _compose(continuation_overrides(config)[0] + overrides)
    return config


def continuation_overrides(config: TrainConfig) -> tuple[list[str], list[str]]:
    """(the `key=value` overrides that continue trainer.continue_from's run as the tool that began
    it would, notes on what could not be carried over)."""
    path = config.trainer.continue_from
    if config.model.init_from:
        raise ConfigError(f"trainer.continue_from={path!r} and model.init_from={config.model.init_from!r} both name "
                          "a checkpoint to start from; give one (continue_from also carries the optimizer and step)")
    run = open_continuation(path)
    if run is None:
        raise ConfigError(f"trainer.continue_from={path!r} is not nanoGPT's ckpt.pt (or an out_dir holding one) "
                          "nor a transformers Trainer's checkpoint-N folder (with trainer_state.json); a triax run "
                          "continues by itself (same trainer.run_dir), and other checkpoints start a run with "
                          "model.init_from")
    parallel = config.parallel
    # Whichever launcher started this process (torchrun, srun, mpirun) says how many there are.
    data_parallel = max(1, detect_place().world_size // max(1, parallel.tp * parallel.pp))
    return run.overrides(data_parallel)


def _compose(overrides: list[str]) -> TrainConfig:
    for override in overrides:
        match = re.fullmatch(r"\+?\+?~?model=(.*)", override)
        if match and match.group(1) not in _model_presets():
            raise ConfigError(f"unknown model preset {match.group(1)!r}; presets are: "
                              f"{', '.join(_model_presets())}")
    check_overrides(overrides, TrainConfig)
    _register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="triax.conf", version_base=None):
            composed = compose(config_name="config", overrides=overrides)
        check_composed(composed, TrainConfig)
        config = OmegaConf.to_object(composed)
    except (HydraException, OmegaConfBaseException) as error:
        raise ConfigError(_one_line(error)) from None
    except yaml.YAMLError as error:  # a config file with a Python tag or broken YAML: never run, one line
        raise ConfigError(f"a config file is not plain YAML ({_one_line(error)}); triax reads only plain "
                          "mappings, lists and scalars (no !!python or other tags)") from None
    finally:
        GlobalHydra.instance().clear()
    validate(config)
    return config


def _one_line(error: Exception) -> str:
    """Hydra wraps OmegaConf's precise message ("Key 'foo' not in 'TrainerConfig'", "Value 'abc'
    could not be converted to Integer") in vaguer ones; report the innermost one with its key."""
    chain = [error]
    while (chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 20:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    keyed = [item for item in chain if "full_key:" in str(item)]
    cause = keyed[-1] if keyed else chain[min(1, len(chain) - 1)]
    text = str(cause).strip() or type(cause).__name__
    first = text.splitlines()[0]
    key = re.search(r"full_key: (\S+)", text)
    if key and re.match(r"Key '.*' not in", first):
        return str(unknown_key_error(key.group(1), sorted(schema_keys(TrainConfig))))
    if key:
        wrong_type = _wrong_type(key.group(1), first)
        if wrong_type:
            return wrong_type
    if key:
        first = f"{key.group(1)}: {first}"
    options = re.search(r"Available options in '[^']*':\n((?:\t\S+\n?)+)", text)
    if options:
        first += "; available: " + ", ".join(options.group(1).split())
    if "Could not override" in first:
        first += "; run `triax train --help` to list the valid keys"
    return f"config error: {first}"


# OmegaConf's name for a type it could not convert to -> how the error names what is expected.
_EXPECTED = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "text"}


def _wrong_type(key: str, message: str) -> str | None:
    """One line for a value of the wrong type: the key, the value, the type expected and the
    default as an example (OmegaConf's own wording names neither the expectation nor an example)."""
    section, _, name = key.partition(".")
    schema = typing.get_type_hints(TrainConfig).get(section)
    item = next((item for item in dataclasses.fields(schema) if item.name == name), None) if schema else None
    if item is None:
        return None
    hint = typing.get_type_hints(schema)[name]
    default = _format_value(_default(item))
    converted = (re.match(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", message)
                 or re.match(r"Value '(.*)' is not a valid (bool)", message))
    expected = _EXPECTED.get(converted.group(2).capitalize().replace("Bool", "Boolean")) if converted else None
    if expected:
        optional = " or null" if typing.get_origin(hint) is typing.Union else ""
        return f"{key}={converted.group(1)} is not {expected}; give {expected}{optional} (default {default})"
    if "is not a ListConfig" in message:
        return f"{key} is a list; write it in brackets (default {key}={default})"
    return None


def _need(ok: bool, key: str, value, what: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid; {what}")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


DEVICE_HELP = "use auto, cpu, cuda or cuda:N"


def _check_device(requested: str) -> None:
    """Syntax only (auto | cpu | cuda | cuda:N); whether CUDA exists is checked where it is used."""
    if requested == "auto":
        return
    try:
        device = torch.device(requested)
    except (RuntimeError, ValueError, TypeError):
        device = None
    _need(device is not None and device.type in ("cpu", "cuda"), "trainer.device", requested, DEVICE_HELP)


def validate(config: TrainConfig) -> None:
    """Every value's range, checked here once, before any file or process group exists."""
    _check_model(config.model)
    _check_data(config.data)
    _check_optim(config.optim)
    _check_trainer(config.trainer)
    _check_parallel(config.parallel)
    _check_debug(config.debug)
    check_dpo(config.dpo)


def _check_model(model: ModelConfig) -> None:
    # GPTConfig owns the shape's rules; the data's sizes are checked in _check_data.
    gpt_config(model, vocab_size=1, block_size=1)
    check_lora(model.lora)


def _check_data(data: DataConfig) -> None:
    _need(data.task in ("char", "tokens", "addition", "chat", "preference"), "data.task", data.task,
          "use char, tokens, addition, chat or preference")
    _need(data.truncation_mode in ("keep_start", "keep_end"), "data.truncation_mode", data.truncation_mode,
          "use keep_start or keep_end")
    _need(data.overlong in ("truncate", "drop"), "data.overlong", data.overlong, "use truncate or drop")
    _need(data.vocab_size is None or data.vocab_size >= 1, "data.vocab_size", data.vocab_size,
          "use 1 or more (or leave it unset to take meta.json's)")
    _need(data.token_dtype is None or data.token_dtype in TOKEN_DTYPES, "data.token_dtype", data.token_dtype,
          f"use one of {', '.join(TOKEN_DTYPES)}")
    _need(data.path is None or data.path.strip() != "", "data.path", data.path,
          "give a file (or leave it unset for the built-in corpus)")
    _need(data.block_size >= 1, "data.block_size", data.block_size, "use 1 or more")
    _need(_finite(data.train_split) and 0 < data.train_split < 1, "data.train_split", data.train_split,
          "use a fraction between 0 and 1 (the tail is the validation set)")
    _need(_finite(data.truncate) and 0 < data.truncate <= 1, "data.truncate", data.truncate, "use 0 < truncate <= 1")
    _need(data.digits >= 1, "data.digits", data.digits, "use 1 or more")


def _check_optim(optim: OptimConfig) -> None:
    _need(_finite(optim.lr) and optim.lr > 0, "optim.lr", optim.lr, "use a positive learning rate such as 1e-3")
    _need(optim.min_lr is None or (_finite(optim.min_lr) and 0 <= optim.min_lr <= optim.lr), "optim.min_lr",
          optim.min_lr, f"use 0 <= min_lr <= optim.lr ({optim.lr}), or leave it unset for optim.lr / 10")
    _need(optim.warmup_steps >= 0, "optim.warmup_steps", optim.warmup_steps, "use 0 or more")
    _need(optim.decay in DECAY_RULES, "optim.decay", optim.decay, f"use one of {', '.join(DECAY_RULES)}")
    _need(optim.schedule in SCHEDULES, "optim.schedule", optim.schedule, f"use one of {', '.join(SCHEDULES)}")
    _need(optim.decay_steps is None or optim.decay_steps >= 1, "optim.decay_steps", optim.decay_steps,
          "use 1 or more, or leave it unset for the run's length")
    _need(_finite(optim.eps) and optim.eps > 0, "optim.eps", optim.eps, "use a number above 0, e.g. 1e-8")
    _need(len(optim.betas) == 2, "optim.betas", optim.betas, "give two values, e.g. [0.9,0.95]")
    _need(all(_finite(beta) and 0 <= beta < 1 for beta in optim.betas), "optim.betas", optim.betas,
          "each beta must be in [0, 1)")
    _need(_finite(optim.weight_decay) and optim.weight_decay >= 0, "optim.weight_decay", optim.weight_decay,
          "use 0 or more")


def _check_trainer(trainer: TrainerConfig) -> None:
    if trainer.max_steps is None and trainer.max_epochs is None:
        raise ConfigError("set trainer.max_steps or trainer.max_epochs (both are null)")
    for name in ("max_steps", "max_epochs"):
        value = getattr(trainer, name)
        _need(value is None or value >= 1, f"trainer.{name}", value, "use 1 or more (or null)")
    for name in ("batch_size", "grad_accum", "log_every", "max_save_failures"):
        _need(getattr(trainer, name) >= 1, f"trainer.{name}", getattr(trainer, name), "use 1 or more")
    _need(trainer.save_every is None or trainer.save_every >= 0, "trainer.save_every", trainer.save_every,
          "use 0 or more (or leave it unset to snapshot at every evaluation)")
    for name in ("eval_every", "eval_batches", "keep_last", "sample_tokens"):
        _need(getattr(trainer, name) >= 0, f"trainer.{name}", getattr(trainer, name), "use 0 or more")
    _need(_finite(trainer.grad_clip) and trainer.grad_clip >= 0, "trainer.grad_clip", trainer.grad_clip,
          "use 0 (no clipping) or a positive norm")
    _need(trainer.precision in POLICY_NAMES, "trainer.precision", trainer.precision,
          f"use one of {', '.join(POLICY_NAMES)}")
    _need(0 <= trainer.seed < 2**63, "trainer.seed", trainer.seed, "use 0 .. 2**63-1")
    _need(trainer.peak_flops is None or (_finite(trainer.peak_flops) and trainer.peak_flops > 0), "trainer.peak_flops",
          trainer.peak_flops, "use a positive FLOP/s figure such as 3.12e14, or leave it unset")
    _need(_finite(trainer.stop_grace) and trainer.stop_grace > 0, "trainer.stop_grace", trainer.stop_grace,
          "use a positive number of seconds")
    _check_device(trainer.device)
    _need(trainer.run_dir.strip() != "", "trainer.run_dir", trainer.run_dir, "give a directory")
    _need(trainer.snapshot_dir is None or trainer.snapshot_dir.strip() != "", "trainer.snapshot_dir",
          trainer.snapshot_dir, "give a directory or URL, or leave it unset for <run_dir>/snapshots")
    if trainer.collective_timeout is not None:
        collective_timeout(trainer.collective_timeout)  # raises with the key and value if not positive
    check_trackers(trainer.loggers, "trainer.loggers")  # names known, packages installed
    _need(trainer.project.strip() != "", "trainer.project", trainer.project, "give a project name")


def _check_parallel(parallel: ParallelConfig) -> None:
    for name in ("dp_replicate", "dp_shard"):
        value = getattr(parallel, name)
        _need(value == -1 or value >= 1, f"parallel.{name}", value, "use 1 or more, or -1 for the rest")
    for name in ("tp", "pp"):
        _need(getattr(parallel, name) >= 1, f"parallel.{name}", getattr(parallel, name), "use 1 or more")
    _need(parallel.pp_schedule in PP_SCHEDULES, "parallel.pp_schedule", parallel.pp_schedule,
          f"use one of {', '.join(PP_SCHEDULES)}")
    _need(parallel.pp_microbatches >= 0, "parallel.pp_microbatches", parallel.pp_microbatches,
          "use 0 (2 x pp) or more")
    _need(all(layers >= 1 for layers in parallel.pp_balance), "parallel.pp_balance", parallel.pp_balance,
          "every stage needs 1 or more layers")
    _need(parallel.activation_checkpointing in ACTIVATION_CHECKPOINTING, "parallel.activation_checkpointing",
          parallel.activation_checkpointing, f"use one of {', '.join(ACTIVATION_CHECKPOINTING)}")
    _need(_finite(parallel.bucket_mb) and parallel.bucket_mb > 0, "parallel.bucket_mb", parallel.bucket_mb,
          "use a positive size in MB")
    check_compression(parallel.grad_compression, parallel.powersgd_rank)


def _check_debug(debug: DebugConfig) -> None:
    _need(debug.preempt_at_step is None or debug.preempt_at_step >= 1, "debug.preempt_at_step",
          debug.preempt_at_step, "use a positive step (or null)")
    _need(debug.preempt_rank >= 0, "debug.preempt_rank", debug.preempt_rank, "use 0 or more")


def final_lr(optim: OptimConfig) -> float:
    """optim.min_lr, or what it follows when unset: optim.lr / 10."""
    return optim.min_lr if optim.min_lr is not None else optim.lr / 10


def snapshot_every(trainer: TrainerConfig) -> int:
    """trainer.save_every, or what it follows when unset: trainer.eval_every."""
    return trainer.save_every if trainer.save_every is not None else trainer.eval_every


def asynchronous_snapshots(trainer: TrainerConfig, device: torch.device) -> bool:
    """trainer.async_save, or what it follows when unset: whether the device is a GPU."""
    return trainer.async_save if trainer.async_save is not None else device.type == "cuda"


def snapshot_root(config: TrainConfig) -> str:
    """Where a run's snapshots live: trainer.snapshot_dir, else <run_dir>/snapshots."""
    return config.trainer.snapshot_dir or os.path.join(config.trainer.run_dir, "snapshots")


def changed_from_preset(model: ModelConfig) -> dict:
    """{key: value} of the shape keys (dropout aside, init_from aside) that differ from preset
    model.name's: what the command line or an experiment changed."""
    preset = ModelConfig(name=model.name, **preset_fields(model.name)) if model.name in PRESETS else ModelConfig()
    return {item.name: getattr(model, item.name) for item in dataclasses.fields(model)
            if item.name not in ("name", "init_from", "dropout") and getattr(model, item.name) != getattr(preset, item.name)}


def absolute_paths(config: TrainConfig) -> None:
    """Make the local paths a run depends on absolute, in place, as the directory it starts in
    resolves them: the run's config.yaml then names its data, its starting checkpoint and its
    snapshots wherever `triax eval`, `generate` or a resume is run from. URLs (s3://...) stay;
    trainer.run_dir stays as given (each command names the run directory anew)."""
    def absolute(path: str | None) -> str | None:
        if not path or "://" in path:
            return path
        return os.path.abspath(os.path.expanduser(path))

    config.data.path = absolute(config.data.path)
    config.model.init_from = absolute(config.model.init_from)
    config.trainer.continue_from = absolute(config.trainer.continue_from)
    config.trainer.snapshot_dir = absolute(config.trainer.snapshot_dir)


def to_dict(config: TrainConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(config))


def from_dict(values: dict) -> TrainConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), values))


def _default(item) -> object:
    if item.default is not dataclasses.MISSING:
        return item.default
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return None


def _format_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(map(_format_value, value)) + "]"
    return str(value).replace(" ", "")


def describe_keys(width: int = 100) -> str:
    """Every key of TrainConfig with its default and docstring, section by section, for
    `triax train --help`; generated from the dataclasses themselves."""
    lines = []
    for section in dataclasses.fields(TrainConfig):
        schema = section.type if isinstance(section.type, type) else _default(section).__class__
        title = " ".join((inspect.getdoc(schema) or "").split())
        if title.startswith(f"{schema.__name__}("):  # dataclass's generated signature, not a docstring
            title = ""
        lines += textwrap.wrap(f"{section.name}: {title}", width=width, subsequent_indent="  ") or [section.name]
        docs = field_docs(schema)
        for item in dataclasses.fields(schema):
            key = f"  {section.name}.{item.name}={_format_value(_default(item))}"
            doc = textwrap.wrap(docs.get(item.name, ""), width=max(40, width - 44)) or [""]
            lines.append(key.ljust(44) + (" " if len(key) >= 44 else "") + doc[0])
            lines += [" " * 44 + more for more in doc[1:]]
    return "\n".join(lines)