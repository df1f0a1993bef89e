"""One rank fails where the others do not: every rank must stop (or fall back) together.

Started as plain processes with RANK/WORLD_SIZE set (no torchrun agent to kill the survivors),
so a rank left waiting in a collective would hang until the test's timeout.

    python agreement_worker.py MODE DIR     MODE: generic | rng | fatal
"""

import hashlib
import json
import os
import sys

import torch

from triax import checkpoint
from triax.runtime.failure_agreement import raise_together
from triax.runtime.shared_decisions import barrier
from triax.runtime.place import detect_place
from triax.runtime.process_group import init_distributed, shutdown_distributed


def tamper_rng_file(snapshot: str, rank: int) -> None:
    """Replace one rank's RNG file by valid JSON of the wrong shape, with a manifest that vouches
    for it (so only reading it, not the checksum, finds the problem)."""
    relative = f"rng/rank_{rank:05d}.json"
    data = json.dumps({"python": [1, 2]}).encode()
    with open(os.path.join(snapshot, relative), "wb") as handle:
        handle.write(data)
    manifest_path = os.path.join(snapshot, "manifest.json")
    with open(manifest_path) as handle:
        manifest = json.load(handle)
    manifest["files"][relative] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(manifest_path, "w") as handle:
        json.dump(manifest, handle)


def main(mode: str, directory: str) -> None:
    place = init_distributed(torch.device("cpu"), detect_place(), timeout_s=120)
    rank = place.rank
    try:
        if mode == "generic":
            try:
                with raise_together("writing a file on rank 0"):
                    if rank == 0:
                        raise OSError("disk full")
            except Exception as error:
                print(f"rank {rank}: {type(error).__name__}: {error}", flush=True)
            return
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        root = os.path.join(directory, "snapshots")
        for step in (1, 2):
            checkpoint.save_snapshot(root, step, model, optimizer, {"note": step})
        barrier()
        if rank == 0 and mode == "rng":
            tamper_rng_file(checkpoint.latest_snapshot(root), rank=1)
        barrier()
        def check_failing_on_rank_1(state):
            # A failure that is not a damaged file (the snapshot is another model's), on one rank only.
            if rank == 1:
                raise checkpoint.SnapshotError("snapshot does not fit this model (a key only rank 1 lacks)")

        kwargs = {"check_state": check_failing_on_rank_1} if mode == "fatal" else {}
        try:
            found = checkpoint.load_latest_snapshot(root, model, optimizer, **kwargs)
            print(f"rank {rank}: loaded {os.path.basename(found[0])}", flush=True)
        except Exception as error:
            print(f"rank {rank}: {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
    finally:
        barrier()
        shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
