"""Snapshots: everything needed to continue a run exactly, written so a crash cannot spoil them.

A snapshot is a directory under the snapshot root (a local path or an fsspec URL):

    step_00000100/
        shards/rank_00000.bin  the model and optimizer tensors this rank held (raw bytes), one
        shards/rank_00001.bin  file per rank that had something to write: nobody gathers
        shards.json            which bytes are which slice of which tensor, sha256 per chunk
        state.json             step, data position, scheduler, scaler, optimizer hyper-parameters,
                               config, triax version, world size (whatever the caller passes)
        rng/rank_00000.json    each rank's random-number generator states
        manifest.json          written last: size and sha256 of every file above

Tensors go through torch.distributed.checkpoint (DCP): torch.distributed.checkpoint.state_dict
gives each rank its own shards (FSDP2 and tensor-parallel DTensors stay sharded; replicated
tensors are written once), and on load DCP's planner works out which byte ranges each rank needs
for the layout it has *now*, so a snapshot from any layout and world size loads into any other
without any rank holding the whole state. The storage underneath is triax's own
(triax.checkpoint.shards): raw bytes and JSON, nothing pickled, nothing unpickled.

Locally the directory is assembled as `step_00000100.tmp` and renamed when complete; on an object
store the manifest is the completion mark. The manifest is written by the coordinator only after
every rank's shard file is durable (DCP's finish step), so a crash at any moment leaves the previous
snapshot as the newest good one. Loading validates everything (triax.checkpoint.reader) and
`load_latest_snapshot` falls back to the previous snapshot on any damage.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
import warnings
from concurrent.futures import Future
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from triax.runtime.failure_agreement import raise_together
from triax.checkpoint.errors import SnapshotCorruptError, SnapshotError, SnapshotWriteError
from triax.checkpoint.padding import PaddedRowsLoadPlanner
from triax.checkpoint.reader import FORMAT, MANIFEST, SNAPSHOT_NAME, STATE, SnapshotReader
from triax.checkpoint.rng import capture_rng_state, check_rng_state, restore_rng_state
from triax.checkpoint.shard_format import SHARDS_METADATA
from triax.checkpoint.shards import ShardReader, ShardWriter
from triax.checkpoint.storage import Store, sha256
from triax.runtime.shared_decisions import broadcast_int, max_across_ranks
from triax.errors import TriaxError, printable
from triax.version import __version__

SNAPSHOT_PREFIX = "step_"
STAGING_SUFFIX = ".tmp"  # a local snapshot being written
REPLACED_SUFFIX = ".old"  # a local snapshot being replaced by a new one of the same step
QUARANTINE_SUFFIX = ".corrupt"  # a snapshot that failed verification, kept for inspection
QUARANTINED_NAME = re.compile(r"^step_\d{8}\.corrupt(\.\d+)?$")  # .corrupt.2, ... when a step failed again
_SHARDED = StateDictOptions(full_state_dict=False)
# Gathered whole, on the CPU of rank 0 only (the others hold nothing): Accelerate's FULL_STATE_DICT.
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
# A model with a module marked `snapshot_trainable_only` (LoRA's base, triax.models.lora) saves
# only its trainable parameters: the frozen ones never change, and model.init_from gives them back
# before a resume. DCP loads exactly the tensors asked for and fails on any the snapshot lacks, so
# loading is not strict about the frozen ones.
TRAINABLE_ONLY = "snapshot_trainable_only"


def _options(model: torch.nn.Module, full: bool, loading: bool = False) -> StateDictOptions:
    if not any(getattr(module, TRAINABLE_ONLY, False) for module in model.modules()):
        return _FULL if full else _SHARDED
    return StateDictOptions(full_state_dict=full, cpu_offload=full, ignore_frozen_params=True, strict=not loading)

MODEL_KEY, OPTIMIZER_KEY = "model/", "optim/"


def snapshot_name(step: int) -> str:
    return f"{SNAPSHOT_PREFIX}{step:08d}"


def snapshot_step(snapshot: str) -> int:
    match = SNAPSHOT_NAME.match(snapshot.rstrip("/").rsplit("/", 1)[-1].rsplit(os.sep, 1)[-1])
    if not match:
        raise TriaxError(f"{snapshot!r} is not a snapshot directory (expected a name like {snapshot_name(100)})")
    return int(match.group(1))


def _ours(name: str, *suffixes: str) -> bool:
    """A name triax creates: step_ and 8 digits, plus one of `suffixes` ('' for none)."""
    for suffix in suffixes:
        if (name.endswith(suffix) if suffix else True) and SNAPSHOT_NAME.match(name[: len(name) - len(suffix)]):
            return True
    return False


def list_snapshots(snapshot_root: str) -> list[str]:
    """Complete snapshots (those with a manifest) under `snapshot_root`, oldest first. Cheap: the
    contents are validated when a snapshot is loaded, not here. Other names are ignored."""
    store = Store(snapshot_root)
    found = []
    for name in store.names():
        if _ours(name, "") and store.is_directory(store.path(name)) and store.exists(store.path(name, MANIFEST)):
            found.append((int(name[len(SNAPSHOT_PREFIX):]), store.url_of(store.path(name))))
    return [path for _, path in sorted(found)]


def latest_snapshot(snapshot_root: str) -> str | None:
    snapshots = list_snapshots(snapshot_root)
    return snapshots[-1] if snapshots else None


# ---- the tensors of a model and optimizer, as DCP sees them ---------------------------------------

def _identity(key: str) -> str:
    return key


def _tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, stored_name: Callable[[str], str],
                  full: bool = False):
    """(flat {stored key: tensor} for DCP, the model's own state dict, the optimizer's).

    Keys are this rank's parameter names mapped by `stored_name` (a pipeline stage strips its part
    prefix, so the names are the plain model's whatever the layout). Tensors stay sharded, unless
    `full`: then rank 0 gathers them whole into host memory and writes them alone."""
    options = _options(model, full)
    model_state = get_model_state_dict(model, options=options)
    flat = {MODEL_KEY + stored_name(key): value for key, value in model_state.items()}
    optim_state = None
    if optimizer is not None:
        optim_state = get_optimizer_state_dict(model, optimizer, options=options)
        for name, entries in optim_state.get("state", {}).items():  # {} on ranks > 0 when `full`
            for key, value in list(entries.items()):
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    value = entries[key] = torch.tensor(value)
                if isinstance(value, torch.Tensor):
                    flat[f"{OPTIMIZER_KEY}{stored_name(name)}/{key}"] = value
    return flat, model_state, optim_state


def _padded_keys(tensors: dict, real_rows: dict[str, int] | None) -> dict[str, int]:
    """{DCP key: real rows} of the tensors of `real_rows` ({stored parameter name: rows that hold
    the model, the rest being padding}): the parameter and its optimizer state of the same rows."""
    padded = {}
    for key, value in tensors.items():
        if key.startswith(MODEL_KEY):
            name = key[len(MODEL_KEY):]
        elif key.startswith(OPTIMIZER_KEY):
            name = key[len(OPTIMIZER_KEY):].rsplit("/", 1)[0]
        else:
            continue
        if real_rows and name in real_rows and value.dim() >= 1:  # not the optimizer's step count
            padded[key] = real_rows[name]
    return padded


def _optimizers(optimizer: torch.optim.Optimizer) -> tuple:
    """`optimizer` may be one optimizer or a tuple of optimizers over the model's parameters
    (torch.distributed.checkpoint.state_dict takes both; their groups are saved in order)."""
    return tuple(optimizer) if isinstance(optimizer, (list, tuple)) else (optimizer,)


def _hyper_parameters(optim_state: dict | None) -> list | None:
    """Optimizer groups without their parameter lists (those differ per pipeline stage): JSON."""
    if optim_state is None:
        return None
    return [{k: v for k, v in group.items() if k != "params"} for group in optim_state["param_groups"]]


# ---- save --------------------------------------------------------------------------------------

@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every single-process save/load that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _describe(error: BaseException) -> str:
    """One rank's failure in one line: a write error as it is, an OSError by its reason."""
    if isinstance(error, SnapshotWriteError):
        return str(error)
    if isinstance(error, OSError):
        return f"{type(error).__name__}: {error.strerror or error}"
    return f"{type(error).__name__}: {error}"  # e.g. a caller's state that is not JSON


