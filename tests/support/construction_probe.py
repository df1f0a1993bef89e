"""Run by test_sharded_construction under torchrun: build the trainer for a layout and report
what each rank constructed (was every model built on the meta device? which layers?) and what it
holds afterwards (parameter values per rank, against the whole model)."""

import json
import os
import sys

# Run by path, so put this checkout (not an installed triax) first on the path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from torch.distributed.tensor import DTensor  # noqa: E402

from triax.models import decoder  # noqa: E402
from triax.runtime.process_group import shutdown_distributed  # noqa: E402
from triax.config import compose_config  # noqa: E402
from triax.parallel.plan import ModelShape, local_parameter_count  # noqa: E402
from triax.train.trainer import Trainer  # noqa: E402

built = []
original_init = decoder.Decoder.__init__
MODELS = os.path.dirname(os.path.abspath(decoder.__file__))


def recording_init(self, *args, **kwargs):
    original_init(self, *args, **kwargs)
    frame = sys._getframe(1)
    while os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == MODELS:  # past build_model
        frame = frame.f_back
    caller = os.path.basename(frame.f_code.co_filename)
    built.append({"by": caller, "layers": sorted(int(k) for k in self.layers.keys()), "embeddings": self.tok_emb is not None,
                  "head": self.lm_head is not None, "meta": all(p.is_meta for p in self.parameters())})


def local(tensor):
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor)


def main():
    report_dir, overrides = sys.argv[1], sys.argv[2:]
    decoder.Decoder.__init__ = recording_init
    trainer = Trainer(compose_config(overrides))
    params = list(trainer.model.parameters())
    report = {"rank": trainer.rank, "built": built, "local_values": sum(local(p).numel() for p in params),
              "total_values": trainer.num_params + trainer.model_config.block_size * trainer.model_config.n_embd,
              "all_materialized": not any(local(p).is_meta for p in params),
              "pp_rank": trainer.layout.coordinates(trainer.rank)["pp"],
              # what triax plan counts for the most loaded rank of this layout (its first stage)
              "planned_values": local_parameter_count(ModelShape.from_config(trainer.model_config), trainer.layout,
                                                      trainer.config.parallel.pp_schedule)}
    # One file per rank (lines printed by several ranks at once can interleave); the first argument is the directory.
    with open(os.path.join(report_dir, f"rank{trainer.rank}.json"), "w") as handle:
        json.dump(report, handle)
    shutdown_distributed()


if __name__ == "__main__":
    main()
