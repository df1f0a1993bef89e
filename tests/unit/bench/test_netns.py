"""Two simulated nodes (network namespaces joined through a rate-limited link) meet by torchrun's
rendezvous across it and train: the result equals one process with the whole batch."""

import os
import subprocess

import pytest

from support.helpers import assert_same_training, final_weights, tiny_overrides, train
from triax.bench.netns import SimulatedNetwork, unavailable_reason
from triax.testing import quiet_env
from support import REPO_DIR, WORKERS_DIR

# Every test here starts processes (torchrun, launchers, scripts).
pytestmark = pytest.mark.multiprocess

REPO = REPO_DIR
REASON = unavailable_reason()


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.skipif(REASON is not None, reason=f"simulated network unavailable: {REASON}")
def test_two_namespace_nodes_rendezvous_and_train(tmp_path, tiny_corpus):
    overrides = tiny_overrides(tmp_path / "nodes", tiny_corpus, **{"trainer.batch_size": 4})
    with SimulatedNetwork(nodes=2, rate="100mbit") as network:
        assert network.namespace(1) in _namespaces()
        network.torchrun(["-m", "triax", "train", *overrides], timeout=240,
                         env=quiet_env(PYTHONPATH=REPO))
        # The gradients really crossed the link: each node sent at least a few copies of them.
        sent = [int(subprocess.run(["ip", "netns", "exec", network.namespace(node), "cat",
                                    "/sys/class/net/eth0/statistics/tx_bytes"],
                                   capture_output=True, text=True, check=True).stdout) for node in range(2)]
    assert network.prefix not in _namespaces(), "the namespaces were not removed"
    train(tiny_overrides(tmp_path / "single", tiny_corpus, **{"trainer.batch_size": 8}), nproc=1)
    weights = final_weights(tmp_path / "nodes")
    gradient_bytes = 4 * sum(tensor.numel() for tensor in weights.values())
    assert min(sent) > gradient_bytes, (sent, gradient_bytes)
    assert_same_training(tmp_path / "nodes", tmp_path / "single")


def test_network_is_removed_when_the_block_fails():
    if REASON is not None:
        pytest.skip(f"simulated network unavailable: {REASON}")
    network = SimulatedNetwork(nodes=3, rate="1gbit")
    with pytest.raises(RuntimeError, match="job failed"):
        with network:
            assert network.namespace(2) in _namespaces()
            raise RuntimeError("job failed")
    assert network.prefix not in _namespaces()


@pytest.mark.skipif(REASON is not None, reason=f"simulated network unavailable: {REASON}")
def test_powersgd_with_several_buckets_in_flight_on_a_slow_link(tmp_path):
    # PowerSGD issues its factor all-reduces from gloo's callback thread; with several buckets in
    # flight on a slow link the two nodes once issued them in different orders and gloo aborted
    # ("Received data size doesn't match expected size"). 0.25 MB buckets: one per 256 x 256 layer;
    # 14 steps: PowerSGD compresses from step 10 on.
    env = quiet_env(PYTHONPATH=REPO, TRIAX_GRAD_COMPRESSION="powersgd", TRIAX_DDP_BUCKET_CAP_MB="0.25")
    script = os.path.join(WORKERS_DIR, "deep_mlp_ddp.py")
    with SimulatedNetwork(nodes=2, rate="100mbit") as network:
        results = network.torchrun(["--module", "triax.ddp_boost", script, "14", "256", "6"], timeout=120, env=env)
    checksums = [line.split()[-1] for result in results for line in result.stdout.splitlines()
                 if line.startswith("rank ")]
    assert len(checksums) == 2 and checksums[0] == checksums[1], checksums
