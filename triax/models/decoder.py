"""What every decoder-only transformer triax builds shares: the skeleton (token embedding, a
stack of blocks, final norm, head), its layout-independent initialisation, the key/value cache
and generation. A family (triax/models/<family>/model.py) supplies its block and its norm.

The model is plain PyTorch and knows nothing about processes or devices: data, fully-sharded,
tensor and pipeline parallelism are applied from outside by `triax.parallel`. What it does offer
is a description of itself that those plans need (`flops_per_token`, the layer list).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from triax.models.config import GPTConfig
from triax.models.init import init_constant, init_normal


class LayerCache:
    """One attention layer's keys and values (batch, heads, positions, head size) of the positions
    already processed, so generation feeds each new token alone instead of the whole context. A
    layer whose queries see only a window of keys may keep only those (`append`'s `keep`)."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.dropped = 0  # positions processed before the first one kept

    @property
    def length(self) -> int:
        """Positions processed (kept or not)."""
        return self.dropped + (0 if self.keys is None else self.keys.size(2))

    def append(self, keys: torch.Tensor, values: torch.Tensor,
               keep: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions; returns the keys and values of every position kept so far, the
        new ones included (they start at position `length` minus their count). `keep`: afterwards
        hold only the last `keep` positions (None: all)."""
        if self.keys is not None:
            keys, values = torch.cat((self.keys, keys), dim=2), torch.cat((self.values, values), dim=2)
        self.keys, self.values = keys, values
        if keep is not None and keys.size(2) > keep:
            self.dropped += keys.size(2) - keep
            first = keys.size(2) - keep
            self.keys, self.values = keys[:, :, first:], values[:, :, first:]
        return keys, values


class KVCache:
    """Keys and values of every layer for the positions fed so far (`model(idx, cache)`). Valid
    only while the sequence grows within the context window: sliding the window moves every token
    to a new position and changes every key (learned or rotary positions alike)."""

    def __init__(self):
        self.layers: dict[str, LayerCache] = {}

    @property
    def length(self) -> int:
        """Positions held (every layer holds the same)."""
        return next(iter(self.layers.values())).length if self.layers else 0

    def layer(self, name: str) -> LayerCache:
        return self.layers.setdefault(name, LayerCache())

    def repeat_rows(self, times: int) -> None:
        """Each row's keys and values `times` over, in place of it (several continuations of one
        prefix: its positions computed once)."""
        for layer in self.layers.values():
            if layer.keys is not None:
                layer.keys = layer.keys.repeat_interleave(times, dim=0)
                layer.values = layer.values.repeat_interleave(times, dim=0)

    def truncate(self, length: int) -> None:
        """Forget the positions from `length` on in every layer: positions fed only to round a forward
        up (tensor parallelism's sequence sharding wants a multiple of its size). A layer that keeps a
        window of keys may have let those positions push real ones out of it: exact only without one."""
        for layer in self.layers.values():
            if layer.keys is not None:
                kept = max(0, length - layer.dropped)
                layer.keys, layer.values = layer.keys[:, :, :kept], layer.values[:, :, :kept]


class Packed(NamedTuple):
    """Several examples packed into each row (data.packing): which positions see which, and each
    position's place within its own example, so that no example attends to or is positioned by
    another; the same numbers as each example alone in its own row."""

    mask: torch.Tensor  # (batch, 1, seq, seq) bool: query i sees key j (same example, j <= i)
    positions: torch.Tensor  # (batch, seq) int64: the position within its example

    @classmethod
    def of(cls, documents: torch.Tensor) -> "Packed":
        """From (batch, seq) example numbers (a row's examples numbered in order; padding -1)."""
        seq = documents.size(1)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
        same = documents[:, :, None] == documents[:, None, :]
        return cls((same & causal)[:, None], cls.positions_of(documents))

    @staticmethod
    def positions_of(documents: torch.Tensor) -> torch.Tensor:
        """(batch, seq) each position's place within its own example."""
        index = torch.arange(documents.size(1), device=documents.device).expand_as(documents)
        starts = torch.ones_like(documents, dtype=torch.bool)
        starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
        first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
        return index - first

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, dropout_p=dropout,
                                              enable_gqa=k.size(1) != q.size(1))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache | None,
                     dropout: float, packed: Packed | None = None) -> torch.Tensor:
    """Scaled dot-product attention of q (batch, heads, seq, head size) over k, v, which may have
    fewer heads (grouped-query attention: each serves n_head / n_kv_head query heads). With a
    cache, k and v are appended to the cached positions and q takes the positions after them.
    `packed`: each position sees only its own example's earlier positions (or, under context
    parallelism, a triax.parallel.context_parallel.ContextSlice: this rank's part of the sequence)."""
    if packed is not None:
        if cache is not None:  # a mask over the cached keys and the new ones (rows of several lengths)
            k, v = cache.append(k, v)
        return packed.attend(q, k, v, dropout)
    seq, past = q.size(2), 0
    if cache is not None:
        past = cache.length
        k, v = cache.append(k, v)
    mask = None
    if past and seq > 1:  # new queries after cached keys: query i sees keys up to past + i
        mask = torch.ones(seq, past + seq, dtype=torch.bool, device=q.device).tril(diagonal=past)
    # One fused call: flash / memory-efficient kernels on GPU, a fused kernel on CPU (grouped heads
    # included, without copying k and v per query head). A single query after cached keys sees all
    # of them: no causal mask.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not past, dropout_p=dropout,
                                          enable_gqa=k.size(1) != q.size(1))


