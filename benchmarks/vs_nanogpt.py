"""triax against nanoGPT on nanoGPT's own CPU Shakespeare configuration, side by side.

nanoGPT's README trains its character-level Shakespeare model on a CPU with

    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
        --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
        --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0

This script runs exactly that from a nanoGPT checkout you point it to, and `triax train` with the same
model, data, batch, schedule and evaluation cadence, alternated A B A B on one thread each, and
prints for every run: wall-clock, time to the end of the first training step, median step, seconds
in evaluation and in snapshots, the last validation loss each reports, and the ratios.

    python benchmarks/vs_nanogpt.py --nanogpt ~/src/nanoGPT            # 2 rounds of 2000 steps
    python benchmarks/vs_nanogpt.py --nanogpt ~/src/nanoGPT --steps 300 --rounds 1   # a quick look

Nothing is downloaded: both train on the same text file (--text, default triax's built-in corpus),
which this script also writes in nanoGPT's data layout (train.bin/val.bin/meta.pkl, the sorted
characters, 90% train / 10% validation, as nanoGPT's prepare.py does). Without a checkout (no
--nanogpt and no $NANOGPT_DIR) it says so and exits 0.

How the seconds are split: both programs print a line per step, and each line is time-stamped as it
arrives. A gap between two step lines longer than the median step is work that is not a step:
evaluation (the gap that ends in a validation line) or a snapshot (the gap after a save). nanoGPT
evaluates the training and the validation split (20 batches each) at steps 0, 250, ... 2000 and saves
when the validation loss improves; triax evaluates 20 validation batches (and samples a line of text)
every 250 steps and snapshots every 250 steps, as the flags below say.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

NANOGPT_FILES = ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py")
EVAL_EVERY = 250


def nanogpt_command(steps: int) -> list[str]:
    return [sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
            "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4",
            "--n_head=4", "--n_embd=128", f"--max_iters={steps}", f"--lr_decay_iters={steps}", "--dropout=0.0"]


def triax_command(steps: int, text: str, run_dir: str) -> list[str]:
    # nanoGPT's train.py defaults and its shakespeare_char config, in triax's keys: no biases, tied
    # embeddings, exact GELU (nanoGPT's nn.GELU), AdamW(0.9, 0.99) with weight decay 0.1, lr 1e-3 -> 1e-4 cosine after 100 warm-up
    # steps, gradient clipping at 1.0, one step per batch of 12, a line per step.
    return [sys.executable, "-m", "triax", "train", f"data.path={text}", "data.block_size=64",
            "model.n_layer=4", "model.n_head=4", "model.n_embd=128", "model.dropout=0.0", "model.bias=false",
            "model.tie_embeddings=true", "model.gelu=exact", "trainer.batch_size=12", f"trainer.max_steps={steps}", "optim.lr=1e-3",
            "optim.min_lr=1e-4", "optim.warmup_steps=100", "optim.betas=[0.9,0.99]", "optim.weight_decay=0.1",
            "trainer.grad_clip=1.0", f"trainer.eval_every={EVAL_EVERY}", "trainer.eval_batches=20",
            f"trainer.save_every={EVAL_EVERY}", "trainer.log_every=1", f"trainer.run_dir={run_dir}",
            "trainer.resume=false"]


def write_nanogpt_data(text: str, directory: str) -> None:
    """nanoGPT's shakespeare_char layout for `text` (what its prepare.py writes, without the download)."""
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    ids = np.array([stoi[ch] for ch in text], dtype=np.uint16)
    cut = int(len(ids) * 0.9)
    os.makedirs(directory, exist_ok=True)
    ids[:cut].tofile(os.path.join(directory, "train.bin"))
    ids[cut:].tofile(os.path.join(directory, "val.bin"))
    with open(os.path.join(directory, "meta.pkl"), "wb") as handle:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, handle)


