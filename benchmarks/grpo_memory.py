"""GRPO's peak memory: one training step of triax against one of TRL's GRPOTrainer, on the same
model, at Qwen's 151,936-word vocabulary and 1,024-token completions (docs/grpo.md,
docs/performance.md). At that vocabulary the `[rows x length x vocabulary]` logits dominate.

The model is examples/tiny_chat_llama.py's tokenizer and chat template with a tiny random Llama (2
layers, width 64) whose embedding and output layer have 151,936 rows; random, it never samples its
end of turn, so every completion runs to the full 1,024 tokens. Each side runs one step in a fresh
process of its own: it samples `--generations` completions of one prompt (each generating with its
own sampler: triax's key/value cache, TRL's transformers `generate`), scores them, and takes one
update (the dapo loss, beta 0, fp32, every weight trained). The figure is the process's peak
resident memory (`VmHWM`, as `resource.getrusage` reports it), and the same process's resident
memory just before the step (imports and model loaded), so that the step's own growth shows too.

    python benchmarks/grpo_memory.py                  # 4 completions of 1,024 tokens
    python benchmarks/grpo_memory.py --generations 2  # a quicker look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCABULARY, LENGTH = 151_936, 1024

# What both measuring processes end with: the peak and the resident memory before the step, in MiB.
MEMORY = r"""
import resource
def resident_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
"""

TRIAX_SCRIPT = MEMORY + r"""
import json, sys
import torch
from triax.config import compose_config
from triax.train.trainer import Trainer
torch.set_num_threads(1)
trainer = Trainer(compose_config(sys.argv[2:]))
before = resident_mib()
trainer.fit()
print(json.dumps({"before_mib": before, "peak_mib": peak_mib()}))
"""

TRL_SCRIPT = MEMORY + r"""
import json, sys, warnings
import datasets, torch, transformers, trl
base, prompts, out, generations, length = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(1)
records = [json.loads(line) for line in open(prompts)][:4]

def exact_match(prompts, completions, answer, **kwargs):
    return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    args = trl.GRPOConfig(output_dir=out + "/trl", report_to=[], per_device_train_batch_size=generations,
                          num_generations=generations, max_completion_length=length, max_steps=1,
                          learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                          max_grad_norm=1.0, logging_steps=1, save_strategy="no", use_cpu=True, seed=0,
                          bf16=False, gradient_checkpointing=False)
    trainer = trl.GRPOTrainer(model=base, reward_funcs=[exact_match], args=args,
                              train_dataset=datasets.Dataset.from_list(records),
                              processing_class=transformers.AutoTokenizer.from_pretrained(base))
    before = resident_mib()
    trainer.train()
lengths = [entry["completions/mean_length"] for entry in trainer.state.log_history if "completions/mean_length" in entry]
print(json.dumps({"before_mib": before, "peak_mib": peak_mib(), "mean_length": lengths[0]}))
"""


def run(command: list[str], env: dict) -> str:
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[:4])}... failed:\n{result.stderr[-3000:]}")
    return result.stdout


def wide_model(small: str, base: str) -> None:
    """The example's tokenizer files with a tiny random Llama of VOCABULARY rows and room for the
    completions (the ids past the tokenizer's decode to nothing, as a padded vocabulary's do)."""
    import shutil

    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCABULARY, hidden_size=64, intermediate_size=176,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=2048, tie_word_embeddings=False,
                                      eos_token_id=3, bos_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(base)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(small, name), os.path.join(base, name))


def triax_step(base: str, prompts: str, work: str, generations: int, env: dict) -> dict:
    overrides = [f"model.init_from={base}", "data.task=grpo", f"data.path={prompts}", f"data.block_size={LENGTH + 64}",
                 f"grpo.num_generations={generations}", f"grpo.max_completion_length={LENGTH}",
                 "grpo.reward_funcs=[exact_match]", "trainer.batch_size=1", "optim.lr=1e-4", "optim.warmup_steps=0",
                 "trainer.max_steps=1", "trainer.eval_every=0", "trainer.save_every=0", "data.shuffle=false",
                 f"trainer.run_dir={os.path.join(work, 'triax')}", "trainer.overwrite=true"]
    result = json.loads(run([sys.executable, "-c", TRIAX_SCRIPT, "--", *overrides], env).strip().splitlines()[-1])
    records = [json.loads(line) for line in open(os.path.join(work, "triax", "metrics.jsonl"))]
    result["mean_length"] = [record for record in records if "loss" in record][0]["completions/mean_length"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generations", type=int, default=4, help="completions of the step's prompt")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TRL_EXPERIMENTAL_SILENCE": "1"}
    with tempfile.TemporaryDirectory() as work:
        small, base, prompts = (os.path.join(work, name) for name in ("small", "base", "prompts.jsonl"))
        run([sys.executable, "examples/tiny_chat_llama.py", small, "--conversations", os.path.join(work, "chat.jsonl"),
             "--prompts", prompts, "--count", "8"], env)
        wide_model(small, base)
        ours = triax_step(base, prompts, work, args.generations, env)
        theirs = json.loads(run([sys.executable, "-c", TRL_SCRIPT, base, prompts, work, str(args.generations),
                                 str(LENGTH)], env).strip().splitlines()[-1])
    for name, figures in (("triax", ours), ("TRL", theirs)):
        print(f"{name}: peak {figures['peak_mib']:,.0f} MiB ({figures['peak_mib'] - figures['before_mib']:,.0f} MiB "
              f"above the {figures['before_mib']:,.0f} MiB before the step; completions of "
              f"{figures['mean_length']:.0f} tokens)")
    growth = (ours["peak_mib"] - ours["before_mib"]) / (theirs["peak_mib"] - theirs["before_mib"])
    print(f"one step, {args.generations} completions x {LENGTH} tokens x {VOCABULARY:,} words: triax/TRL peak ratio "
          f"{ours['peak_mib'] / theirs['peak_mib']:.2f}; the step's growth ratio {growth:.2f}")


if __name__ == "__main__":
    main()
