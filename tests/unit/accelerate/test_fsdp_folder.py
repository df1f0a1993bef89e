"""Accelerate's FSDP checkpoint folders (triax/accelerate/_internal/fsdp_folder.py): a checkpoint moves between
Accelerate and triax both ways in either layout (DCP folders or whole files), and a DCP folder that
runs code or was changed after the save is refused in one line. The runs come from
support/fsdp_runs.py (shared with test_accelerate_fsdp.py)."""

import json
import os
import pickle

import pytest

from support.fsdp_runs import PLUGIN, SCRIPT, fsdp_env, run_fsdp_script, folder_listing, rank_records, saved_weights
from support.helpers import assert_bitwise_equal

# Each test starts without FSDP_* / ACCELERATE_USE_FSDP (support/fsdp_runs.py).
pytestmark = pytest.mark.usefixtures("no_fsdp_environment")


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_an_fsdp_checkpoint_moves_between_accelerate_and_triax_both_ways(runs, tmp_path, kind):
    """Accelerate's own FSDP2 saves at step 3 in its layout (DCP folders, or whole files by process
    0); triax resumes from its folder and Accelerate from triax's, and both end bitwise equal to
    Accelerate resuming from its own folder (here also equal to the run never stopped: the loader
    is not shuffled, so Accelerate's resume replays its order)."""
    pytest.importorskip("accelerate")
    plugin = json.dumps(dict(PLUGIN, state_dict_type=kind))
    accelerate, triax = ["--plugin", plugin, "--door", "accelerate"], ["--plugin", plugin]
    run_fsdp_script(tmp_path, 2, "--out", str(tmp_path / "accelerate"), *accelerate, "--save-at", "3",
            "--save", str(tmp_path / "accelerate_ckpt"))
    if kind == "SHARDED_STATE_DICT":
        triax_ckpt = runs / "sharded"  # the fixture's triax run saved at step 3 with this plugin
    else:
        triax_ckpt = tmp_path / "triax_ckpt"
        run_fsdp_script(tmp_path, 2, "--out", str(tmp_path / "triax"), *triax, "--save-at", "3", "--save", str(triax_ckpt))
    assert folder_listing(triax_ckpt) == folder_listing(tmp_path / "accelerate_ckpt")
    run_fsdp_script(tmp_path, 2, "--out", str(tmp_path / "accelerate_resumed"), *accelerate, "--resume",
            str(tmp_path / "accelerate_ckpt"))
    run_fsdp_script(tmp_path, 2, "--out", str(tmp_path / "triax_from_accelerate"), *triax, "--resume",
            str(tmp_path / "accelerate_ckpt"))
    run_fsdp_script(tmp_path, 2, "--out", str(tmp_path / "accelerate_from_triax"), *accelerate, "--resume", str(triax_ckpt))
    reference = saved_weights(tmp_path / "accelerate_resumed")
    assert_bitwise_equal(saved_weights(tmp_path / "triax_from_accelerate"), reference)
    assert_bitwise_equal(saved_weights(tmp_path / "accelerate_from_triax"), reference)
    assert_bitwise_equal(reference, saved_weights(runs / "fsdp"))
    for name in ("triax_from_accelerate", "accelerate_from_triax"):
        assert [r["losses"] for r in rank_records(tmp_path / name)] == [r["losses"] for r in rank_records(tmp_path / "accelerate_resumed")]


@pytest.mark.multiprocess
def test_a_dcp_folder_that_runs_code_or_is_damaged_is_refused_in_one_line(runs, tmp_path):
    """The sharded folder's .metadata is a pickle DCP would unpickle as it is: triax reads it with
    its checked reader; a file changed after the save fails the manifest."""
    import shutil

    from support import forked

    marker = tmp_path / "ran"
    for case in ("pickle", "resized"):
        folder = tmp_path / case
        shutil.copytree(runs / "sharded", folder)
        if case == "pickle":
            (folder / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
        else:
            with open(folder / "optimizer_0" / "__1_0.distcp", "ab") as handle:
                handle.write(b"x")
        result = forked.launch(2, [SCRIPT, "--out", str(tmp_path / f"out_{case}"), "--plugin", json.dumps(PLUGIN),
                                   "--resume", str(folder)], env=fsdp_env(tmp_path), timeout=300, check=False)
        assert result.returncode != 0 and not marker.exists()
        expected = "needs posix.system" if case == "pickle" else "the manifest says"
        assert expected in result.stderr, result.stderr[-2000:]


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))
