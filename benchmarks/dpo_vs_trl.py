"""DPO with LoRA: triax's training loop against TRL's DPOTrainer on the same machine, side by side
(docs/preference.md, docs/performance.md).

The same random Llama (4 layers, width 128, examples/tiny_chat_llama.py's tokenizer and chat
template), the same preference pairs (its --pairs: a sum's right answer chosen, a wrong one
rejected) in file order, LoRA of rank 8 on q and v (alpha 16), beta 0.1, sigmoid loss, AdamW
(0.9, 0.999) at a constant rate, clipping at 1.0, fp32, batches of 8 pairs, one thread each. The time is the
training loop's: the seconds from the end of the first step to the end of the last (start-up,
tokenizing and the first step's set-up left out), from triax's per-step `step_time_s` and from a
TrainerCallback in TRL. Runs alternate triax, TRL, each in a fresh process; the ratio printed is
triax's median time over TRL's (below 1: triax is faster).

    python benchmarks/dpo_vs_trl.py                        # 3 rounds of 60 steps
    python benchmarks/dpo_vs_trl.py --rounds 1 --steps 10  # a quick look
    python benchmarks/dpo_vs_trl.py --quality --steps 60   # validation reward accuracy over 3 seeds

--quality: each of 3 seeds trains both from fresh adapters (each its own initialisation) on pairs in
an order of its own (triax's data.shuffle with trainer.seed, TRL's sampler with its seed), then both
score the same 64 held-out pairs: the mean validation reward accuracy of each, and the difference.
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
BATCH, RANK, ALPHA, BETA, LR, BLOCK = 8, 8, 16, 0.1, 5e-3, 64

TRL_SCRIPT = r"""
import json, sys, time, warnings
import datasets, peft, torch, transformers, trl
base, pairs, out, steps, seed, val = sys.argv[1:4] + [int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]]
torch.set_num_threads(1)
records = [json.loads(line) for line in open(pairs)]

class InOrder(trl.DPOTrainer):
    def _get_train_sampler(self, *args, **kwargs):
        if val:  # --quality: TRL's own shuffled order for this seed
            return super()._get_train_sampler(*args, **kwargs)
        return torch.utils.data.SequentialSampler(self.train_dataset)

class Clock(transformers.TrainerCallback):
    ends = []
    def on_step_end(self, args, state, control, **kwargs):
        Clock.ends.append(time.perf_counter())

warnings.simplefilter("ignore")
model = transformers.AutoModelForCausalLM.from_pretrained(base)
config = peft.LoraConfig(r=%(rank)d, lora_alpha=%(alpha)d, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
args = trl.DPOConfig(output_dir=out, report_to=[], max_length=%(block)d, beta=%(beta)r,
                     per_device_train_batch_size=%(batch)d, max_steps=steps, learning_rate=%(lr)r,
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                     logging_steps=10**9, save_strategy="no", use_cpu=True,
                     bf16=False, gradient_checkpointing=False, disable_tqdm=True, seed=seed, data_seed=seed)
trainer = InOrder(model=model, args=args, train_dataset=datasets.Dataset.from_list(records), processing_class=
                  transformers.AutoTokenizer.from_pretrained(base), peft_config=config, callbacks=[Clock()])
trainer.train()
result = {"loop_s": Clock.ends[-1] - Clock.ends[0], "steps": len(Clock.ends)}
if val:
    metrics = trainer.evaluate(datasets.Dataset.from_list([json.loads(line) for line in open(val)]))
    result["accuracy"] = metrics["eval_rewards/accuracies"]
print(json.dumps(result))
""" % {"rank": RANK, "alpha": ALPHA, "block": BLOCK, "beta": BETA, "batch": BATCH, "lr": LR}


def write_inputs(directory: str, steps: int) -> tuple[str, str]:
    """A 4-layer, 128-wide Llama with examples/tiny_chat_llama.py's tokenizer and template, and its pairs."""
    import torch
    import transformers

    script = os.path.join(ROOT, "examples", "tiny_chat_llama.py")
    small, pairs = os.path.join(directory, "small"), os.path.join(directory, "pairs.jsonl")
    subprocess.run([sys.executable, script, small, "--conversations", os.path.join(directory, "chat.jsonl"),
                    "--pairs", pairs, "--count", str(max(400, 2 * steps * BATCH))], check=True, capture_output=True)
    config = transformers.LlamaConfig.from_pretrained(small)
    config.update(dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4))
    torch.manual_seed(0)
    base = os.path.join(directory, "base")
    transformers.LlamaForCausalLM(config).save_pretrained(base)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(small, name), "rb") as source, open(os.path.join(base, name), "wb") as target:
            target.write(source.read())
    return base, pairs


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TQDM_DISABLE": "1"}


