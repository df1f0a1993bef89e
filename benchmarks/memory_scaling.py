"""Peak resident memory per rank, per phase, as FSDP shards a model over 1, 2, 4 processes.

For each shard count N (parallel.dp_shard=N, N processes under torchrun) it runs the trainer on
a GPT preset and records, on every rank, the peak resident set size (VmHWM from /proc/self/status,
reset before each phase through /proc/self/clear_refs; a 10 ms /proc sampler where that reset is
not allowed) of each phase:

    construct  Trainer(config): process group, model built on meta, shards allocated and initialised
    step       one training step (forward, backward, optimizer)
    save       one snapshot (trainer.save)
    resume     a fresh launch whose Trainer(config) finds that snapshot and loads it

next to the ideal, 16 bytes x parameters / N (fp32 weights, gradients, and AdamW's two moments)
plus the measured baseline of a bare python + torch + gloo process. It also checks `triax plan`'s
per-rank parameter, gradient and optimizer bytes against the bytes the rank really holds. On a
GPU it reports the peak device memory of each phase too (that is where parallel.cpu_offload saves).

    python benchmarks/memory_scaling.py                           # gpt2-medium, N = 1 2 4, all phases
    python benchmarks/memory_scaling.py --model gpt2-large --shards 4 --phases construct step
    python benchmarks/memory_scaling.py --model gpt-mini --cpu-offload   (offload needs N > 1)

Memory figures stay valid on a busy machine; the seconds it prints do not.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

print = functools.partial(print, flush=True)  # noqa: A001 - progress shows up when piped to a file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RECORDS_ENV = "MEMORY_SCALING_RECORDS"  # the directory where each rank writes its records
PHASES = ("construct", "step", "save", "resume")
GIB = 1024 ** 3


# ---- measuring, inside each rank --------------------------------------------------------------

def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


class PeakMemory:
    """Peak RSS of the phase in progress: the kernel's high-water mark when it can be reset,
    otherwise the highest of samples taken every 10 ms."""

    def __init__(self):
        self.sampled = 0
        self.exact = True
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self):
        while not self._stop.wait(0.01):
            self.sampled = max(self.sampled, _status_bytes("VmRSS"))

    def reset(self):
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # 5: reset the peak RSS (VmHWM) to the current RSS
        except OSError:
            self.exact = False
        self.sampled = _status_bytes("VmRSS")
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> dict:
        import torch

        peak = _status_bytes("VmHWM") if self.exact else max(self.sampled, _status_bytes("VmRSS"))
        result = {"peak_rss": peak, "rss_after": _status_bytes("VmRSS"), "exact": self.exact}
        if torch.cuda.is_available():
            result["peak_device"] = torch.cuda.max_memory_allocated()
        return result


def _local_bytes(tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _report(rank: int, **values) -> None:
    # One file per rank: lines that several ranks print at once would interleave on stdout.
    with open(os.path.join(os.environ[RECORDS_ENV], f"rank{rank}.jsonl"), "a") as handle:
        handle.write(json.dumps({"rank": rank, **values}) + "\n")


def worker_baseline() -> None:
    """A bare python + torch + gloo process: the fixed cost every rank pays."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    _report(dist.get_rank(), phase="bare", peak_rss=_status_bytes("VmHWM"), rss_after=_status_bytes("VmRSS"))
    dist.destroy_process_group()