def _retryable(error: BaseException) -> bool:
    """Whether a later attempt may succeed: a storage fault (OSError), not a fault of the program."""
    return error.retryable if isinstance(error, SnapshotWriteError) else isinstance(error, OSError)


def _checkpoint_failure(error: CheckpointException) -> tuple[str, bool]:
    """The first rank's error inside DCP's wrapper, in one line, and whether it is retryable."""
    for rank, (failure, _) in sorted(error.failures.items()):
        if isinstance(failure, OSError):
            return f"rank {rank}: {type(failure).__name__}: {failure.strerror or failure}", True
        text = str(failure).strip().splitlines()[0] if str(failure).strip() else ""
        return f"rank {rank}: {type(failure).__name__}: {text}", _retryable(failure)
    return "unknown failure", True


class PendingSnapshot:
    """A snapshot being written. `wait()` returns its path once complete (manifest written), or
    raises SnapshotWriteError on every rank. Collective: every rank waits."""

    def __init__(self, path: str, future: Future | None, cleanup: Callable[[], None]):
        self.path, self._future, self._cleanup = path, future, cleanup
        self._result: str | BaseException | None = None if future is not None else path

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self) -> str:
        if self._result is None:
            try:
                self._future.result()
                self._result = self.path
            except CheckpointException as error:
                text, retryable = _checkpoint_failure(error)
                self._result = SnapshotWriteError(f"could not write snapshot {self.path}: {text}", retryable)
            except Exception as error:  # noqa: BLE001 - reported as a write failure on every rank
                self._result = SnapshotWriteError(f"could not write snapshot {self.path}: {type(error).__name__}: "
                                                  f"{error}", _retryable(error))
            if isinstance(self._result, BaseException):
                self._cleanup()
        if isinstance(self._result, BaseException):
            raise self._result
        return self._result


