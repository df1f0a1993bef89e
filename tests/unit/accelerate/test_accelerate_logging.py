"""triax.accelerate.logging against accelerate.logging: the same records for the same calls (message,
level, the caller's file and line), the same refusal before the process state exists, and, on two
processes, main_process_only and in_order."""

import copy
import json
import logging
import os
import sys

import pytest
import torch
import torch.utils.data

from triax.testing import quiet_env
from support import REPO_DIR, TESTS_DIR

ROOT = REPO_DIR


def test_logging_before_the_state_exists_is_a_runtime_error(fresh_state):
    from triax.accelerate.logging import get_logger
    from triax.errors import TriaxError

    logger = get_logger("triax.test.before")
    with pytest.raises(RuntimeError, match="create the Accelerator") as caught:
        logger.warning("too early")
    assert isinstance(caught.value, TriaxError) and "\n" not in str(caught.value)


def _records(get_logger, state_class, caplog, name):
    """Log a few calls through `get_logger(name)` and return what the records say."""
    state_class(cpu=True)
    logger = get_logger(name)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=name):
        logger.info("plain %s", "argument")
        logger.warning("everywhere", main_process_only=False)
        logger.error("in order", in_order=True)
        logger.debug("debug")
        for _ in range(3):
            logger.warning_once("only once")
    return [(record.levelname, record.getMessage(), record.filename, record.funcName, record.name)
            for record in caplog.records if record.name == name]


def test_records_equal_accelerates(fresh_state, caplog):
    accelerate_logging = pytest.importorskip("accelerate.logging")
    from accelerate.state import PartialState as AcceleratePartialState

    from triax.accelerate.logging import get_logger
    from triax.accelerate.state import PartialState

    ours = _records(get_logger, PartialState, caplog, "triax.test.records")
    theirs = _records(accelerate_logging.get_logger, AcceleratePartialState, caplog, "triax.test.records")
    assert [record[:2] for record in ours] == [record[:2] for record in theirs] == [
        ("INFO", "[RANK 0] plain argument"), ("WARNING", "[RANK 0] everywhere"), ("ERROR", "[RANK 0] in order"),
        ("DEBUG", "[RANK 0] debug"), ("WARNING", "[RANK 0] only once")]
    # Each record names the caller's file and function; for warning_once Accelerate's names its own
    # warning_once, triax's the caller.
    assert ours[:-1] == theirs[:-1]
    assert {record[2:4] for record in ours} == {(os.path.basename(__file__), "_records")}


def test_the_callers_line_is_the_records(fresh_state, caplog):
    from triax.accelerate.logging import get_logger
    from triax.accelerate.state import PartialState

    PartialState(cpu=True)
    logger = get_logger("triax.test.line")
    with caplog.at_level(logging.INFO, logger="triax.test.line"):
        line = sys._getframe().f_lineno + 1
        logger.info("here")
        logger.warning_once("once here")
    assert [record.lineno for record in caplog.records] == [line, line + 1]


def test_log_level_sets_the_logger_and_the_root(fresh_state, monkeypatch):
    from triax.accelerate.logging import get_logger

    root = logging.getLogger()
    before = root.level
    try:
        assert get_logger("triax.test.level", log_level="debug").logger.level == logging.DEBUG
        assert root.level == logging.DEBUG
        monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "ERROR")
        assert get_logger("triax.test.level_env").logger.level == logging.ERROR
    finally:
        root.setLevel(before)


def _two_process_job(out):
    """Run by debug_launcher in each of two processes: logs, a LocalSGD run, results to `out`."""
    from triax.accelerate import Accelerator
    from triax.accelerate.local_sgd import LocalSGD
    from triax.accelerate.logging import get_logger

    accelerator = Accelerator()
    rank = accelerator.process_index
    handler = logging.FileHandler(os.path.join(out, "log.txt"))  # both processes append to one file
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = get_logger("triax.test.two")
    logger.logger.addHandler(handler)
    logger.logger.setLevel(logging.INFO)
    logger.info("main only")
    logger.info(f"everyone {rank}", main_process_only=False)
    for turn in range(3):
        logger.info(f"turn {turn} rank {rank}", in_order=True)
    handler.close()

    # LocalSGD: each process steps on its own data; parameters agree only after every 2nd step.
    torch.manual_seed(rank)
    model = accelerator.prepare(torch.nn.Linear(3, 1))
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    agreed = []
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=2) as local_sgd:
        for step in range(4):
            model(torch.randn(4, 3) * (rank + 1)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            local_sgd.step()
            weights = accelerator.gather(model.module.weight.detach()[None])
            agreed.append(bool(torch.equal(weights[0], weights[1])))
    # split_between_processes, as Accelerate's: a datasets.Dataset (anything with select) too, and
    # padding repeats the last item of the whole input.
    shares = {}
    for padded in (False, True):
        inputs = {"list": [0, 1, 2], "tensor": torch.arange(3), "rows": Rows([0, 1, 2])}
        with accelerator.split_between_processes(inputs, apply_padding=padded) as share:
            shares[str(padded)] = {"list": share["list"], "tensor": share["tensor"].tolist(),
                                   "rows": share["rows"].rows}
    # A stateful loader over a stream (process 0 reads, DataLoaderDispatcher) saved mid-pass
    # resumes with exactly the batches the pass had not yet given.
    accelerator.dataloader_config.use_stateful_dataloader = True
    loader = accelerator.prepare(torch.utils.data.DataLoader(Stream(torch.arange(40)), batch_size=2))
    unseen = []
    for step, batch in enumerate(loader):
        if step == 2:
            position = copy.deepcopy(loader.state_dict())
        elif step > 2:
            unseen.append(batch.tolist())
    loader.load_state_dict(position)
    resumed = [batch.tolist() for batch in loader]
    with open(os.path.join(out, f"rank_{rank}.json"), "w") as handle:
        json.dump({"agreed": agreed, "shares": shares, "unseen": unseen, "resumed": resumed}, handle)


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, values):
        self.values = values

    def __iter__(self):
        yield from self.values


