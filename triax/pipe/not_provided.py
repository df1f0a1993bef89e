"""FairScale's pipe names that triax does not provide. They import, so a script's import block
runs unchanged; making one raises UnsupportedFeatureError naming what to use instead."""

from __future__ import annotations

from typing import Any

from triax.errors import UnsupportedFeatureError

ACROSS_PROCESSES = ("FairScale's pipelines across processes are not part of triax; use triax.pipe.Pipe (one "
                    "process, several devices) or `triax train` with parallel.pp (torch.distributed.pipelining)")


def _not_provided(name: str, instead: str) -> type:
    def refuse(self, *args: Any, **kwargs: Any):
        raise UnsupportedFeatureError(f"fairscale.nn.pipe.{name} is not provided by triax: {instead}")

    return type(name, (), {"__init__": refuse, "__doc__": f"Not provided: {instead}", "__module__": __name__})


AsyncPipe = _not_provided("AsyncPipe", ACROSS_PROCESSES)
PipeRPCWrapper = _not_provided("PipeRPCWrapper", ACROSS_PROCESSES)
LazyModule = _not_provided("LazyModule", "it defers building a partition for FairScale's pipelines across "
                           "processes, which are not part of triax; build the module itself and use triax.pipe.Pipe "
                           "or `triax train` with parallel.pp")
