"""Raw timings (one record per process count, from worker.py) -> table rows, JSON and chart."""

from __future__ import annotations

import statistics

from triax.bench.adapters import BASELINE, NO_COMM


def summarize(records: list[dict]) -> list[dict]:
    """One row per (way, process count)."""
    rows = []
    single = {}  # way -> samples/s with one process, for scaling efficiency
    for record in sorted(records, key=lambda r: r["world_size"]):
        world = record["world_size"]
        impls = record["impls"]
        medians = {name: statistics.median(result["step_times"])
                   for name, result in impls.items() if result["step_times"]}
        for name, result in impls.items():
            row = {"impl": name, "processes": world, "nodes": record.get("num_nodes", 1),
                   "status": result["status"]}
            if name in medians:
                times = result["step_times"]
                median = medians[name]
                samples_per_s = record["samples_per_step"] / median
                row.update({
                    "step_time_s": median, "step_time_min_s": min(times), "step_time_max_s": max(times),
                    "spread": (max(times) - min(times)) / median, "repeats": len(times),
                    "samples_per_s": samples_per_s,
                    "tokens_per_s": (samples_per_s * record["tokens_per_sample"]
                                     if record["tokens_per_sample"] else None),
                    # Every process does the FLOPs of its own samples against its own peak.
                    "mfu": record["flops_per_sample"] * samples_per_s / (record["peak_flops"] * world),
                    "last_loss": result["losses"][-1],
                })
                if world == 1:
                    single[name] = samples_per_s
                if name in single and world > 1:
                    row["scaling_efficiency"] = samples_per_s / (world * single[name])
                elif world == 1:
                    row["scaling_efficiency"] = 1.0
                if BASELINE in medians:
                    row["time_vs_ddp"] = median / medians[BASELINE]
                if name == BASELINE and NO_COMM in medians:
                    # The part of the step that disappears when nothing is sent.
                    row["comm_share"] = max(0.0, 1.0 - medians[NO_COMM] / median)
            rows.append(row)
    return rows


def _cell(value: float | int | str | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(rows: list[dict]) -> str:
    header = (f"{'way':<14}{'procs':>5} {'step ms (min-max)':>24}{'spread':>8}{'samples/s':>11}"
              f"{'tokens/s':>11}{'MFU':>8}{'scaling':>9}{'comm':>7}{'vs ddp':>8}")
    lines = [header, "-" * len(header)]
    for row in rows:
        if "step_time_s" not in row:
            lines.append(f"{row['impl']:<14}{row['processes']:>5}  {row['status']}")
            continue
        span = (f"{1000 * row['step_time_s']:.1f} ({1000 * row['step_time_min_s']:.1f}-"
                f"{1000 * row['step_time_max_s']:.1f})")
        lines.append(
            f"{row['impl']:<14}{row['processes']:>5} {span:>24}{_cell(100 * row['spread'], '.1f'):>7}%"
            f"{row['samples_per_s']:>11.1f}{_cell(row['tokens_per_s'], '.0f'):>11}"
            f"{100 * row['mfu']:>7.2f}%{_cell(row.get('scaling_efficiency'), '.2f'):>9}"
            f"{'-' if 'comm_share' not in row else format(100 * row['comm_share'], '.0f') + '%':>7}"
            f"{_cell(row.get('time_vs_ddp'), '.3f'):>8}")
    lines.append("step ms: median over repeats; spread: (max-min)/median; scaling: samples/s against "
                 "N x one process; comm: share of the hand-written DDP step that a no-op comm hook "
                 "removes; vs ddp: step time / hand-written DDP step time (lower is faster)")
    return "\n".join(lines)


def write_chart(rows: list[dict], path: str, title: str) -> bool:
    """Samples/s against process count, one line per way, whiskers from the fastest to the slowest
    repeat. Returns False when matplotlib is missing (pip install 'triax[bench]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for impl in dict.fromkeys(row["impl"] for row in rows):
        points = [row for row in rows if row["impl"] == impl and "samples_per_s" in row]
        if not points:
            continue
        xs = [row["processes"] for row in points]
        ys = [row["samples_per_s"] for row in points]
        # Whiskers: samples/s of the slowest and fastest repeat.
        lower = [y - y * row["step_time_s"] / row["step_time_max_s"] for y, row in zip(ys, points)]
        upper = [y * row["step_time_s"] / row["step_time_min_s"] - y for y, row in zip(ys, points)]
        axes.errorbar(xs, ys, yerr=[lower, upper], marker="o", capsize=3, label=impl,
                      linestyle="--" if impl == NO_COMM else "-")
    axes.set_xlabel("processes")
    axes.set_ylabel("samples / s")
    axes.set_xticks(sorted({row["processes"] for row in rows}))
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
