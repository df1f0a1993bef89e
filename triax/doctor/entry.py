"""`triax doctor`'s entry: `--gpu-suite` runs the GPU acceptance (gpu_suite.py, its own options and
report), anything else the machine and cluster checks (command.py). Kept apart from both so that
neither imports the other: the trainer's preflight imports command.py, and the GPU suite the trainer."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    if "--gpu-suite" in argv:
        from triax.doctor import gpu_suite  # deferred: torch.profiler and the trainer, only for the suite

        return int(gpu_suite.main([arg for arg in argv if arg != "--gpu-suite"]) or 0)
    from triax.doctor import command  # deferred: one of the two, as asked

    return command.main(argv)
