"""Gradient compression on a slow link: 2 simulated nodes (network namespaces, tc-limited), one
process each, the triax trainer's step with each compression and bucket size timed side by side
(interleaved in the same job), at each link rate.

    sudo python benchmarks/netns_compression.py --model gpt-mini --rates 1gbit,100mbit

Prints, per rate, step time (median, min-max over repeats), throughput against uncompressed
triax, and the loss after the same number of steps against uncompressed; writes JSON and a PNG.
Needs root and iproute2 (scripts/netns.sh check says why not).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from triax.bench import report  # noqa: E402
from triax.bench.jobs import worker_arguments  # noqa: E402
from triax.bench.netns import SimulatedNetwork, unavailable_reason  # noqa: E402
from triax.bench.worker import add_step_arguments  # noqa: E402
from triax.testing import quiet_env  # noqa: E402

DEFAULT_IMPLS = ("ddp,triax,triax:bf16,triax:fp16,triax:powersgd,"
                 "triax:none:1,triax:none:100")
REFERENCE = "triax"  # uncompressed triax with the default 25 MB buckets


def table(record: dict) -> list[dict]:
    rows = report.summarize([record])
    times = {row["impl"]: row["step_time_s"] for row in rows if "step_time_s" in row}
    losses = {row["impl"]: row["last_loss"] for row in rows if "last_loss" in row}
    for row in rows:
        if "step_time_s" in row and REFERENCE in times:
            row["throughput_vs_uncompressed"] = times[REFERENCE] / row["step_time_s"]
            row["loss_minus_uncompressed"] = losses[row["impl"]] - losses[REFERENCE]
    return rows


def format_rows(rows: list[dict], rate: str) -> str:
    lines = [f"link {rate}: 2 nodes x 1 process",
             f"{'variant':<18}{'step ms (min-max)':>26}{'samples/s':>11}{'x uncompr.':>11}{'loss':>9}{'Δloss':>9}"]
    for row in rows:
        if "step_time_s" not in row:
            lines.append(f"{row['impl']:<18}  {row['status']}")
            continue
        span = (f"{1000 * row['step_time_s']:.0f} ({1000 * row['step_time_min_s']:.0f}-"
                f"{1000 * row['step_time_max_s']:.0f})")
        lines.append(f"{row['impl']:<18}{span:>26}{row['samples_per_s']:>11.2f}"
                     f"{row.get('throughput_vs_uncompressed', float('nan')):>11.2f}"
                     f"{row['last_loss']:>9.4f}{row.get('loss_minus_uncompressed', float('nan')):>+9.4f}")
    return "\n".join(lines)


def chart(results: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(results)
    variants = [row["impl"] for row in results[rates[0]] if "samples_per_s" in row]
    figure, axes = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(len(rates), 1)
    for index, rate in enumerate(rates):
        by_name = {row["impl"]: row for row in results[rate]}
        values = [by_name.get(name, {}).get("samples_per_s", 0) for name in variants]
        axes.bar([x + index * width for x in range(len(variants))], values, width, label=rate)
    axes.set_xticks([x + width * (len(rates) - 1) / 2 for x in range(len(variants))])
    axes.set_xticklabels(variants, rotation=20, fontsize=8)
    axes.set_ylabel("samples / s (2 nodes)")
    axes.set_title(title, fontsize=10)
    axes.legend(title="link")
    axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    add_step_arguments(parser)
    parser.add_argument("--rates", default="1gbit,100mbit", help="tc rates, e.g. 1gbit,100mbit")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--out", default="bench-results/netns")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.set_defaults(model="gpt-mini", impls=DEFAULT_IMPLS, warmup=12, steps=4, repeats=3)
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"cannot build the simulated network: {reason}", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    env = quiet_env(PYTHONPATH=REPO, OMP_NUM_THREADS=str(args.threads))
    results, raw = {}, {}
    for rate in [rate.strip() for rate in args.rates.split(",") if rate.strip()]:
        out_path = os.path.abspath(os.path.join(args.out, f"raw-{rate}.json"))
        with SimulatedNetwork(nodes=args.nodes, rate=rate) as network:
            print(network.up_message, flush=True)
            network.torchrun(["-m", "triax.bench.worker", *worker_arguments(args), "--out", out_path],
                             timeout=args.timeout, env=env)
        with open(out_path) as handle:
            raw[rate] = json.load(handle)
        results[rate] = table(raw[rate])
        print(format_rows(results[rate], rate), flush=True)
    summary = {"command": "python benchmarks/netns_compression.py " + " ".join(sys.argv[1:]),
               "model": args.model, "batch_size_per_process": args.batch_size, "block_size": args.block_size,
               "results": results, "raw": raw}
    with open(os.path.join(args.out, "netns.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    try:
        chart(results, os.path.join(args.out, "netns.png"),
              f"{args.model}, batch {args.batch_size}/node, {args.nodes} simulated nodes")
    except ImportError:
        print("no chart: matplotlib is not installed")
    print(f"wrote {args.out}/netns.json and netns.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
