"""Where and how elastic commits are kept between restarts, without pickle.

A commit is one safetensors file: the tensors (model and optimizer state), plus the rest of the
state as tagged JSON in the file's metadata. Reading it can only produce JSON values and tensors,
never run code. It is written to a temporary name and renamed, so a crash mid-write leaves the
previous commit whole.

The directory is either one the user names (TRIAX_HOROVOD_ELASTIC_DIR) or a private per-user
directory under the temp dir, created with mode 0700 and checked (a real directory, owned by this
user, closed to others) before every use, so another user cannot plant a commit. A first start
reads nothing: only a restarted attempt of the same job (torchrun's restart count > 0) loads.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from typing import Any

import torch

from triax.horovod.errors import HorovodTypeError, HorovodValueError

DIRECTORY_ENV = "TRIAX_HOROVOD_ELASTIC_DIR"
FILE_NAME = "commit.safetensors"
_METADATA_KEY = "triax_elastic_state"
_MAX_DEPTH = 64  # nesting allowed in a committed value; deeper means a damaged or hostile file


class CommitCorrupt(HorovodValueError):
    """The committed file cannot be read back as a commit."""


def _check_private(path: str, *, follow: bool) -> None:
    """Refuse a directory another user could have made or can write into."""
    info = os.stat(path) if follow else os.lstat(path)
    problems = []
    if not stat.S_ISDIR(info.st_mode):
        problems.append("is not a directory (a symlink or a file)")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        problems.append(f"belongs to uid {info.st_uid}, not to you (uid {os.getuid()})")
    if info.st_mode & (0o022 if not follow else 0o002):
        problems.append(f"is writable by others (mode {stat.S_IMODE(info.st_mode):o})")
    if problems:
        raise HorovodValueError(f"refusing the elastic commit directory {path}: it {' and '.join(problems)}; "
                                f"remove it, or set {DIRECTORY_ENV} to a directory of your own")


def _private_directory(path: str, *, follow: bool) -> str:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    _check_private(path, follow=follow)
    return path


def commit_directory() -> str | None:
    """The directory this job's commits live in (created and checked), or None: memory only.

    Under torchrun with restarts allowed, the job is named by its run id and the torchrun agent's
    pid, which stay the same across restarts of one job and differ between jobs.
    """
    named = os.environ.get(DIRECTORY_ENV)
    if named:
        os.makedirs(named, mode=0o700, exist_ok=True)
        _check_private(named, follow=True)  # the user named it: a symlink of theirs is fine
        return named
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) <= 0:
        return None
    uid = os.getuid() if hasattr(os, "getuid") else 0
    base = _private_directory(os.path.join(tempfile.gettempdir(), f"triax-horovod-elastic-{uid}"), follow=False)
    job = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{run_id}-{os.getppid()}")
    return _private_directory(os.path.join(base, job), follow=False)


# ---- tagged JSON: values keep their Python types (tuple vs list, int dict keys) -----------------
def _encode(value: Any, tensors: dict, depth: int = 0):
    if depth > _MAX_DEPTH:
        raise HorovodTypeError(f"elastic state nests deeper than {_MAX_DEPTH} levels; flatten it")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if torch.is_tensor(value):
        key = str(len(tensors))
        tensors[key] = value.detach().to("cpu").contiguous()
        return {"tensor": key}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, tensors, depth + 1) for v in value]}
    if isinstance(value, list):
        return {"list": [_encode(v, tensors, depth + 1) for v in value]}
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise HorovodTypeError(f"elastic state dict key {key!r} is a {type(key).__name__}; "
                                       "only str and int keys can be committed")
            items.append([key, _encode(item, tensors, depth + 1)])
        return {"dict": items}
    raise HorovodTypeError(f"elastic state value of type {type(value).__name__} cannot be committed: "
                           "use numbers, strings, None, lists, tuples, dicts and tensors")


def _decode(node: Any, tensors: dict[str, torch.Tensor], depth: int = 0):
    if depth > _MAX_DEPTH:
        raise CommitCorrupt("nested too deeply")
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if not isinstance(node, dict) or len(node) != 1:
        raise CommitCorrupt(f"unexpected entry {str(node)[:60]!r}")
    (tag, body), = node.items()
    if tag == "tensor" and isinstance(body, str) and body in tensors:
        return tensors[body]
    if tag in ("tuple", "list") and isinstance(body, list):
        items = [_decode(v, tensors, depth + 1) for v in body]
        return tuple(items) if tag == "tuple" else items
    if tag == "dict" and isinstance(body, list):
        result = {}
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (str, int))
                    and not isinstance(pair[0], bool)):
                raise CommitCorrupt(f"bad dict entry {str(pair)[:60]!r}")
            result[pair[0]] = _decode(pair[1], tensors, depth + 1)
        return result
    raise CommitCorrupt(f"unknown entry {tag!r}")


def check_committable(value: Any) -> None:
    """Raise HorovodTypeError now if `value` could not be committed."""
    _encode(value, {})


def write(directory: str, snapshot: dict) -> None:
    """Commit `snapshot` atomically (rank 0 only)."""
    from safetensors.torch import save_file

    tensors: dict = {}
    document = json.dumps(_encode(snapshot, tensors))
    path = os.path.join(directory, FILE_NAME)
    temporary = path + f".{os.getpid()}.tmp"
    save_file(tensors, temporary, metadata={_METADATA_KEY: document})
    os.replace(temporary, path)


def read(directory: str):
    """The last commit in `directory`, or None when there is none; CommitCorrupt if damaged."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    path = os.path.join(directory, FILE_NAME)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode):
        raise CommitCorrupt(f"{path} is not a regular file")
    try:
        with safe_open(path, framework="pt", device="cpu") as handle:
            document = (handle.metadata() or {}).get(_METADATA_KEY)
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        if document is None:
            raise CommitCorrupt(f"{path} has no elastic state")
        return _decode(json.loads(document), tensors)
    except (SafetensorError, ValueError, RecursionError, OSError) as error:
        if isinstance(error, CommitCorrupt):
            raise
        raise CommitCorrupt(f"{path} is damaged ({type(error).__name__}: {str(error)[:100]})") from None


def discard(directory: str) -> None:
    """Forget a commit left by an earlier job under the same name (first start only)."""
    try:
        os.unlink(os.path.join(directory, FILE_NAME))
    except FileNotFoundError:
        pass