class SelfAttention(nn.Module):
    """Causal self-attention with n_kv_head key/value heads, each shared by n_head / n_kv_head
    query heads (GPT-2: as many as query heads; 1: multi-query). `rotary`: a callable that turns
    (q, k, positions before them) into rotated (q, k) (the llama family's rotary positions; GPT-2
    adds learned positions to the embeddings instead)."""

    def __init__(self, config: GPTConfig, rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None):
        super().__init__()
        self.head_dim = config.head_dim
        width = config.n_head * config.head_dim
        # Separate q/k/v projections (rather than one fused tensor) so a tensor-parallel plan can
        # shard each by heads with a plain column-parallel split.
        self.q_proj = nn.Linear(config.n_embd, width, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=config.qkv_bias)
        self.out_proj = nn.Linear(width, config.n_embd, bias=config.bias)
        self.out_proj.residual_projection = True  # marks it for the scaled init
        # Qwen3: each query and key head RMS-normalised (over its head_dim values) before rotation.
        self.q_norm = nn.RMSNorm(config.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(config.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.rotary = rotary
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None, packed: Packed | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 for the head counts: under tensor parallelism this rank holds only some heads.
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            # The new positions come after the cached ones. The whole sequence is here even under
            # sequence parallelism (the tensor-parallel plan gathers it before attention).
            q, k = self.rotary(q, k, cache.length if cache is not None else 0,
                               packed.positions if packed is not None else None)
        y = self.attend(q, k, v, cache, packed)
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.out_proj(y))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache | None,
               packed: Packed | None) -> torch.Tensor:
        """The heads' outputs (batch, heads, seq, head size) of rotated q, k and v: causal attention
        (a family whose softmax differs, with sinks or windows, overrides this)."""
        return causal_attention(q, k, v, cache, self.dropout if self.training else 0.0, packed)


class Block(nn.Module):
    """A pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, ln_1: nn.Module, attn: nn.Module, ln_2: nn.Module, mlp: nn.Module):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = ln_1, attn, ln_2, mlp

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None, packed: Packed | None = None) -> torch.Tensor:
        # The cache by keyword: tensor-parallel input plans count the positional inputs.
        x = x + self.attn(self.ln_1(x), cache=cache, **({"packed": packed} if packed is not None else {}))
        return x + self.mlp(self.ln_2(x))


class PaddedVocabMask(nn.Module):
    """Gives the logits of padding rows the lowest value, so softmax assigns them exactly zero
    probability: the loss, the gradients and sampling are those of the unpadded vocabulary."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        # The vocabulary id of this process's first logit column: tensor parallelism may leave the
        # logits sharded over the vocabulary (see triax.parallel.tensor_parallel).
        self.first_id = 0

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(self.first_id, self.first_id + logits.shape[-1], device=logits.device)
        return logits.masked_fill(ids >= self.vocab_size, torch.finfo(logits.dtype).min)


def _embedding(rows: int, width: int) -> nn.Embedding:
    # An embedding without nn.Embedding's own N(0, 1) fill: init_weights fills it (or nothing
    # does, on the meta device). On the meta device that fill would import torch._dynamo, about
    # 0.6 s of every run's start-up.
    return nn.Embedding(rows, width, _weight=torch.empty(rows, width))


NORMS = (nn.LayerNorm, nn.RMSNorm)

# The parameters with one row per token id: what a vocabulary padded for tensor parallelism pads.
VOCABULARY_PARAMETERS = ("tok_emb.weight", "lm_head.weight")


