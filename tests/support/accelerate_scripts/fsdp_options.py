"""A plain torch model prepared with FSDP options that leave a trace, for tests/unit/accelerate/test_accelerate_fsdp.py.

python fsdp_options.py --out DIR --plugin JSON
Each process builds the model from its own seed (so only process 0's weights can survive
sync_module_states) and writes DIR/rank_<r>.json: the FSDP units, which parameters are sharded,
how many units each unit prefetches in forward, and the full weights after prepare.
"""

import argparse
import json
import os

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from triax.accelerate import Accelerator
from triax.accelerate.utils import FullyShardedDataParallelPlugin


def model_for(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 4))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--plugin", required=True)
    args = parser.parse_args()
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(**json.loads(args.plugin)))
    model = model_for(seed=accelerator.process_index)
    model = accelerator.prepare(model)
    units = {name: module for name, module in model.named_modules() if isinstance(module, FSDPModule)}
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    record = {
        "units": sorted(units),
        "sharded": sorted(name for name, p in model.named_parameters() if isinstance(p, DTensor)),
        "prefetched": {name: len(module._get_fsdp_state()._states_to_forward_prefetch or [])
                       for name, module in units.items()},
        "weights": {name: tensor.tolist() for name, tensor in state.items()},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank_{accelerator.process_index}.json"), "w") as handle:
        json.dump(record, handle)


if __name__ == "__main__":
    main()
