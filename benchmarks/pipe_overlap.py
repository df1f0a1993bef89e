"""How well `triax.pipe.Pipe` overlaps micro-batches: measured step time beside the ideal ones.

Default (any machine): every partition does a fixed amount of "work" per mini-batch, T seconds,
as time.sleep split evenly over the micro-batches (sleep releases the GIL, as PyTorch kernels do,
and is not slowed by other processes on a shared machine). With P partitions and M micro-batches:

    sequential  = P * T                 (partitions take turns: what a plain model split over devices does)
    pipelined   = (M + P - 1) / M * T   (GPipe fill-and-drain: the ideal)

The step is a forward and a backward pass (the sleep is in forward; backward is nearly free).

    python benchmarks/pipe_overlap.py                      # sleep-dominated overlap table
    python benchmarks/pipe_overlap.py --classifier         # + seed 002's classifier on 2 CPU partitions
    python benchmarks/pipe_overlap.py --gpu                # + memory per GPU and throughput (needs GPUs)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from triax.pipe import Pipe
from triax.pipe.schedule import pipelined_ticks


class SleepLayer(nn.Module):
    """Sleeps `work_seconds` per mini-batch, pro rata to the micro-batch's share of the samples."""

    def __init__(self, work_seconds: float, batch_size: int):
        super().__init__()
        self.work_seconds = work_seconds
        self.batch_size = batch_size
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        time.sleep(self.work_seconds * x.size(0) / self.batch_size)
        return x * self.scale


def step_seconds(model: nn.Module, inputs: torch.Tensor, repeats: int) -> float:
    """Median time of a forward + backward step, after one warm-up step."""
    times = []
    for attempt in range(repeats + 1):
        began = time.perf_counter()
        model(inputs).sum().backward()
        for index in range(torch.cuda.device_count()):  # GPU work is asynchronous: wait for it
            torch.cuda.synchronize(index)
        if attempt:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def overlap_table(work: float, batch_size: int, repeats: int) -> None:
    print(f"sleep-dominated partitions: T = {work * 1000:.0f} ms of work per partition per mini-batch "
          f"of {batch_size} samples; forward + backward step, median of {repeats}")
    print(f"{'partitions':>10} {'chunks':>6} {'measured s':>10} {'pipelined s':>11} {'sequential s':>12} "
          f"{'measured/pipelined':>18} {'speed-up vs sequential':>22}")
    inputs = torch.ones(batch_size, 4)
    for partitions in (2, 4):
        for chunks in (1, 2, 4, 8):
            model = nn.Sequential(*[SleepLayer(work, batch_size) for _ in range(partitions)])
            pipe = Pipe(model, balance=[1] * partitions, devices=["cpu"] * partitions, chunks=chunks,
                        checkpoint="never")
            measured = step_seconds(pipe, inputs, repeats)
            pipelined = pipelined_ticks(chunks, partitions) / chunks * work
            sequential = partitions * work
            print(f"{partitions:>10} {chunks:>6} {measured:>10.3f} {pipelined:>11.3f} {sequential:>12.3f} "
                  f"{measured / pipelined:>18.2f} {sequential / measured:>21.2f}x")


def load_classifier():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from pipe_classifier import classifier, one_hot  # noqa: E402

    return classifier, one_hot


