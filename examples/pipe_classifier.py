"""A CIFAR-style classifier, flattened into an nn.Sequential and trained through `Pipe`.

The classifier (conv features -> MLP -> softmax, BCE on one-hot labels) is the kind FairScale's
Pipe was used for on CIFAR-10; here its layers run through `triax.pipe.Pipe` on two devices. The
data is one batch of random 32x32 images with random labels (no download needed), shown again at
every step: the loss falls as the model memorises it, which shows the pipeline trains (a second
batch would not be learned, as random labels carry nothing to generalise). Defaults take seconds
on a CPU.

    python examples/pipe_classifier.py                          # two CPU partitions
    python examples/pipe_classifier.py --devices cuda:0 cuda:1  # two GPUs
    python examples/pipe_classifier.py --balance 10 9 --chunks 4 --checkpoint never
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from triax.pipe import Pipe, balance_by_time
from triax.runtime.threads import apply_thread_choice


def classifier(dropout: float = 0.5) -> nn.Sequential:
    """The classifier's three blocks and its flatten, laid out as one sequence."""
    return nn.Sequential(
        # features: 3x32x32 -> 128x3x3
        nn.Conv2d(3, 32, kernel_size=4, stride=2, padding=1), nn.ReLU(), nn.MaxPool2d((2, 2), 1),
        nn.Conv2d(32, 64, kernel_size=3, stride=2, padding=1), nn.ReLU(), nn.MaxPool2d((2, 2), 1),
        nn.Conv2d(64, 128, 2, 2, 1), nn.ReLU(), nn.MaxPool2d((2, 2), 1),
        nn.Flatten(),  # was torch.flatten(x, 1) in Classifier.forward
        # classifier
        nn.Linear(3 * 3 * 128, 4096), nn.ReLU(), nn.Dropout(p=dropout),
        nn.Linear(4096, 2048), nn.ReLU(),
        nn.Linear(2048, 1024), nn.ReLU(),
        # last_layer_input
        nn.Linear(1024, 10), nn.Softmax(dim=1),
    )


def synthetic_batches(count: int, batch_size: int, seed: int = 88):
    """Random images and labels standing in for CIFAR-10 (values in [0, 1] like ToTensor)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        images = torch.rand(batch_size, 3, 32, 32, generator=generator)
        labels = torch.randint(0, 10, (batch_size,), generator=generator)
        yield images, labels


def one_hot(labels: torch.Tensor, device: torch.device) -> torch.Tensor:
    target = torch.zeros(labels.size(0), 10, device=device)
    target[torch.arange(labels.size(0)), labels.to(device)] = 1
    return target


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, images, labels) -> float:
    output = model(images)
    loss = nn.functional.binary_cross_entropy(output, one_hot(labels, output.device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--devices", nargs="+", default=["cpu", "cpu"])
    parser.add_argument("--balance", nargs="+", type=int, default=None,
                        help="layers per partition (default: balance_by_time on a sample batch)")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--checkpoint", default="except_last")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=1, help="distinct batches, cycled (so loss can fall)")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    # triax's commands' thread rule (the cores idle now, OMP_NUM_THREADS if set): torch's default of
    # a thread per core ran this 3x slower on cores other programs kept busy.
    print(f"threads: {apply_thread_choice().describe()}")

    torch.manual_seed(88)
    model = classifier()
    batches = list(synthetic_batches(args.repeat, args.batch_size))
    balance = args.balance
    if balance is None:
        sample = batches[0][0][: max(1, args.batch_size // args.chunks)]
        balance = balance_by_time(len(args.devices), model, sample, timeout=0.1, device="cpu")
    model = Pipe(model, balance=balance, devices=args.devices, chunks=args.chunks, checkpoint=args.checkpoint)
    print(f"balance {model.balance} on {[str(d) for d in model.devices]}, chunks {model.chunks}, "
          f"checkpoint {model.checkpoint}")
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        images, labels = batches[step % len(batches)]
        loss = train_step(model, optimizer, images, labels)
        print(f"step {step} loss {loss:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
