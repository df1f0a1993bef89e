"""The launch configuration file that `triax launch` takes its defaults from (written by `triax
config`: triax.commands.config).

One small YAML file, by default ~/.cache/triax/default_config.yaml ($XDG_CACHE_HOME respected),
or wherever $TRIAX_CONFIG_FILE points. `triax config` asks a few questions; `triax config
--default` writes the defaults for this machine without asking. Unknown keys are errors, so a
typo does not silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Sequence

import yaml

from triax import safe_files, safe_yaml
from triax.errors import ConfigError
from triax.launch.accelerate_config import from_accelerate, is_accelerate_config
from triax.launch.settings import MIXED_PRECISION_CHOICES, PARALLEL_CHOICES

ENV_CONFIG_FILE = "TRIAX_CONFIG_FILE"
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
# More processes (or machines) than any job here starts: a larger number is a typo, and torchrun
# would build one entry per process before failing.
MAX_PROCESSES = 65536


def _default_num_processes() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


@dataclass
class LaunchConfig:
    num_machines: int = 1
    """Machines (nodes) in the job."""
    num_processes: int = 1
    """Processes per machine (one per GPU; on CPU, how many copies of the script)."""
    machine_rank: int = 0
    """This machine's index, 0 .. num_machines-1; machine 0 hosts the rendezvous."""
    main_process_ip: str = "127.0.0.1"
    """Address of machine 0, reachable from every machine (loopback when there is one machine)."""
    main_process_port: int = 29500
    """TCP port on machine 0 for the rendezvous; 0 picks a free one (single machine only)."""
    mixed_precision: str = "no"
    """no | bf16 | fp16, handed to the Accelerator through the environment (triax/launch/settings.py)."""
    parallel: str = "ddp"
    """ddp | fsdp | none, handed to the Accelerator through the environment (triax/launch/settings.py)."""
    use_cpu: bool = False
    """Train on the CPU even where GPUs exist."""
    gradient_accumulation_steps: int = 1
    """Default micro-steps per optimizer update for Accelerator.accumulate."""
    max_restarts: int = 0
    """How often torchrun restarts all workers after a failure."""
    rdzv_backend: str = "static"
    """static (fixed machines) or c10d / etcd (elastic) rendezvous of torchrun."""
    rdzv_id: str = "none"
    """Job id shared by the machines of one elastic job."""

    def validate(self, source: str = "config") -> "LaunchConfig":
        def need(ok: bool, key: str, what: str):
            if not ok:
                raise ConfigError(f"{source}: {key}={getattr(self, key)!r} is invalid; {what}")

        for field in fields(self):
            value = getattr(self, field.name)
            expected = {"int": int, "str": str, "bool": bool}[field.type]
            if expected is int and isinstance(value, bool) or not isinstance(value, expected):
                raise ConfigError(f"{source}: {field.name}={value!r} should be a {field.type}")
        need(1 <= self.num_machines <= MAX_PROCESSES, "num_machines", f"use 1 .. {MAX_PROCESSES}")
        need(1 <= self.num_processes <= MAX_PROCESSES, "num_processes", f"use 1 .. {MAX_PROCESSES}")
        need(0 <= self.machine_rank < self.num_machines, "machine_rank",
             f"use 0 .. {self.num_machines - 1} (num_machines={self.num_machines})")
        need(0 <= self.main_process_port < 65536, "main_process_port", "use 0 (pick a free one) .. 65535")
        need(self.mixed_precision in MIXED_PRECISION_CHOICES, "mixed_precision",
             f"use one of {', '.join(MIXED_PRECISION_CHOICES)}")
        need(self.parallel in PARALLEL_CHOICES, "parallel", f"use one of {', '.join(PARALLEL_CHOICES)}")
        need(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps", "use 1 or more")
        need(self.max_restarts >= 0, "max_restarts", "use 0 or more")
        need(self.rdzv_backend in RDZV_BACKENDS, "rdzv_backend", f"use one of {', '.join(RDZV_BACKENDS)}")
        return self


def default_config() -> LaunchConfig:
    return LaunchConfig(num_processes=_default_num_processes())


def config_path() -> str:
    explicit = os.environ.get(ENV_CONFIG_FILE)
    if explicit:
        return explicit
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "triax", "default_config.yaml")


def load_config(path: str | None = None) -> LaunchConfig | None:
    """The config at `path` (default: config_path()), or None if there is no file there."""
    read = read_config_file(path or config_path())
    return None if read is None else read[0]


def read_config_file(path: str) -> tuple[LaunchConfig, dict[str, str]] | None:
    """(config, environment for the workers) from a file `triax config` wrote, or from one
    `accelerate config` wrote (triax.launch.accelerate_config); None if there is no file."""
    if not os.path.exists(path):
        return None
    if os.path.isdir(path):
        raise ConfigError(f"{path} is not a file (a directory?); give the path of a launch configuration file")
    try:
        data = safe_yaml.read(path, MAX_CONFIG_BYTES) or {}
    except safe_yaml.YamlFileError as error:
        raise ConfigError(str(error)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} should hold key: value pairs, found a {type(data).__name__}")
    if is_accelerate_config(data):
        values, environment = from_accelerate(data, path)
        return LaunchConfig(**values).validate(path), environment
    known = {field.name for field in fields(LaunchConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; known keys are {', '.join(sorted(known))}")
    return LaunchConfig(**data).validate(path), {}


HEADER = "# triax launch configuration (written by `triax config`)"
MAX_CONFIG_BYTES = safe_yaml.MAX_CONFIG_BYTES  # a launch configuration is a dozen lines


def written_by_triax(path: str) -> bool:
    """Whether `path` is a regular file starting with the header `triax config` writes."""
    try:
        if not os.path.isfile(path) or os.path.islink(path):
            return False
        with open(path, "rb") as handle:
            return handle.read(len(HEADER)) == HEADER.encode()
    except OSError:
        return False


def check_config_file(path: str, force: bool = False) -> None:
    """Where `triax config` may write: not a directory, not a file triax did not write (unless
    `force`), in a directory that exists or can be created."""
    if not path.strip():
        raise ConfigError("--config-file is empty; give the path of a file")
    if os.path.isdir(path):
        raise ConfigError(f"--config-file {path} is a directory; give the path of a file, e.g. "
                          f"{os.path.join(path, 'default_config.yaml')}")
    if os.path.lexists(path) and not force and not written_by_triax(path):
        raise ConfigError(f"{path} exists and was not written by `triax config`; choose another --config-file, "
                          "or add --force to replace it")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ConfigError(f"cannot create {path}: {parent} is not a writable directory")
    safe_files.check_output_place("--config-file", path, directory=False)  # /proc, a name too long, read-only


def write_config(config: LaunchConfig, path: str | None = None) -> str:
    path = path or config_path()
    config.validate()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(HEADER + "\n")
        yaml.safe_dump(dataclasses.asdict(config), handle, sort_keys=False)
    return path