def worker_train(overrides: list[str], phases: list[str], resume: bool) -> None:
    import torch.distributed as dist

    from triax.runtime.process_group import shutdown_distributed
    from triax.config import compose_config
    from triax.train.trainer import Trainer

    memory = PeakMemory()
    config = compose_config(overrides)
    rank = int(os.environ.get("RANK", "0"))
    _report(rank, phase="ready", peak_rss=_status_bytes("VmHWM"), rss_after=_status_bytes("VmRSS"))
    memory.reset()
    start = time.perf_counter()
    trainer = Trainer(config)
    _report(rank, phase="resume" if resume else "construct", seconds=time.perf_counter() - start, **memory.peak())
    if resume:
        shutdown_distributed()
        return
    if "step" in phases or "save" in phases:
        held = {"params": sum(_local_bytes(p) for p in trainer.model.parameters())}
        zero_grad = trainer.optimizer.zero_grad

        def measuring_zero_grad(*args, **kwargs):  # the gradients exist until the step clears them
            held["grads"] = sum(_local_bytes(p.grad) for p in trainer.model.parameters() if p.grad is not None)
            zero_grad(*args, **kwargs)
        trainer.optimizer.zero_grad = measuring_zero_grad
        memory.reset()
        start = time.perf_counter()
        trainer.train_step()
        seconds = time.perf_counter() - start
        trainer.optimizer.zero_grad = zero_grad
        held["optimizer"] = sum(_local_bytes(value) for state in trainer.optimizer.state.values()
                                for value in state.values() if hasattr(value, "dim") and value.dim() > 0)
        _report(rank, phase="step", seconds=seconds, held=held, **memory.peak(), **_planned(trainer))
    if "save" in phases:
        memory.reset()
        start = time.perf_counter()
        trainer.save()
        if dist.is_initialized():
            dist.barrier()
        _report(rank, phase="save", seconds=time.perf_counter() - start, **memory.peak())
    shutdown_distributed()


def _planned(trainer) -> dict:
    """`triax plan`'s per-rank bytes for this rank's layout (it describes the most loaded rank)."""
    from triax.parallel.plan import ModelShape, estimate

    c = trainer.model_config
    shape = ModelShape(c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.block_size, c.bias)
    precision = "bf16-pure" if trainer.precision.name == "bf16-pure" else "fp32"
    e = estimate(shape, trainer.layout, batch_size=trainer.config.trainer.batch_size, precision=precision)
    return {"planned": {"params": e.params_gb * GIB, "grads": e.grads_gb * GIB, "optimizer": e.optimizer_gb * GIB},
            "num_params": trainer.num_params + c.block_size * c.n_embd}


# ---- driving, in the parent ------------------------------------------------------------------

