"""The names of the parts of the decoder block every family shares (decoder.Block and
SelfAttention), as a family's tensor-parallel plan, `triax plan` and LoRA name them. A family's
parallel.py adds its own parts (a gated MLP, per-head norms) to these.

Tensor-parallel styles are named, not built (triax/parallel/tensor_parallel.py turns each name into
DTensor's parallel style), so a family imports nothing of torch.distributed:
colwise (split the outputs), rowwise (split the inputs; the partial sums reduce-scattered along the
sequence), sequence (norms and dropout on a slice of the sequence), gather_sequence (a module whose
input is gathered from the sequence slices), head_sequence (per-head norms on this rank's heads),
gather_sequence_head_params (gather_sequence, and the module's own per-head parameters split by
head), whole (a module every rank computes whole, its parameters replicated: a routed MLP), and
replicate / local_partial (latent attention's: triax/models/deepseek_v3/parallel.py)."""

from __future__ import annotations

# Megatron-LM's plan for the attention and the norms around it.
ATTENTION_PLAN = {"ln_1": "sequence", "attn": "gather_sequence", "attn.q_proj": "colwise", "attn.k_proj": "colwise",
                  "attn.v_proj": "colwise", "attn.out_proj": "rowwise", "ln_2": "sequence", "mlp": "gather_sequence"}

# An MLP of an up and a down projection.
MLP_PLAN = {"mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}

# Parameter-name endings and the dimension tensor parallelism splits (what `triax plan` counts).
TP_SPLIT_DIMS = {
    "q_proj.weight": 0, "q_proj.bias": 0, "k_proj.weight": 0, "k_proj.bias": 0,
    "v_proj.weight": 0, "v_proj.bias": 0, "up_proj.weight": 0, "up_proj.bias": 0,
    "out_proj.weight": 1, "down_proj.weight": 1,
    "tok_emb.weight": 0, "pos_emb.weight": 0, "lm_head.weight": 0,
}

# model.lora.targets' short names -> the linear layer inside a block.
LORA_TARGETS = {"q": "attn.q_proj", "k": "attn.k_proj", "v": "attn.v_proj", "o": "attn.out_proj",
                "up": "mlp.up_proj", "down": "mlp.down_proj"}
