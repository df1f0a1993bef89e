"""GRPO: triax's training loop (generation and update) against TRL's GRPOTrainer generating with
transformers (no vLLM), on the same machine, side by side (docs/grpo.md, docs/performance.md).

The same random Llama of examples/tiny_chat_llama.py (2 layers, width 64) with its chat template,
its --prompts (a sum in words, scored by exact match), 8 prompts a step with 8 completions each of
at most 16 tokens, temperature 1.0, the dapo loss, beta 0, AdamW (0.9, 0.999) at a constant rate
without weight decay, clipping at 1.0, fp32, one thread each, every weight trained. The time is the
loop's: the seconds of the steps after the first (triax's per-step `step_time_s`; TRL's own
per-step `step_time`, which includes its generation). Runs alternate triax, TRL, each in a fresh
process; the ratio printed is triax's median time over TRL's (below 1: triax is faster). The
completions differ (each side samples its own).

    python benchmarks/grpo_vs_trl.py                        # 3 rounds of 20 steps
    python benchmarks/grpo_vs_trl.py --rounds 1 --steps 6   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS, GENERATIONS, LENGTH, LR = 8, 8, 16, 5e-4

# TRL's side, in a fresh process: argv base, prompts, out, steps, seed, completion length, and a
# directory to save the final model in ("" for none); prints the loop's seconds and each step's reward.
TRL_SCRIPT = r"""
import json, sys, warnings
import datasets, torch, transformers, trl
base, prompts, out, steps, seed, length, save = sys.argv[1:4] + [int(value) for value in sys.argv[4:7]] + sys.argv[7:8]
torch.set_num_threads(1)
records = [json.loads(line) for line in open(prompts)]

def exact_match(prompts, completions, answer, **kwargs):
    return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    args = trl.GRPOConfig(output_dir=out + "/trl", report_to=[], per_device_train_batch_size=%(rows)d,
                          num_generations=%(generations)d, max_completion_length=length, max_steps=steps,
                          learning_rate=%(lr)r, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                          max_grad_norm=1.0, logging_steps=1, save_strategy="no", use_cpu=True, seed=seed,
                          bf16=False, gradient_checkpointing=False, disable_tqdm=True)
    trainer = trl.GRPOTrainer(model=base, reward_funcs=[exact_match], args=args,
                              train_dataset=datasets.Dataset.from_list(records),
                              processing_class=transformers.AutoTokenizer.from_pretrained(base))
    trainer.train()
    if save:
        trainer.save_model(save)
times = [entry["step_time"] for entry in trainer.state.log_history if "step_time" in entry]
rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
print(json.dumps({"seconds": sum(times[1:]), "steps": len(times) - 1, "rewards": rewards}))
""" % {"rows": PROMPTS * GENERATIONS, "generations": GENERATIONS, "lr": LR}


def run(command: list[str], env: dict) -> str:
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[:4])}... failed:\n{result.stderr[-3000:]}")
    return result.stdout


def bench_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TRL_EXPERIMENTAL_SILENCE": "1"}


def trl_run(base: str, prompts: str, work: str, steps: int, env: dict, seed: int = 0, length: int = LENGTH,
            save: str = "") -> dict:
    """TRL's GRPOTrainer in a fresh process: {"seconds": the loop's after step 1, "steps", "rewards": per step}."""
    output = run([sys.executable, "-c", TRL_SCRIPT, base, prompts, work, str(steps), str(seed), str(length), save],
                 env)
    return json.loads(output.strip().splitlines()[-1])


def triax_train(base: str, prompts: str, run_dir: str, steps: int, env: dict, length: int = LENGTH,
                extra: tuple[str, ...] = ("data.shuffle=false", "trainer.eval_every=0")) -> list[dict]:
    """triax's GRPO run with TRL's settings (AdamW's betas and no weight decay included); its metrics.jsonl."""
    run([sys.executable, "-m", "triax", "train", f"model.init_from={base}", "data.task=grpo",
         f"data.path={prompts}", "data.block_size=64", f"grpo.num_generations={GENERATIONS}",
         f"grpo.max_completion_length={length}", "grpo.reward_funcs=[exact_match]", f"trainer.batch_size={PROMPTS}",
         f"optim.lr={LR}", "optim.schedule=constant", "optim.warmup_steps=0", "optim.weight_decay=0.0",
         "optim.betas=[0.9,0.999]", "trainer.grad_clip=1.0", f"trainer.max_steps={steps}", "trainer.log_every=1",
         "trainer.save_every=0", "trainer.sample_tokens=0", *extra,
         f"trainer.run_dir={run_dir}", "trainer.overwrite=true"], env)
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def triax_seconds(base: str, prompts: str, work: str, steps: int, env: dict) -> float:
    records = triax_train(base, prompts, os.path.join(work, "triax"), steps, env)
    return sum(record["step_time_s"] for record in records if "step_time_s" in record and record["step"] > 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    env = bench_env()
    with tempfile.TemporaryDirectory() as work:
        base, prompts = os.path.join(work, "base"), os.path.join(work, "prompts.jsonl")
        run([sys.executable, "examples/tiny_chat_llama.py", base, "--conversations", os.path.join(work, "chat.jsonl"),
             "--prompts", prompts], env)
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(triax_seconds(base, prompts, work, args.steps, env))
            theirs.append(trl_run(base, prompts, work, args.steps, env)["seconds"])
    print(f"{args.steps - 1} steps after the first: triax {statistics.median(ours):.2f} s, TRL "
          f"{statistics.median(theirs):.2f} s (medians of {args.rounds}; rounds "
          f"{', '.join(f'{a / b:.2f}' for a, b in zip(ours, theirs))}); triax/TRL time ratio "
          f"{statistics.median(ours) / statistics.median(theirs):.2f}")


if __name__ == "__main__":
    main()
