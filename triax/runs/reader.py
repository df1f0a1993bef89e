"""A finished or running `triax train` run, read back: its snapshot root, its newest good snapshot,
its model and text codec, and the checks that keep a command's output out of the run's own files.
Used by the commands that read a run (generate, export, eval) and by a run started from another
triax run (model.init_from); it imports no command."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from triax import checkpoint, safe_files, safe_yaml
from triax.checkpoint.export import load_module_streaming
from triax.data import Vocabulary
from triax.errors import TriaxError, UsageError, printable
from triax.interop.hf.files import description_files
from triax.interop.triax_run import TriaxRun
from triax.models import VOCABULARY_PARAMETERS, GPTConfig, build_model
from triax.models.memory import check_whole_model_fits
from triax.runtime.place import detect_place
from triax.config import TrainConfig, from_dict, snapshot_root
from triax.runs.files import KEPT_SOURCE_DIR, read_model_config, read_vocabulary

# Where a run's config.yaml may keep its snapshots (the object stores triax documents).
SNAPSHOT_SCHEMES = ("file", "memory", "s3", "gs", "gcs", "az", "abfs")


def configured_snapshot_root(run_dir: str) -> str:
    """Where the run keeps its snapshots: its config.yaml's trainer.snapshot_dir, else
    <run_dir>/snapshots (the trainer's own rule, triax.config.snapshot_root)."""
    config = TrainConfig()
    config_file = os.path.join(run_dir, "config.yaml")
    if os.path.lexists(config_file):
        try:
            # No link, FIFO or huge file (safe_files), no alias bomb or deep nesting (safe_yaml),
            # and nothing outside the run read or reached.
            config = from_dict(safe_yaml.loads(safe_files.read_text(config_file), config_file) or {})
        except Exception as error:  # noqa: BLE001 - a damaged run file is the user's to fix: one line
            raise TriaxError(f"{config_file!r} is not a valid run config ({type(error).__name__}); "
                             "restore it from the run, or give the run directory of a finished `triax train`") from None
    location = config.trainer.snapshot_dir or ""
    scheme = location.split("://", 1)[0].lower() if "://" in location else "file"
    if scheme not in SNAPSHOT_SCHEMES:
        # A run directory may come from someone else: its config must not make this command
        # connect to an arbitrary host (ftp://, http://, ssh://...).
        raise TriaxError(f"{config_file!r} names trainer.snapshot_dir {location[:200]!r}, a {scheme}:// location "
                         f"triax does not read snapshots from; use one of {', '.join(SNAPSHOT_SCHEMES)}:// "
                         "or copy the snapshots into the run directory")
    config.trainer.run_dir = run_dir  # the directory as given now, wherever the run was started
    return snapshot_root(config)


def newest_good_snapshot(root: str, run_dir: str, skip: int = 0) -> checkpoint.SnapshotReader:
    """The validated reader of the newest snapshot that passes validation (older ones are tried
    when the newest is damaged, as a resume would; nothing is moved: this is a read-only command),
    passing over the first `skip` good ones (whose tensor bytes a caller found damaged)."""
    snapshots = checkpoint.list_snapshots(root)
    if not snapshots:
        raise TriaxError(f"{run_dir!r} has no snapshot yet in {root}; wait for the first save "
                         "(the first evaluation, trainer.save_every) or the end of training")
    for snapshot in reversed(snapshots):
        try:
            reader = checkpoint.open_snapshot(snapshot)
        except checkpoint.SnapshotCorruptError as error:
            print(printable(f"triax: warning: {error}; trying the previous snapshot"), file=sys.stderr)
            continue
        if skip == 0:
            return reader
        skip -= 1
    raise TriaxError(f"none of the {len(snapshots)} snapshot(s) in {root} passed verification")


def check_exists(path: str, what: str) -> None:
    """A directory a command reads must exist; a relative one is named with where it was looked
    for (the current directory), the usual slip being a command run from another directory."""
    if not os.path.lexists(path):
        where = "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"
        raise TriaxError(f"{path!r} does not exist{where}; give {what}")


def run_snapshot_root(run_dir: str) -> str:
    """The snapshot root of a run directory; one line if `run_dir` is not a run."""
    check_exists(run_dir, "the trainer.run_dir of a `triax train` run")
    if not os.path.isfile(os.path.join(run_dir, "model.json")):
        raise TriaxError(f"{run_dir!r} is not a triax run directory (no model.json); "
                         "give the trainer.run_dir of a finished or running `triax train`")
    return configured_snapshot_root(run_dir)


def open_run(run_dir: str, snapshot_root: str | None = None, skip: int = 0) -> tuple:
    """(validated reader of the newest good snapshot, the checked model config, the text codec or
    None) of a run directory; `skip`: see newest_good_snapshot. model.json is checked against the
    snapshot before anything is allocated: a damaged one must not make us build a model of terabytes."""
    root = snapshot_root or run_snapshot_root(run_dir)
    reader = newest_good_snapshot(root, run_dir, skip)
    model_config = read_model_config(run_dir, reader)  # matched against its tensors before building
    return reader, model_config, read_vocabulary(run_dir, model_config.vocab_size)


def as_foreign_run(run_dir: str) -> TriaxRun:
    """The run as another run starts from it (model.init_from): its newest good snapshot, its text
    codec, and the copies it kept of a transformers model.init_from's files, which it passes on."""
    reader, model_config, vocab = open_run(run_dir)
    tokenizer = os.path.join(run_dir, "tokenizer.json")
    if os.path.isfile(tokenizer):
        vocab.source_path = tokenizer  # the new run keeps a copy
    kept = os.path.join(run_dir, KEPT_SOURCE_DIR)
    description = description_files(kept, follow_links=False) if safe_files.is_directory(kept) else {}
    return TriaxRun(run_dir, reader.snapshot, model_config, vocab, description)


def with_fallback(run_dir: str, root: str, action: Callable[..., Any]) -> Any:
    """`action(reader, model_config, vocab)` on the newest good snapshot; when its tensor bytes
    turn out damaged (a chunk fails its sha256, found only when it is read), on the one before,
    as a resume falls back. Read-only: nothing is moved aside."""
    skip = 0
    while True:
        opened = open_run(run_dir, root, skip)
        try:
            return action(*opened)
        except checkpoint.SnapshotCorruptError as error:
            print(printable(f"triax: warning: {error}; trying the previous snapshot"), file=sys.stderr)
            skip += 1


def true_shapes(model_config: GPTConfig, vocab: object) -> tuple[dict, dict]:
    """(the model config without tensor-parallel vocabulary padding, {tensor name: its unpadded
    shape} of the tensors the padding extends). The snapshot's own rows may differ from
    model.json's padding: a run resumed in another layout writes model.json before its first
    snapshot, and every layout's padding rows are zero."""
    values = dataclasses.asdict(model_config)
    # model.json's vocab_size is the true vocabulary; padded_vocab_size the rows tensor
    # parallelism added (zero, masked, never sampled).
    rows = len(vocab) if isinstance(vocab, Vocabulary) else model_config.vocab_size
    true_config = dict(values, vocab_size=min(rows, model_config.vocab_size), padded_vocab_size=None)
    with torch.device("meta"):  # shapes only, no memory
        true_shapes = {k: list(v.shape) for k, v in build_model(GPTConfig(**true_config)).state_dict().items()}
    return true_config, {k: v for k, v in true_shapes.items() if k in VOCABULARY_PARAMETERS}


def load_run_model(run_dir: str, device: str | object = "cpu", opened: tuple | None = None) -> tuple:
    """The trained plain model of a run directory (newest good snapshot) and its text codec,
    loaded tensor by tensor through the validating reader, vocabulary padding dropped."""
    reader, model_config, vocab = opened or open_run(run_dir)
    true_config, _ = true_shapes(model_config, vocab)
    config = GPTConfig(**true_config)
    # Built whole on this host: a model.json of terabytes is one line, before anything is allocated.
    check_whole_model_fits(config, torch.device("cpu"), os.path.join(run_dir, "model.json"),
                           detect_place().local_world_size)
    model = build_model(config)
    load_module_streaming(reader, model)
    return model.to(device).eval(), vocab, reader.snapshot


def check_not_in_run(output: str, run_dir: str, snapshot_root: str, option: str = "output") -> None:
    """Refuse an output inside the run's snapshots (the next prune would delete it) or one of the
    run's own files."""
    target = os.path.realpath(output)
    protected = [os.path.realpath(snapshot_root)] if "://" not in snapshot_root else []
    if any(target == root or target.startswith(root + os.sep) for root in protected):
        raise UsageError(f"{option} {output!r} lies inside the run's snapshots ({protected[0]}); "
                         "write the export somewhere else")
    kept = os.path.realpath(os.path.join(run_dir, KEPT_SOURCE_DIR))
    if target == kept or target.startswith(kept + os.sep):
        # The run's copies of its model.init_from files: its next start replaces them.
        raise UsageError(f"{option} {output!r} lies inside the run's {KEPT_SOURCE_DIR}/ ({kept}), which the run's next "
                         "start rewrites; write the export somewhere else")
    if os.path.dirname(target) == os.path.realpath(run_dir) and os.path.basename(target) in RUN_FILES:
        raise UsageError(f"{option} {output!r} is the run's own {os.path.basename(target)}; "
                         "write the export somewhere else")


# Files of a run directory that `triax train` writes and generate/export/resume read.
RUN_FILES = ("model.json", "vocab.json", "config.yaml", "metrics.jsonl")
