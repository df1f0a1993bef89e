"""triax/interop/: every foreign run implements one interface with the same signatures, and a
path's format is recognised once (formats.open_foreign), never switched on by a kind string."""

import inspect

import pytest

from triax.interop.foreign_run import ForeignRun
import torch

from triax.interop.formats import AmbiguousFormatError, open_continuation, open_foreign, open_whole_model
from triax.interop.hf.directory import HFDirectory
from triax.interop.hf_trainer.run import TrainerRun
from triax.interop.meta.run import MetaLayout
from triax.interop.nanogpt.run import NanoGPTRun
from triax.interop.triax_run import TriaxRun

INTERFACE = ("load_weights", "overrides", "saved_state", "check_continuation", "load_optimizer_state")


@pytest.mark.parametrize("run", [HFDirectory, TrainerRun, MetaLayout, NanoGPTRun, TriaxRun])
def test_every_foreign_run_has_the_interfaces_signatures(run):
    assert issubclass(run, ForeignRun)
    for name in INTERFACE:
        ours, theirs = inspect.signature(getattr(run, name)), inspect.signature(getattr(ForeignRun, name))
        assert list(ours.parameters) == list(theirs.parameters), (run.__name__, name)


def test_the_runs_that_continue_say_whose_run_they_are():
    assert (NanoGPTRun.tool_name, TrainerRun.tool_name) == ("nanoGPT's", "transformers Trainer's")
    assert NanoGPTRun.can_continue and TrainerRun.can_continue and not HFDirectory.can_continue
    assert TriaxRun.is_triax_run and not any(run.is_triax_run for run in (HFDirectory, NanoGPTRun, MetaLayout))


def test_what_is_no_foreign_format_is_left_to_the_caller(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "model.json").write_text("{}")
    for path in (tmp_path / "missing", tmp_path / "run", tmp_path):
        assert open_foreign(str(path), None, str) is None
        assert open_continuation(str(path)) is None


def test_a_path_two_formats_claim_is_refused_by_every_reader(tmp_path):
    """No precedence: a triax run holding a config.json is neither read as the run nor as the checkpoint."""
    (tmp_path / "model.json").write_text("{}")
    (tmp_path / "config.json").write_text("{}")
    for reader in (lambda: open_foreign(str(tmp_path), None, str), lambda: open_continuation(str(tmp_path)),
                   lambda: open_whole_model(str(tmp_path), str, torch.device("cpu"))):
        with pytest.raises(AmbiguousFormatError, match="a triax run .model.json. and a transformers checkpoint"):
            reader()
