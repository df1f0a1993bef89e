"""`triax plan`: which layouts fit a model on given devices, and which should be fastest.

Per-device memory, by formula (B = bytes per value of the parameter dtype: 4 fp32, 2 bf16-pure):
- parameters:  sum over this device's tensors of their local size x B (the tensors and their full
  shapes are the model's own, built on the meta device: GPT-2 or the llama family with its
  grouped key/value heads and SwiGLU MLP). A tensor split by tensor
  parallelism (q/k/v/gate/up/head/embeddings along dim 0, out/down projections along dim 1) holds
  ceil(n/tp) of that dimension; FSDP then keeps ceil(dim0/dp_shard) rows of what is left; a
  pipeline stage holds only its layers (plus embeddings first, final norm and head last). The
  figure is for the most loaded device (the first stage, rank 0 of each group).
- gradients:   as parameters (same shards, same dtype: FSDP reduces in fp32 for mixed precision).
- optimizer:   AdamW's exp_avg and exp_avg_sq: 2 x parameters.
- activations: per layer and micro-batch of b sequences of length s, width h, in the compute
  dtype (A bytes): none 17·s·b·h·A/tp (Korthikanti et al. 2022, 34·s·b·h bytes at A = 2, without
  the attention-score term a fused attention kernel does not store); selective 10·s·b·h·A/tp (the
  matmul and attention outputs); full s·b·h·A (each layer's input) plus one layer's 17·s·b·h·A/tp
  being recomputed. The llama family's block keeps (8h + 2k + 4I)·s·b·A/tp in place of the 17
  (what autograd saves, counted: the block's input and its residual after attention, each
  RMSNorm's normalised input and output, the rotated queries and the attention output: 8h; the
  rotated keys and the values, k = n_kv_head x head size wide: 2k; the SwiGLU's gate, up,
  silu(gate) and product, I = intermediate_size wide: 4I); selective and full scale alike. Micro-batches
  alive on the first stage: m for gpipe, min(m, pp) for 1f1b-style
  schedules. Plus the loss's peak on the last stage, where a micro-batch's whole logits fit in
  the limit M (parallel.max_logits_mb: 4·s·b·V ≤ M, V the padded vocabulary, or M = 0; always
  under pipeline parallelism, whose loss takes the whole logits) LOSS_BYTES_PER_LOGIT·s·b·V/tp: in
  its backward the fp32 log-probabilities and two fp32 gradients are alive beside the bf16 logits
  (and, with a padded vocabulary, their masked copy); 16 bytes a logit matches the memory per
  sample measured on an H200 within 5% (GPT-2 124M: 1.066 GiB estimated, 1.028 measured; a 125M
  Llama: 0.828 and 0.825). Compiled (parallel.compile) the loss keeps no fp32 copy and needs less:
  an overcount then. Above the limit the loss takes c = floor(M / 4V) positions at a time
  (triax.objectives.chunked_logits; its arithmetic: logits_budget) and holds one chunk's logits,
  their log-softmax and its gradient, CHUNK_BYTES_PER_LOGIT·c·V/tp = about 3·M/tp (three such
  tensors, measured on a CPU: docs/performance.md), whatever the micro-batch. `triax plan` takes M as a GPU run leaves it
  unset, a quarter of --memory-gb; the trainer's own check takes its run's.
- context parallelism (cp > 1): each rank holds s/cp of every sequence, so the activation and
  loss terms above take s/cp; each layer also keeps the whole sequence's gathered keys and values
  for backward, 2·s·b·k·A/tp with k the key/value width (n_kv_head x head size). The cp ranks
  shard the parameters with FSDP (over dp_shard x cp), so the parameter terms and FSDP's gathered
  blocks below count dp_shard x cp. Time: the keys and values all-gathered in forward and reduced
  in backward, 4·L·s·b·k·A·(cp-1)/cp per device per micro-batch at --bandwidth, not overlapped.
- expert parallelism (ep > 1, mixtures of experts): each rank holds num_experts / ep of every
  layer's experts, which FSDP shards again over efsdp = dp_shard / ep: along the expert dimension
  (ceil(num_experts/ep/efsdp) experts on the most loaded device, as FSDP over dp_shard alone keeps)
  or, when a rank holds fewer experts than efsdp, along their width (1/efsdp of each: 1/dp_shard
  of the experts where FSDP alone leaves whole experts on some ranks and none on others). A
  block's experts in flight are its num_experts / ep, and their all-gather and reduce-scatter
  run over efsdp. Time: every routed layer sends each
  token's experts_per_token copies of its h values to the ranks holding their experts and back,
  in forward and in backward (4 all-to-alls; 6 with recomputation, selective or full, whose
  forward exchanges again), (ep-1)/ep of them leaving the rank, at --bandwidth, not overlapped
  (the exchange sits on the forward path).
- gathered:    with FSDP (dp_shard > 1), the whole (unsharded) blocks in flight: about two
  blocks' parameters all-gathered (the one computing and the one prefetched) and two blocks'
  unsharded gradients before their reduce-scatter, 2·(P/tp)·G + 2·(P/tp)·4 bytes with P a block's
  parameters (12·h² for GPT-2) and G the all-gather dtype's bytes (4·48·h² bytes in fp32: 0.19 GiB
  for gpt2-medium, where 0.18 GiB was measured, benchmarks/memory_scaling.py).
Not included: the runtime itself (python + torch: about 0.3 GiB on a CPU, more with a CUDA
context) and allocator slack: leave that margin out of --memory-gb.
Step time, by formula: compute 6·N·T + 12·L·H·Q·s·T FLOPs (T tokens per step, H·Q query heads
times their width: h for GPT-2) over world x
--tflops, x 4/3 for full recomputation (x 1.1 selective), / (1 - (pp-1)/(m+pp-1)) for the
pipeline bubble; plus tensor-parallel traffic 8·L·s·b·h·A·(tp-1)/tp per micro-batch per device
(4 all-gather/reduce-scatter pairs per layer, forward and backward) at --bandwidth; data-parallel
traffic (3 x parameter bytes for FSDP, 2 x for replication, x (n-1)/n) is assumed to overlap with
compute, so the step takes the longer of the two. These are estimates to rank layouts, not promises.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch

from triax.errors import ConfigError
from triax.models import build_model
from triax.models.config import DEFAULT_ARCH, GPTConfig
from triax.models.family import spec_of
from triax.objectives.logits_budget import CHUNK_BYTES_PER_LOGIT, gpu_logits_limit_mb, positions_per_chunk
from triax.parallel.stage_split import split_layers
from triax.parallel.mesh import (MULTI_STAGE_SCHEDULES, Layout, check_context_parallel, num_stages,
                                 check_expert_parallel, padded_vocab_size)
from triax.parallel.experts import check_layout as check_expert_layout

MAX_WORLD = 2**16  # the layout search grows with world x its divisors: beyond this it takes minutes
EXPERTS = ".mlp.experts."  # in the name of every routed expert's tensor (triax.models.experts.GroupedExperts)
# A routed MLP's shared expert: whole on every tensor-parallel rank with the rest of the routed MLP
# (triax/models/moe/parallel.py), though its Linear names are those a dense MLP splits.
SHARED_EXPERT = ".mlp.shared_expert."



@dataclass(frozen=True)
class ModelShape:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    block_size: int
    bias: bool | None = None  # unset: the architecture's (GPTConfig)
    tie_embeddings: bool = False  # the head is the embedding: no lm_head.weight of its own
    arch: str = DEFAULT_ARCH
    n_kv_head: int | None = None
    intermediate_size: int | None = None
    head_dim: int | None = None
    extra: tuple = ()  # the other GPTConfig fields of EXTRA_FIELDS as (name, value) pairs (hashable: lists as tuples)

    @classmethod
    def from_config(cls, config: GPTConfig, block_size: int | None = None) -> "ModelShape":
        """The shape of a GPTConfig (vocabulary padding aside: the layout decides it here), for
        sequences of `block_size` (default: the model's context)."""
        return cls(config.n_layer, config.n_head, config.n_embd, config.vocab_size, block_size or config.block_size,
                   config.bias, config.tie_embeddings, config.arch, config.n_kv_head, config.intermediate_size,
                   config.head_dim, tuple((name, _hashable(getattr(config, name))) for name in EXTRA_FIELDS))

    def config(self, tp: int = 1):
        """The GPTConfig of this shape, its vocabulary padded for tp."""
        padded = padded_vocab_size(self.vocab_size, tp)
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.block_size, arch=self.arch,
                         n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd, n_kv_head=self.n_kv_head,
                         head_dim=self.head_dim, intermediate_size=self.intermediate_size, bias=self.bias,
                         tie_embeddings=self.tie_embeddings,
                         padded_vocab_size=padded if padded != self.vocab_size else None,
                         **{name: list(value) if isinstance(value, tuple) else value for name, value in self.extra})

    def parameter_shapes(self, tp: int = 1) -> dict[str, tuple[int, ...]]:
        """Name -> full shape of every parameter of the model (vocabulary padded for tp; a tied
        head is the embedding and has no entry of its own)."""
        return dict(_parameter_shapes(self, tp))

    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.parameter_shapes().values())

    def active_params(self) -> int:
        """Parameters one token passes through: a mixture of experts' tokens go through
        experts_per_token of its num_experts experts only."""
        extra = dict(self.extra)
        experts, chosen = extra.get("num_experts", 0), extra.get("experts_per_token", 0)
        idle = sum(math.prod(s) for name, s in self.parameter_shapes().items() if EXPERTS in name)
        return self.num_params() - (idle * (experts - chosen) // experts if experts else 0)

    def flops_per_token(self) -> float:
        """The PaLM formula over the active parameters (MFU counts the FLOPs a token costs)."""
        c = self.config()
        # A learned position table (GPT-2's) is looked up, not multiplied: no FLOPs.
        n = self.active_params() - (self.block_size * self.n_embd if spec_of(c.arch).model.learned_positions else 0)
        return 6 * n + 12 * self.n_layer * self.n_head * c.head_dim * self.block_size

    def block_params(self) -> int:
        """Parameters of one transformer block."""
        return sum(math.prod(s) for name, s in self.parameter_shapes().items() if name.startswith("layers.0."))

    def block_expert_params(self) -> int:
        """Parameters of one transformer block's routed experts (0 for a dense block)."""
        return sum(math.prod(s) for name, s in self.parameter_shapes().items()
                   if name.startswith("layers.0.") and EXPERTS in name)

    def routed_layers(self) -> int:
        """Layers whose MLP routes tokens to experts."""
        return len({name.split(".")[1] for name in self.parameter_shapes() if EXPERTS in name})

    @property
    def num_experts(self) -> int:
        return dict(self.extra).get("num_experts", 0)


# GPTConfig fields beyond ModelShape's own that change the parameters: q/k norms, the experts.
EXTRA_FIELDS = ("qk_norm", "num_experts", "experts_per_token", "moe_intermediate_size", "norm_topk_prob",
                "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size", "shared_expert_gate",
                "router_scoring", "router_groups", "router_topk_groups", "first_dense_layers", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _hashable(value: object):
    return tuple(value) if isinstance(value, list) else value


@functools.lru_cache(maxsize=64)
def _parameter_shapes(shape: ModelShape, tp: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    with torch.device("meta"):  # the model's own tensors, without memory
        model = build_model(shape.config(tp))
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def stage_parameter_names(shape: ModelShape, layout: Layout, pp_schedule: str, stage: int = 0,
                          balance: list[int] | None = None) -> list[str]:
    names = list(shape.parameter_shapes(layout.tp))
    if layout.pp == 1:
        return names
    total = num_stages(layout.pp, pp_schedule)
    stages = [stage + k * layout.pp for k in range(total // layout.pp)]  # looped placement
    ranges = split_layers(shape.n_layer, total, balance)
    owned_layers = {layer for s in stages for layer in ranges[s]}
    kept = []
    for name in names:
        if name.startswith("layers."):
            keep = int(name.split(".")[1]) in owned_layers
        elif name.startswith(("tok_emb", "pos_emb")):
            keep = 0 in stages
        else:
            keep = total - 1 in stages
        if keep:
            kept.append(name)
    return kept


def local_numel(name: str, full: tuple[int, ...], tp: int, dp_shard: int, ep: int = 1,
                split_dims: Mapping[str, int] | None = None) -> int:
    """Values of this parameter on the most loaded device (rank 0 of its tp and dp_shard groups).
    Under expert parallelism a routed expert's tensor is split over ep (exactly: ep divides the
    experts), then FSDP shards each rank's part over the dp_shard / ep ranks left. `split_dims`:
    the family's {parameter-name ending: the dim tensor parallelism splits} (FamilySpec.tp_split_dims)."""
    local = list(full)
    for ending, dim in (split_dims or {}).items():
        if name.endswith(ending) and tp > 1 and SHARED_EXPERT not in name:
            local[dim] = -(-local[dim] // tp)
    if ep > 1 and EXPERTS in name:
        local[0] //= ep
        dp_shard //= ep
        if local[0] < dp_shard:  # fewer experts than ranks: FSDP shards their width (expert_shard_placement)
            local[1] = -(-local[1] // dp_shard)
            return math.prod(local)
    if dp_shard > 1:
        local[0] = -(-local[0] // dp_shard)
    return math.prod(local)


LOSS_BYTES_PER_LOGIT = 16  # the eager loss's peak with the whole logits (module docstring)


def loss_bytes(positions: float, vocabulary: int, tp: int, max_logits_mb: float) -> float:
    """The loss's peak on one device for a micro-batch of `positions` positions (module docstring):
    the whole logits' where they fit in `max_logits_mb` (0: always), else one chunk's."""
    chunk = positions_per_chunk(math.ceil(positions), vocabulary, max_logits_mb)
    if chunk >= positions:
        return LOSS_BYTES_PER_LOGIT * positions * vocabulary / tp
    return CHUNK_BYTES_PER_LOGIT * chunk * vocabulary / tp


def local_parameter_count(shape: ModelShape, layout: Layout, pp_schedule: str = "1f1b", stage: int = 0,
                          balance: list[int] | None = None) -> int:
    shapes = shape.parameter_shapes(layout.tp)
    split_dims = spec_of(shape.arch).tp_split_dims
    return sum(local_numel(name, shapes[name], layout.tp, layout.dp_shard * layout.cp, layout.ep, split_dims)
               for name in stage_parameter_names(shape, layout, pp_schedule, stage, balance))


@dataclass
class Estimate:
    layout: Layout
    checkpointing: str
    params_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    step_s: float
    gathered_gb: float = 0.0  # FSDP's unsharded blocks in flight (module docstring)

    @property
    def total_gb(self) -> float:
        return self.params_gb + self.grads_gb + self.optimizer_gb + self.activations_gb + self.gathered_gb


def estimate(shape: ModelShape, layout: Layout, *, batch_size: int, precision: str = "bf16",
             checkpointing: str = "none", pp_schedule: str = "1f1b", microbatches: int = 0,
             tflops: float = 100.0, bandwidth_gbs: float = 100.0, max_logits_mb: float = 0.0) -> Estimate:
    """Per-device memory and step time of one layout; `batch_size` is per data-parallel rank;
    `max_logits_mb`: parallel.max_logits_mb as the run applies it (0: the whole logits at any size)."""
    param_bytes = 2 if precision == "bf16-pure" else 4
    act_bytes = 4 if precision == "fp32" else 2
    gb = 1024 ** 3
    local = local_parameter_count(shape, layout, pp_schedule)
    params = local * param_bytes / gb
    s, h, t = shape.block_size // layout.cp, shape.n_embd, layout.tp  # s: this rank's tokens of a sequence
    m = (microbatches or 2 * layout.pp) if layout.pp > 1 else 1
    b = batch_size / m
    stages = num_stages(layout.pp, pp_schedule)
    layers = math.ceil(shape.n_layer / stages) * (stages // layout.pp)  # layers on the busiest rank
    widths = layer_widths(shape)
    per_layer_full = widths * s * b * act_bytes / t
    per_layer = {"none": per_layer_full, "selective": widths * 10 / 17 * s * b * act_bytes / t,
                 "full": s * b * h * act_bytes}[checkpointing]
    alive = m if (layout.pp == 1 or pp_schedule == "gpipe") else min(m, layout.pp)
    activations = alive * layers * per_layer + (per_layer_full if checkpointing == "full" else 0)
    activations += loss_bytes(s * b, padded_vocab_size(shape.vocab_size, t), t,
                              max_logits_mb if layout.pp == 1 else 0.0)
    kv_width = (shape.n_kv_head or shape.n_head) * shape.config().head_dim / t
    gathered_kv = 2 * shape.block_size * b * kv_width * act_bytes if layout.cp > 1 else 0.0  # one layer's
    activations += layers * gathered_kv
    # Step time.
    tokens = batch_size * layout.dp * shape.block_size
    compute = shape.flops_per_token() * tokens / (layout.world_size * tflops * 1e12)
    compute *= {"none": 1.0, "selective": 1.1, "full": 4 / 3}[checkpointing]
    if layout.pp > 1:
        compute /= 1 - (layout.pp - 1) / (m + layout.pp - 1)
    tp_comm = 0.0 if t == 1 else 8 * layers * s * b * h * act_bytes * (t - 1) / t * m / (bandwidth_gbs * 1e9)
    tp_comm += 2 * layers * gathered_kv * (layout.cp - 1) / layout.cp / (bandwidth_gbs * 1e9)
    tp_comm += expert_exchange_seconds(shape, layout, batch_size * s, act_bytes, checkpointing, bandwidth_gbs)
    dp_comm = data_parallel_seconds(shape, layout, local, param_bytes, bandwidth_gbs)
    # A block in flight holds its experts of this rank's ep group only.
    block_values = (shape.block_params() - shape.block_expert_params() * (layout.ep - 1) // layout.ep) / t
    shards = layout.dp_shard * layout.cp
    gathered = 2 * block_values * param_bytes_gathered(precision) + 2 * block_values * 4 if shards > 1 else 0.0
    return Estimate(layout, checkpointing, params, params, 2 * params, activations / gb,
                    max(compute, dp_comm) + tp_comm, gathered / gb)


def data_parallel_seconds(shape: ModelShape, layout: Layout, local: int, param_bytes: int,
                          bandwidth_gbs: float) -> float:
    """Data-parallel traffic of one step on one device (3 x parameter bytes for FSDP, 2 x for
    replication, x (n-1)/n), over the `local` parameter values this device holds; under expert
    parallelism the experts' share runs over their efsdp group, on the experts that group holds."""
    dp, shards = layout.reducing, layout.dp_shard * layout.cp
    if dp == 1:
        return 0.0
    dp_factor = 3 if shards > 1 else 2
    if layout.ep == 1:
        replica_bytes = local * shards * param_bytes  # one data-parallel replica's parameters
        return dp_factor * replica_bytes * (dp - 1) / dp / (bandwidth_gbs * 1e9)
    efsdp = shards // layout.ep
    shapes = shape.parameter_shapes(layout.tp)
    split_dims = spec_of(shape.arch).tp_split_dims
    experts = sum(local_numel(name, full, layout.tp, shards, layout.ep, split_dims) for name, full in shapes.items()
                  if EXPERTS in name)
    dense_bytes = (local - experts) * shards * param_bytes
    expert_bytes = experts * efsdp * param_bytes  # the experts of this rank's ep group
    traffic = dense_bytes * (dp - 1) / dp + expert_bytes * (efsdp - 1) / efsdp
    return dp_factor * traffic / (bandwidth_gbs * 1e9)


def expert_exchange_seconds(shape: ModelShape, layout: Layout, tokens: int, act_bytes: int, checkpointing: str,
                            bandwidth_gbs: float) -> float:
    """Expert parallelism's all-to-all time of one step on one device routing `tokens` tokens
    (module docstring): not overlapped, so it adds to the step."""
    if layout.ep == 1:
        return 0.0
    exchanges = 4 if checkpointing == "none" else 6
    copies = tokens * dict(shape.extra).get("experts_per_token", 1)
    sent = exchanges * shape.routed_layers() * copies * shape.n_embd * act_bytes * (layout.ep - 1) / layout.ep
    return sent / (bandwidth_gbs * 1e9)


def layer_widths(shape: ModelShape) -> int:
    """Values per token one block keeps for backward (module docstring)."""
    config = shape.config()
    widths = spec_of(config.arch).layer_widths
    return 17 * shape.n_embd if widths is None else widths(config)


def param_bytes_gathered(precision: str) -> int:
    """Bytes per value FSDP all-gathers parameters in: the compute dtype under mixed precision."""
    return 4 if precision == "fp32" else 2


def candidate_layouts(world: int, shape: ModelShape, cps: list[int] | None = None) -> list[Layout]:
    """Every layout of `world` devices this shape can run in; `cps`: the context-parallel degrees
    to consider (default: every one the sequence allows)."""
    layouts = []
    experts = shape.config() if shape.num_experts else None  # a mixture of experts composes with fewer
    for cp in cps or range(1, world + 1):
        if world % cp or not context_parallel_fits(shape, cp):
            continue
        for pp in range(1, world // cp + 1) if cp == 1 else (1,):
            for tp in range(1, world // (pp * cp) + 1):
                for dp_shard in range(1, world // (pp * tp * cp) + 1):
                    rest = world // (pp * tp * cp * dp_shard)
                    if pp * tp * cp * dp_shard * rest != world:
                        continue
                    if shape.n_head % tp or (shape.n_kv_head or shape.n_head) % tp or pp > shape.n_layer \
                            or (shape.block_size // cp) % tp:
                        continue
                    layout = Layout(pp=pp, dp_replicate=rest, dp_shard=dp_shard, tp=tp, cp=cp)
                    if experts is None:
                        layouts.append(layout)
                    elif experts_compose(experts, layout) and tp == 1:
                        # (tensor parallelism runs; not searched: the estimates split every block's
                        # activations and compute by tp, and a routed MLP runs whole on every rank)
                        layouts += [layout, *expert_parallel_layouts(layout, shape)]
    return layouts


def experts_compose(model_config: GPTConfig, layout: Layout) -> bool:
    """Whether a mixture of experts runs in this layout (triax.parallel.experts.check_layout)."""
    try:
        check_expert_layout(model_config, layout)
    except ConfigError:
        return False
    return True


def expert_parallel_layouts(layout: Layout, shape: ModelShape) -> list[Layout]:
    """`layout` with each expert-parallel degree above 1 the model's experts and the layout allow."""
    found = []
    for ep in range(2, min(layout.dp_shard, shape.num_experts) + 1):
        candidate = replace(layout, ep=ep)
        try:
            check_expert_parallel(candidate, shape.num_experts, shape.arch)
        except ConfigError:
            continue
        found.append(candidate)
    return found


def context_parallel_fits(shape: ModelShape, cp: int) -> bool:
    """Whether the sequence cuts into 2 x cp chunks (triax.parallel.mesh.check_context_parallel)."""
    try:
        check_context_parallel(Layout(cp=cp), shape.block_size)
    except ConfigError:
        return False
    return True


def plan(shape: ModelShape, world: int, memory_gb: float, global_batch: int, cps: list[int] | None = None,
         **kwargs: Any) -> list[Estimate]:
    """The layouts that fit in `memory_gb` per device (each with the least checkpointing that
    makes it fit), fastest first, for `global_batch` sequences per step whatever the layout."""
    # The logits' limit a GPU run leaves unset: a quarter of the device's memory.
    kwargs.setdefault("max_logits_mb", gpu_logits_limit_mb(memory_gb * 2**30))
    fitting = []
    for layout in candidate_layouts(world, shape, cps):
        if global_batch % layout.dp:
            continue
        batch_size = global_batch // layout.dp
        schedule = kwargs.get("pp_schedule", "1f1b")
        if layout.pp > 1 and schedule in MULTI_STAGE_SCHEDULES and 2 * layout.pp > shape.n_layer:
            continue
        micro = kwargs.get("microbatches", 0) or 2 * layout.pp
        if layout.pp > 1 and batch_size % micro:
            continue
        for checkpointing in ("none", "selective", "full"):
            result = estimate(shape, layout, batch_size=batch_size, checkpointing=checkpointing, **kwargs)
            if result.total_gb <= memory_gb:
                fitting.append(result)
                break
    return sorted(fitting, key=lambda e: (e.step_s, e.total_gb))


def check_memory(shape: ModelShape, layout: Layout, memory_gb: float, where: str, *, batch_size: int,
                 **kwargs: Any) -> None:
    """Refuse, before anything is allocated, a run whose per-device estimate (`estimate`, the
    formulas above, without the runtime) exceeds `memory_gb`, the memory `where`
    describes. One line naming the keys that decide the larger part."""
    result = estimate(shape, layout, batch_size=batch_size, **kwargs)
    if result.total_gb <= memory_gb:
        return
    states = result.params_gb + result.grads_gb + result.optimizer_gb + result.gathered_gb
    if result.activations_gb >= states:
        cause = (f"data.block_size={shape.block_size} with trainer.batch_size={batch_size} needs "
                 f"{result.activations_gb:.1f} GiB of activations")
        advice = ("lower data.block_size or trainer.batch_size, set parallel.activation_checkpointing=full, "
                  "or cut each sequence over more processes (parallel.cp)")
    else:
        cause = (f"the model ({shape.num_params() / 1e6:,.0f}M parameters: model.n_layer={shape.n_layer}, "
                 f"model.n_embd={shape.n_embd}) needs {states:.1f} GiB for its weights, gradients and AdamW state")
        advice = "use a smaller model, or shard it over more processes (parallel.dp_shard)"
    raise ConfigError(f"{cause} per process, {result.total_gb:.1f} GiB in all (triax plan's estimate), but {where} "
                      f"has {memory_gb:.1f} GiB; {advice}")
