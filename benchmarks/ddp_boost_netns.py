"""A plain DDP script on a simulated 2-node 100 Mbit/s network, with and without triax.ddp_boost.

    sudo python benchmarks/ddp_boost_netns.py --rounds 3 --steps 20     # needs root (namespaces)

Each round runs the same unchanged script (benchmarks/ddp_boost_script.py: an MLP of about
`--width`^2 x 4 parameters) once plainly and once per compression through
`python -m triax.ddp_boost`, in turns, and prints median seconds per step and the ratio against
the plain run. Report the machine (lscpu | grep 'Model name') and `uptime` with the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from triax.bench.netns import SimulatedNetwork, unavailable_reason
from triax.testing import quiet_env

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "ddp_boost_script.py")


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--compressions", nargs="+", default=["bf16", "fp16", "powersgd"])
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"cannot simulate a network here: {reason}")
    env = quiet_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH", "")]))
    variants = ["plain"] + args.compressions
    times: dict[str, list[float]] = {name: [] for name in variants}
    with SimulatedNetwork(nodes=2, rate=args.rate) as network:
        for _ in range(args.rounds):
            for name in variants:
                if name == "plain":
                    command = [SCRIPT, str(args.steps), str(args.width)]
                else:
                    command = ["--module", "triax.ddp_boost", SCRIPT, str(args.steps), str(args.width)]
                results = network.torchrun(command, env={**env, "TRIAX_GRAD_COMPRESSION": name})
                seconds = [float(line.split()[-1]) for line in results[0].stdout.splitlines()
                           if line.startswith("seconds per step")]
                times[name].append(seconds[-1])
    baseline = statistics.median(times["plain"])
    print(f"{'variant':<10} {'s/step':>8} {'vs plain':>9}   ({args.rate}, 2 nodes, width {args.width})")
    for name in variants:
        median = statistics.median(times[name])
        print(f"{name:<10} {median:8.3f} {median / baseline:9.3f}")


if __name__ == "__main__":
    sys.exit(main())