_async_group = None


def _async_process_group():
    """A gloo group of its own for background saves, so their collectives never interleave with
    the training step's on the default group. Created once, by every rank (collective)."""
    global _async_group
    if _async_group is None and dist.is_initialized():
        _async_group = dist.new_group(backend="gloo")
    return _async_group


def start_snapshot(snapshot_root: str, step: int, model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer | None, state: dict, keep_last: int = 0,
                   stored_name: Callable[[str], str] = _identity, asynchronous: bool = False,
                   full_state_dict: bool = False) -> PendingSnapshot:
    """Begin a snapshot of `model`, `optimizer`, the JSON-able `state` and every rank's RNG states.
    Collective: every rank calls it. With `asynchronous`, the tensors are copied to CPU memory
    and written in the background (DCP's async_save); otherwise the write is done on return.
    Either way the manifest is written only when every rank's shard file is durable, then the
    snapshot is renamed into place and `keep_last` > 0 deletes all but that many newest ones.
    `stored_name` maps this rank's parameter names to the names stored (pipeline stages).
    `full_state_dict`: rank 0 gathers the tensors and writes them all (loading is the same)."""
    rank, world = _rank(), _world()
    store = Store(snapshot_root)
    final = store.path(snapshot_name(step))
    # Locally we assemble under a temporary name and rename; object stores cannot rename, so
    # there the snapshot is written in place and only the manifest, written last, completes it.
    work = final + STAGING_SUFFIX if store.local else final
    url = store.url_of(final)

    def cleanup() -> None:
        if rank == 0:
            with contextlib.suppress(Exception):  # best effort; a leftover is ignored anyway
                store.remove_tree(work)

    tensors, _, optim_state = _tensor_state(model, optimizer, stored_name, full_state_dict)
    try:
        _write_directory_and_state(store, work, step, state, optim_state)
    except Exception as failure:
        cleanup()
        raise SnapshotWriteError(f"could not write snapshot {url}: {_describe(failure)}", _retryable(failure)) from None

    def finish(shards_json: bytes) -> None:  # the coordinator, once every shard file is durable
        _complete(store, work, final, step, world, shards_json)
        if keep_last > 0:
            try:
                prune_snapshots(snapshot_root, keep_last)
            except Exception as error:  # the new snapshot is complete; old ones are only disk space
                print(printable(f"triax: warning: could not delete old snapshots in {snapshot_root}: "
                                f"{_describe(error)}"), file=sys.stderr)

    writer = ShardWriter(store, work, finish)
    if asynchronous:
        # The stager copies every tensor to CPU memory before returning: training may go on.
        future = dcp.async_save(tensors, storage_writer=writer, process_group=_async_process_group(),
                                async_stager=BlockingAsyncStager(), no_dist=not dist.is_initialized())
        future = getattr(future, "upload_completion", future)
        return PendingSnapshot(url, future, cleanup)
    return _save_now(tensors, writer, url, cleanup)


