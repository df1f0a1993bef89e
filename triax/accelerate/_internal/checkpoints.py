"""Where save_state writes and load_state reads: explicit directories, `<project_dir>/checkpoints`,
or Accelerate's automatic naming `<project_dir>/checkpoints/checkpoint_<iteration>` with a
`total_limit` on how many are kept.

Each such directory is a snapshot root (triax.checkpoint writes `step_<n>/` inside it); this
module only decides which root, so the storage underneath can change without touching it.
Every function here is collective: the main process touches the file system, and its outcome
(including a failure) is shared so that no process is left waiting.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import triax.safe_files as safe_files
from triax.accelerate._internal.errors import AcceleratorRuntimeError, AcceleratorValueError
from triax.accelerate.utils.operations import broadcast_object_list
from triax.runtime.process_group import is_distributed

CHECKPOINT_NAME = re.compile(r"^checkpoint_(\d{1,18})$")


def _numbered(root: str) -> list[tuple[int, str]]:
    """(iteration, path) of the checkpoint_<n> directories under root, oldest first. Symlinks and
    other names are never counted (and so never deleted)."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = CHECKPOINT_NAME.match(name)
        path = os.path.join(root, name)
        if match and safe_files.is_directory(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def _on_main(is_main: bool, action: Callable):
    """Run `action` on the main process; every process returns its result or raises its error."""
    outcome = [None, None]
    if is_main:
        try:
            outcome = [action(), None]
        except AcceleratorValueError as error:
            outcome = [None, ("value", str(error))]
        except OSError as error:
            outcome = [None, ("os", f"{type(error).__name__}: {error}")]
    if is_distributed():
        outcome = broadcast_object_list(outcome)
    result, error = outcome
    if error is not None:
        kind, message = error
        raise (AcceleratorValueError if kind == "value" else AcceleratorRuntimeError)(
            message if kind == "value" else f"the main process could not prepare the checkpoint directory: {message}")
    return result


def next_automatic_dir(project: Any, is_main: bool) -> str:
    """`<project_dir>/checkpoints/checkpoint_<iteration>`, after deleting the oldest checkpoints so
    that at most `total_limit` remain once it is written."""
    root = os.path.join(project.project_dir, "checkpoints")
    target = os.path.join(root, f"checkpoint_{project.iteration}")

    def prepare():
        os.makedirs(root, exist_ok=True)
        if os.path.lexists(target):
            raise AcceleratorValueError(f"checkpoint directory {target} (iteration {project.iteration}) already "
                                        "exists; set accelerator.project_configuration.iteration to continue "
                                        "from a new number")
        existing = _numbered(root)
        if project.total_limit is not None:
            for _, path in existing[:max(len(existing) + 1 - project.total_limit, 0)]:
                shutil.rmtree(path)
        return target

    return _on_main(is_main, prepare)


def latest_automatic_dir(project: Any) -> str:
    root = os.path.join(project.project_dir, "checkpoints")
    existing = _numbered(root)
    if not existing:
        raise AcceleratorValueError(f"load_state found no checkpoint_<n> directory in {root}; save_state "
                                    "first, or pass the directory to load")
    return existing[-1][1]
