"""Run the chat path's refusals many times, with busy processes beside them, and count the runs
that did not end as a refusal should (exit code 2, one line): an abort at exit (`terminate called
without an active exception`, exit 134), a hang, a traceback.

    python scripts/stress_chat_refusals.py CHECKPOINT --runs 100 --busy 2 --parallel 4

CHECKPOINT is a directory with tokenizer.json and a chat template (tokenizer_config.json). The
cases are Parquet, JSONL and JSON files with one bad record each, read by `triax tokenize --chat`.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time

GOOD = {"messages": [{"role": "user", "content": "two plus two?"}, {"role": "assistant", "content": "four."}]}
BAD = {
    "missing content": {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
    "unknown role": {"messages": [{"role": "wizard", "content": "q"}, {"role": "assistant", "content": "x"}]},
    "no assistant": {"messages": [{"role": "user", "content": "q"}]},
    "two forms": {**GOOD, "prompt": "q", "completion": "a"},
}


def write_cases(directory: str) -> list[str]:
    import pyarrow
    import pyarrow.parquet as parquet

    paths = []
    for number, (name, record) in enumerate(BAD.items()):
        records = [GOOD] * 50 + [record] + [GOOD] * 50
        path = os.path.join(directory, f"case{number}.parquet")
        # Inferred over every row (from_pylist would take the first row's fields only).
        rows = pyarrow.RecordBatch.from_struct_array(pyarrow.array(records))
        parquet.write_table(pyarrow.Table.from_batches([rows]), path)
        paths.append(path)
        path = os.path.join(directory, f"case{number}.jsonl")
        with open(path, "w") as handle:
            handle.writelines(json.dumps(item) + "\n" for item in records)
        paths.append(path)
    return paths


def busy(stop_at: float) -> None:
    while time.time() < stop_at:
        sum(i * i for i in range(10000))


def one_run(run: int, case: str, args, directory: str, env: dict) -> str:
    """One refusal; its outcome ("refused", "hang" or "exit N"), printed when it is not a refusal."""
    command = [sys.executable, "-m", "triax", "tokenize", "--chat", args.checkpoint, case,
               "--out", os.path.join(directory, f"out{run}")]
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"run {run} ({os.path.basename(case)}): hung", flush=True)
        return "hang"
    lines = result.stderr.strip().splitlines()
    if result.returncode == 2 and len(lines) == 1 and lines[0].startswith("triax: error:"):
        return "refused"
    print(f"run {run} ({os.path.basename(case)}): exit {result.returncode}: {result.stderr.strip()[-300:]}",
          flush=True)
    return f"exit {result.returncode}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--busy", type=int, default=4, help="busy-looping processes beside the runs")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time")
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    outcomes = collections.Counter()
    with tempfile.TemporaryDirectory() as directory:
        cases = write_cases(directory)
        workers = [multiprocessing.Process(target=busy, args=(time.time() + 3600,), daemon=True)
                   for _ in range(args.busy)]
        for worker in workers:
            worker.start()
        try:
            with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
                runs = [pool.submit(one_run, run, cases[run % len(cases)], args, directory, env)
                        for run in range(args.runs)]
                for done, future in enumerate(concurrent.futures.as_completed(runs), 1):
                    outcomes[future.result()] += 1
                    if done % 10 == 0:
                        print(f"{done} runs: {dict(outcomes)}", flush=True)
        finally:
            for worker in workers:
                worker.terminate()
    print(f"{args.runs} runs with {args.busy} busy processes beside: " +
          ", ".join(f"{count} {name}" for name, count in sorted(outcomes.items())))
    return 0 if set(outcomes) == {"refused"} else 1


if __name__ == "__main__":
    sys.exit(main())
