"""LoRA fine-tuning on chat data: triax's trainer against a plain loop of transformers + PEFT, and
LoRA's memory against full fine-tuning, side by side (docs/performance.md).

The same random Llama (4 layers, width 128, 4 query heads on 2 key/value heads, written by
examples/tiny_chat_llama.py's recipe with its chat template) is fine-tuned on the same chat rows
(triax's data.task=chat rows, one conversation per row padded to the block, the loss on the
answers) in triax's sample order, with LoRA of rank 8 on every linear layer (alpha 16, no
dropout), AdamW (0.9, 0.95), weight decay 0.1, constant learning rate, clipping at 1.0, fp32, one
thread each. The PEFT loop is what a user writes: get_peft_model, model(ids).logits, the
cross-entropy over the answer tokens, backward, clip, AdamW over the trainable parameters. Runs
alternate A B A B, each in a fresh process.

Memory: peak resident memory of a process that builds the model and takes the steps, triax with
LoRA against triax fine-tuning every weight (the same shape and data), and the bytes of optimizer
state each holds (AdamW's two moments: LoRA's are the adapters' alone).

    python benchmarks/lora_vs_peft.py                        # 3 rounds of 100 steps
    python benchmarks/lora_vs_peft.py --rounds 1 --steps 10  # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK_SIZE, BATCH_SIZE, RANK, ALPHA = 128, 8, 8, 16
LR, BETAS, WEIGHT_DECAY, CLIP, SEED = 1e-3, (0.9, 0.95), 0.1, 1.0, 1337
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_checkpoint(directory: str) -> str:
    """A 4-layer, 128-wide Llama with the chat template and tokenizer of examples/tiny_chat_llama.py."""
    import torch
    import transformers

    script = os.path.join(ROOT, "examples", "tiny_chat_llama.py")
    chat = os.path.join(directory, "chat.jsonl")
    small = os.path.join(directory, "small")
    subprocess.run([sys.executable, script, small, "--conversations", chat, "--count", "2000"], check=True,
                   capture_output=True)
    config = transformers.LlamaConfig.from_pretrained(small)
    config.update(dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4))
    torch.manual_seed(0)
    checkpoint = os.path.join(directory, "base")
    transformers.LlamaForCausalLM(config).save_pretrained(checkpoint)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(small, name), "rb") as source, open(os.path.join(checkpoint, name), "wb") as target:
            target.write(source.read())
    return checkpoint


def overrides(checkpoint: str, run_dir: str, steps: int, lora: bool) -> list[str]:
    values = [f"model.init_from={checkpoint}", "data.task=chat", f"data.path={os.path.dirname(checkpoint)}/chat.jsonl",
              f"data.block_size={BLOCK_SIZE}", f"trainer.batch_size={BATCH_SIZE}", f"trainer.max_steps={steps}",
              f"optim.lr={LR}", f"optim.min_lr={LR}", "optim.warmup_steps=0", f"optim.betas=[{BETAS[0]},{BETAS[1]}]",
              f"optim.weight_decay={WEIGHT_DECAY}", f"trainer.grad_clip={CLIP}", f"trainer.seed={SEED}",
              "trainer.eval_every=0", f"trainer.log_every={10**9}", "trainer.sample_tokens=0",
              f"trainer.run_dir={run_dir}",
              "trainer.precision=fp32", "trainer.device=cpu", "trainer.loggers=[jsonl]"]
    if lora:
        values += [f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", "model.lora.targets=[all-linear]"]
    return values


def timed_steps(step, steps: int) -> tuple[list[float], float]:
    times, loss = [], float("nan")
    for _ in range(steps):
        started = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - started)
    return times, loss


def optimizer_bytes(optimizer) -> int:
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if hasattr(value, "numel") and value.dim() > 0)


def run_triax(checkpoint: str, steps: int, lora: bool) -> dict:
    from triax.config import compose_config
    from triax.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(compose_config(overrides(checkpoint, run_dir, steps, lora)))
        trainer.model.train()
        times, loss = timed_steps(lambda: trainer.train_step()[0], steps)
        state = optimizer_bytes(trainer.optimizer)
        trainer.logger.close()
    return {"step_times": times, "last_loss": loss, "optimizer_state_bytes": state}


def run_peft(checkpoint: str, steps: int) -> dict:
    import peft
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from triax.data import GlobalSampler
    from triax.data.addition import IGNORE_INDEX
    from triax.train import init_from
    from triax.config import compose_config
    from triax.train.data import build_data

    with tempfile.TemporaryDirectory() as run_dir:
        config = compose_config(overrides(checkpoint, run_dir, steps, True))
    source = init_from.resolve(checkpoint)
    data = build_data(config.data, source.codec, source)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                        target_modules=TARGETS, task_type="CAUSAL_LM"))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    sampler = GlobalSampler(len(data.train), seed=SEED)
    position = {"epoch": 0, "index": 0}

    def step() -> float:
        if not sampler.fits(position["index"], BATCH_SIZE):
            position["epoch"], position["index"] = position["epoch"] + 1, 0
        x, y = data.train.batch(sampler.rank_slice(position["epoch"], position["index"], BATCH_SIZE, 0))
        position["index"] += BATCH_SIZE
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.reshape(-1), ignore_index=IGNORE_INDEX)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    times, loss = timed_steps(step, steps)
    return {"step_times": times, "last_loss": loss, "optimizer_state_bytes": optimizer_bytes(optimizer)}


def worker(which: str, checkpoint: str, steps: int) -> None:
    import torch

    torch.set_num_threads(1)
    result = run_peft(checkpoint, steps) if which == "peft" else run_triax(checkpoint, steps, which == "triax-lora")
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)


def run_worker(which: str, checkpoint: str, steps: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [sys.executable, os.path.abspath(__file__), "--worker", which, "--checkpoint", checkpoint,
               "--steps", str(steps)]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"the {which} run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--worker", choices=("triax-lora", "triax-full", "peft"), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.checkpoint, args.steps)
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = write_checkpoint(scratch)
        print(f"Llama 4 x 128, LoRA rank {RANK} on all linear layers, block {BLOCK_SIZE}, batch {BATCH_SIZE}, fp32, "
              f"1 thread each; {args.rounds} rounds of {args.steps} steps, alternated", flush=True)
        runs = {"triax-lora": [], "peft": [], "triax-full": []}
        for round_number in range(args.rounds):
            order = list(runs) if round_number % 2 == 0 else list(reversed(runs))
            for which in order:
                result = run_worker(which, checkpoint, args.steps)
                result["median_step_s"] = statistics.median(result["step_times"][min(5, args.steps - 1):])
                runs[which].append(result)
                print(f"round {round_number + 1} {which:>10}: median step {1000 * result['median_step_s']:.2f} ms, "
                      f"peak RSS {result['peak_rss_mb']:.0f} MB, optimizer state "
                      f"{result['optimizer_state_bytes'] / 2**20:.2f} MiB, last loss {result['last_loss']:.4f}",
                      flush=True)
    summary = {which: {key: statistics.median(r[key] for r in results)
                       for key in ("median_step_s", "peak_rss_mb", "optimizer_state_bytes")}
               for which, results in runs.items()}
    lora, peft_loop, full = summary["triax-lora"], summary["peft"], summary["triax-full"]
    ratio = peft_loop["median_step_s"] / lora["median_step_s"]
    print(f"step: triax LoRA {1000 * lora['median_step_s']:.2f} ms, transformers + PEFT "
          f"{1000 * peft_loop['median_step_s']:.2f} ms (ratio PEFT / triax {ratio:.3f}); "
          f"triax full fine-tuning {1000 * full['median_step_s']:.2f} ms")
    print(f"memory: peak RSS triax LoRA {lora['peak_rss_mb']:.0f} MB, full {full['peak_rss_mb']:.0f} MB; optimizer "
          f"state LoRA {lora['optimizer_state_bytes'] / 2**20:.2f} MiB, "
          f"full {full['optimizer_state_bytes'] / 2**20:.2f} MiB")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"runs": runs, "summary": summary}, handle, indent=1)


if __name__ == "__main__":
    main()