def triax_loop(base: str, pairs: str, run_dir: str, steps: int, seed: int = 0, val: str = "") -> float:
    """The loop's seconds after the first step (--quality: the final validation reward accuracy)."""
    order = [f"trainer.seed={seed}", f"data.val_path={val}", f"trainer.eval_every={steps}"] if val else [
        "data.shuffle=false", "trainer.eval_every=0"]
    overrides = order + [
        f"model.init_from={base}", "data.task=preference", f"data.path={pairs}", f"data.block_size={BLOCK}",
        f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", "model.lora.targets=[q,v]", f"dpo.beta={BETA}",
        f"optim.lr={LR}", "optim.warmup_steps=0", "optim.schedule=constant", "optim.weight_decay=0.0",
        "optim.betas=[0.9,0.999]", f"trainer.batch_size={BATCH}", f"trainer.max_steps={steps}", "trainer.log_every=1",
        "trainer.save_every=0", "trainer.sample_tokens=0", f"trainer.run_dir={run_dir}"]
    subprocess.run([sys.executable, "-m", "triax", "train", *overrides], check=True, capture_output=True, env=env())
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        records = [json.loads(line) for line in handle]
    if val:
        return [record for record in records if "val_rewards/accuracies" in record][-1]["val_rewards/accuracies"]
    records = [record for record in records if "step_time_s" in record]
    return sum(record["step_time_s"] for record in records[1:])  # from the end of step 1, as TRL's clock


def trl_loop(base: str, pairs: str, out: str, steps: int, seed: int = 0, val: str = "") -> float:
    result = subprocess.run([sys.executable, "-c", TRL_SCRIPT, base, pairs, out, str(steps), str(seed), val],
                            check=True, capture_output=True, text=True, env=env())
    return json.loads(result.stdout.strip().splitlines()[-1])["accuracy" if val else "loop_s"]


def quality(directory: str, base: str, pairs: str, steps: int) -> None:
    """Validation reward accuracy over 3 seeds, each side with its own order and initial adapters."""
    lines = open(pairs).readlines()
    train_pairs, val = os.path.join(directory, "train.jsonl"), os.path.join(directory, "val.jsonl")
    with open(train_pairs, "w") as handle:
        handle.writelines(lines[:-64])
    with open(val, "w") as handle:
        handle.writelines(lines[-64:])
    ours, theirs = [], []
    for seed in range(3):
        ours.append(triax_loop(base, train_pairs, os.path.join(directory, f"quality-{seed}"), steps, seed, val))
        theirs.append(trl_loop(base, train_pairs, os.path.join(directory, "trl"), steps, seed, val))
        print(f"seed {seed}: validation reward accuracy triax {ours[-1]:.3f}, TRL {theirs[-1]:.3f}", flush=True)
    mean_ours, mean_theirs = statistics.mean(ours), statistics.mean(theirs)
    print(f"validation reward accuracy over 3 seeds, {steps} steps of {BATCH} pairs: triax {mean_ours:.3f}, TRL "
          f"{mean_theirs:.3f}; triax - TRL = {mean_ours - mean_theirs:+.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--quality", action="store_true", help="validation reward accuracy over 3 seeds instead")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        base, pairs = write_inputs(directory, args.steps)
        if args.quality:
            quality(directory, base, pairs, args.steps)
            return
        ours, theirs = [], []
        for round_number in range(args.rounds):
            ours.append(triax_loop(base, pairs, os.path.join(directory, f"run-{round_number}"), args.steps))
            theirs.append(trl_loop(base, pairs, os.path.join(directory, "trl"), args.steps))
            print(f"round {round_number + 1}: triax {ours[-1]:.2f}s, TRL {theirs[-1]:.2f}s "
                  f"({args.steps - 1} steps after the first)", flush=True)
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"DPO training loop, {args.steps - 1} steps of {BATCH} pairs: triax {statistics.median(ours):.2f}s, TRL "
          f"{statistics.median(theirs):.2f}s; triax/TRL time ratio {ratio:.2f} (median of {args.rounds})")


if __name__ == "__main__":
    main()
