"""`triax plan`: which layouts fit a model on given devices, and which should be fastest (the
estimates and the search: triax.parallel.plan)."""

from __future__ import annotations

import argparse

from triax.arguments import ArgumentParser, at_least, positive
from triax.errors import ConfigError
from triax.models.config import PRESETS, GPTConfig, preset_fields
from triax.parallel import plan as plan_module
from triax.parallel.mesh import PP_SCHEDULES, Layout, check_context_parallel
from triax.parallel.plan import MAX_WORLD, ModelShape, plan


def parse(argv: list[str]) -> argparse.Namespace:
    parser = ArgumentParser(prog="triax plan", description=plan_module.__doc__.split("\n")[0],
                            epilog="The formulas are in the docstring of triax/parallel/plan.py.")
    parser.add_argument("--model", default="gpt2", help=f"preset: {', '.join(PRESETS)}")
    parser.add_argument("--world", type=int, required=True, help="number of devices (processes)")
    parser.add_argument("--memory-gb", type=float, required=True, help="memory per device, GiB")
    parser.add_argument("--global-batch", type=int, default=32, help="sequences per optimizer step (all ranks)")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (block size)")
    parser.add_argument("--vocab", type=int, default=None,
                        help="vocabulary size (default: the preset's, else GPT-2's 50257)")
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16", "bf16-pure"])
    parser.add_argument("--pp-schedule", default="1f1b", choices=PP_SCHEDULES)
    parser.add_argument("--microbatches", type=int, default=0, help="pipeline micro-batches (0: 2 x pp)")
    parser.add_argument("--tflops", type=float, default=100.0, help="sustained TFLOP/s per device")
    parser.add_argument("--bandwidth", type=float, default=100.0, help="GB/s between devices")
    parser.add_argument("--top", type=int, default=15, help="show this many layouts")
    parser.add_argument("--cp", type=int, default=0, help="context-parallel degree to plan for (0: every one "
                                                          "the sequence allows)")
    args = parser.parse_args(argv)
    if args.model not in PRESETS:
        raise ConfigError(f"unknown model preset {args.model!r}; presets are: {', '.join(PRESETS)}")
    # Every number is checked before any arithmetic: a zero rate would divide by zero, a negative
    # size would print negative GiB, a huge world would make the layout search run for hours.
    at_least("--world", args.world, 1)
    if args.world > MAX_WORLD:
        raise ConfigError(f"--world {args.world} is beyond what plan searches (at most {MAX_WORLD} devices)")
    for option, value in (("--memory-gb", args.memory_gb), ("--tflops", args.tflops),
                          ("--bandwidth", args.bandwidth)):
        positive(option, value)
    if args.vocab is None:
        args.vocab = PRESETS[args.model].get("vocab_size", 50257)
    for option, value in (("--global-batch", args.global_batch), ("--seq", args.seq), ("--vocab", args.vocab),
                          ("--top", args.top)):
        at_least(option, value, 1)
    at_least("--microbatches", args.microbatches, 0)
    at_least("--cp", args.cp, 0)
    if args.cp:
        if args.world % args.cp:
            raise ConfigError(f"--cp {args.cp} does not divide --world {args.world}; choose a divisor of the world")
        check_context_parallel(Layout(cp=args.cp), args.seq, length_key="--seq", degree_key="--cp")  # one line
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    shape = ModelShape.from_config(GPTConfig(vocab_size=args.vocab, block_size=args.seq, **preset_fields(args.model)))
    results = plan(shape, args.world, args.memory_gb, args.global_batch, [args.cp] if args.cp else None,
                   precision=args.precision,
                   pp_schedule=args.pp_schedule, microbatches=args.microbatches, tflops=args.tflops,
                   bandwidth_gbs=args.bandwidth)
    active = shape.active_params()  # a mixture of experts' tokens use only some of its parameters
    active_note = f" ({active / 1e6:.1f}M active per token)" if active != shape.num_params() else ""
    print(f"{args.model}: {shape.num_params() / 1e6:.1f}M parameters{active_note}, {args.world} device{'s' if args.world != 1 else ''} x {args.memory_gb:g} GiB, "
          f"{args.global_batch} x {args.seq} tokens per step, {args.precision}")
    if not results:
        print("no layout fits; add devices, lower --global-batch / --seq, or use --precision bf16-pure")
        return 1
    header = (f"{'layout':<36} {'ckpt':<9} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} "
              f"{'gather':>7} {'total':>7} {'step s':>8}")
    print(header + "\n" + "-" * len(header))
    for e in results[: args.top]:
        print(f"{e.layout.describe():<36} {e.checkpointing:<9} {e.params_gb:7.2f} {e.grads_gb:7.2f} "
              f"{e.optimizer_gb:7.2f} {e.activations_gb:7.2f} {e.gathered_gb:7.2f} {e.total_gb:7.2f} {e.step_s:8.3f}")
    print("memory in GiB per device (most loaded device; gather: FSDP's unsharded blocks in flight), not counting "
          "the runtime itself (~0.3 GiB on CPU, more with CUDA); step s: compute at --tflops "
          f"{args.tflops:g} TFLOP/s per device and communication at --bandwidth {args.bandwidth:g} GB/s, "
          "an estimate for ranking layouts; formulas: triax/parallel/plan.py docstring")
    return 0
