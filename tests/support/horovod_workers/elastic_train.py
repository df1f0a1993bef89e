"""hvd.elastic under torchrun: rank 1 dies once mid-training; torchrun restarts both processes,
which resume from the last commit. Started by tests/unit/horovod/test_horovod_elastic.py.

--crash-marker: a file; if it does not exist yet, rank 1 creates it and exits at epoch 2 (after
that epoch's commit), so the first attempt fails exactly once. Rank 0 saves the final model and
the epochs each attempt ran to --out.
"""

import argparse
import faulthandler
import os

import torch
import torch.nn.functional as F

import triax.horovod as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--crash-marker")
parser.add_argument("--epochs", type=int, default=4)
args = parser.parse_args()
faulthandler.dump_traceback_later(240, exit=True)

hvd.init()
torch.manual_seed(1000 + hvd.rank())
generator = torch.Generator().manual_seed(0)
features = torch.randn(32, 6, generator=generator)
targets = features.sum(1, keepdim=True)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                     named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0, history=[])
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])


@hvd.elastic.run
def train(state):
    while state.epoch < args.epochs:
        # this rank's half of the (fixed) global batch of 16 samples for this epoch
        order = torch.randperm(32, generator=torch.Generator().manual_seed(state.epoch))[:16]
        mine = order.chunk(hvd.size())[hvd.rank()]
        optimizer.zero_grad()
        F.mse_loss(model(features[mine]), targets[mine]).backward()
        optimizer.step()
        state.history.append((os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), state.epoch))
        state.epoch += 1
        state.commit()
        if (args.crash_marker and hvd.rank() == 1 and state.epoch == 2
                and not os.path.exists(args.crash_marker)):
            open(args.crash_marker, "w").close()
            os._exit(1)  # a worker lost mid-run


train(state)
if hvd.rank() == 0:
    torch.save({"model": model.state_dict(), "history": state.history, "resets": resets}, args.out)
hvd.shutdown()