def _write_directory_and_state(store: Store, work: str, step: int, state: dict, optim_state: dict | None) -> None:
    """The snapshot's directory (rank 0), every rank's RNG file and rank 0's state.json. Collective:
    each rank's part may fail alone; every rank learns it before the next collective."""
    rank, world = _rank(), _world()
    with raise_together("creating the snapshot directory", SnapshotWriteError):
        if rank == 0:
            _prepare(store, work)
    with raise_together("writing its RNG state", SnapshotWriteError):
        store.write(store.join(work, "rng", f"rank_{rank:05d}.json"), json.dumps(capture_rng_state()).encode())
        if rank == 0:
            record = dict(state, step=step, world_size=world, triax_version=__version__,
                          optimizer_groups=_hyper_parameters(optim_state))
            store.write(store.join(work, STATE), json.dumps(record, indent=1).encode())


def _save_now(tensors: dict, writer: ShardWriter, url: str, cleanup: Callable[[], None]) -> PendingSnapshot:
    """Write the tensors before returning; the snapshot, already complete (or its error, raised)."""
    future: Future = Future()
    try:
        with _single_process_quiet():
            dcp.save(tensors, storage_writer=writer, no_dist=not dist.is_initialized())
        future.set_result(None)
    except CheckpointException as error:
        future.set_exception(error)
    pending = PendingSnapshot(url, future, cleanup)
    pending.wait()
    return pending


def save_snapshot(snapshot_root: str, step: int, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer | None, state: dict, keep_last: int = 0,
                  stored_name: Callable[[str], str] = _identity, full_state_dict: bool = False) -> str:
    """Write a snapshot and return its path (see start_snapshot). If storage fails, every rank
    raises SnapshotWriteError and earlier snapshots are untouched."""
    return start_snapshot(snapshot_root, step, model, optimizer, state, keep_last, stored_name,
                          full_state_dict=full_state_dict).wait()


def _prepare(store: Store, work: str) -> None:
    if not store.local and store.exists(store.join(work, MANIFEST)):
        # Re-writing a step: un-complete it first, so a crash mid-way cannot leave a manifest
        # that vouches for a mix of old and new files.
        store.fs.rm(store.join(work, MANIFEST))
    store.remove_tree(work)  # a leftover (or a planted symlink: unlinked, never followed)
    if store.local:
        os.makedirs(os.path.dirname(work), exist_ok=True)
        os.mkdir(work)  # fails if anything appeared meanwhile: we write only into our own directory
    store.makedirs(store.join(work, "rng"))
    store.makedirs(store.join(work, "shards"))


def _complete(store: Store, work: str, final: str, step: int, world: int, shards_json: bytes) -> None:
    """Write shards.json and the manifest (last), then give the directory its final name."""
    files = {}
    store.write(store.join(work, SHARDS_METADATA), shards_json)
    for relative, entry in json.loads(shards_json)["files"].items():
        files[relative] = entry  # hashed by the rank that wrote it, while writing
    small = [STATE, SHARDS_METADATA] + [f"rng/rank_{other:05d}.json" for other in range(world)]
    for relative in small:
        data = store.read(store.join(work, *relative.split("/")))
        files[relative] = {"bytes": len(data), "sha256": sha256(data)}
    manifest = {"format": FORMAT, "step": step, "world_size": world, "triax_version": __version__,
                "created": time.time(), "files": files}
    if store.local:
        store.sync_directory(store.join(work, "rng"))
        store.sync_directory(store.join(work, "shards"))
    store.write(store.join(work, MANIFEST), json.dumps(manifest, indent=1).encode())
    if not store.local:
        return
    store.sync_directory(work)
    if store.is_directory(final):  # same step saved again (after a fallback): swap, then delete
        replaced = final + REPLACED_SUFFIX
        store.remove_tree(replaced)
        os.replace(final, replaced)
        store.rename(work, final)
        store.remove_tree(replaced)
    else:
        store.remove_tree(final)  # not a directory we wrote (a planted link or file): unlinked
        store.rename(work, final)


