"""examples/pipe_classifier.py: a CIFAR-style classifier, flattened into an nn.Sequential, trains through Pipe."""

import copy
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from triax.pipe import Pipe
from triax.testing import quiet_env, run
from support import REPO_DIR

ROOT = Path(REPO_DIR)
EXAMPLE = ROOT / "examples" / "pipe_classifier.py"


def load_example():
    spec = importlib.util.spec_from_file_location("pipe_classifier", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread():
    # The model is big for a shared 2-core machine; one intra-op thread avoids fighting over the cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_classifier_training_through_pipe_equals_plain_training(one_thread):
    example = load_example()
    torch.manual_seed(0)
    plain = example.classifier(dropout=0.0)  # dropout masks would differ between the two runs
    pipe = Pipe(copy.deepcopy(plain), balance=[10, 9], devices=["cpu", "cpu"], chunks=2)
    assert len(plain) == 19
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, pipe)]
    losses = {"plain": [], "pipe": []}
    for images, labels in example.synthetic_batches(2, 4):
        for name, model, optimizer in zip(losses, (plain, pipe), optimizers):
            losses[name].append(example.train_step(model, optimizer, images, labels))
    assert losses["pipe"] == [pytest.approx(v, rel=1e-5) for v in losses["plain"]]
    for got, expected in zip(pipe.parameters(), plain.parameters()):
        # micro-batches sum their gradients in another order than one big batch: rounding only
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.multiprocess
def test_example_script_learns_its_batches():
    env = quiet_env(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = run([sys.executable, str(EXAMPLE), "--steps", "10"], env=env, timeout=240)  # else its defaults
    assert re.search(r"balance \[\d+, \d+\] on \['cpu', 'cpu'\], chunks 4, checkpoint except_last", result.stdout)
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 10
    # Visibly: from 0.325 (uniform answers) by more than a tenth, memorising the batch it is shown.
    assert losses[-1] < 0.9 * losses[0], losses
