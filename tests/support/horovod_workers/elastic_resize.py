"""An elastic Horovod training script for `triax horovodrun --host-discovery-script`, started by
tests/unit/horovod/test_horovod_elastic_driver.py, which changes the hosts and kills a worker while it runs.

It trains a small model with an ElasticSampler in a TorchState, committing after every step, until
the file --stop-file exists (checked at the end of each epoch). Every rank keeps, in the state,
the global batch of every committed step (the indices of all ranks, gathered), so after any
reset the committed history is exactly what the model went through. Prints, for the test to
follow: `started with HOROVOD_...=...` before hvd.init(), `joined HOST rank R size S pid P gloo
threads N` at every (re)join, `step N size S` after each commit, and `final rank R size S digest D`
at the end. Rank 0 writes --out: the committed history, the
initial and final weights and the resets each rank saw.
"""

import argparse
import faulthandler
import hashlib
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import triax.horovod as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--stop-file", required=True)
parser.add_argument("--samples", type=int, default=48)
parser.add_argument("--batch-size", type=int, default=2)
parser.add_argument("--step-pause", type=float, default=0.02, help="seconds: leaves the test time to act")
parser.add_argument("--hold-exchange-on", metavar="HOST",
                    help="the worker on HOST, at its 3rd step, stops in the middle of its gradient exchange "
                         "(one of two buckets sent, the other not) and says `holding the exchange pid P`, "
                         "so the test can kill it while the others wait in their allreduce")
args = parser.parse_args()
faulthandler.dump_traceback_later(600, exit=True)


class Numbered(Dataset):
    """Sample i: (i, features, target), fixed by the seed."""

    def __init__(self, count):
        generator = torch.Generator().manual_seed(0)
        self.features = torch.randn(count, 6, generator=generator)
        self.targets = self.features.sum(1, keepdim=True)

    def __len__(self):
        return len(self.features)

    def __getitem__(self, index):
        return index, self.features[index], self.targets[index]


def build_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def say(text):
    # One write per line: every worker shares the driver's stdout, and print() writes the text and
    # its newline separately when unbuffered, so two workers' lines could run into each other.
    os.write(1, (text + "\n").encode())


# What horovodrun put in this worker's environment before the script started.
HOROVOD_VARIABLES = ["HOROVOD_HOSTNAME", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK",
                     "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE"]
say("started with " + " ".join(f"{name}={os.environ.get(name)}" for name in HOROVOD_VARIABLES))
hvd.init()
dataset = Numbered(args.samples)
model = build_model()
initial = {k: v.clone() for k, v in model.state_dict().items()}
backward_passes = 0


def hold_exchange(_parameter):
    # On the first layer's weight, registered before DistributedOptimizer's own hooks: it runs
    # before that layer's bucket (the second of two) is sent; the last layer's bucket, whose
    # gradients come first in backward, is already on its way.
    global backward_passes
    backward_passes += 1
    if backward_passes == 3:
        say(f"holding the exchange pid {os.getpid()}")
        time.sleep(3600)


if args.hold_exchange_on == os.environ["HOROVOD_HOSTNAME"]:
    model[0].weight.register_post_accumulate_grad_hook(hold_exchange)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5),
                                     named_parameters=model.named_parameters(),
                                     groups=2 if args.hold_exchange_on else None)
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, history=[])
resets = []


def gloo_threads() -> int:
    """Threads of gloo's (its work loops and its connections' loop) in this process now."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as handle:
                count += "gloo" in handle.read()
        except OSError:
            pass  # ended meanwhile
    return count


def joined():
    say(f"joined {os.environ['HOROVOD_HOSTNAME']} rank {hvd.rank()} size {hvd.size()} pid {os.getpid()} "
        f"gloo threads {gloo_threads()}")


def on_reset():
    resets.append(hvd.size())
    joined()


state.register_reset_callbacks([on_reset])


@hvd.elastic.run
def train(state):
    while True:
        for batch_idx, (indices, features, targets) in enumerate(loader):
            optimizer.zero_grad()
            F.mse_loss(model(features), targets).backward()
            optimizer.step()
            everyone = hvd.allgather(indices)  # this step's global batch, every rank's share
            state.history.append((state.epoch, hvd.size(), everyone.tolist()))
            sampler.record_batch(batch_idx, args.batch_size)
            state.commit()
            say(f"step {len(state.history)} size {hvd.size()}")
            time.sleep(args.step_pause)
        state.epoch += 1
        sampler.set_epoch(state.epoch)
        state.commit()
        if hvd.broadcast_object(os.path.exists(args.stop_file), 0, name="stop?"):
            return


joined()
train(state)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
say(f"final rank {hvd.rank()} size {hvd.size()} digest {digest}")
if hvd.rank() == 0:
    torch.save({"history": state.history, "initial": initial, "final": model.state_dict(),
                "epochs": state.epoch}, args.out)
hvd.shutdown()