def prune_snapshots(snapshot_root: str, keep_last: int) -> list[str]:
    """Delete all but the `keep_last` newest complete snapshots, and leftovers of interrupted
    writes. Only names triax creates are touched. Not collective: the main rank calls it.
    Returns what was deleted."""
    store = Store(snapshot_root)
    complete = list_snapshots(snapshot_root)
    doomed = complete[:-keep_last] if keep_last > 0 else []
    for name in store.names():
        if _ours(name, STAGING_SUFFIX, REPLACED_SUFFIX):
            doomed.append(store.url_of(store.path(name)))
        elif _ours(name, "") and not store.exists(store.path(name, MANIFEST)) and store.is_directory(store.path(name)):
            doomed.append(store.url_of(store.path(name)))  # object store: never completed
    for path in doomed:
        store.remove_tree(Store(path).root)
    return doomed


def remove_snapshots(snapshot_root: str) -> None:
    """Delete every snapshot (complete or not) under the root: `trainer.overwrite=true`. Only
    names triax creates are touched; anything else (a `step_9`, a symlink) is left alone."""
    store = Store(snapshot_root)
    for name in store.names():
        path = store.path(name)
        quarantined = QUARANTINED_NAME.match(name) is not None
        if (quarantined or _ours(name, "", STAGING_SUFFIX, REPLACED_SUFFIX)) and store.is_directory(path):
            store.remove_tree(path)


# ---- load --------------------------------------------------------------------------------------

def open_snapshot(snapshot: str) -> SnapshotReader:
    """The validated reader of one snapshot (raises SnapshotCorruptError)."""
    return SnapshotReader(snapshot)


def read_state(snapshot: str) -> dict:
    """The JSON state of a snapshot (step, data position, config, ...), validated."""
    return SnapshotReader(snapshot).state


def iter_model_tensors(snapshot: str | SnapshotReader):
    """(name, full tensor) of each model tensor, one at a time, verified."""
    reader = snapshot if isinstance(snapshot, SnapshotReader) else SnapshotReader(snapshot)
    for key in reader.tensor_names():
        if key.startswith(MODEL_KEY):
            yield key[len(MODEL_KEY):], reader.full_tensor(key)


def read_model_tensors(snapshot: str) -> dict:
    """All model weights of a snapshot, by parameter name, on CPU (small models and tests; export
    and generate stream with iter_model_tensors instead)."""
    return dict(iter_model_tensors(snapshot))


def _fit_error(snapshot: str, error: BaseException) -> SnapshotError:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return SnapshotError(f"snapshot {snapshot} does not fit this model/optimizer ({first[:300]}); "
                         "resume with the model config it was saved with, or train this model in another "
                         "trainer.run_dir")


def _same_kind(saved: Any, current: Any) -> bool:
    if isinstance(current, bool) or current is None or isinstance(current, str):
        return type(saved) is type(current)
    if isinstance(current, (int, float, torch.Tensor)):
        return type(saved) in (int, float)
    if isinstance(current, (list, tuple)):
        return isinstance(saved, list) and len(saved) == len(current) and all(map(_same_kind, saved, current))
    return False


def _as_held(saved: Any, current: Any):
    """JSON has no tuples: a saved list is given back as a tuple where the optimizer holds one
    (Adam's betas), so the restored state_dict equals the saved one."""
    return tuple(saved) if isinstance(current, tuple) and isinstance(saved, list) else saved