def run_timed(command: list[str], cwd: str, env: dict, log_path: str) -> tuple[float, list[tuple[float, str]]]:
    """Run `command`, time-stamping each output line as it arrives; returns (wall seconds, lines)."""
    started = time.perf_counter()
    lines = []
    with open(log_path, "w") as log, subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True, bufsize=1) as process:
        for line in process.stdout:
            lines.append((time.perf_counter() - started, line.rstrip("\n")))
            log.write(f"{lines[-1][0]:10.3f} {line}")
        code = process.wait()
    wall = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"{command[1]} exited with {code}; its output is in {log_path}")
    return wall, lines


def split_seconds(lines: list[tuple[float, str]], step_line: str, eval_line: str, save_line: str | None) -> dict:
    """Wall-clock of a run cut into steps, evaluation and snapshots from its time-stamped lines."""
    steps = [(t, int(m.group(1))) for t, text in lines if (m := re.match(step_line, text))]
    if len(steps) < 3:
        raise SystemExit(f"too few step lines matched {step_line!r}; see the log")
    gaps = [later - earlier for (earlier, _), (later, _) in zip(steps, steps[1:])]
    median = statistics.median(gaps)
    evals, saves = 0.0, 0.0
    # Every gap is attributed to the step line that ends it; an evaluation or a save inside it shows
    # as a marker line (the validation result, the save notice) between the two step lines.
    marks = [(t, "eval") for t, text in lines if re.search(eval_line, text)]
    if save_line:
        marks += [(t, "save") for t, text in lines if re.search(save_line, text)]
    for (earlier, _), (later, _) in zip(steps, steps[1:]):
        inside = [kind for t, kind in marks if earlier < t <= later]
        extra = max(later - earlier - median, 0.0)
        if "eval" in inside and "save" in inside:
            # nanoGPT: evaluation, then the save notice, then torch.save: the notice splits the gap
            t_save = max(t for t, kind in marks if kind == "save" and earlier < t <= later)
            evals += max(t_save - earlier, 0.0)  # no step in this part
            saves += max(later - t_save - median, 0.0)
        elif "eval" in inside:
            evals += extra
        elif "save" in inside:
            saves += extra
    first_step = steps[0][0]
    before_first = [t for t, kind in marks if kind == "eval" and t <= first_step]
    if before_first:  # nanoGPT evaluates before its first step: that evaluation is not start-up
        earlier_lines = [t for t, _ in lines if t < before_first[0]]
        evaluation_0 = before_first[0] - (earlier_lines[-1] if earlier_lines else 0.0)
        evals += evaluation_0
        first_step -= evaluation_0
    return {"first_step_s": first_step, "median_step_s": median, "eval_s": evals, "snapshot_s": saves,
            "steps": len(steps)}


