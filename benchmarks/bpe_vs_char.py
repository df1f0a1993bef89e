"""Byte-level BPE tokens (made by `triax tokenize`) against characters, on the same text.

    python benchmarks/bpe_vs_char.py PATH/TO/text.txt                # 300 steps each, vocabulary 1024
    python benchmarks/bpe_vs_char.py text.txt --steps 1000 --vocab-size 2048 --model gpt-mini

1. Times `triax tokenize` on the text (seconds per MB, bytes per token).
2. Trains the same model twice for the same number of steps and batch: once on characters
   (data.task=char), once on the BPE token directory (data.task=tokens); the validation text is
   the last 10% of the file in both.
3. Prints both side by side with ratios. Loss per token is not comparable across vocabularies, so
   the comparison is bits per byte of validation text: loss / ln 2 / (bytes per token).

Both runs are in this process's machine at the same time of day, one after the other; on a loaded
machine the tokens/s and seconds/MB figures are not meaningful, the bits per byte are.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time


def triax(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "triax", *args], check=True, capture_output=True, text=True)


def last_eval(run_dir: str) -> dict:
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    evaluated = [r for r in records if "val_loss" in r]
    timed = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    return {"val_loss": evaluated[-1]["val_loss"], "tokens_per_s": sorted(timed)[len(timed) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("text", help="a UTF-8 text file (e.g. tinyshakespeare)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--model", default="gpt-micro")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    size_mb = os.path.getsize(args.text) / 1e6
    text_bytes = os.path.getsize(args.text)

    with tempfile.TemporaryDirectory() as work:
        tokens = os.path.join(work, "tokens")
        start, cpu_start = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        triax("tokenize", args.text, "--out", tokens, "--vocab-size", str(args.vocab_size), "--val-fraction", "0.1")
        tokenize_s = time.perf_counter() - start
        cpu_end = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = (cpu_end.ru_utime - cpu_start.ru_utime) + (cpu_end.ru_stime - cpu_start.ru_stime)
        meta = json.load(open(os.path.join(tokens, "meta.json")))
        bytes_per_token = text_bytes / (meta["train_tokens"] + meta["val_tokens"])
        # CPU seconds as well as wall seconds: CPU time is what a loaded machine distorts least.
        print(f"triax tokenize: {size_mb:.2f} MB in {tokenize_s:.1f} s wall = {tokenize_s / size_mb:.2f} s/MB, "
              f"{cpu_s / size_mb:.2f} CPU s/MB (both include interpreter start-up); vocabulary "
              f"{meta['vocab_size']}, {bytes_per_token:.2f} bytes/token")

        common = [f"model={args.model}", f"trainer.max_steps={args.steps}", f"trainer.batch_size={args.batch_size}",
                  f"data.block_size={args.block_size}", f"trainer.eval_every={args.steps}", "trainer.eval_batches=50",
                  "trainer.sample_tokens=0", f"trainer.log_every={max(1, args.steps // 10)}"]
        results = {}
        with open(args.text, encoding="utf-8") as handle:
            text = handle.read()
        char_bytes_per_token = len(text.encode("utf-8")) / len(text)
        for name, extra, per_token in (
                ("char", [f"data.path={args.text}", "data.task=char", "data.train_split=0.9"], char_bytes_per_token),
                ("bpe", [f"data.path={tokens}", "data.task=tokens"], bytes_per_token)):
            run_dir = os.path.join(work, name)
            triax("train", *common, *extra, f"trainer.run_dir={run_dir}")
            result = last_eval(run_dir)
            result["bits_per_byte"] = result["val_loss"] / math.log(2) / per_token
            result["bytes_per_s"] = result["tokens_per_s"] * per_token
            results[name] = result

    print(f"\n{args.model}, {args.steps} steps x {args.batch_size} windows of {args.block_size} tokens")
    print(f"{'':<22}{'char':>12}{'bpe':>12}{'bpe/char':>10}")
    for key in ("val_loss", "bits_per_byte", "tokens_per_s", "bytes_per_s"):
        a, b = results["char"][key], results["bpe"][key]
        print(f"{key:<22}{a:>12.4g}{b:>12.4g}{b / a:>10.3f}")


if __name__ == "__main__":
    main()
