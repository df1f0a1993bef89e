"""Run by test_parallel_layouts under torchrun: build the trainer for a layout, take one step, and
print what this rank really holds (parameter and optimizer-state values) next to `triax plan`'s
formula for the same layout."""

import json
import os
import sys

# Run by path, so put this checkout (not an installed triax) first on the path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from triax.parallel.plan import ModelShape, local_parameter_count  # noqa: E402
from triax.runtime.process_group import shutdown_distributed  # noqa: E402
from triax.config import compose_config  # noqa: E402
from triax.train.trainer import Trainer  # noqa: E402


def local(tensor):
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).numel()


def main():
    trainer = Trainer(compose_config(sys.argv[1:]))
    trainer.train_step()
    params = list(trainer.model.parameters())
    optimizer_values = sum(local(value) for p in params for value in trainer.optimizer.state[p].values()
                           if torch.is_tensor(value) and value.dim() > 0)
    c = trainer.model_config
    shape = ModelShape.from_config(c)
    report = {"rank": trainer.rank, "local_params": sum(local(p) for p in params),
              "local_optimizer": optimizer_values, "total_params": shape.num_params(),
              "planned_params": local_parameter_count(shape, trainer.layout, trainer.config.parallel.pp_schedule,
                                                      stage=trainer.layout.coordinates(trainer.rank)["pp"])}
    print("PROBE " + json.dumps(report), flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    main()
