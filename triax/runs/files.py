"""The small files of a run directory that `triax generate` and `triax export` read before the
weights (model.json, vocab.json), checked before anything is allocated.

A run directory is user-writable: a damaged or hostile model.json (say n_embd=10**9) must not
make triax try to allocate terabytes. The model it describes is bounded by what the snapshot
actually stores: every parameter is saved at 2 bytes or more (bf16), so a model needing more than
half the snapshot's bytes in parameters cannot be the one that was saved.
"""

from __future__ import annotations

import math
import os

from triax import safe_files
from triax.checkpoint.reader import SnapshotReader
from triax.checkpoint.snapshot import MODEL_KEY
from triax.errors import ConfigError, TriaxError, UsageError
from triax.models.config import MAX_SIZES, GPTConfig

# Far beyond any model triax trains, small enough that arithmetic on them stays exact and cheap.
SIZE_LIMITS = MAX_SIZES
MIN_BYTES_PER_PARAMETER = 2
MAX_SMALL_FILE_BYTES = 64 * 2**20  # model.json / vocab.json are kilobytes; never read a huge one whole
# The directory of a run holding the copies of its transformers model.init_from's description
# files (config, generation config, tokenizer files), which `triax export --format hf` writes back.
KEPT_SOURCE_DIR = "init_from"


def _read_small_json(path: str, what: str):
    try:
        # No link, no FIFO, no huge file: read_json checks before it reads.
        return safe_files.read_json(path, MAX_SMALL_FILE_BYTES)
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as error:
        raise TriaxError(f"{path} is damaged ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
                         f"it is the run's {what}, written by `triax train`") from None


def parameter_count(config: GPTConfig) -> int:
    """Parameters of the model a checked GPTConfig describes, counted on the meta device (shapes
    only: no memory, whatever the sizes)."""
    import torch  # deferred: with build_model, only once model.json has passed the cheap checks

    from triax.models import build_model  # deferred: see above

    with torch.device("meta"):
        return build_model(config).num_params(exclude_position=False)


def snapshot_bytes(snapshot: str) -> int | None:
    """Bytes of the regular files of a local snapshot directory (None for a remote URL)."""
    if "://" in snapshot or not os.path.isdir(snapshot):
        return None
    total = 0
    for directory, _, files in os.walk(snapshot):  # does not follow symlinked directories
        for name in files:
            path = os.path.join(directory, name)
            total += safe_files.stored_bytes(path)  # a sparse file counts what it really holds
    return total


def _refuse_lora_run(run_dir: str, snapshot: SnapshotReader | str | None) -> None:
    """A LoRA run's snapshots hold its adapters alone: reading one as a whole model is not damage."""
    config = getattr(snapshot, "state", {}).get("config")
    lora = ((config or {}).get("model") or {}).get("lora") if isinstance(config, dict) else None
    rank = lora.get("rank") if isinstance(lora, dict) else None
    if isinstance(rank, int) and rank > 0:
        raise UsageError(f"{run_dir!r} is a LoRA run (model.lora.rank={rank}): its snapshots hold its adapters only, "
                         "not a whole model; export it with --format hf --merge (the merged model) or --format peft "
                         "(the adapters) and use the export")


