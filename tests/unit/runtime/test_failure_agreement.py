"""One rank fails, every rank stops together (plain processes: no torchrun agent to kill them): the
failure agreement of triax.runtime.failure_agreement, through tests/support/workers/agreement_worker.py."""

import os

import pytest

from support import WORKERS_DIR
from support.helpers import tiny_overrides


def start_ranks(command, tmp_path, world=2, **env):
    """Start `world` plain processes of `command` as ranks of one job; return their outputs."""
    import subprocess

    from triax.testing import free_port, quiet_env

    port = str(free_port())
    processes = []
    for rank in range(world):
        rank_env = quiet_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                             LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                             GLOO_SOCKET_IFNAME="lo", **env)
        processes.append(subprocess.Popen(command, env=rank_env, cwd=tmp_path, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    try:
        for process in processes:
            # Far below the 120 s collective timeout the workers use: a rank left waiting fails this.
            out, err = process.communicate(timeout=90)
            results.append((process.returncode, out, err))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return results


AGREEMENT_WORKER = os.path.join(WORKERS_DIR, "agreement_worker.py")


@pytest.mark.multiprocess
def test_raise_together_stops_every_rank(tmp_path):
    import sys

    results = start_ranks([sys.executable, AGREEMENT_WORKER, "generic", str(tmp_path)], tmp_path)
    assert "rank 0: OSError: disk full" in results[0][1], results[0]
    assert "rank 1: RankFailedError: rank 0 failed while writing a file on rank 0" in results[1][1], results[1]


@pytest.mark.multiprocess
def test_one_rank_damaged_rng_file_makes_every_rank_fall_back(tmp_path):
    import sys

    results = start_ranks([sys.executable, AGREEMENT_WORKER, "rng", str(tmp_path)], tmp_path)
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, err
        assert f"rank {rank}: loaded step_00000001" in out, (out, err)
    assert os.path.isdir(tmp_path / "snapshots" / "step_00000002.corrupt")


@pytest.mark.multiprocess
def test_one_rank_failing_to_load_stops_every_rank(tmp_path):
    import sys

    results = start_ranks([sys.executable, AGREEMENT_WORKER, "fatal", str(tmp_path)], tmp_path)
    assert "rank 1: SnapshotError" in results[1][1] and "does not fit" in results[1][1], results[1]
    assert "rank 0: SnapshotError" in results[0][1] and "failed on another rank" in results[0][1], results[0]


@pytest.mark.multiprocess
def test_trainer_rank_0_failing_to_write_run_files_stops_every_rank(tmp_path, tiny_corpus):
    import sys

    run_dir = tmp_path / "run"
    (run_dir / "metrics.jsonl").mkdir(parents=True)  # rank 0 alone opens it, and cannot
    results = start_ranks([sys.executable, "-m", "triax", "train", *tiny_overrides(run_dir, tiny_corpus)], tmp_path)
    for rank, (code, _, err) in enumerate(results):
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (rank, err)
    assert "cannot write" in results[0][2] and "metrics.jsonl" in results[0][2], results[0]
    assert "rank 0 failed while writing the run files" in results[1][2], results[1]
