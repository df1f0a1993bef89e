import os
import random

import pytest

# Fixtures several test files share: the hostile-input sandbox and one trained run; the FSDP runs of
# the Accelerator's FSDP tests (each run once for the whole session, when a test asks for it).
pytest_plugins = ["support.sandbox", "support.fsdp_runs"]

# Tests run many processes on 2 cores: one thread each keeps them from fighting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# cuBLAS keeps to one workspace layout, so a GPU test that compares two runs bit for bit compares
# the same arithmetic (torch.use_deterministic_algorithms asks for it); no effect without CUDA.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A small deterministic text file (no download, no dependence on files outside the repo).
    Shared by the whole session: tests read it and never write it."""
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "cat", "runs"]
    text = "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(600))
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text)
    return str(path)


@pytest.fixture
def fresh_state():
    """triax.accelerate's process-wide states (and Accelerate's, which they reset too) forgotten
    before and after the test, so each test makes its Accelerator from scratch."""
    from triax.accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests skip, with the reason, where no CUDA GPU is visible."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
