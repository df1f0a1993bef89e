"""`triax tokenize --workers N` against one worker and against the tokenizer's own rate.

Writes 8 text files of `--megabytes` each (the lines of this checkout's docs in a seeded order),
trains a 4096-token BPE on the first, then runs `triax tokenize` over all 8 in turn, `--rounds`
times each: `--workers 1` (one thread), the default (one process, the tokenizer's pool of `--cores`
threads) and `--workers` `--cores` (that many processes of one thread). Prints each one's median
wall and CPU seconds (CPU: the process and its workers, from the operating system's accounting)
and checks that all wrote the same train.bin. The tokenizer's own rate is Hugging Face tokenizers' encode_batch on one thread in
this process, over the same text, without reading or writing.

    python benchmarks/tokenize_workers.py                  # 8 x 3 MB, 3 rounds
    python benchmarks/tokenize_workers.py --megabytes 1 --rounds 1
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

os.environ["RAYON_NUM_THREADS"] = "1"  # this process's encoding: one thread (read at the pool's first use)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FILES = 8


def write_inputs(directory: str, megabytes: float) -> list[str]:
    """FILES text files of about `megabytes` each, lines of the docs drawn with a seed per file."""
    lines = []
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]:
        with open(path, encoding="utf-8") as handle:
            lines += handle.read().splitlines(keepends=True)
    paths = []
    for number in range(FILES):
        draw, size, chosen = random.Random(number), 0, []
        while size < megabytes * 1e6:
            chosen.append(lines[draw.randrange(len(lines))])
            size += len(chosen[-1].encode("utf-8"))
        paths.append(os.path.join(directory, f"part_{number}.txt"))
        with open(paths[-1], "w", encoding="utf-8") as handle:
            handle.write("".join(chosen))
    return paths


def tokenize(arguments: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of it and its workers) of one `triax tokenize`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "triax", "tokenize", *arguments, "--overwrite"], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def own_rate(tokenizer_file: str, paths: list[str]) -> tuple[float, float]:
    """(MB per second, CPU seconds) of the tokenizer alone on one thread over all of `paths`."""
    from triax.data.tokenize_files import CHUNK_CHARACTERS
    from triax.data.tokenize_parallel import encode_text
    from triax.data.tokenizer import BPETokenizer

    tokenizer = BPETokenizer.from_file(tokenizer_file)
    texts = [open(path, encoding="utf-8").read() for path in paths]
    chunks = [text[start:start + CHUNK_CHARACTERS] for text in texts for start in range(0, len(text), CHUNK_CHARACTERS)]
    started = time.process_time()
    for chunk in chunks:
        encode_text(tokenizer, chunk, "uint16")
    seconds = time.process_time() - started
    return sum(len(text.encode("utf-8")) for text in texts) / 1e6 / seconds, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=3.0, help="size of each of the 8 files")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cores", type=int, default=2, help="threads of the pool, and workers")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the start")
    with tempfile.TemporaryDirectory() as scratch:
        paths = write_inputs(scratch, args.megabytes)
        env = {**os.environ, "PYTHONPATH": ROOT}
        env.pop("RAYON_NUM_THREADS")
        tokenize([paths[0], "--out", os.path.join(scratch, "bpe"), "--vocab-size", "4096"], env)
        tokenizer = os.path.join(scratch, "bpe", "tokenizer.json")
        rate, seconds = own_rate(tokenizer, paths)
        print(f"the tokenizer alone, one thread: {rate:.2f} MB/s ({seconds:.1f} CPU s for "
              f"{FILES} x {args.megabytes:g} MB)")
        # (--workers, RAYON_NUM_THREADS): --workers 1 is one thread; without --workers, one process
        # with the tokenizer's pool, here of --cores threads; --workers N, N processes of one thread.
        variants = {"--workers 1": (["--workers", "1"], None),
                    f"default, {args.cores} threads": ([], str(args.cores)),
                    f"--workers {args.cores}": (["--workers", str(args.cores)], None)}
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (workers, threads) in variants.items():
                out = os.path.join(scratch, name.replace(" ", "_").replace(",", "").replace("-", ""))
                run_env = {**env, **({"RAYON_NUM_THREADS": threads} if threads else {})}
                times[name].append(tokenize([*paths, "--out", out, "--tokenizer", tokenizer, *workers], run_env))
        outputs = {open(path, "rb").read() for path in glob.glob(os.path.join(scratch, "*", "train.bin"))
                   if "bpe" not in path}
        assert len(outputs) == 1, "the variants wrote different tokens"
    first = statistics.median(wall for wall, _ in times["--workers 1"])
    for name, runs in times.items():
        wall, cpu = statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)
        print(f"{name:>20}: {wall:6.2f} s wall, {cpu:6.2f} CPU s, {FILES * args.megabytes / wall:5.2f} MB/s, "
              f"{first / wall:.2f}x one thread's speed")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