def last_float(lines: list[tuple[float, str]], pattern: str) -> float | None:
    found = [float(m.group(1)) for _, text in lines if (m := re.search(pattern, text))]
    return found[-1] if found else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", default=os.environ.get("NANOGPT_DIR"),
                        help="a nanoGPT checkout (train.py, model.py, configurator.py); default $NANOGPT_DIR")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2, help="A B pairs, alternated")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for both")
    parser.add_argument("--text", help="UTF-8 text both train on (default: triax's built-in corpus)")
    parser.add_argument("--keep", help="keep the logs and run directories here")
    parser.add_argument("--judge", action="store_true",
                        help="also score both final models over the whole validation split with one evaluator "
                             "that is neither's: transformers' GPT2LMHeadModel (needs transformers)")
    args = parser.parse_args(argv)
    if not args.nanogpt:
        print("vs_nanogpt: skipped: no nanoGPT checkout given (--nanogpt PATH or NANOGPT_DIR); nothing is downloaded")
        return
    missing = [name for name in NANOGPT_FILES if not os.path.isfile(os.path.join(args.nanogpt, name))]
    if missing:
        raise SystemExit(f"vs_nanogpt: {args.nanogpt!r} is not a nanoGPT checkout: it lacks {', '.join(missing)}")
    if args.steps < EVAL_EVERY:
        raise SystemExit(f"vs_nanogpt: --steps {args.steps} is below the evaluation interval {EVAL_EVERY}")

    work = args.keep or tempfile.mkdtemp(prefix="vs_nanogpt-")
    os.makedirs(work, exist_ok=True)
    if args.text:
        with open(args.text, encoding="utf-8") as handle:
            text = handle.read()
    else:
        from triax.data.text import builtin_corpus
        text = builtin_corpus()
    text_path = os.path.join(work, "input.txt")
    with open(text_path, "w", encoding="utf-8") as handle:
        handle.write(text)
    nano_dir = os.path.join(work, "nanogpt")
    for name in NANOGPT_FILES:
        os.makedirs(os.path.dirname(os.path.join(nano_dir, name)), exist_ok=True)
        shutil.copy(os.path.join(args.nanogpt, name), os.path.join(nano_dir, name))
    write_nanogpt_data(text, os.path.join(nano_dir, "data", "shakespeare_char"))

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    results = {"nanogpt": [], "triax": []}
    for round_ in range(args.rounds):
        for name in ("nanogpt", "triax"):
            log = os.path.join(work, f"{name}-{round_}.log")
            if name == "nanogpt":
                shutil.rmtree(os.path.join(nano_dir, "out-shakespeare-char"), ignore_errors=True)
                wall, lines = run_timed(nanogpt_command(args.steps), nano_dir, env, log)
                row = split_seconds(lines, r"iter (\d+): loss", r"^step \d+: train loss", r"^saving checkpoint")
                row["val_loss"] = last_float(lines, r"val loss ([0-9.]+)")
            else:
                run_dir = os.path.join(work, f"triax-run-{round_}")
                wall, lines = run_timed(triax_command(args.steps, text_path, run_dir), work, env, log)
                row = split_seconds(lines, r"step (\d+)/\d+ \|", r"^--- sample at step", None)
                row["snapshot_s"] = snapshot_seconds(lines, row["median_step_s"])
                row["val_loss"] = last_float(lines, r"val_loss ([0-9.]+)")
            row["wall_s"] = wall
            results[name].append(row)
            print(f"round {round_ + 1} {name:8s} wall {wall:7.1f} s | first step {row['first_step_s']:5.2f} s | "
                  f"median step {1000 * row['median_step_s']:6.1f} ms | eval {row['eval_s']:5.1f} s | "
                  f"snapshots {row['snapshot_s']:5.1f} s | val loss {row['val_loss']}", flush=True)

    best = {name: min(rows, key=lambda r: r["wall_s"]) for name, rows in results.items()}
    n, t = best["nanogpt"], best["triax"]
    print(f"\nbest of {args.rounds} each, {args.steps} steps, OMP_NUM_THREADS={args.threads}")
    print(f"{'':22s}{'nanoGPT':>10s}{'triax':>10s}")
    for key, label, scale in (("wall_s", "wall-clock (s)", 1), ("first_step_s", "to first step (s)", 1),
                              ("median_step_s", "median step (ms)", 1000), ("eval_s", "evaluation (s)", 1),
                              ("snapshot_s", "snapshots (s)", 1), ("val_loss", "last val loss", 1)):
        print(f"{label:22s}{n[key] * scale:10.3f}{t[key] * scale:10.3f}")
    print(f"triax speed against nanoGPT (nanoGPT wall / triax wall): {n['wall_s'] / t['wall_s']:.3f}x; "
          f"first step {t['first_step_s'] - n['first_step_s']:+.2f} s")
    if args.judge:
        val_ids = np.fromfile(os.path.join(nano_dir, "data", "shakespeare_char", "val.bin"), dtype=np.uint16)
        scores = judge(os.path.join(nano_dir, "out-shakespeare-char", "ckpt.pt"),
                       os.path.join(work, f"triax-run-{args.rounds - 1}"), val_ids, work)
        print(f"whole validation split ({scores['tokens']} tokens), scored by transformers' GPT-2, last round's "
              f"models: nanoGPT {scores['nanogpt']:.4f} (its checkpoint of step {scores['nanogpt_step']}: it saves "
              f"when the validation loss improves), triax {scores['triax']:.4f}")
    print(f"logs: {work}")