def _check_groups(saved: list, current: list, snapshot: str) -> None:
    """Saved optimizer hyper-parameters must be the ones this optimizer has, with the same types:
    anything else would only fail later, inside a training step (or, for a count that differs, in
    the middle of the collective load)."""
    if len(saved) != len(current):
        raise SnapshotCorruptError(f"snapshot {snapshot}: {len(saved)} optimizer parameter groups in state.json, "
                                   f"this optimizer has {len(current)}")
    for saved_group, group in zip(saved, current):
        for key, value in saved_group.items():
            if key == "params" or key not in group or not _same_kind(value, group[key]):
                raise SnapshotCorruptError(f"snapshot {snapshot}: optimizer setting {key[:40]!r} in state.json "
                                           "is not one this optimizer has, or has the wrong type")


def _open_checked(snapshot: str, optimizer: torch.optim.Optimizer | None, restore_rng: bool,
                  check_state: Callable[[dict], None] | None) -> tuple[SnapshotReader, dict | None]:
    """The snapshot's reader, its state checked (by the caller's `check_state` and against the
    optimizer's groups), and this rank's RNG state to restore (None: none to restore)."""
    reader, rng_state = SnapshotReader(snapshot), None
    if check_state is not None:
        check_state(reader.state)
    if optimizer is not None and reader.state.get("optimizer_groups") is not None:
        groups = [group for one in _optimizers(optimizer) for group in one.param_groups]
        _check_groups(reader.state["optimizer_groups"], groups, snapshot)
    rng_file = f"rng/rank_{_rank():05d}.json"
    # A rank that did not exist when saving (resuming on more processes) keeps its own seed.
    if restore_rng and reader.has(rng_file):
        rng_state = reader.json(rng_file)
        check_rng_state(rng_state, snapshot)
    return reader, rng_state


def _set_loaded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, model_state: dict,
                      optim_state: dict | None, state: dict) -> None:
    """Put the loaded tensors into the model and the optimizer, with the saved hyper-parameters."""
    set_model_state_dict(model, model_state, options=_options(model, False, loading=True))
    if optim_state is not None:
        saved_groups = state["optimizer_groups"]
        if len(saved_groups) != len(optim_state["param_groups"]):
            raise ValueError(f"{len(saved_groups)} optimizer parameter groups saved, "
                             f"{len(optim_state['param_groups'])} now")
        optim_state["param_groups"] = [
            dict(group, **{key: _as_held(value, group.get(key)) for key, value in saved.items()},
                 params=group["params"])
            for group, saved in zip(optim_state["param_groups"], saved_groups)]
        set_optimizer_state_dict(model, optimizer, optim_state, options=_options(model, False))


def load_snapshot(snapshot: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                  restore_rng: bool = True, stored_name: Callable[[str], str] = _identity,
                  check_state: Callable[[dict], None] | None = None, stats: dict | None = None,
                  real_rows: dict[str, int] | None = None) -> dict:
    """Load a snapshot into `model` (and `optimizer`), whatever layout either was saved or is
    now in, and restore this rank's RNG states. Returns the JSON state. Collective. Every rank
    reads only the byte ranges its own shards need (`stats["bytes_read"]` says how many).
    Raises SnapshotCorruptError on every rank if any rank finds the snapshot damaged;
    `check_state(state)` may raise it too (the caller's own schema for its keys).
    `real_rows`: {stored parameter name: rows that hold the model} of tensors whose further rows
    are zero padding (a vocabulary padded for tensor parallelism): only those rows are read, for
    the parameter and its optimizer state, so a snapshot saved with any padding loads into any
    other (triax.checkpoint.padding)."""
    reader, rng_state = None, None
    # Corrupt, or one rank's own refusal: agreed before any collective load, so nobody is left waiting.
    with raise_together(f"verifying snapshot {snapshot}", SnapshotCorruptError):
        reader, rng_state = _open_checked(snapshot, optimizer, restore_rng, check_state)
    state = reader.state
    tensors, model_state, optim_state = _tensor_state(
        model, optimizer if state.get("optimizer_groups") is not None else None, stored_name)
    shard_reader = ShardReader(reader)
    padded = _padded_keys(tensors, real_rows)
    try:
        with _single_process_quiet():
            dcp.load(tensors, storage_reader=shard_reader, planner=PaddedRowsLoadPlanner(padded),
                     no_dist=not dist.is_initialized())
    except CheckpointException as failure:
        causes = [cause for cause, _ in failure.failures.values()]
        corrupt = next((c for c in causes if isinstance(c, SnapshotCorruptError)), None)
        if corrupt is not None:
            raise SnapshotCorruptError(str(corrupt)) from None
        raise _fit_error(snapshot, causes[0] if causes else failure) from None
    try:
        _set_loaded_state(model, optimizer, model_state, optim_state, state)
    except (RuntimeError, KeyError, ValueError, TypeError) as failure:
        raise _fit_error(snapshot, failure) from None
    if rng_state is not None:
        try:
            restore_rng_state(rng_state)
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as failure:
            # check_rng_state passed, so this is a state torch itself refuses: corrupt rather than a
            # crash (the other ranks have already loaded; they fall back on the next agreement).
            raise SnapshotCorruptError(f"snapshot {snapshot}: rng/rank_{_rank():05d}.json does not hold RNG "
                                       f"states ({type(failure).__name__}: {failure})") from None
    if stats is not None:
        stats["bytes_read"] = shard_reader.bytes_read
    return state


