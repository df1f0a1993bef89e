"""`triax export --format hf`: transformers' GPT2LMHeadModel loads the directory and computes the
same logits as triax's GPT (fp32), with and without biases and tied embeddings, for either GELU.
The weights are large enough (std 0.3) that the two GELU forms give visibly different logits, so
exporting the wrong activation_function fails the comparison."""

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from triax.commands.cli import main as triax_main
from triax.models import GPT, GPTConfig
from triax.interop.hf.export import ExportError, export_hf, hf_tensors

from support.helpers import tiny_overrides


def random_model(**options):
    """A GPT with every weight random (LayerNorm gains and biases too, so a mix-up cannot hide)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=67, block_size=24, n_layer=2, n_head=2, n_embd=16, **options))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.3)
    return model.eval()


def test_converted_names_and_shapes_match_gpt2():
    """Without transformers: the tensors written are exactly GPT-2's names and shapes."""
    model = random_model()
    entries = list(hf_tensors(model.config, model.state_dict()))
    assert len(entries) == 2 + 2 * 12 + 2 + 1
    for name, build, shape in entries:
        assert tuple(build().shape) == shape, name
    assert dict((n, s) for n, _, s in entries)["transformer.h.1.attn.c_attn.weight"] == (16, 48)


@pytest.mark.parametrize("bias,tie,gelu", [(True, False, "tanh"), (False, True, "tanh"), (True, False, "exact")])
def test_transformers_logits_equal_triax(tmp_path, bias, tie, gelu):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")
    model = random_model(bias=bias, tie_embeddings=tie, gelu=gelu)
    out = tmp_path / "hf"
    export_hf(model.config, model.state_dict(), str(out))
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out), attn_implementation="eager").eval()
    idx = torch.randint(0, 67, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits
    # fp32 all the way; the only differences are summation order (fused c_attn, attention kernel).
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_options_without_an_equivalent_are_refused(tmp_path):
    @dataclasses.dataclass
    class Extended(GPTConfig):
        rotary: bool = False

    config = Extended(vocab_size=67, block_size=8, n_layer=1, n_head=2, n_embd=16, rotary=True)
    with pytest.raises(ExportError, match="rotary=True has no equivalent"):
        export_hf(config, {}, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_export_command_carries_the_tokenizer(tmp_path, capsys):
    """A tokens run with a tokenizer: the command writes a directory transformers loads, with the
    run's tokenizer beside it; an existing non-empty OUT_DIR is refused in one line."""
    pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install 'triax[tokenize]')")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 300)
    assert triax_main(["tokenize", str(corpus), "--out", str(tmp_path / "tokens"), "--vocab-size", "280"]) == 0
    run_dir = tmp_path / "run"
    assert triax_main(["train", *tiny_overrides(run_dir, str(tmp_path / "tokens"),
                                                **{"data.task": "tokens", "trainer.max_steps": 2})]) == 0
    out = tmp_path / "hf"
    assert triax_main(["export", str(run_dir), str(out), "--format", "hf"]) == 0
    assert "with its tokenizer" in capsys.readouterr().out
    assert (out / "tokenizer.json").read_text() == (run_dir / "tokenizer.json").read_text()
    config = json.loads((out / "config.json").read_text())
    assert config["n_embd"] == 32 and config["activation_function"] == "gelu_new"
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        assert "transformer.h.1.mlp.c_fc.weight" in handle.keys()
    assert triax_main(["export", str(run_dir), str(out), "--format", "hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not an empty directory" in err
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.decode(tokenizer("the lazy dog")["input_ids"]) == "the lazy dog"
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    from triax.runs.reader import load_run_model

    model, _, _ = load_run_model(str(run_dir))
    idx = torch.tensor([tokenizer("the quick brown fox jumps")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), atol=1e-5, rtol=1e-5)