def launch(nproc: int, worker_args: list[str], timeout: float) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               os.path.abspath(__file__), *worker_args]
    with tempfile.TemporaryDirectory(prefix="triax_memory_records_") as records_dir:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env[RECORDS_ENV] = records_dir
        env.setdefault("OMP_NUM_THREADS", "1")
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        if result.returncode != 0:
            raise SystemExit(f"{' '.join(worker_args[:2])} with {nproc} process(es) failed:\n{result.stderr[-3000:]}")
        return [json.loads(line) for name in sorted(os.listdir(records_dir))
                for line in open(os.path.join(records_dir, name))]


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "unknown CPU")
    return f"{model}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start"


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2-medium", help="model preset")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4], help="FSDP degrees (= processes)")
    parser.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per rank")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--cpu-offload", action="store_true", help="parallel.cpu_offload=true (N > 1 only)")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="more trainer settings, e.g. trainer.return_freed_memory=false")
    parser.add_argument("--run-root", default=None, help="where run directories go (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per launch")
    parser.add_argument("--worker", choices=["baseline", "train", "resume"], help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.worker == "baseline":
        return worker_baseline()
    if args.worker in ("train", "resume"):
        return worker_train([a for a in rest if a != "--"], args.phases, resume=args.worker == "resume")

    print(f"memory_scaling: {args.model}, block {args.block_size}, batch {args.batch_size}/rank, {args.precision}, "
          f"FSDP x {args.shards}, phases {' '.join(args.phases)}{', cpu_offload' if args.cpu_offload else ''}"
          + "".join(f", {setting}" for setting in args.set))
    print(f"machine: {machine()}")
    root = args.run_root or tempfile.mkdtemp(prefix="triax_memory_")
    rows = []
    for n in args.shards:
        bare = max(r["peak_rss"] for r in launch(n, ["--worker", "baseline"], args.timeout))
        run_dir = os.path.join(root, f"{args.model}_x{n}")
        shutil.rmtree(run_dir, ignore_errors=True)
        overrides = [f"model={args.model}", f"data.block_size={args.block_size}",
                     f"trainer.batch_size={args.batch_size}", f"trainer.precision={args.precision}",
                     f"trainer.device={args.device}", "trainer.max_steps=1", "trainer.eval_every=0",
                     "trainer.sample_tokens=0", "trainer.keep_last=1", f"trainer.run_dir={run_dir}",
                     "parallel.dp_replicate=1", f"parallel.dp_shard={n}"]
        if args.cpu_offload:
            overrides.append("parallel.cpu_offload=true")
        overrides += args.set
        phases = [p for p in args.phases if p != "resume"]
        records = launch(n, ["--worker", "train", "--phases", *phases, "--", *overrides], args.timeout) if phases else []
        if "resume" in args.phases:
            if "save" not in args.phases:
                raise SystemExit("--phases resume needs save too (it loads the snapshot that save wrote)")
            records += launch(n, ["--worker", "resume", "--", *overrides, "trainer.resume=true"], args.timeout)
        rows.append((n, bare, records))
        print(f"  x{n}: done ({len(records)} records)")
        shutil.rmtree(run_dir, ignore_errors=True)
    if args.run_root is None:
        shutil.rmtree(root, ignore_errors=True)
    report(rows, args.phases)


def report(rows, phases) -> None:
    step = next((r for _, _, records in rows for r in records if r["phase"] == "step"), None)
    num_params = step["num_params"] if step else None
    single = {}
    on_device = any("peak_device" in r for _, _, records in rows for r in records)
    print()
    print(f"{'phase':<10} {'N':>2} {'peak/rank GiB (min..max)':>25} {'max on':>6} {'ideal GiB':>10} "
          f"{'peak/ideal':>10} {'vs N=1':>7} {'seconds':>8}" + ("  device GiB" if on_device else ""))
    for n, bare, records in rows:
        ready = max((r["peak_rss"] for r in records if r["phase"] == "ready"), default=0)
        for phase in phases:
            of_phase = [r for r in records if r["phase"] == phase]
            if not of_phase:
                continue
            peaks = [r["peak_rss"] / GIB for r in of_phase]
            worst = max(peaks)
            worst_rank = max(of_phase, key=lambda r: r["peak_rss"])["rank"]
            single.setdefault(phase, worst)
            ideal = (16 * num_params / n + bare) / GIB if num_params else float("nan")
            device = max((r.get("peak_device", 0) for r in of_phase), default=0) / GIB
            seconds = max(r.get("seconds", 0.0) for r in of_phase)
            print(f"{phase:<10} {n:>2} {min(peaks):>12.2f} .. {worst:<10.2f} {'rank ' + str(worst_rank):>6} "
                  f"{ideal:>10.2f} {worst / ideal:>10.2f} "
                  f"{worst / single[phase]:>7.2f} {seconds:>8.1f}" + (f"  {device:.2f}" if on_device else "") +
                  ("" if all(r.get("exact", True) for r in of_phase) else "  (sampled)"))
        print(f"{'':<10} {n:>2} baseline: bare python+torch+gloo {bare / GIB:.2f} GiB, "
              f"with triax imported and config composed {ready / GIB:.2f} GiB")
    if num_params:
        print(f"\n{num_params / 1e6:.1f}M parameters; ideal = 16 bytes x parameters / N + bare baseline")
    print("\ntriax plan against what rank 0 holds after one step (bytes):")
    print(f"{'N':>2} {'kind':<10} {'held GiB':>9} {'planned GiB':>12} {'planned/held':>13}")
    for n, _, records in rows:
        rank0 = next((r for r in records if r["phase"] == "step" and r["rank"] == 0), None)
        if rank0 is None:
            continue
        for kind in ("params", "grads", "optimizer"):
            held, planned = rank0["held"].get(kind, 0), rank0["planned"][kind]
            ratio = planned / held if held else float("nan")
            flag = "" if abs(ratio - 1) <= 0.15 else "  <- off by more than 15%"
            print(f"{n:>2} {kind:<10} {held / GIB:>9.3f} {planned / GIB:>12.3f} {ratio:>13.3f}{flag}")


if __name__ == "__main__":
    main()