def judge(nanogpt_checkpoint: str, triax_run: str, val_ids: np.ndarray, work: str) -> dict:
    """Mean next-token loss of both models over every target of the validation split (windows of 64
    targets, the tail by a last window that scores only its new targets), computed by transformers'
    GPT2LMHeadModel: triax's model as `triax export --format hf` writes it, nanoGPT's checkpoint
    converted here (Linear -> Conv1D transposes, its absent biases as zeros)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    exported = os.path.join(work, "triax-hf")
    shutil.rmtree(exported, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "triax", "export", triax_run, exported, "--format", "hf"], check=True,
                   stdout=subprocess.DEVNULL)
    with open(os.path.join(triax_run, "vocab.json")) as handle:
        triax_chars = json.load(handle)["chars"]
    with open(os.path.join(os.path.dirname(os.path.dirname(nanogpt_checkpoint)), "data", "shakespeare_char",
                           "meta.pkl"), "rb") as handle:
        nanogpt_chars = [char for _, char in sorted(pickle.load(handle)["itos"].items())]
    if triax_chars != nanogpt_chars:
        raise SystemExit("vs_nanogpt: the two runs' vocabularies differ; the judge needs one id for each character")

    checkpoint = torch.load(nanogpt_checkpoint, map_location="cpu", weights_only=False)
    args = checkpoint["model_args"]
    config = GPT2Config(vocab_size=args["vocab_size"], n_positions=args["block_size"], n_embd=args["n_embd"],
                        n_layer=args["n_layer"], n_head=args["n_head"], activation_function="gelu",
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                        bos_token_id=None, eos_token_id=None)  # a character vocabulary has neither
    nanogpt = GPT2LMHeadModel(config).eval()
    state = {key.removeprefix("_orig_mod."): value for key, value in checkpoint["model"].items()}
    converted = {}
    for name, parameter in nanogpt.named_parameters():
        source = state.get(name)
        if source is None:  # nanoGPT's bias=False: no biases
            converted[name] = torch.zeros_like(parameter)
        elif name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            converted[name] = source.t()  # nn.Linear (out, in) -> Conv1D (in, out)
        else:
            converted[name] = source
    nanogpt.load_state_dict(converted, strict=False)
    triax_model = GPT2LMHeadModel.from_pretrained(exported, local_files_only=True).eval()

    ids = torch.from_numpy(val_ids.astype(np.int64))
    block = args["block_size"]
    targets = len(ids) - 1
    windows = [(start, 0) for start in range(0, targets - block + 1, block)]
    if targets % block:
        windows.append((targets - block, block - targets % block))
    scores = {"tokens": targets, "nanogpt_step": checkpoint.get("iter_num")}
    for name, model in (("nanogpt", nanogpt), ("triax", triax_model)):
        total = 0.0
        with torch.no_grad():
            for begin in range(0, len(windows), 256):
                chunk = windows[begin:begin + 256]
                x = torch.stack([ids[start:start + block] for start, _ in chunk])
                y = torch.stack([ids[start + 1:start + block + 1] for start, _ in chunk])
                for row, (_, skip) in enumerate(chunk):
                    y[row, :skip] = -100  # already scored by the window before
                logits = model(x).logits
                total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100,
                                                           reduction="sum").item()
        scores[name] = total / targets
    return scores


def snapshot_seconds(lines: list[tuple[float, str]], median_step: float) -> float:
    """triax saves right after the step line of every save_every-th step: the gap to the next step
    line, less one step, is the snapshot (the final snapshot is the time after the last line)."""
    steps = [(t, int(m.group(1))) for t, text in lines if (m := re.match(r"step (\d+)/\d+ \|", text))]
    total = 0.0
    for (earlier, step), (later, _) in zip(steps, steps[1:]):
        if step % EVAL_EVERY == 0:
            total += max(later - earlier - median_step, 0.0)
    return total


if __name__ == "__main__":
    main()