def load_latest_snapshot(snapshot_root: str, model: torch.nn.Module,
                         optimizer: torch.optim.Optimizer | None = None,
                         report: Callable[[str], None] | None = None,
                         stored_name: Callable[[str], str] = _identity,
                         check_state: Callable[[dict], None] | None = None,
                         stats: dict | None = None,
                         real_rows: dict[str, int] | None = None) -> tuple[str, dict] | None:
    """Load the newest snapshot that passes verification on every rank, falling back to older
    ones (each rejected one is reported in one line and moved aside). Collective. Returns
    (path, state), or None when there is no snapshot at all. `stats`, `real_rows`: see load_snapshot."""
    rank = _rank()
    store = Store(snapshot_root)
    candidates = [snapshot_step(path) for path in list_snapshots(snapshot_root)] if rank == 0 else []
    rejected = 0
    while True:
        # Rank 0's listing decides, so every rank tries the same snapshot.
        step = broadcast_int(candidates.pop() if candidates else -1)
        if step < 0:
            if rejected:
                raise SnapshotError(f"none of the {rejected} snapshot(s) in {snapshot_root} passed verification; "
                                    "restore one from a backup, or start over with trainer.resume=false "
                                    "trainer.overwrite=true")
            return None
        path = store.url_of(store.path(snapshot_name(step)))
        error, fatal, state = None, None, None
        try:
            state = load_snapshot(path, model, optimizer, stored_name=stored_name, check_state=check_state,
                                  stats=stats, real_rows=real_rows)
        except SnapshotCorruptError as failure:
            error = str(failure)
        except Exception as failure:  # not a bad file (e.g. another model's snapshot): all ranks stop
            fatal = failure
        outcome = max_across_ranks(2 if fatal is not None else 1 if error is not None else 0)
        if outcome == 2:
            raise fatal or SnapshotError(f"loading snapshot {path} failed on another rank; every rank stops")
        if outcome == 0:
            return path, state
        error = error or f"snapshot {path} failed verification on another rank"
        rejected += 1
        if rank == 0:
            moved = quarantine_snapshot(path)
            if report is not None:
                report(f"{error}; moved it to {moved} and trying the previous snapshot")
        else:
            print(printable(f"triax: rank {rank}: {error}"), file=sys.stderr)


def quarantine_snapshot(snapshot: str) -> str:
    """Take a bad snapshot out of the list: locally renamed to `<name>.corrupt` (kept for a
    post-mortem); on an object store its manifest is deleted. Returns where it went."""
    store = Store(snapshot)
    if store.local:
        # A step quarantined before (a run that fell back, then wrote and lost the same step
        # again) keeps its earlier copy: the new one gets the next free number.
        base = store.root.rstrip(os.sep) + QUARANTINE_SUFFIX
        target, number = base, 1
        while os.path.lexists(target):
            number += 1
            target = f"{base}.{number}"
        os.replace(store.root, target)
        return target
    if store.exists(store.path(MANIFEST)):
        store.fs.rm(store.path(MANIFEST))
    return f"{snapshot} (manifest deleted)"
