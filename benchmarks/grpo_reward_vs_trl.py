"""GRPO: what triax's training reaches against TRL's GRPOTrainer, over 3 seeds, each side sampling
its own completions (docs/grpo.md, docs/performance.md).

The initial model is docs/grpo.md's recipe's: examples/tiny_chat_llama.py's random Llama (2 layers,
width 64) after its 40 steps of chat fine-tuning with triax, exported to a transformers directory
(a random model never answers a sum right, so GRPO would have nothing to reinforce). Its 400
addition prompts are cut into 360 to train on and the last 40 held out. For each seed both sides
train 50 steps from that model with the same settings (benchmarks/grpo_vs_trl.py's: 8 prompts a
step with 8 completions of at most 6 tokens, temperature 1.0, exact match of the answer, the dapo
loss, beta 0, AdamW (0.9, 0.999) at 5e-4 without weight decay, clipping at 1.0, fp32, one thread
each), each with its own seed for its own sampling and prompt order (triax's trainer.seed with
data.shuffle, TRL's seed for its sampler and generation).

The figure compared: the mean reward of each final model on the 40 held-out prompts, 32 completions
each (temperature 1.0, at most 6 tokens), sampled by one evaluator for every model (transformers'
`generate`, the same seed for each model) and scored by exact match, as the training scored them:
the share of right answers. The initial model is scored the same way, to show how far 50 steps move
it. Also shown: each side's own logged training reward, the mean over its last 5 steps.

    python benchmarks/grpo_reward_vs_trl.py              # 3 seeds of 50 steps: a few minutes
    python benchmarks/grpo_reward_vs_trl.py --seeds 1    # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from grpo_vs_trl import bench_env, run, triax_train, trl_run  # noqa: E402

STEPS, LENGTH, HELD_OUT, SAMPLES, LAST_STEPS = 50, 6, 40, 32, 5
EVAL_SEED = 1234  # the evaluator's: one seed for every model, so each is scored on the same random draws
# docs/grpo.md's chat fine-tuning, as the page runs it.
CHAT_SFT = ("data.task=chat", "data.block_size=128", "optim.lr=3e-3", "trainer.max_steps=40", "trainer.sample_tokens=0")


def initial_model(work: str, env: dict) -> tuple[str, str, str]:
    """The recipe's fine-tuned stand-in as a transformers directory, the training prompts, the held-out ones."""
    chat, prompts = os.path.join(work, "chat.jsonl"), os.path.join(work, "prompts.jsonl")
    run([sys.executable, "examples/tiny_chat_llama.py", os.path.join(work, "chat-llama"), "--conversations", chat,
         "--prompts", prompts], env)
    sft_run, base = os.path.join(work, "chat-sft-run"), os.path.join(work, "chat-sft")
    run([sys.executable, "-m", "triax", "train", f"model.init_from={os.path.join(work, 'chat-llama')}",
         f"data.path={chat}", *CHAT_SFT, f"trainer.run_dir={sft_run}"], env)
    run([sys.executable, "-m", "triax", "export", sft_run, base, "--format", "hf"], env)
    with open(prompts) as handle:
        lines = handle.readlines()
    train, held_out = os.path.join(work, "train.jsonl"), os.path.join(work, "held_out.jsonl")
    for path, part in ((train, lines[:-HELD_OUT]), (held_out, lines[-HELD_OUT:])):
        with open(path, "w") as handle:
            handle.writelines(part)
    return base, train, held_out


def held_out_reward(model_dir: str, held_out: str) -> float:
    """The share of SAMPLES sampled completions of each held-out prompt whose text is the answer."""
    import torch
    import transformers

    torch.set_num_threads(1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    end = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    torch.manual_seed(EVAL_SEED)
    right = total = 0
    with open(held_out) as handle:
        records = [json.loads(line) for line in handle]
    for record in records:
        text = tokenizer.apply_chat_template(record["prompt"], add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]] * SAMPLES)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=LENGTH, eos_token_id=end, pad_token_id=end)
        answers = tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
        right += sum(answer.strip() == record["answer"] for answer in answers)
        total += len(answers)
    return right / total


def one_seed(seed: int, base: str, train: str, held_out: str, work: str, steps: int, env: dict) -> dict:
    """Both sides trained from `base` with this seed: their held-out rewards and last steps' training rewards."""
    run_dir, ours = os.path.join(work, f"triax-{seed}"), os.path.join(work, f"triax-{seed}-final")
    records = triax_train(base, train, run_dir, steps, env, LENGTH,
                          (f"trainer.seed={seed}", f"data.val_path={held_out}", "trainer.eval_every=0"))
    run([sys.executable, "-m", "triax", "export", run_dir, ours, "--format", "hf"], env)
    theirs = os.path.join(work, f"trl-{seed}-final")
    trl_rewards = trl_run(base, train, work, steps, env, seed, LENGTH, theirs)["rewards"]
    triax_rewards = [record["reward"] for record in records if "reward" in record]
    return {"triax": held_out_reward(ours, held_out), "trl": held_out_reward(theirs, held_out),
            "triax_train": statistics.mean(triax_rewards[-LAST_STEPS:]),
            "trl_train": statistics.mean(trl_rewards[-LAST_STEPS:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    env = bench_env()
    with tempfile.TemporaryDirectory() as work:
        base, train, held_out = initial_model(work, env)
        print(f"initial model: held-out reward {held_out_reward(base, held_out):.3f} "
              f"({HELD_OUT} prompts x {SAMPLES} completions)", flush=True)
        results = []
        for seed in range(args.seeds):
            results.append(one_seed(seed, base, train, held_out, work, args.steps, env))
            figures = results[-1]
            print(f"seed {seed}: held-out reward after {args.steps} steps triax {figures['triax']:.3f}, TRL "
                  f"{figures['trl']:.3f}; training reward over the last {LAST_STEPS} steps triax "
                  f"{figures['triax_train']:.3f}, TRL {figures['trl_train']:.3f}", flush=True)
    mean = {key: statistics.mean(figures[key] for figures in results) for key in results[0]}
    print(f"means over {args.seeds} seeds: held-out reward triax {mean['triax']:.3f}, TRL {mean['trl']:.3f}, "
          f"triax - TRL = {mean['triax'] - mean['trl']:+.3f}; training reward (last {LAST_STEPS} steps) triax "
          f"{mean['triax_train']:.3f}, TRL {mean['trl_train']:.3f}, triax - TRL = "
          f"{mean['triax_train'] - mean['trl_train']:+.3f}")


if __name__ == "__main__":
    main()
