"""The pipeline bubble of torch.distributed.pipelining's schedules, measured against (p-1)/(m+p-1).

Each stage's work is a sleep (forward `F/m` seconds per micro-batch, backward twice that), so the
figure measures the schedule's idle time and its gloo send/recv overhead, not how 2 CPU cores
share matrix multiplications among p processes. Bubble = 1 - (ideal busy time) / (measured step
time), with ideal busy time = m x (forward + backward) per micro-batch = 3F.

    python benchmarks/pipeline_bubble.py            # p in 2 4, m in 1 2 4 8, gpipe and 1f1b
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn

FORWARD_S = 0.24  # forward time of one stage for the whole batch


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class SleepStage(nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return _Sleep.apply(x * self.scale, self.seconds)


def worker(args) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for schedule_name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        for m in args.microbatches:
            if schedule_name == "1f1b" and m < world:
                continue  # 1f1b needs m >= p
            stage = PipelineStage(SleepStage(FORWARD_S / m), rank, world, torch.device("cpu"))
            schedule = cls(stage, n_microbatches=m, loss_fn=lambda out, target: out.sum())
            x = torch.ones(8 * m, 8)
            times = []
            for repeat in range(args.repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                if rank == 0:
                    schedule.step(x)
                elif rank == world - 1:
                    schedule.step(target=x)
                else:
                    schedule.step()
                dist.barrier()
                if repeat:  # the first step also infers shapes
                    times.append(time.perf_counter() - start)
            step = min(times)
            results.append({"p": world, "m": m, "schedule": schedule_name, "step_s": step,
                            "measured": 1 - 3 * FORWARD_S / step, "formula": (world - 1) / (m + world - 1)})
    if rank == 0:
        print("RESULTS " + json.dumps(results), flush=True)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from triax.testing import run_torchrun

    print(f"pipeline bubble, stage work = sleep ({FORWARD_S}s forward + {2 * FORWARD_S}s backward per batch), gloo")
    print(f"{'p':>2} {'m':>3} {'schedule':<8} {'step s':>7} {'measured':>9} {'(p-1)/(m+p-1)':>14}")
    for p in args.stages:
        out = run_torchrun(p, [__file__, "--worker", "--microbatches", *map(str, args.microbatches),
                               "--repeats", str(args.repeats)], timeout=600)
        line = next(line for line in out.stdout.splitlines() if line.startswith("RESULTS "))
        for r in json.loads(line[len("RESULTS "):]):
            print(f"{r['p']:>2} {r['m']:>3} {r['schedule']:<8} {r['step_s']:7.3f} {r['measured']:9.3f} "
                  f"{r['formula']:14.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
