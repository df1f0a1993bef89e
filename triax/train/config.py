"""The training configuration: typed dataclasses (the schema) composed by Hydra from YAML.

`triax train model=gpt2 trainer.max_steps=100` composes triax/conf/config.yaml, the chosen model
preset from triax/conf/model/, and the command-line overrides, then checks the result against
these dataclasses: an unknown key or a value of the wrong type fails with a message naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import OmegaConf

from triax.errors import ConfigError


@dataclass
class ModelConfig:
    name: str = "gpt-micro"  # the preset this started from (informational once composed)
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads; must divide n_embd
    n_embd: int = 128  # width of the residual stream
    dropout: float = 0.0  # dropout on embeddings, attention weights and residual branches
    bias: bool = True  # biases in Linear and LayerNorm layers
    tie_embeddings: bool = False  # share the token embedding with the output head


@dataclass
class DataConfig:
    path: Optional[str] = None  # fsspec URL of a UTF-8 text file; unset = built-in corpus
    task: str = "char"  # char (next-character prediction) | addition (minGPT's a+b task)
    block_size: int = 64  # context length in characters (addition: set from digits)
    train_split: float = 0.9  # leading fraction of the text for training; the tail validates
    truncate: float = 1.0  # use only this leading fraction of the text
    digits: int = 2  # addition task: digits of each operand


@dataclass
class OptimConfig:
    lr: float = 1e-3  # peak learning rate, reached after warm-up
    min_lr: float = 1e-4  # learning rate at the end of the cosine decay
    warmup_steps: int = 20  # linear warm-up length in optimizer steps
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    weight_decay: float = 0.1  # decoupled weight decay on Linear weights only


@dataclass
class TrainerConfig:
    max_steps: Optional[int] = 500  # optimizer steps; null to train by epochs only
    max_epochs: Optional[int] = None  # passes over the training set; the first limit reached ends the run
    batch_size: int = 32  # samples per data-parallel process per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    precision: str = "fp32"  # fp32 | bf16 (autocast, CPU too) | fp16 (autocast + GradScaler, CUDA)
    seed: int = 1337  # seeds model init, data order and dropout
    device: str = "auto"  # auto (CUDA if present, else CPU) | cpu | cuda | cuda:N
    run_dir: str = "runs/gpt"  # where metrics, TensorBoard events and snapshots go
    save_every: int = 0  # snapshot every N steps (0: only at the end, at epoch ends if asked, and when preempted)
    save_on_epoch_end: bool = False  # also snapshot when an epoch of the training set ends
    snapshot_dir: Optional[str] = None  # where snapshots go: a path or fsspec URL (s3://, memory://...); unset = <run_dir>/snapshots
    keep_last: int = 3  # complete snapshots to keep; older ones are deleted after each save (0 keeps all)
    resume: bool = True  # continue from the newest good snapshot if there is one; false starts fresh
    overwrite: bool = False  # with resume=false, delete an existing run's snapshots instead of refusing to start
    max_save_failures: int = 3  # consecutive failed snapshot writes (full or unwritable storage) before the run stops
    eval_every: int = 100  # evaluate (and sample text) every N steps; 0 disables
    eval_batches: int = 10  # validation batches per evaluation
    log_every: int = 10  # log a line and a metrics.jsonl record every N steps
    sample_tokens: int = 200  # characters of text sampled at each evaluation


@dataclass
class ParallelConfig:
    dp_replicate: int = -1  # replicas of the model (DDP; with dp_shard > 1: HSDP); -1 = the rest
    dp_shard: int = 1  # ranks one copy of the model is sharded over (FSDP2); -1 = the rest
    tp: int = 1  # tensor-parallel degree (splits each layer); must divide n_head
    pp: int = 1  # pipeline-parallel stages (splits the layer stack)
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble
    pp_microbatches: int = 0  # micro-batches per pipeline step; 0 = 2 x pp
    pp_balance: List[int] = field(default_factory=list)  # layers per pipeline stage, e.g. [3,1]; empty = even
    activation_checkpointing: str = "none"  # none | full | selective
    compile: bool = False  # torch.compile each transformer block
    bucket_mb: float = 25.0  # gradient all-reduce bucket size in MB (DDP)
    grad_compression: str = "none"  # none | bf16 | fp16 | powersgd: gradients on the wire
    powersgd_rank: int = 2  # rank of PowerSGD's low-rank approximation
    cpu_offload: bool = False  # FSDP keeps parameter shards, gradients and optimizer state in host memory (needs dp_shard > 1)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


_registered = False


def _register_schema() -> None:
    global _registered
    if not _registered:
        from hydra.core.config_store import ConfigStore

        ConfigStore.instance().store(name="triax_schema", node=TrainConfig)
        _registered = True


def _model_presets() -> list[str]:
    from triax.models.gpt import PRESETS

    return list(PRESETS)


def compose_config(overrides: list[str] | None = None) -> TrainConfig:
    """Compose the bundled YAML with `key=value` overrides into a checked TrainConfig."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = list(overrides or [])
    for override in overrides:
        match = re.fullmatch(r"\+?\+?~?model=(.*)", override)
        if match and match.group(1) not in _model_presets():
            raise ConfigError(f"unknown model preset {match.group(1)!r}; presets are: "
                              f"{', '.join(_model_presets())}")
    _register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="triax.conf", version_base=None):
            composed = compose(config_name="config", overrides=overrides)
        config = OmegaConf.to_object(composed)
    except (HydraException, OmegaConfBaseException) as error:
        raise ConfigError(_one_line(error)) from None
    finally:
        GlobalHydra.instance().clear()
    validate(config)
    return config


