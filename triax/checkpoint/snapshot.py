"""Snapshots: everything needed to continue a run exactly, written so a crash cannot spoil them.

A snapshot is a directory under the snapshot root (a local path or an fsspec URL):

    step_00000100/
        model.safetensors      full (consolidated) model weights, by parameter name
        optimizer.safetensors  optimizer state tensors, keyed "<param name>/<state key>"
        state.json             step, data position, scheduler, scaler, optimizer hyper-parameters,
                               config, triax version, world size (whatever the caller passes)
        rng/rank_00000.json    each rank's random-number generator states
        manifest.json          written last: size and sha256 of every file above

Locally the directory is assembled as `step_00000100.tmp` and renamed when complete; on an object
store the manifest is the completion mark. Loading checks every file it reads against the
manifest, so a torn, truncated or bit-flipped snapshot is detected, and `load_latest_snapshot`
falls back to the previous one.

Model and optimizer state go through torch.distributed.checkpoint.state_dict, which gives the same
full, name-keyed state for a plain module, DDP, FSDP2 or tensor-parallel DTensors, so a snapshot
taken in one layout loads into any other. Loading reads only safetensors and JSON: nothing is
unpickled. Tensors are read to CPU, then set_*_state_dict copies them to the model's device.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors_from_bytes
from safetensors.torch import load_file as load_tensors_from_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from triax.checkpoint.rng import capture_rng_state, restore_rng_state
from triax.checkpoint.storage import Store, file_sha256, sha256
from triax.errors import TriaxError
from triax.runtime import any_rank, broadcast_int, max_across_ranks

SNAPSHOT_PREFIX = "step_"
MANIFEST = "manifest.json"
FORMAT = "triax-snapshot/1"
STAGING_SUFFIX = ".tmp"  # a local snapshot being written
REPLACED_SUFFIX = ".old"  # a local snapshot being replaced by a new one of the same step
QUARANTINE_SUFFIX = ".corrupt"  # a snapshot that failed verification, kept for inspection
# Test-only: seconds to pause in the middle of a write, so a test can kill a process mid-write.
WRITE_DELAY_ENV = "TRIAX_TEST_SNAPSHOT_WRITE_DELAY_S"

_NAME = re.compile(rf"^{SNAPSHOT_PREFIX}(\d+)$")
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class SnapshotError(TriaxError):
    """A snapshot could not be written or read."""


class SnapshotWriteError(SnapshotError):
    """Writing failed (unwritable or full storage). Earlier snapshots are untouched."""


class SnapshotCorruptError(SnapshotError):
    """A snapshot is incomplete or fails its checksums."""


def snapshot_name(step: int) -> str:
    return f"{SNAPSHOT_PREFIX}{step:08d}"


def snapshot_step(snapshot: str) -> int:
    match = _NAME.match(snapshot.rstrip("/").rsplit("/", 1)[-1].rsplit(os.sep, 1)[-1])
    if not match:
        raise TriaxError(f"{snapshot!r} is not a snapshot directory (expected a name like {snapshot_name(100)})")
    return int(match.group(1))


def list_snapshots(snapshot_root: str) -> list[str]:
    """Complete snapshots (those with a manifest) under `snapshot_root`, oldest first. Cheap: the
    checksums are verified when a snapshot is loaded, not here."""
    store = Store(snapshot_root)
    found = []
    for name in store.names():
        match = _NAME.match(name)
        if match and store.exists(store.path(name, MANIFEST)):
            found.append((int(match.group(1)), store.url_of(store.path(name))))
    return [path for _, path in sorted(found)]


def latest_snapshot(snapshot_root: str) -> str | None:
    snapshots = list_snapshots(snapshot_root)
    return snapshots[-1] if snapshots else None


# ---- optimizer state <-> flat tensors + JSON ---------------------------------------------------

def _flatten_optimizer(state_dict: dict) -> tuple[dict, dict]:
    tensors, scalars = {}, {}
    for name, entries in state_dict["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}/{key}"] = value.contiguous()
            else:
                scalars[f"{name}/{key}"] = value
    return tensors, {"scalars": scalars, "param_groups": state_dict["param_groups"]}


def _unflatten_optimizer(tensors: dict, meta: dict) -> dict:
    state: dict[str, dict] = {}
    for flat, value in list(tensors.items()) + list(meta["scalars"].items()):
        name, key = flat.rsplit("/", 1)
        state.setdefault(name, {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def _unshared(tensors: dict) -> dict:
    """safetensors refuses tensors that share storage (tied embeddings): copy the second one."""
    seen, result = set(), {}
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset()) if tensor.numel() else None
        result[name] = tensor.clone().contiguous() if key in seen else tensor.contiguous()
        if key is not None:
            seen.add(key)
    return result


# ---- save --------------------------------------------------------------------------------------

def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _outcome(error: str | None, doing: str) -> None:
    """Every rank learns whether any rank failed, so all of them raise (or go on) together."""
    if any_rank(error is not None):
        raise SnapshotWriteError(error or f"another rank failed while {doing}")


def _attempt(action: Callable[[], None]) -> str | None:
    """Run one rank's part of a write; return what went wrong instead of raising, so the ranks can
    agree on the outcome first (a rank raising alone would leave the others waiting forever)."""
    try:
        action()
    except OSError as error:
        return f"{type(error).__name__}: {error.strerror or error}"
    except Exception as error:  # e.g. a caller's state that is not JSON: still agreed, then raised
        return f"{type(error).__name__}: {error}"
    return None


def gather_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
    """(model state, optimizer state), full and keyed by parameter name, on CPU. Collective for
    sharded models (FSDP2, tensor parallel): every rank takes part."""
    model_state = get_model_state_dict(model, options=_FULL)
    optim_state = get_optimizer_state_dict(model, optimizer, options=_FULL) if optimizer else None
    return model_state, optim_state


def apply_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                     model_state: dict, optim_state: dict | None) -> None:
    """Put full, name-keyed state into `model` / `optimizer` in whatever layout they are now."""
    set_model_state_dict(model, model_state, options=StateDictOptions(full_state_dict=True))
    if optimizer is not None and optim_state is not None:
        set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=True))


def save_snapshot(snapshot_root: str, step: int, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer | None, state: dict, keep_last: int = 0,
                  gather=gather_full_state) -> str:
    """Write a snapshot of `model`, `optimizer`, the JSON-able `state` and every rank's RNG states;
    returns its path. Collective: every rank calls it. The snapshot counts as written only when
    complete; if storage fails, every rank raises SnapshotWriteError and earlier snapshots are
    untouched. `keep_last` > 0 then deletes all but that many newest complete snapshots.
    `gather(model, optimizer)` collects the full state (a pipeline stage holds only part of it:
    see triax.parallel.pipeline_checkpoint)."""
    rank, world = _rank(), _world()
    store = Store(snapshot_root)
    final = store.path(snapshot_name(step))
    # Locally we assemble under a temporary name and rename; object stores cannot rename, so
    # there the snapshot is written in place and only the manifest, written last, completes it.
    work = final + STAGING_SUFFIX if store.local else final
    model_state, optim_state = gather(model, optimizer)
    try:
        error = _attempt(lambda: _prepare(store, work)) if rank == 0 else None
        _outcome(error, "creating the snapshot directory")
        rng_bytes = json.dumps(capture_rng_state()).encode()
        error = _attempt(lambda: store.write(store.join(work, "rng", f"rank_{rank:05d}.json"), rng_bytes))
        _outcome(error, "writing its RNG state")
        if rank == 0:
            record = dict(state, step=step, world_size=world)
            error = _attempt(lambda: _write_rank0_files(store, work, final, step, world, model_state,
                                                        optim_state, record))
        _outcome(error, "writing the snapshot")
    except SnapshotWriteError as failure:
        if rank == 0:
            _attempt(lambda: store.remove_tree(work))  # best effort; a leftover is ignored anyway
        raise SnapshotWriteError(f"could not write snapshot {store.url_of(final)}: {failure}") from None
    if rank == 0 and keep_last > 0:
        error = _attempt(lambda: prune_snapshots(snapshot_root, keep_last))
        if error:
            print(f"triax: warning: could not delete old snapshots in {snapshot_root}: {error}", file=sys.stderr)
    return store.url_of(final)


def _prepare(store: Store, work: str) -> None:
    if not store.local and store.exists(store.join(work, MANIFEST)):
        # Re-writing a step: un-complete it first, so a crash mid-way cannot leave a manifest
        # that vouches for a mix of old and new files.
        store.fs.rm(store.join(work, MANIFEST))
    store.remove_tree(work)
    store.makedirs(store.join(work, "rng"))


def _write_rank0_files(store: Store, work: str, final: str, step: int, world: int,
                       model_state: dict, optim_state: dict | None, record: dict) -> None:
    from triax import __version__

    files = {}

    def put(relative: str, data: bytes) -> None:
        store.write(store.join(work, *relative.split("/")), data)
        files[relative] = {"bytes": len(data), "sha256": sha256(data)}

    def put_tensors(relative: str, tensors: dict) -> None:
        size, digest = store.write_tensors(store.join(work, relative), tensors)
        files[relative] = {"bytes": size, "sha256": digest}

    put_tensors("model.safetensors", _unshared(model_state))
    delay = float(os.environ.get(WRITE_DELAY_ENV, "0") or 0)
    if delay > 0:
        time.sleep(delay)
    meta = {}
    if optim_state is not None:
        tensors, meta = _flatten_optimizer(optim_state)
        put_tensors("optimizer.safetensors", tensors)
    record = dict(record, triax_version=__version__, optimizer=meta)
    put("state.json", json.dumps(record, indent=1).encode())
    # Each rank wrote its own RNG file; read them back so the manifest vouches for what is stored.
    for other in range(world):
        relative = f"rng/rank_{other:05d}.json"
        data = store.read(store.join(work, "rng", f"rank_{other:05d}.json"))
        files[relative] = {"bytes": len(data), "sha256": sha256(data)}
    manifest = {"format": FORMAT, "step": step, "world_size": world, "triax_version": __version__,
                "created": time.time(), "files": files}
    store.write(store.join(work, MANIFEST), json.dumps(manifest, indent=1).encode())
    if store.local:
        store.sync_directory(store.join(work, "rng"))
        store.sync_directory(work)
        if os.path.exists(final):  # same step saved again (after a fallback): swap, then delete
            replaced = final + REPLACED_SUFFIX
            store.remove_tree(replaced)
            os.replace(final, replaced)
            store.rename(work, final)
            store.remove_tree(replaced)
        else:
            store.rename(work, final)


def prune_snapshots(snapshot_root: str, keep_last: int) -> list[str]:
    """Delete all but the `keep_last` newest complete snapshots, and leftovers of interrupted
    writes. Not collective: the main rank calls it. Returns what was deleted."""
    store = Store(snapshot_root)
    complete = list_snapshots(snapshot_root)
    doomed = complete[:-keep_last] if keep_last > 0 else []
    for name in store.names():
        if name.endswith((STAGING_SUFFIX, REPLACED_SUFFIX)) and _NAME.match(name.rsplit(".", 1)[0]):
            doomed.append(store.url_of(store.path(name)))
        elif _NAME.match(name) and not store.exists(store.path(name, MANIFEST)):
            doomed.append(store.url_of(store.path(name)))  # object store: never completed
    for path in doomed:
        store.remove_tree(Store(path).root)
    return doomed


def remove_snapshots(snapshot_root: str) -> None:
    """Delete every snapshot (complete or not) under the root: `trainer.overwrite=true`."""
    store = Store(snapshot_root)
    for name in store.names():
        if name.startswith(SNAPSHOT_PREFIX):
            store.remove_tree(store.path(name))


# ---- load --------------------------------------------------------------------------------------

class _Reader:
    """Reads files of one snapshot, checking each against the manifest."""

    def __init__(self, snapshot: str, verify: bool = True):
        self.snapshot, self.verify = snapshot, verify
        self.store = Store(snapshot)
        self.manifest = json.loads(self._raw(MANIFEST, "the manifest"))
        if self.manifest.get("format") != FORMAT:
            raise SnapshotCorruptError(f"snapshot {snapshot} has an unknown format "
                                       f"{self.manifest.get('format')!r} (this triax reads {FORMAT})")

    def _raw(self, relative: str, what: str | None = None) -> bytes:
        try:
            return self.store.read(self.store.path(*relative.split("/")))
        except FileNotFoundError:
            raise SnapshotCorruptError(f"snapshot {self.snapshot} is incomplete: {what or relative} is missing") from None
        except OSError as error:
            raise SnapshotCorruptError(f"snapshot {self.snapshot}: cannot read {relative} ({error})") from None

    def has(self, relative: str) -> bool:
        return relative in self.manifest["files"]

    def _expected(self, relative: str) -> dict:
        expected = self.manifest["files"].get(relative)
        if expected is None:
            raise SnapshotCorruptError(f"snapshot {self.snapshot} has no {relative} in its manifest")
        return expected

    def _check(self, relative: str, size: int, digest: str) -> None:
        expected = self._expected(relative)
        if size != expected["bytes"]:
            raise SnapshotCorruptError(f"snapshot {self.snapshot} is truncated: {relative} has {size} "
                                       f"bytes, the manifest says {expected['bytes']}")
        if digest != expected["sha256"]:
            raise SnapshotCorruptError(f"snapshot {self.snapshot} is corrupt: {relative} fails its sha256 checksum")

    def read(self, relative: str) -> bytes:
        self._expected(relative)
        data = self._raw(relative)
        if self.verify:
            self._check(relative, len(data), sha256(data))
        return data

    def tensors(self, relative: str, copy: bool = True) -> dict:
        try:
            if not self.store.local:
                return load_tensors_from_bytes(self.read(relative))
            # Locally: hash the file in chunks, then map it and copy each tensor out, rather than
            # holding the whole file as one bytes object and deserializing a second copy.
            path = self.store.path(*relative.split("/"))
            self._expected(relative)
            if self.verify:
                try:
                    size, digest = file_sha256(path)
                except FileNotFoundError:
                    raise SnapshotCorruptError(f"snapshot {self.snapshot} is incomplete: {relative} is missing") from None
                self._check(relative, size, digest)
            tensors = load_tensors_from_file(path)
            # Copies, so nothing (optimizer state included) stays backed by the mapped file; the
            # caller may skip them when it copies anyway (load_state_dict copies into parameters).
            return {name: tensor.clone() for name, tensor in tensors.items()} if copy else tensors
        except SafetensorError as error:
            raise SnapshotCorruptError(f"snapshot {self.snapshot}: {relative} is not valid safetensors ({error})") from None

    def json(self, relative: str) -> dict:
        try:
            return json.loads(self.read(relative))
        except (ValueError, UnicodeDecodeError) as error:
            raise SnapshotCorruptError(f"snapshot {self.snapshot}: {relative} is not valid JSON ({error})") from None


def _open(snapshot: str, verify: bool) -> _Reader:
    try:
        return _Reader(snapshot, verify)
    except (ValueError, UnicodeDecodeError) as error:
        raise SnapshotCorruptError(f"snapshot {snapshot}: {MANIFEST} is not valid JSON ({error})") from None


def read_state(snapshot: str, verify: bool = True) -> dict:
    """The JSON state of a snapshot (step, data position, config, ...)."""
    return _open(snapshot, verify).json("state.json")


def read_model_tensors(snapshot: str, verify: bool = True) -> dict:
    """The full model weights of a snapshot, by parameter name, on CPU."""
    return _open(snapshot, verify).tensors("model.safetensors")


def load_snapshot(snapshot: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                  restore_rng: bool = True, verify: bool = True, apply=apply_full_state) -> dict:
    """Load a snapshot into `model` (and `optimizer`), whatever layout either was saved or is
    now in, and restore this rank's RNG states. Returns the JSON state. Raises
    SnapshotCorruptError if a file is missing or fails its checksum. `apply(model, optimizer,
    model_state, optimizer_state)` places the full state (pipeline stages take only their keys)."""
    reader = _open(snapshot, verify)
    state = reader.json("state.json")
    model_state = reader.tensors("model.safetensors", copy=False)
    optim_tensors = reader.tensors("optimizer.safetensors") if optimizer is not None and state.get("optimizer") else None
    rng_file = f"rng/rank_{_rank():05d}.json"
    rng_state = reader.json(rng_file) if restore_rng and reader.has(rng_file) else None
    try:
        optim_state = _unflatten_optimizer(optim_tensors, state["optimizer"]) if optim_tensors is not None else None
        apply(model, optimizer, model_state, optim_state)
    except (RuntimeError, KeyError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SnapshotError(f"snapshot {snapshot} does not fit this model/optimizer ({first}); "
                            "resume with the model config it was saved with") from None
    # A rank that did not exist when saving (resuming on more processes) keeps its own seed.
    if rng_state is not None:
        try:
            restore_rng_state(rng_state)
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as error:
            # Corrupt rather than a crash, so the ranks agree on it and fall back together.
            raise SnapshotCorruptError(f"snapshot {snapshot}: {rng_file} does not hold RNG states "
                                       f"({type(error).__name__}: {error})") from None
    return state


def load_latest_snapshot(snapshot_root: str, model: torch.nn.Module,
                         optimizer: torch.optim.Optimizer | None = None,
                         report: Callable[[str], None] | None = None,
                         apply=apply_full_state) -> tuple[str, dict] | None:
    """Load the newest snapshot that passes verification on every rank, falling back to older
    ones (each rejected one is reported in one line and moved aside). Collective. Returns
    (path, state), or None when there is no snapshot at all."""
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
        error, fatal = None, None
        try:
            state = load_snapshot(path, model, optimizer, apply=apply)
        except SnapshotCorruptError as failure:
            error = str(failure)
        except Exception as failure:  # not a bad file (e.g. another model's snapshot): all ranks stop
            fatal = failure
        outcome = max_across_ranks(2 if fatal is not None else 1 if error is not None else 0)
        if outcome == 2:
            raise fatal or SnapshotError(f"loading snapshot {path} failed on another rank; every rank stops")
        if outcome == 0:
            return path, state
        rejected += 1
        if rank == 0:
            moved = quarantine_snapshot(path)
            if report is not None:
                report(f"{error or f'snapshot {path} failed verification on another rank'}; "
                       f"moved it to {moved} and trying the previous snapshot")
        elif error:
            print(f"triax: rank {rank}: {error}", file=sys.stderr)


def quarantine_snapshot(snapshot: str) -> str:
    """Take a bad snapshot out of the list: locally renamed to `<name>.corrupt` (kept for a
    post-mortem); on an object store its manifest is deleted. Returns where it went."""
    store = Store(snapshot)
    if store.local:
        target = store.root.rstrip(os.sep) + QUARANTINE_SUFFIX
        store.remove_tree(target)
        os.replace(store.root, target)
        return target
    if store.exists(store.path(MANIFEST)):
        store.fs.rm(store.path(MANIFEST))
    return f"{snapshot} (manifest deleted)"
