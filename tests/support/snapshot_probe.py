"""Run by test_parallel_layouts under torchrun: resume a run (its config from the command line),
print how many snapshot bytes this rank read to do so, then finish the run."""

import json
import os
import sys

# Run by path, so put this checkout (not an installed triax) first on the path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from triax.runtime.shared_decisions import barrier  # noqa: E402

from triax.runtime.process_group import shutdown_distributed  # noqa: E402
from triax.config import compose_config  # noqa: E402
from triax.train.trainer import Trainer  # noqa: E402


def main():
    trainer = Trainer(compose_config(sys.argv[1:]))
    report = {"rank": trainer.rank, "step": trainer.step, "bytes_read": trainer.resume_stats.get("bytes_read")}
    print("PROBE " + json.dumps(report), flush=True)
    trainer.fit()
    barrier()
    shutdown_distributed()


if __name__ == "__main__":
    main()
