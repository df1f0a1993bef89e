"""The whole model `triax eval MODEL` scores, recognised once (triax/runs/whole_model.py): a transformers
directory read through its ForeignRun (HFDirectory.whole_model), checked to fit this host before its
weights are opened; anything that is neither a run nor a transformers directory is one line."""

from __future__ import annotations

import json

import pytest
import torch

from support.llama_checkpoints import hf_model, save_checkpoint
from triax.errors import ConfigError, TriaxError
from triax.eval.scoring import load_model
from triax.interop.foreign_run import ForeignRun
from triax.interop.hf.directory import HFDirectory
from triax.interop.hf.files import CheckpointError

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")


def test_a_transformers_directory_is_scored_through_its_foreign_run(tmp_path):
    reference = save_checkpoint(tmp_path, "llama")
    model, codec, run_config = load_model(str(tmp_path), torch.device("cpu"))
    assert codec is None and run_config is None  # no tokenizer.json; not a run: no splits
    assert not model.training
    ids = torch.randint(0, 301, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_a_config_too_large_for_this_host_is_refused_before_the_weights_are_read(tmp_path):
    """The memory check comes first: the weights (here missing altogether) are never opened."""
    hf_model("llama").config.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(num_hidden_layers=1000, hidden_size=16384, intermediate_size=65536, num_attention_heads=128,
                  num_key_value_heads=8, vocab_size=128000)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config.json describes a model of [\d,]+ parameters"):
        load_model(str(tmp_path), torch.device("cpu"))


def test_missing_weights_of_a_config_that_fits_are_refused_in_one_line(tmp_path):
    hf_model("llama").config.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError):
        load_model(str(tmp_path), torch.device("cpu"))


def test_a_directory_that_is_neither_a_run_nor_transformers_is_one_line(tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"")
    with pytest.raises(TriaxError, match="is neither a triax run directory .model.json. nor a transformers "
                                         r"directory .config.json.; give one of them"):
        load_model(str(tmp_path), torch.device("cpu"))


def test_a_whole_copy_keeps_no_description_and_reads_no_tokenizer_unless_asked(tmp_path):
    save_checkpoint(tmp_path, "llama")
    (tmp_path / "tokenizer.json").write_text("not a tokenizer")  # never read: no codec asked for
    source = HFDirectory(str(tmp_path), None, whole_on=torch.device("cpu"))
    assert source.codec is None and source.description == {}
    assert source.whole_model(torch.device("cpu")).config.arch == "llama"


def test_a_format_without_a_whole_model_says_so():
    with pytest.raises(NotImplementedError, match="a meta checkpoint is not read as a whole model"):
        type("MetaLike", (ForeignRun,), {"kind": "meta"})("folder", {}, None).whole_model(torch.device("cpu"))