def _one_line(error: Exception) -> str:
    """Hydra wraps OmegaConf's precise message ("Key 'foo' not in 'TrainerConfig'", "Value 'abc'
    could not be converted to Integer") in a vaguer one; report the precise one with its key."""
    cause = error.__cause__ if error.__cause__ is not None else error
    text = str(cause).strip() or type(cause).__name__
    first = text.splitlines()[0]
    key = re.search(r"full_key: (\S+)", text)
    if key:
        first = f"{key.group(1)}: {first}"
    if "not in" in first or "Could not override" in first:
        first += "; run `triax train --help` to list the valid keys"
    return f"config error: {first}"


def validate(config: TrainConfig) -> None:
    """Checks the types alone cannot express."""
    trainer, data = config.trainer, config.data
    if data.task not in ("char", "addition"):
        raise ConfigError(f"data.task must be 'char' or 'addition', got {data.task!r}")
    if trainer.max_steps is None and trainer.max_epochs is None:
        raise ConfigError("set trainer.max_steps or trainer.max_epochs (both are null)")
    for name in ("max_steps", "max_epochs"):
        value = getattr(trainer, name)
        if value is not None and value <= 0:
            raise ConfigError(f"trainer.{name} must be positive, got {value}")
    for name in ("batch_size", "grad_accum", "eval_batches", "log_every"):
        if getattr(trainer, name) <= 0:
            raise ConfigError(f"trainer.{name} must be positive, got {getattr(trainer, name)}")
    if trainer.max_save_failures <= 0:
        raise ConfigError(f"trainer.max_save_failures must be positive, got {trainer.max_save_failures}")
    for name in ("save_every", "eval_every", "keep_last"):
        if getattr(trainer, name) < 0:
            raise ConfigError(f"trainer.{name} must be >= 0, got {getattr(trainer, name)}")
    if data.block_size <= 0:
        raise ConfigError(f"data.block_size must be positive, got {data.block_size}")
    from triax.parallel.comm_hooks import check_compression

    check_compression(config.parallel.grad_compression, config.parallel.powersgd_rank)
    if len(config.optim.betas) != 2:
        raise ConfigError(f"optim.betas needs two values, got {config.optim.betas}")


def to_dict(config: TrainConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(config))


def from_dict(values: dict) -> TrainConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), values))


def describe_keys() -> str:
    """Every key with its default and comment, for `triax train --help`."""
    import inspect

    lines = []
    for section, schema in (("model", ModelConfig), ("data", DataConfig), ("optim", OptimConfig),
                            ("trainer", TrainerConfig), ("parallel", ParallelConfig)):
        source = inspect.getsource(schema)
        for match in re.finditer(r"^\s+(\w+): [^=]+= (.+?)(?:\s+#\s*(.*))?$", source, re.M):
            name, default, comment = match.groups()
            default = re.sub(r"field\(default_factory=lambda: (.*)\)", r"\1", default)
            lines.append(f"  {section}.{name}={default}".ljust(44) + (comment or ""))
    return "\n".join(lines)
