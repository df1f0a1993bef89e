"""Memory per rank of a small Mixtral under expert parallelism x 2 against one process, side by side.

The model: 256 wide, 4 layers, 8 query heads on 4 key/value heads, 8 experts of SwiGLU 512, top-2
(the shape of benchmarks/moe_vs_transformers.py); block 128, 8 sequences per step in every layout
(one process: 8; two processes: 4 each), fp32, AdamW. Three layouts, each a fresh torchrun job
(gloo on a CPU):

    one    1 process
    fsdp2  parallel.dp_shard=2               every tensor, experts included, sharded over 2 ranks
    ep2    parallel.dp_shard=2 parallel.ep=2 each rank holds 4 of the 8 experts whole, the rest FSDP

Every rank builds the trainer, takes --steps training steps, and reports what it holds (the bytes
of its parameters, gradients and AdamW state, counted from its own tensors: a DTensor's local
shard) and the peak resident memory of those steps (VmHWM, reset after construction: see
benchmarks/memory_scaling.py). Printed: each rank's figures and the ratio to one process.

    python benchmarks/moe_memory.py               # 3 steps per layout
    python benchmarks/moe_memory.py --steps 1     # a quicker look

Memory figures stay valid on a busy machine (nothing here is timed).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile

print = functools.partial(print, flush=True)  # noqa: A001 - progress shows up when piped to a file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from memory_scaling import RECORDS_ENV, PeakMemory, _local_bytes, _report, machine  # noqa: E402

MIB = 2 ** 20
MODEL = ["model=mixtral-debug", "model.n_layer=4", "model.n_head=8", "model.n_kv_head=4", "model.n_embd=256",
         "model.intermediate_size=512", "model.num_experts=8", "model.experts_per_token=2"]
LAYOUTS = {"one": (1, []), "fsdp2": (2, ["parallel.dp_shard=2"]),
           "ep2": (2, ["parallel.dp_shard=2", "parallel.ep=2"])}


def worker(overrides: list[str], steps: int) -> None:
    """One rank: build, train `steps` steps, report the bytes held and the peak RSS of the steps."""
    from triax.runtime.process_group import shutdown_distributed
    from triax.config import compose_config
    from triax.train.trainer import Trainer

    memory = PeakMemory()
    trainer = Trainer(compose_config(overrides))
    rank = int(os.environ.get("RANK", "0"))
    parameters = list(trainer.model.parameters())
    held = {"params": sum(_local_bytes(p) for p in parameters)}
    zero_grad = trainer.optimizer.zero_grad

    def measuring_zero_grad(*args, **kwargs):  # the gradients exist until the step clears them
        held["grads"] = sum(_local_bytes(p.grad) for p in parameters if p.grad is not None)
        zero_grad(*args, **kwargs)
    trainer.optimizer.zero_grad = measuring_zero_grad
    memory.reset()
    for _ in range(steps):
        trainer.train_step()
    held["optimizer"] = sum(_local_bytes(value) for state in trainer.optimizer.state.values()
                            for value in state.values() if hasattr(value, "dim") and value.dim() > 0)
    _report(rank, held=held, **memory.peak())
    shutdown_distributed()


def launch(nproc: int, overrides: list[str], steps: int) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               os.path.abspath(__file__), "--worker", "--steps", str(steps), "--", *overrides]
    with tempfile.TemporaryDirectory(prefix="triax_moe_memory_") as records_dir:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env[RECORDS_ENV] = records_dir
        env.setdefault("OMP_NUM_THREADS", "1")
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        if result.returncode != 0:
            raise SystemExit(f"{nproc} process(es) failed:\n{result.stderr[-3000:]}")
        return sorted((json.loads(line) for name in os.listdir(records_dir)
                       for line in open(os.path.join(records_dir, name))), key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.worker:
        return worker([a for a in rest if a != "--"], args.steps)
    print(f"moe_memory: Mixtral 256 wide, 4 layers, 8 experts of 512, top-2, block 128, 8 sequences per step, "
          f"fp32, {args.steps} steps\nmachine: {machine()}")
    print(f"{'layout':<6} {'rank':>4} {'params MiB':>10} {'grads MiB':>9} {'AdamW MiB':>9} {'held MiB':>8} "
          f"{'vs one':>6} {'peak RSS MiB':>12} {'vs one':>6}")
    one = None
    with tempfile.TemporaryDirectory(prefix="triax_moe_runs_") as runs:
        for name, (nproc, layout) in LAYOUTS.items():
            overrides = [*MODEL, "data.block_size=128", f"trainer.batch_size={8 // nproc}", "trainer.eval_every=0",
                         "trainer.sample_tokens=0", "trainer.precision=fp32", "trainer.device=cpu",
                         "parallel.dp_replicate=1", f"trainer.run_dir={os.path.join(runs, name)}", *layout]
            for record in launch(nproc, overrides, args.steps):
                held = record["held"]
                total = held["params"] + held.get("grads", 0) + held["optimizer"]
                one = one or (total, record["peak_rss"])
                print(f"{name:<6} {record['rank']:>4} {held['params'] / MIB:>10.1f} {held.get('grads', 0) / MIB:>9.1f} "
                      f"{held['optimizer'] / MIB:>9.1f} {total / MIB:>8.1f} {total / one[0]:>6.2f} "
                      f"{record['peak_rss'] / MIB:>12.0f} {record['peak_rss'] / one[1]:>6.2f}")
    print("held: parameters + gradients + AdamW state on the rank; peak RSS: the whole process during the "
          "steps (python, torch and gloo included)")


if __name__ == "__main__":
    main()
