"""Snapshots of a pipeline-split model, in the same full, name-keyed format as any other layout.

A pipeline rank holds only its stages' layers, inside a ModuleList of parts (so state-dict keys
come prefixed "<part>."). Saving: each stage's full state (gathered over tp/dp by
torch.distributed.checkpoint.state_dict) has the prefix removed — the names are then the plain
GPT's — and is sent to global rank 0, which merges them. Loading: each rank picks out the keys its
parts own. The snapshot therefore does not record how many stages wrote it.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

# Not cpu_offload: with it, full state is kept on global rank 0 only, and a later stage's
# leader is not rank 0. Each stage's leader keeps its stage's full state and moves it to CPU.
_FULL = StateDictOptions(full_state_dict=True)


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def _split_prefix(key: str) -> tuple[str, str]:
    part, rest = key.split(".", 1)
    return part, rest


def gather_pipeline_state(container, optimizer, pp_group=None, leader: bool = True):
    """(model state, optimizer state) of the whole model on global rank 0; partial elsewhere.

    `leader`: whether this rank's pipeline group is the one through global rank 0 (tp and dp
    coordinates 0) — the others have identical copies and skip the gather."""
    model_state = _to_cpu(get_model_state_dict(container, options=_FULL))
    optim_state = _to_cpu(get_optimizer_state_dict(container, optimizer, options=_FULL)) if optimizer else None
    model_state = {_split_prefix(k)[1]: v for k, v in model_state.items()}
    if optim_state is not None:
        optim_state = {"state": {_split_prefix(k)[1]: v for k, v in optim_state["state"].items()},
                       "param_groups": [dict(g, params=[_split_prefix(p)[1] for p in g["params"]])
                                        for g in optim_state["param_groups"]]}
    if pp_group is None or not leader:
        return model_state, optim_state
    pieces = [None] * dist.get_world_size(pp_group) if dist.get_rank() == 0 else None
    dist.gather_object((model_state, optim_state), pieces, dst=0, group=pp_group)
    if dist.get_rank() != 0:
        return model_state, optim_state
    merged_model, merged_optim = {}, None
    for piece_model, piece_optim in pieces:
        merged_model.update(piece_model)
        if piece_optim is None:
            continue
        if merged_optim is None:
            merged_optim = {"state": {}, "param_groups": [dict(g, params=[]) for g in piece_optim["param_groups"]]}
        merged_optim["state"].update(piece_optim["state"])
        for merged_group, group in zip(merged_optim["param_groups"], piece_optim["param_groups"]):
            merged_group["params"] += group["params"]
    return merged_model, merged_optim


def apply_pipeline_state(container, optimizer, model_state: dict, optim_state: dict | None) -> None:
    """Load the full, plain-named state into this rank's parts: each takes only its own keys."""
    owned = list(get_model_state_dict(container).keys())
    # Each prefixed key of ours -> its plain name in the snapshot.
    plain = {key: _split_prefix(key)[1] for key in owned}
    missing = [name for name in plain.values() if name not in model_state]
    if missing:
        from triax.errors import TriaxError

        raise TriaxError(f"the snapshot lacks {len(missing)} parameter(s) this stage needs, e.g. {missing[0]!r}; "
                         "was it written by a different model configuration?")
    set_model_state_dict(container, {key: model_state[name] for key, name in plain.items()},
                         options=StateDictOptions(full_state_dict=True))
    if optimizer is None or optim_state is None:
        return
    to_prefixed = {name: key for key, name in plain.items()}
    ours = {"state": {to_prefixed[name]: value for name, value in optim_state["state"].items() if name in to_prefixed},
            "param_groups": [dict(g, params=[to_prefixed[p] for p in g["params"] if p in to_prefixed])
                             for g in optim_state["param_groups"]]}
    set_optimizer_state_dict(container, optimizer, ours, options=StateDictOptions(full_state_dict=True))


def pipeline_state_functions(pp_group, leader: bool):
    """(gather, apply) for triax.checkpoint.save_snapshot / load_snapshot."""
    return functools.partial(gather_pipeline_state, pp_group=pp_group, leader=leader), apply_pipeline_state
