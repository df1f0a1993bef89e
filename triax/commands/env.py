"""`triax env`: print what a bug report needs (versions, devices, the launch configuration, the
environment: triax.launch.env)."""

from __future__ import annotations

import json

from triax.arguments import ArgumentParser
from triax.launch.env import collect


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="triax env", description="Print what a bug report needs.")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    info = collect()
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    print("Copy this into your bug report:\n")
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"- {key}:" + ("" if value else " (none)"))
            for inner_key, inner_value in value.items():
                print(f"    {inner_key}: {inner_value}")
        elif isinstance(value, list):
            print(f"- {key}:")
            for item in value:
                print(f"    {item}")
        else:
            print(f"- {key}: {value}")
    return 0