def vocabulary_rows(config: GPTConfig) -> dict[str, int]:
    """{parameter name: rows that hold the model} of the tensors the vocabulary's padding extends:
    the rows past `vocab_size` are zero whatever the padding (see PaddedVocabMask), so a snapshot
    loads by these rows into a model of any padding (triax.checkpoint.load_snapshot's real_rows)."""
    return {name: config.vocab_size for name in VOCABULARY_PARAMETERS}


class Decoder(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab).

    `layers`, `embeddings`, `head`: build only part of the model (a pipeline stage): those layer
    numbers, with or without the embeddings and the final norm + head. Parameter names stay the
    full model's. `seed`: the initial weights are a function of (seed, parameter name) only
    (triax.models.init), so a part, a shard or the whole model built from one seed agree; None
    draws the seed from torch's global generator (so torch.manual_seed still decides it). Built
    on the meta device, nothing is initialised: materialise with `to_empty`, then `init_weights`.
    """

    family = ""  # the GPTConfig.family this class builds
    learned_positions = False  # a table of position embeddings beside the token embedding
    # Whether a forward's numbers are its attention mask's and positions' alone (an explicit `packed`
    # may then be any pattern, over cached keys too, and a padding position changes no other one):
    # true of dense blocks attending by decoder.causal_attention; not of windows counted in row
    # places, of latent attention's own cache, nor of routers whose balance counts every position.
    attends_by_mask = False
    # Set from outside by context parallelism (triax.parallel.context_parallel): each forward then
    # takes this rank's part of the sequence, and asks it for positions and attention.
    context = None

    def __init__(self, config: GPTConfig, layers: Iterable[int] | None = None, embeddings: bool = True,
                 head: bool = True, seed: int | None = None):
        super().__init__()
        if config.family != self.family:
            raise ValueError(f"{type(self).__name__} builds the {self.family} family, not model.arch={config.arch}; "
                             "use triax.models.build_model(config)")
        self.config = config
        rows = config.vocab_rows
        self.tok_emb = _embedding(rows, config.n_embd) if embeddings else None
        self.pos_emb = _embedding(config.block_size, config.n_embd) if embeddings and self.learned_positions else None
        self.drop = nn.Dropout(config.dropout)
        # A ModuleDict keyed by layer number, not a ModuleList: a pipeline stage holds only some
        # layers and keeps their names ("layers.5"), so checkpoints written by any layout share
        # one set of parameter names.
        numbers = range(config.n_layer) if layers is None else layers
        self.layers = nn.ModuleDict({str(i): self.make_block(config, i) for i in numbers})
        self.ln_f = self.make_norm(config) if head else None
        self.lm_head = nn.Linear(config.n_embd, rows, bias=False) if head else None
        self.vocab_mask = PaddedVocabMask(config.vocab_size) if head and rows > config.vocab_size else None
        if config.tie_embeddings and embeddings and head:
            self.lm_head.weight = self.tok_emb.weight
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights(seed)

    def make_block(self, config: GPTConfig, layer: int = 0) -> nn.Module:
        """Transformer block number `layer`: `block(x, cache=LayerCache | None)` -> x."""
        raise NotImplementedError

    def make_norm(self, config: GPTConfig) -> nn.Module:
        raise NotImplementedError

    def init_weights(self, seed: int | None = None) -> None:
        """GPT-2's initialisation: N(0, 0.02), and residual projections scaled by 1/sqrt(2 * n_layer)
        so the residual stream's variance does not grow with depth; norm gains one, biases and
        padding rows of the vocabulary zero. Fills whatever part of each parameter this process
        holds (plain or DTensor shard)."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        if self.config.tie_embeddings and self.tok_emb is not None and self.lm_head is not None:
            # Materialising from the meta device (to_empty) gives each module its own tensor: tie again.
            self.lm_head.weight = self.tok_emb.weight
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        vocab = self.config.vocab_size
        done = set()
        for module_name, module in self.named_modules():
            prefix = module_name + "." if module_name else ""
            if isinstance(module, nn.Linear):
                std = residual_std if getattr(module, "residual_projection", False) else 0.02
                weights = [(module.weight, std, vocab if module is self.lm_head else None)]
                biases = [module.bias]
            elif isinstance(module, nn.Embedding):
                weights = [(module.weight, 0.02, vocab if module is self.tok_emb else None)]
                biases = []
            elif isinstance(module, NORMS):
                weights, biases = [], [getattr(module, "bias", None)]
                if module.weight is not None:
                    init_constant(module.weight, 1.0)
            else:
                continue
            for weight, std, drawn_rows in weights:
                if id(weight) not in done:  # a tied weight: initialised once, by its first name
                    done.add(id(weight))
                    init_normal(weight, seed, prefix + "weight", std, drawn_rows)
            for bias in biases:
                if bias is not None:
                    init_constant(bias, 0.0)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None,
                documents: torch.Tensor | None = None, logits: bool = True,
                packed: Packed | None = None) -> torch.Tensor:
        """`cache`: positions already fed (their keys and values); `idx` then holds only the new
        tokens, which take the positions after them (generation, under torch.no_grad).
        `documents`: (batch, seq) example numbers of packed rows (triax.data.chat): each example
        attends only to itself and its positions start at 0. `logits=False`: the final hidden
        states instead (after the final norm), for a loss that runs `output_logits` on a few
        positions at a time rather than holding every position's logits at once. `packed`: which
        key each new position sees (over the cached ones too) and its position, given whole (only
        where `attends_by_mask`): left-padded rows sampled together, or completions sharing their
        prompt's positions; the positions, not the row's length, must fit the block."""
        given = packed is not None
        if not given and self.context is not None and cache is None:
            packed = self.context.slice(idx.size(1), documents, idx.device)
        elif not given and documents is not None:
            packed = Packed.of(documents)
        # A pipeline stage may lack the embeddings (it then takes hidden states instead of ids) or
        # the final norm and head (it then returns hidden states instead of logits).
        if self.tok_emb is not None:
            seq = idx.shape[1]
            past = cache.length if cache is not None else 0
            if past + seq > self.config.block_size and not given:
                raise ValueError(f"sequence length {past + seq} exceeds block_size {self.config.block_size}")
            x = self.tok_emb(idx)
            if self.pos_emb is not None:
                x = x + self.pos_emb(packed.positions if packed is not None
                                     else torch.arange(past, past + seq, device=idx.device))
            x = self.drop(x)
        else:
            x = idx
        for name, block in self.layers.items():
            # The cache by keyword: tensor-parallel input plans count the positional inputs.
            extra = {"packed": packed} if packed is not None else {}  # none: compiled blocks keep one signature
            x = block(x, cache=cache.layer(name) if cache is not None else None, **extra)
        if self.ln_f is not None:
            x = self.ln_f(x)
        return self.output_logits(x) if logits else x

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states (the head; a padded vocabulary's unused rows masked)."""
        if self.lm_head is not None:
            hidden = self.lm_head(hidden)
        if self.vocab_mask is not None:
            hidden = self.vocab_mask(hidden)
        return hidden

    def num_params(self, exclude_position: bool = True) -> int:
        """Parameter count; position embeddings are excluded by default (they cost no matmul
        FLOPs). Tied weights count once."""
        total = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        if exclude_position and self.pos_emb is not None:
            total -= self.pos_emb.weight.numel()
        return total

    def flops_per_token(self, seq_len: int | None = None, num_params: int | None = None) -> float:
        """Training FLOPs per token by the PaLM formula: 6N + 12·L·H·Q·T
        (N parameters without position embeddings, L layers, H query heads, Q head size, T sequence).
        Pass `num_params` when this module holds only a shard of the model."""
        c = self.config
        seq_len = seq_len or c.block_size
        n = self.num_params() if num_params is None else num_params
        return 6 * n + 12 * c.n_layer * c.n_head * c.head_dim * seq_len

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, greedy: bool = False,
                 generator: torch.Generator | None = None, vocab_limit: int | None = None,
                 use_cache: bool = True, stop_ids: Iterable[int] = ()) -> torch.Tensor:
        """Extend `idx` (batch, seq) by `max_new_tokens`, one token at a time. `vocab_limit`: only
        ids below it are drawn (a vocabulary padded for tensor parallelism has unused rows).
        `use_cache`: while the text fits in the context window, feed each new token alone and keep
        the keys and values of the earlier ones (KVCache), instead of running the whole context
        again; once it outgrows the window, each token sees the last block_size tokens, recomputed,
        as without the cache. The same text either way, up to float rounding. `stop_ids`: stop
        once every row has produced one of these (a chat model's end of turn), which is kept."""
        if temperature <= 0 and not greedy:
            raise ValueError(f"temperature must be > 0 (got {temperature}); use greedy=True instead")
        block_size = self.config.block_size
        cache = KVCache() if use_cache else None
        stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=idx.device)
        stop = stop if stop.numel() else None
        finished = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
        for _ in range(max_new_tokens):
            if cache is not None and idx.size(1) <= block_size:
                logits = self(idx[:, cache.length:], cache)
            else:
                cache = None  # the window slides: every position changes
                logits = self(idx[:, -block_size:])
            logits = logits[:, -1, :].float()
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
            if stop is not None:
                finished = finished | torch.isin(next_id[:, 0], stop)
                if bool(finished.all()):
                    break
        return idx
