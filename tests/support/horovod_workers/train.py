"""The classic Horovod PyTorch training script, with `import triax.horovod as hvd`.

Started by tests/unit/horovod/test_horovod_training.py with 1 process (the reference) or 2 (under
`triax horovodrun` or `mpirun`). Each rank starts from a different random model on purpose:
broadcast_parameters must make them equal. Several variants (plain, gradient accumulation with
backward_passes_per_step=2, fp16 compression) train one after another in the same processes, so
the suite pays process start-up once. Rank 0 saves the final models to --out.
"""

import argparse
import faulthandler

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import triax.horovod as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True, help="rank 0 saves {variant: final state} here")
parser.add_argument("--base-lr", type=float, default=0.01)
parser.add_argument("--global-batch", type=int, default=16, help="samples per optimizer step, all ranks")
parser.add_argument("--variants", default="plain", help="comma list of: plain, accumulate, fp16")
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()
faulthandler.dump_traceback_later(240, exit=True)

# variant -> (backward passes per step, compression, fusion groups)
VARIANTS = {"plain": (1, "none", 0), "accumulate": (2, "none", 0), "fp16": (1, "fp16", 3)}

hvd.init()
if torch.cuda.is_available():
    torch.cuda.set_device(hvd.local_rank())

# Synthetic regression data, identical on every rank.
generator = torch.Generator().manual_seed(0)
features = torch.randn(64, 10, generator=generator)
targets = features @ torch.randn(10, 1, generator=generator) + 0.1 * torch.randn(64, 1, generator=generator)
dataset = TensorDataset(features, targets)


def train(backward_passes, compression_name, fusion_groups):
    torch.manual_seed(1000 + hvd.rank())  # a different start on every rank, on purpose
    batch_size = args.global_batch // hvd.size() // backward_passes  # per rank, per backward pass
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 1))
    # Horovod's recipe: scale the learning rate by the number of processes.
    optimizer = torch.optim.Adam(model.parameters(), lr=args.base_lr * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # state still empty: Horovod takes a zero-gradient step
    compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[compression_name]
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         backward_passes_per_step=backward_passes,
                                         groups=fusion_groups or None)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        batches = iter(loader)
        for _ in range(len(loader) // backward_passes):
            optimizer.zero_grad()
            for _ in range(backward_passes):
                x, y = next(batches)
                # the mean over the samples of one step, across backward passes too
                (F.mse_loss(model(x), y) / backward_passes).backward()
            optimizer.step()
        # Average a metric across ranks, as Horovod scripts do.
        loss = hvd.allreduce(F.mse_loss(model(features), targets).detach(), name="loss")
    return {"model": model.state_dict(), "loss": float(loss)}


results = {name: train(*VARIANTS[name]) for name in args.variants.split(",")}
if hvd.rank() == 0:  # rank-0 checkpoint
    torch.save(results, args.out)
hvd.shutdown()
