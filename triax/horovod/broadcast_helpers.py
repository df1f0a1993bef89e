"""`broadcast_parameters` and `broadcast_optimizer_state`: make every rank start from the root's.

Tensors are fused by (dtype, device) into one flat broadcast each, instead of one per tensor.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from triax.horovod.errors import HorovodTypeError
from triax.horovod import basics, engine, process_sets
from triax.horovod.process_sets import ProcessSet, global_process_set, in_process_set
from triax.horovod.objects import broadcast_object
from triax.horovod.optimizer import _DistributedOptimizer


def _broadcast_tensors_(tensors: list[torch.Tensor], root_rank: int, label: str) -> None:
    """Overwrite each tensor in place with root_rank's, one fused broadcast per dtype/device."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for group in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        shapes = ";".join(str(tuple(t.shape)) for t in group)
        engine.wait(engine.start_broadcast(flat, root_rank, name=f"{label} [{shapes[:200]}]"))
        offset = 0
        with torch.no_grad():
            for tensor in group:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()


@in_process_set
def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], root_rank: int = 0,
                         prefix: str | None = None, process_set: ProcessSet = global_process_set):
    """`params`: a state_dict (dict name -> tensor) or `model.named_parameters()` pairs."""
    if process_sets.active_size() == 1:
        return
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = list(params)
        if any(not (isinstance(item, (tuple, list)) and len(item) == 2) for item in items):
            raise HorovodTypeError("broadcast_parameters takes model.state_dict() or "
                             "model.named_parameters() (name, tensor) pairs")
    tensors = []
    for name, value in items:
        if value is None:
            continue
        if not torch.is_tensor(value):
            raise HorovodTypeError(f"broadcast_parameters: {name!r} is a {type(value).__name__}, not a tensor; "
                             "use hvd.broadcast_object for other values")
        tensors.append(value.data if isinstance(value, torch.nn.Parameter) else value)
    _broadcast_tensors_(tensors, root_rank, "broadcast_parameters" + (f" {prefix}" if prefix else ""))


def _split_tensors(value: Any, tensors: list):
    """Replace tensors in a nested state by placeholders; collect them in `tensors`."""
    if torch.is_tensor(value):
        tensors.append(value)
        return ("__triax_tensor__", len(tensors) - 1, tuple(value.shape), value.dtype, value.device.type)
    if isinstance(value, dict):
        return {k: _split_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_split_tensors(v, tensors) for v in value)
    return value


def _is_placeholder(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 5 and value[0] == "__triax_tensor__"


def _fill_tensors(value: Any, tensors: list):
    if _is_placeholder(value):
        return tensors[value[1]]
    if isinstance(value, dict):
        return {k: _fill_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fill_tensors(v, tensors) for v in value)
    return value


def _placeholders(value: Any, found: list):
    if _is_placeholder(value):
        found.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _placeholders(v, found)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _placeholders(v, found)
    return found


def _initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Horovod's dummy step: zero gradients, then the wrapped optimizer's own step (no exchange,
    which would need every rank to step), so the state tensors exist on every rank."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam):
                    p.grad = p.grad.to_sparse()
    if isinstance(optimizer, _DistributedOptimizer):
        super(_DistributedOptimizer, optimizer).step()
    else:
        optimizer.step()


@in_process_set
def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model: torch.nn.Module | None = None, process_set: ProcessSet = global_process_set):
    """Every rank's optimizer takes root_rank's state and hyperparameters (lr, momentum, ...).

    As in Horovod, an optimizer with no state yet (before its first step) first takes one local
    step on zero gradients (each trainable parameter's .grad is set to zeros), so its state exists
    and is broadcast too. The layout travels as one pickled object; the tensors travel as fused
    broadcasts.
    """
    if not optimizer.state_dict()["state"]:  # on one process too, as Horovod's: 1 process stays equal to N
        _initialize_state(optimizer)
    if process_sets.active_size() == 1:
        return
    state = optimizer.state_dict() if basics.rank() == root_rank else None
    tensors: list[torch.Tensor] = []
    skeleton = _split_tensors(state, tensors) if state is not None else None
    skeleton = broadcast_object(skeleton, root_rank, name="broadcast_optimizer_state")
    if basics.rank() != root_rank:
        device = basics.world().device
        tensors = [torch.empty(shape, dtype=dtype, device=device if kind != "cpu" else "cpu")
                   for _, _, shape, dtype, kind in _placeholders(skeleton, [])]
    if tensors:
        _broadcast_tensors_(tensors, root_rank, "broadcast_optimizer_state")
    if basics.rank() != root_rank:
        optimizer.load_state_dict(_fill_tensors(skeleton, tensors))
