"""DeepSeek-V3's released weights, 8-bit floats with a float32 scale per block, read equal to
transformers' own dequantization (fp32), by whole tensors and by the slices a sharded process reads;
the last, partial block of a dimension that is not a multiple of the block (576 = 4.5 x 128 rows in
the release) read as its definition says; a damaged quantized checkpoint is one line."""

import json

import pytest
import torch

from support.deepseek_checkpoints import VOCAB, quantize_fp8, save_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """{"whole": every dimension a multiple of the 8 x 8 blocks (kv_a_proj_with_mqa: 24 + 8 rows),
    "partial": kv_a_proj_with_mqa's 16 + 4 = 20 rows, 2.5 blocks}: the FP8 directories."""
    made = {}
    for case, options in (("whole", dict(kv_lora_rank=24, qk_rope_head_dim=8)), ("partial", {})):
        root = tmp_path_factory.mktemp(case)
        save_checkpoint(root / "fp32", **options)
        made[case] = quantize_fp8(root / "fp32", root / "fp8")
    return made


def test_fp8_weights_read_as_transformers_dequantizes_them(quantized):
    from triax.interop.hf.whole_model import load_hf_model

    directory = quantized["whole"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), quantization_config=transformers.FineGrainedFP8Config(dequantize=True)).eval()
    ours = load_hf_model(str(directory), torch.device("cpu"))
    theirs = dict(reference.named_parameters())
    weight = ours.layers["1"].attn.q_b_proj.weight
    assert weight.dtype == torch.float32 and torch.equal(weight, theirs["model.layers.1.self_attn.q_b_proj.weight"])
    assert torch.equal(ours.layers["2"].mlp.experts.down_proj[5],
                       theirs["model.layers.2.mlp.experts.down_proj"][5])
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids, labels=ids).loss.item()
        logits = ours(ids)
    got = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).item()
    assert abs(got - expected) / expected <= 1e-5, (got, expected)


def test_a_partial_last_block_and_a_shard_read_as_defined(quantized):
    """value[i, j] = weight[i, j] * weight_scale_inv[i // 8, j // 8], for the whole tensor and for
    any slice (a shard reads its rows' and columns' scales only)."""
    from safetensors.torch import load_file

    from triax.interop.hf.block_fp8 import BlockScaled
    from triax.interop.hf.files import HFWeights

    directory = quantized["partial"]
    stored = load_file(str(directory / "model.safetensors"))
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    weight, scale = stored[name].float(), stored[name + "_scale_inv"]
    assert weight.shape == (20, 32) and scale.shape == (3, 4)
    rows, columns = torch.arange(20)[:, None] // 8, torch.arange(32)[None, :] // 8
    expected = weight * scale[rows, columns]
    served = BlockScaled(HFWeights(str(directory)), (8, 8))
    assert served.entry(name).dtype == "F32"
    assert torch.equal(served.slice(name, (slice(0, 20), slice(0, 32))), expected)
    for box in ((slice(7, 17), slice(3, 30)), (slice(16, 20), slice(24, 32)), (slice(0, 1), slice(31, 32))):
        assert torch.equal(served.slice(name, box), expected[box])


def _damaged(source, target, change_tensors=None, change_config=None):
    from safetensors.torch import load_file, save_file

    target.mkdir()
    tensors = load_file(str(source / "model.safetensors"))
    if change_tensors:
        change_tensors(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    if change_config:
        change_config(config)
    (target / "config.json").write_text(json.dumps(config))
    return target


SCALE = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
HOSTILE = {
    "a scale missing": (dict(change_tensors=lambda t: t.pop(SCALE)), "without its"),
    "a scale grid of another shape": (dict(change_tensors=lambda t: t.__setitem__(SCALE, t[SCALE][:, :-1].clone())),
                                      "needs a floating grid"),
    "a NaN scale": (dict(change_tensors=lambda t: t[SCALE].fill_(float("nan"))), "not finite"),
    "another quantization": (dict(change_config=lambda c: c["quantization_config"].update(quant_method="bitsandbytes")),
                             "is stored as F8_E4M3, not a floating type"),
    "a block of no rows": (dict(change_config=lambda c: c["quantization_config"].update(weight_block_size=[0, 8])),
                           "weight_block_size=[0, 8]"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_damaged_fp8_checkpoint_is_one_line(case, quantized, tmp_path):
    from triax.interop.hf.files import CheckpointError
    from triax.interop.hf.whole_model import load_hf_model

    change, words = HOSTILE[case]
    damaged = _damaged(quantized["whole"], tmp_path / "damaged", **change)
    with pytest.raises(CheckpointError) as error:
        load_hf_model(str(damaged), torch.device("cpu"))
    assert words in str(error.value) and "\n" not in str(error.value), str(error.value)
