"""The training configuration's schema: typed dataclasses, a docstring under every field.

`triax train model=gpt2 trainer.max_steps=100` composes triax/conf/config.yaml, the chosen model
preset (triax.models.config.PRESETS), and the command-line overrides (triax.config.compose), then
checks the result against these dataclasses and each value's range (triax.config.validate): an
unknown key or a value of the wrong type fails with a message naming it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import textwrap
import typing
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from triax.models.config import PRESETS, GPTConfig, preset_fields
from triax.models.lora_config import LoRAConfig
from triax.objectives.dpo.config import DPOConfig
from triax.objectives.grpo.config import GRPOConfig


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
class SourceConfig:
    """One source of a weighted mixture (data.sources)."""

    path: str = ""
    """A token directory (nanoGPT), a Megatron dataset's prefix or a glob of llm.c shards."""

    weight: float = 1.0
    """Its share of the training samples (the weights are divided by their sum), held at every
    point of the run (Megatron's blending)."""

    val_path: Optional[str] = None
    """A Megatron prefix or a glob of shards to validate this source on (unset = the tail of path;
    a token directory has its val.bin)."""

    name: Optional[str] = None
    """Its name in the log (val_loss/NAME); unset = the last part of path."""


@dataclass
class DataConfig:
    """What the model learns from and how it is cut into samples."""

    path: Optional[str] = None
    """task=char: fsspec URL of a UTF-8 text file (unset = the built-in corpus); task=tokens: a
    directory (or URL) with train.bin, val.bin and meta.json (nanoGPT), the prefix of a Megatron
    dataset (PREFIX.bin + PREFIX.idx) or a glob of llm.c / modded-nanogpt shards (docs/data.md)."""

    task: str = "char"
    """What to learn: char (next-character prediction) | tokens (token files, nanoGPT layout) |
    addition (minGPT's a+b task) | chat (conversations in a local .jsonl/.json/.parquet file, the
    loss on the answers only; docs/chat-lora.md) | preference (prompt/chosen/rejected pairs for
    DPO, dpo.*; docs/preference.md) | grpo (prompts; completions sampled and scored by reward
    functions, grpo.*; docs/grpo.md)."""

    block_size: int = 64
    """Context length in characters or tokens (addition: set from digits)."""

    train_split: float = 0.9
    """task=char: leading fraction of the text for training; the tail validates (task=chat: of the
    conversations; task=tokens: of a Megatron dataset's or shards' tokens; when data.val_path is unset)."""

    val_path: Optional[str] = None
    """task=chat: a second file of conversations to validate on; task=tokens: a Megatron prefix or
    a glob of shards to validate on (unset = the tail of data.path)."""

    chat_template: Optional[str] = None
    """task=chat: a built-in template (chatml) for a checkpoint without one; unset = the checkpoint's."""

    packing: bool = False
    """task=chat: several conversations per row (each attends only to itself) instead of one, padded.
    task=tokens: documents never see each other: within a window, attention stops at document
    boundaries and positions restart at each document (a Megatron dataset's index says where
    documents begin; other formats need data.eot_token)."""

    eot_token: Optional[int] = None
    """task=tokens with data.packing: the end-of-text token id that begins each document in files
    without a document index (50256 for GPT-2's tokens, as llm.c and modded-nanogpt write them)."""

    score_document_starts: bool = True
    """task=tokens with data.packing: score the target that begins the next document (predicted
    from the end of the one before); false: only each document's own tokens are targets, exactly
    as if each document were alone."""

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

    sources: List[SourceConfig] = field(default_factory=list)
    """task=tokens: a weighted mixture instead of data.path, e.g.
    data.sources=[{path:web,weight:0.7},{path:code,weight:0.3}] (docs/data.md); each source is
    validated on its own (val_loss/NAME in the log; val_loss is their weighted mean)."""


# What weight decay applies to (optim.decay): triax's rule, nanoGPT's (and transformers Trainer's
# for these models: biases and norm gains are the only parameters under two dimensions), torchtitan's.
DECAY_RULES = ("linear", "matrices", "all")
# The learning-rate schedules (optim.schedule): triax's own cosine, nanoGPT's, transformers'.
SCHEDULES = ("cosine", "nanogpt", "linear", "cosine_hf", "constant")


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

    max_logits_mb: Optional[float] = None
    """Most fp32 logits (MB: a micro-batch's positions x vocabulary x 4 bytes) the token loss (training
    and validation) and the preference loss hold at once; larger logits are computed in chunks of
    positions that fit, each recomputed in the backward (not under pp). 0 = no limit: the whole logits.
    Unset: 256 on a CPU, a quarter of the device's memory on a GPU."""

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
    grpo: GRPOConfig = field(default_factory=GRPOConfig)


def final_lr(optim: OptimConfig) -> float:
    """optim.min_lr, or what it follows when unset: optim.lr / 10."""
    return optim.min_lr if optim.min_lr is not None else optim.lr / 10


def total_steps(trainer: TrainerConfig, steps_per_epoch: int) -> int:
    """The run's length in optimizer steps: trainer.max_steps or max_epochs, whichever ends first."""
    limits = []
    if trainer.max_steps is not None:
        limits.append(trainer.max_steps)
    if trainer.max_epochs is not None:
        limits.append(trainer.max_epochs * steps_per_epoch)
    return min(limits)


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