def classifier_table(batch_size: int, repeats: int) -> None:
    """Seed 002's classifier: the plain model against Pipe on two CPU partitions (same cores)."""
    classifier, one_hot = load_classifier()
    torch.manual_seed(0)
    plain = classifier(dropout=0.0)
    images = torch.rand(batch_size, 3, 32, 32)
    labels = torch.randint(0, 10, (batch_size,))

    def loss_step(model):
        def step(inputs):
            output = model(inputs)
            return nn.functional.binary_cross_entropy(output, one_hot(labels, output.device))
        return step

    class Wrapped(nn.Module):  # step_seconds calls model(inputs).sum().backward()
        def __init__(self, step):
            super().__init__()
            self.step = step

        def forward(self, inputs):
            return self.step(inputs)

    def accumulated(chunks):
        # The plain model fed the same micro-batches one after another (gradient accumulation):
        # the baseline that isolates the pipe's own cost from the cost of smaller batches.
        def step(inputs):
            total = 0
            for chunk, chunk_labels in zip(inputs.chunk(chunks), labels.chunk(chunks)):
                output = plain(chunk)
                loss = nn.functional.binary_cross_entropy(output, one_hot(chunk_labels, output.device)) / chunks
                loss.backward()
                total = total + loss.detach()
            return total.requires_grad_()  # backward of the returned sum is then a no-op
        return step

    print(f"\nseed 002 classifier (19 layers, 15.2M parameters), batch {batch_size}, CPU, "
          f"{torch.get_num_threads()} intra-op threads; forward + backward, median of {repeats}")
    baseline = step_seconds(Wrapped(loss_step(plain)), images, repeats)
    print(f"{'configuration':<62} {'step s':>7} {'vs plain':>9}")
    print(f"{'plain nn.Sequential, one batch':<62} {baseline:>7.3f} {1.0:>8.2f}x")
    for chunks in (1, 4):
        for checkpoint in ("never", "except_last", "always"):
            if chunks == 1 and checkpoint != "never":
                continue
            if chunks > 1 and checkpoint == "never":
                seconds = step_seconds(Wrapped(accumulated(chunks)), images, repeats)
                print(f"{f'plain, {chunks} micro-batches accumulated':<62} {seconds:>7.3f} {seconds / baseline:>8.2f}x")
            pipe = Pipe(copy.deepcopy(plain), balance=[10, 9], devices=["cpu", "cpu"], chunks=chunks,
                        checkpoint=checkpoint)
            seconds = step_seconds(Wrapped(loss_step(pipe)), images, repeats)
            label = f"Pipe [10, 9] on cpu, cpu, chunks {chunks}, checkpoint {checkpoint}"
            print(f"{label:<62} {seconds:>7.3f} {seconds / baseline:>8.2f}x")


def gpu_table(batch_size: int, repeats: int) -> None:
    """Memory on each GPU and throughput of Pipe (chunks 1, 4, 8) against the plain model on one GPU."""
    count = torch.cuda.device_count()
    if count == 0:
        print("\n--gpu: no GPU visible, skipped")
        return
    devices = [f"cuda:{index % count}" for index in range(2)]
    torch.manual_seed(0)
    width, depth = 4096, 16
    plain = nn.Sequential(*[layer for _ in range(depth) for layer in (nn.Linear(width, width), nn.GELU())])
    inputs = torch.randn(batch_size, width)

    def measure(model, first_device):
        for index in range(count):
            torch.cuda.reset_peak_memory_stats(index)
        x = inputs.to(first_device)
        seconds = step_seconds(model, x, repeats)
        peaks = [torch.cuda.max_memory_allocated(index) / 2**30 for index in range(count)]
        return batch_size / seconds, peaks

    print(f"\nGPU: {depth} x Linear({width}, {width}) + GELU, batch {batch_size}, forward + backward, median of {repeats}")
    print(f"{'configuration':<44} {'samples/s':>10} {'vs plain':>9}  peak GiB per GPU")
    reference = copy.deepcopy(plain).to("cuda:0")
    base, peaks = measure(reference, "cuda:0")
    print(f"{'plain on cuda:0':<44} {base:>10.0f} {1.0:>8.2f}x  {[round(p, 2) for p in peaks]}")
    del reference
    for chunks in (1, 4, 8):
        pipe = Pipe(copy.deepcopy(plain), balance=[depth, depth], devices=devices, chunks=chunks)
        throughput, peaks = measure(pipe, devices[0])
        label = f"Pipe on {', '.join(devices)}, chunks {chunks}"
        print(f"{label:<44} {throughput:>10.0f} {throughput / base:>8.2f}x  {[round(p, 2) for p in peaks]}")
        del pipe


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=float, default=0.2, help="seconds of sleep per partition per mini-batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--classifier", action="store_true", help="also time seed 002's classifier on CPU")
    parser.add_argument("--classifier-batch", type=int, default=64)
    parser.add_argument("--gpu", action="store_true", help="also measure memory and throughput on GPUs")
    parser.add_argument("--gpu-batch", type=int, default=256)
    args = parser.parse_args(argv)
    overlap_table(args.work, batch_size=32, repeats=args.repeats)
    if args.classifier:
        classifier_table(args.classifier_batch, args.repeats)
    if args.gpu:
        gpu_table(args.gpu_batch, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
