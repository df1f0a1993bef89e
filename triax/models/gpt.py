"""A GPT in one readable file (the minGPT/GPT-2 architecture).

The model is plain PyTorch and knows nothing about processes or devices: data, fully-sharded,
tensor and pipeline parallelism are applied from outside by `triax.parallel`. What it does offer
is a description of itself that those plans need (`flops_per_token`, the layer list).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from triax.errors import ConfigError

# (n_layer, n_head, n_embd), as in minGPT.
PRESETS: dict[str, tuple[int, int, int]] = {
    "openai-gpt": (12, 12, 768),   # 117M
    "gpt2": (12, 12, 768),         # 124M
    "gpt2-medium": (24, 16, 1024),  # 350M
    "gpt2-large": (36, 20, 1280),  # 774M
    "gpt2-xl": (48, 25, 1600),     # 1558M
    "gopher-44m": (8, 16, 512),
    "gpt-mini": (6, 6, 192),
    "gpt-micro": (4, 4, 128),
    "gpt-nano": (3, 3, 48),
}


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ConfigError(f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}; "
                              f"choose n_embd as a multiple of n_head")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def from_preset(cls, name: str, **kwargs) -> "GPTConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; presets are: {', '.join(PRESETS)}")
        n_layer, n_head, n_embd = PRESETS[name]
        return cls(n_layer=n_layer, n_head=n_head, n_embd=n_embd, **kwargs)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        # Separate q/k/v projections (rather than one fused c_attn) so a tensor-parallel plan can
        # shard each by heads with a plain column-parallel split.
        self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.k_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.out_proj.residual_projection = True  # marks it for the GPT-2 scaled init
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 for the head count: under tensor parallelism this rank holds only some heads.
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        # One fused call: flash / memory-efficient kernels on GPU, a fused kernel on CPU.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.out_proj(y))

    @property
    def head_dim(self) -> int:
        return self.q_proj.in_features // self.n_head


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.down_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.down_proj.residual_projection = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.gelu(self.up_proj(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        # A ModuleDict keyed by layer number, not a ModuleList: a pipeline stage can delete the
        # layers it does not own and keep the others' names ("layers.5"), so checkpoints written
        # by any layout share one set of parameter names.
        self.layers = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layer)})
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.init_weights()
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def init_weights(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), and residual projections scaled by 1/sqrt(2 * n_layer)
        so the residual stream's variance does not grow with depth."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                std = residual_std if getattr(module, "residual_projection", False) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # Each stage of a pipeline-parallel split may lack tok_emb / ln_f / lm_head (set to None);
        # it then takes or returns hidden states instead of ids or logits.
        if self.tok_emb is not None:
            seq = idx.shape[1]
            if seq > self.config.block_size:
                raise ValueError(f"sequence length {seq} exceeds block_size {self.config.block_size}")
            positions = torch.arange(seq, device=idx.device)
            x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        else:
            x = idx
        for block in self.layers.values():
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x

    def num_params(self, exclude_position: bool = True) -> int:
        """Parameter count; position embeddings are excluded by default (they cost no matmul
        FLOPs). Tied weights count once."""
        total = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        if exclude_position and self.pos_emb is not None:
            total -= self.pos_emb.weight.numel()
        return total

    def flops_per_token(self, seq_len: int | None = None, num_params: int | None = None) -> float:
        """Training FLOPs per token by the PaLM formula: 6N + 12·L·H·Q·T
        (N parameters without position embeddings, L layers, H heads, Q head size, T sequence).
        Pass `num_params` when this module holds only a shard of the model."""
        c = self.config
        seq_len = seq_len or c.block_size
        n = self.num_params() if num_params is None else num_params
        return 6 * n + 12 * c.n_layer * c.n_head * (c.n_embd // c.n_head) * seq_len

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, greedy: bool = False,
                 generator: torch.Generator | None = None, vocab_limit: int | None = None) -> torch.Tensor:
        """Extend `idx` (batch, seq) by `max_new_tokens`, one token at a time. `vocab_limit`: only
        ids below it are drawn (a vocabulary padded for tensor parallelism has unused rows)."""
        if temperature <= 0 and not greedy:
            raise ValueError(f"temperature must be > 0 (got {temperature}); use greedy=True instead")
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]
            logits = self(context)[:, -1, :].float()
            if vocab_limit is not None:
                logits[:, vocab_limit:] = float("-inf")
            if greedy:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, next_id), dim=1)
        return idx