class Rows:
    """What split_between_processes uses of a datasets.Dataset: len() and select(indices)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def select(self, indices):
        return Rows([self.rows[index] for index in indices])


def _fails():
    raise ValueError("boom in a child")


@pytest.mark.multiprocess
def test_two_processes_main_process_only_in_order_local_sgd_and_splitting(tmp_path, fresh_state):
    script = tmp_path / "job.py"
    script.write_text(f"""
import sys
sys.path[:0] = [{os.path.dirname(os.path.abspath(__file__))!r}, {TESTS_DIR!r}]  # this file, and the support package
from test_accelerate_logging import _fails, _two_process_job
from triax.accelerate import debug_launcher
debug_launcher(_two_process_job, ({str(tmp_path)!r},), num_processes=2)
try:
    debug_launcher(_fails, num_processes=2)
except RuntimeError as error:
    print("raised:", error)
""")
    from triax.testing import run

    result = run([sys.executable, str(script)], env=quiet_env(PYTHONPATH=ROOT), timeout=300)
    lines = (tmp_path / "log.txt").read_text().splitlines()
    assert lines.count("[RANK 0] main only") == 1 and not any("main only" in line for line in lines if "RANK 1" in line)
    assert sorted(line for line in lines if "everyone" in line) == ["[RANK 0] everyone 0", "[RANK 1] everyone 1"]
    turns = [line for line in lines if "turn" in line]
    assert turns == [f"[RANK {rank}] turn {turn} rank {rank}" for turn in range(3) for rank in (0, 1)]
    records = [json.loads((tmp_path / f"rank_{rank}.json").read_text()) for rank in (0, 1)]
    for record in records:
        assert record["agreed"] == [False, True, False, True]
    assert [record["shares"]["False"] for record in records] == [
        {"list": [0, 1], "tensor": [0, 1], "rows": [0, 1]}, {"list": [2], "tensor": [2], "rows": [2]}]
    assert records[1]["shares"]["True"] == {"list": [2, 2], "tensor": [2, 2], "rows": [2, 2]}
    for rank, record in enumerate(records):
        assert record["resumed"] == record["unseen"] and len(record["unseen"]) == 7
        assert record["unseen"][0] == [12 + 2 * rank, 13 + 2 * rank]  # steps of 2 x 2 samples: step 3 starts at 12
    assert "raised:" in result.stdout and "boom in a child" in result.stdout


def test_verbosity_is_the_library_loggers_level_as_in_accelerate(fresh_state, caplog, monkeypatch):
    """Accelerate 1.16's set_verbosity_* / get_verbosity: the "accelerate" logger's level, which the
    loggers under it follow; the root logger's level stays."""
    from triax.accelerate import Accelerator
    from triax.accelerate import logging as ours

    theirs = pytest.importorskip("accelerate.logging")
    monkeypatch.delenv("ACCELERATE_LOG_LEVEL", raising=False)
    library = logging.getLogger("accelerate")
    monkeypatch.setattr(library, "level", library.level)  # restored after the test
    Accelerator()
    logger = ours.get_logger("accelerate.verbosity_probe")
    root_level = logging.getLogger().level
    with caplog.at_level(logging.WARNING, logger="accelerate"):
        ours.set_verbosity_error()
        assert ours.get_verbosity() == theirs.get_verbosity() == logging.ERROR
        logger.warning("hidden")
        assert not caplog.records
        ours.set_verbosity("warning")
        logger.warning("shown")
        assert [record.name for record in caplog.records] == ["accelerate.verbosity_probe"]
        for setter, level in [(ours.set_verbosity_debug, logging.DEBUG), (ours.set_verbosity_info, logging.INFO),
                              (ours.set_verbosity_warning, logging.WARNING)]:
            setter()
            assert ours.get_verbosity() == theirs.get_verbosity() == level
    assert logging.getLogger().level == root_level
