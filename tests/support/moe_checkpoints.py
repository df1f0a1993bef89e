"""Tiny random Qwen3, Mixtral and Qwen3-MoE checkpoints saved by transformers itself (nothing
downloaded), with a byte-level BPE tokenizer trained on the test corpus beside each."""

import torch

from support.llama_checkpoints import SHAPE, saved

# Three layers, so Qwen3-MoE's dense layer (mlp_only_layers) sits between two routed ones; 4
# experts, 2 per token; heads of 8 values (transformers' Qwen3 would default to 128).
OPTIONS = {
    "qwen3": dict(head_dim=8),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02),
    "qwen3_moe": dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1],
                      norm_topk_prob=False, router_aux_loss_coef=0.02),
}
MODEL_TYPES = tuple(OPTIONS)


def hf_model(model_type, **options):
    """A transformers model of `model_type`, every weight random and distinct (norm gains too)."""
    import transformers

    classes = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
               "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
               "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}
    config_class, model_class = classes[model_type]
    torch.manual_seed(0)
    model = model_class(config_class(**{**SHAPE, "num_hidden_layers": 3, **OPTIONS[model_type], **options}))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model.eval()


def save_checkpoint(directory, model_type, corpus=None, **options):
    """save_pretrained's directory (config.json, model.safetensors) plus tokenizer.json."""
    return saved(hf_model(model_type, **options), directory, corpus)
