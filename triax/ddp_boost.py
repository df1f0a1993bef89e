"""Gradient compression for a plain DDP script, without editing it (seed 004's one-import speed-up).

    import triax.ddp_boost                                   # first line of the script, or:
    triax launch --grad-compression bf16 train.py            # the script untouched

Every `DistributedDataParallel` the script builds afterwards gets the chosen communication hook
(`bf16`, `fp16`, `powersgd`; see triax/parallel/comm_hooks.py) and, if asked, a bucket size. The hook
is registered just before the model's first forward, and only if the script has not registered
one of its own, so scripts that already choose a hook keep theirs.

Settings come from `install(...)` or the environment: TRIAX_GRAD_COMPRESSION (default bf16),
TRIAX_DDP_BUCKET_CAP_MB (default: DDP's own, 25), TRIAX_POWERSGD_RANK (default 2).
`python -m triax.ddp_boost script.py args` (or `-m module args`) runs a script with it installed;
that is what `triax launch --grad-compression` starts on every process.
"""

from __future__ import annotations

import inspect
import os
import runpy
import sys
from dataclasses import dataclass
from typing import Any, Callable, TYPE_CHECKING

from torch.nn.parallel import DistributedDataParallel

import triax.runtime.process_group  # noqa: F401  (its exit handler lets gloo's threads finish: the script's group too)
from triax.errors import ConfigError
from triax.launch import settings as launch_settings
from triax.parallel.comm_hooks import check_compression, register_compression

if TYPE_CHECKING:
    from torch import nn

COMPRESSION_ENV = launch_settings.GRAD_COMPRESSION_ENV
BUCKET_ENV = launch_settings.DDP_BUCKET_CAP_MB_ENV
POWERSGD_RANK_ENV = "TRIAX_POWERSGD_RANK"


@dataclass(frozen=True)
class Settings:
    compression: str
    bucket_cap_mb: float | None
    powersgd_rank: int


_settings: Settings | None = None
_original_init = DistributedDataParallel.__init__
_init_signature = inspect.signature(_original_init)


def _number(name: str, text: str | None, convert: Callable[[str], float], minimum: float):
    if text in (None, ""):
        return None
    try:
        value = convert(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a number") from None
    if value < minimum:
        raise ConfigError(f"{name}={text!r} must be at least {minimum}")
    return value


def settings_from_environment() -> Settings:
    compression = os.environ.get(COMPRESSION_ENV, "bf16").strip().lower() or "bf16"
    bucket = _number(BUCKET_ENV, os.environ.get(BUCKET_ENV), float, 1e-6)
    rank = _number(POWERSGD_RANK_ENV, os.environ.get(POWERSGD_RANK_ENV), int, 1) or 2
    check_compression(compression, rank)
    return Settings(compression, bucket, rank)


def install(compression: str | None = None, bucket_cap_mb: float | None = None,
            powersgd_rank: int | None = None) -> Settings:
    """Apply the settings (arguments, else the environment) to every DDP model built from now on."""
    global _settings
    base = settings_from_environment()
    chosen = Settings(compression if compression is not None else base.compression,
                      bucket_cap_mb if bucket_cap_mb is not None else base.bucket_cap_mb,
                      powersgd_rank if powersgd_rank is not None else base.powersgd_rank)
    check_compression(chosen.compression, chosen.powersgd_rank)
    _settings = chosen
    DistributedDataParallel.__init__ = _boosted_init
    return chosen


def uninstall() -> None:
    global _settings
    _settings = None
    DistributedDataParallel.__init__ = _original_init


def _boosted_init(self, *args: Any, **kwargs: Any):
    settings = _settings
    if settings is not None and settings.bucket_cap_mb is not None:
        given = _init_signature.bind_partial(self, *args, **kwargs).arguments
        if given.get("bucket_cap_mb") is None and "bucket_cap_mb" not in kwargs:
            kwargs["bucket_cap_mb"] = settings.bucket_cap_mb
    _original_init(self, *args, **kwargs)
    if settings is None or settings.compression == "none":
        return

    def before_first_forward(module: nn.Module, inputs: tuple):
        handle.remove()
        if not getattr(module, "_comm_hooks", None):  # the script chose its own hook: keep it
            register_compression(module, settings.compression, settings.powersgd_rank,
                                 process_group=module.process_group)

    handle = self.register_forward_pre_hook(before_first_forward)


# The script's globals, kept until the interpreter ends, as `python script.py` keeps its module's.
# runpy hands back a copy that the caller would drop at once: the script's DDP model and with it
# the last reference to its process group would go then, while PowerSGD's callback closures may
# still hold the group on gloo's thread; the group then dies on that thread, which joins itself
# ("Resource deadlock avoided", exit -6, after a run that succeeded). Kept, they go only after the
# exit handler of triax.runtime.process_group has let gloo's threads finish.
_script_globals: dict[str, Any] = {}


def _run(argv: list[str]) -> None:
    """`python -m triax.ddp_boost (script.py | -m module) [args...]` with the boost installed."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    install()
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("triax.ddp_boost: -m needs a module name")
        sys.argv = argv[1:]
        _script_globals.update(runpy.run_module(argv[1], run_name="__main__", alter_sys=True))
    else:
        script = argv[0]
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` would
        _script_globals.update(runpy.run_path(script, run_name="__main__"))


if __name__ == "__main__":
    _run(sys.argv[1:])
else:
    install()
