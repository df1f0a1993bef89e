"""A tiny random gpt-oss checkpoint saved by transformers itself (nothing downloaded): attention
sinks, a sliding window of 4 tokens on every other layer (shorter than the 32-token windows the
tests score), YaRN over a 16-token original context, experts with biases and a clamp the
pre-activations reach; and the same weights with the experts in MXFP4, as the release stores them."""

import torch

from support.llama_checkpoints import SHAPE, saved

WINDOW = 4
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 16}
OPTIONS = dict(head_dim=8, num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2, intermediate_size=16,
               sliding_window=WINDOW, rope_parameters=YARN, swiglu_limit=0.5, router_aux_loss_coef=0.02)


def hf_model(**options):
    """transformers' GptOssForCausalLM, every weight random and distinct (norm gains, biases and
    sinks too: transformers starts some at one or zero, which would hide a mix-up)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GptOssConfig(**{**SHAPE, **OPTIONS, **options})
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.add_((1.0 if name.endswith("sinks") else 0.05) * torch.randn_like(parameter))
    return model.eval()


def save_checkpoint(directory, corpus=None, **options):
    """save_pretrained's directory (config.json, model.safetensors) plus tokenizer.json."""
    return saved(hf_model(**options), directory, corpus)


def random_mxfp4(shape, generator):
    """(blocks, scales) of a random MXFP4 weight of `shape` (experts, rows, columns): every code,
    and exponents around 2**-4 (weights of a size a model has)."""
    experts, rows, columns = shape
    blocks = torch.randint(0, 256, (experts, rows, columns // 32, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(127 - 7, 127 - 2, (experts, rows, columns // 32), generator=generator, dtype=torch.uint8)
    return blocks, scales


def save_mxfp4_checkpoint(directory, source):
    """A copy of checkpoint `source` whose experts' weights are MXFP4 (random, with rows of 32
    values: hidden_size and intermediate_size multiples of 32), as the released checkpoints store them:
    `*_blocks` / `*_scales` in place of gate_up_proj and down_proj, and a quantization_config."""
    import json

    from safetensors.torch import load_file, save_file

    directory.mkdir()
    config = json.loads((source / "config.json").read_text())
    assert config["hidden_size"] % 32 == 0 and config["intermediate_size"] % 32 == 0
    tensors = load_file(str(source / "model.safetensors"))
    generator = torch.Generator().manual_seed(3)
    for name in [name for name in tensors if name.endswith(("gate_up_proj", "down_proj"))]:
        experts, inputs, outputs = tensors.pop(name).shape  # stored input-major; MXFP4 is output-major
        tensors[name + "_blocks"], tensors[name + "_scales"] = random_mxfp4((experts, outputs, inputs), generator)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                          "model.layers.*.mlp.router",
                                                                                          "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return tensors