def read_model_config(run_dir: str, snapshot: SnapshotReader | str | None = None) -> GPTConfig:
    """model.json as a GPTConfig, checked: known keys, types, sizes (and GPTConfig's own checks),
    and (with `snapshot`, a validated SnapshotReader or a local path) a model no larger than what
    the snapshot stores."""
    from dataclasses import fields

    from triax.models import GPTConfig

    path = os.path.join(run_dir, "model.json")
    values = _read_small_json(path, "model description")
    known = {field.name for field in fields(GPTConfig)}
    if not isinstance(values, dict):
        raise TriaxError(f"{path} is damaged: it should hold an object of {', '.join(sorted(known))}")
    unknown = sorted(set(values) - known)
    if unknown:
        raise TriaxError(f"{path} is damaged: unknown key(s) {', '.join(map(str, unknown))}")
    for name, limit in SIZE_LIMITS.items():
        value = values.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
            raise TriaxError(f"{path} is damaged: {name}={value!r} (expected an integer 1 .. {limit})")
    dropout = values.get("dropout", 0.0)
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not (math.isfinite(dropout)
                                                                                  and 0 <= dropout < 1):
        raise TriaxError(f"{path} is damaged: dropout={dropout!r} (expected 0 <= dropout < 1)")
    for name in ("bias", "tie_embeddings"):
        if name in values and not isinstance(values[name], bool):
            raise TriaxError(f"{path} is damaged: {name}={values[name]!r} (expected true or false)")
    try:
        config = GPTConfig(**values)
        # Counted without its vocabulary padding: that is the layout's, and the snapshot may have
        # been saved by another layout than the one that last wrote model.json.
        unpadded = GPTConfig(**dict(values, padded_vocab_size=None))
    except (ConfigError, TypeError) as error:
        raise TriaxError(f"{path} is damaged: {error}") from None
    count = parameter_count(unpadded)
    if isinstance(snapshot, SnapshotReader):
        # The validated snapshot's own tensor shapes (each backed by distinct verified bytes of a
        # listed file): the model must not need more values than the snapshot's model holds.
        stored_values = sum(math.prod(snapshot.tensor_info(key)[1]) for key in snapshot.tensor_names()
                            if key.startswith(MODEL_KEY))
        if count > stored_values:
            _refuse_lora_run(run_dir, snapshot)
            raise TriaxError(f"{path} describes a model of {count:,} parameters but snapshot "
                             f"{snapshot.snapshot} stores only {stored_values:,} model values: model.json does "
                             "not belong to it (damaged or replaced); restore it from the run's config")
    elif snapshot is not None:
        stored = snapshot_bytes(snapshot)
        needed = count * MIN_BYTES_PER_PARAMETER
        if stored is not None and needed > stored:
            raise TriaxError(f"{path} describes a model of {count:,} parameters but snapshot "
                             f"{snapshot} stores only {stored:,} bytes: model.json does not belong to it "
                             "(damaged or replaced); restore it from the run's config")
    return config


def read_vocabulary(run_dir: str, vocab_size: int | None = None):
    """The run's text codec, checked: its tokenizer.json (data.task=tokens) as a BPETokenizer, else
    vocab.json (characters) as a Vocabulary; None when the run was not trained on text."""
    from triax.data import Vocabulary

    tokenizer_path = os.path.join(run_dir, "tokenizer.json")
    if os.path.lexists(tokenizer_path):
        from triax.data.tokenizer import BPETokenizer

        if not safe_files.is_regular(tokenizer_path) or os.path.getsize(tokenizer_path) > MAX_SMALL_FILE_BYTES:
            raise TriaxError(f"{tokenizer_path} is damaged: not a regular file of at most "
                             f"{MAX_SMALL_FILE_BYTES} bytes")
        tokenizer = BPETokenizer.from_file(tokenizer_path)
        if vocab_size is not None and len(tokenizer) > vocab_size:
            raise TriaxError(f"{tokenizer_path} is damaged: {len(tokenizer)} tokens but the model has only "
                             f"{vocab_size} token ids")
        return tokenizer
    path = os.path.join(run_dir, "vocab.json")
    if not os.path.lexists(path):
        return None
    values = _read_small_json(path, "vocabulary")
    chars = values.get("chars") if isinstance(values, dict) else None
    if not isinstance(chars, list) or not chars or not all(isinstance(ch, str) and len(ch) == 1 for ch in chars) \
            or len(set(chars)) != len(chars):
        raise TriaxError(f"{path} is damaged: it should hold {{\"chars\": [distinct single characters]}}")
    if vocab_size is not None and len(chars) > vocab_size:
        raise TriaxError(f"{path} is damaged: {len(chars)} characters but the model has only {vocab_size} token ids")
    return Vocabulary(chars)


def kept_tokenizer(run_dir: str, needed_for: str) -> tuple[str, dict]:
    """(tokenizer.json's path, the kept checkpoint's description files) of a run trained from a
    transformers checkpoint with its tokenizer; `needed_for` ends the refusal where it has none."""
    from triax.interop.hf import directory as hf  # deferred: `triax --help` and plain generate stay fast

    tokenizer_path = os.path.join(run_dir, "tokenizer.json")
    if not safe_files.is_regular(tokenizer_path):
        raise TriaxError(f"{run_dir!r} has no tokenizer.json; {needed_for}")
    kept = os.path.join(run_dir, KEPT_SOURCE_DIR)
    return tokenizer_path, hf.description_files(kept, follow_links=False) if safe_files.is_directory(kept) else {}
