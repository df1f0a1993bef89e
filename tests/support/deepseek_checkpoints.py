"""Tiny random DeepSeek-V3 checkpoints saved by transformers itself (nothing downloaded): three
layers (the first dense), 8 experts in 4 groups of which a token may use 2, 2 experts per token,
two shared experts, a routed scaling factor; every weight random and distinct, the correction
bias of the router's scores too (transformers starts it at zero, which would hide its loss)."""

import torch

VOCAB = 301
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
             routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, v_head_dim=6,
             qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
             max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None)


def hf_model(**options):
    """A transformers DeepseekV3ForCausalLM with `options` over SHAPE."""
    import transformers

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**SHAPE, **options}))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    return model.eval()


def save_checkpoint(directory, **options):
    """save_pretrained's directory (config.json, model.safetensors); the transformers model."""
    model = hf_model(**options)
    model.save_pretrained(directory)
    return model


def quantize_fp8(directory, target, block=(8, 8)):
    """A copy of checkpoint `directory` laid out as DeepSeek-V3's release: every projection's weight
    as float8_e4m3fn beside its float32 `weight_scale_inv`, one scale per block (the grid rounded up
    where a dimension is not a multiple of the block), and config.json's quantization_config. Each
    block is scaled so that its largest value maps to float8's largest, 448."""
    import json
    import math

    from safetensors.torch import load_file, save_file

    rows_per, columns_per = block
    out = {}
    for name, value in load_file(str(directory / "model.safetensors")).items():
        if not name.endswith(("proj.weight", "proj_with_mqa.weight")):
            out[name] = value
            continue
        rows, columns = value.shape
        grid = math.ceil(rows / rows_per), math.ceil(columns / columns_per)
        padded = torch.zeros(grid[0] * rows_per, grid[1] * columns_per)
        padded[:rows, :columns] = value
        blocks = padded.view(grid[0], rows_per, grid[1], columns_per)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        quantized = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :columns]
        out[name] = quantized.contiguous().to(torch.float8_e4m3fn)
        out[name + "_scale_inv"] = scale.float()
    target.mkdir()
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (target / "config.json").write_text(json.dumps(config))
    return target
