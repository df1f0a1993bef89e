"""The layout of a job (how many ways each kind of parallelism cuts it) and its DeviceMesh.

Every check here is arithmetic on the configuration alone, so it runs on every rank *before* the
process group exists: a bad layout is the same one-line error on each rank, never a hang in a
collective that some ranks reached and others did not.

Rank order on the mesh is (pp, dp_replicate, dp_shard, cp, tp) with tp innermost: tensor-parallel
peers exchange activations every layer, so they get neighbouring ranks (the same node, NVLink);
context-parallel peers exchange keys and values every layer, so they come next; pipeline stages
exchange one activation per micro-batch, so they may sit furthest apart.

Expert parallelism (ep) is a degree of the layout but not a dimension of the mesh: it borrows its
ranks from the fully-sharded ones (dp_shard = efsdp x ep, torchtitan's way), so it does not change
the world size; triax.parallel.expert_parallel builds its own (efsdp, ep) mesh over them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from triax.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
# Schedules that put several (virtual) stages on each rank.
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")
STAGES_PER_RANK_INTERLEAVED = 2
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1  # context parallelism: each sequence cut over cp ranks (triax.parallel.context_parallel)
    ep: int = 1  # expert parallelism: each layer's experts split over ep of the dp_shard ranks (module docstring)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def reducing(self) -> int:
        """Ranks whose gradients are averaged (data and context parallel): each computed them
        on a different part of the step's tokens."""
        return self.dp * self.cp

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension (row-major, tp innermost, cp next)."""
        coords = {}
        for name, size in reversed(list(zip(MESH_DIMS, self.shape))):
            coords[name] = rank % size
            rank //= size
        return coords

    def dp_rank(self, rank: int) -> int:
        """Which slice of the global batch this rank reads (tp and pp peers read the same one)."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def degrees(self) -> dict[str, int]:
        """Every degree by name, in mesh order, ep beside the dp_shard ranks it borrows."""
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "ep": self.ep,
                "cp": self.cp, "tp": self.tp}

    def describe(self) -> str:
        parts = [f"{name}={size}" for name, size in self.degrees().items() if size > 1]
        return ", ".join(parts) or "single process"


def resolve_layout(dp_replicate: int, dp_shard: int, tp: int, pp: int, world_size: int, cp: int = 1,
                   ep: int = 1) -> Layout:
    """Fill in the one degree given as -1, check that the degrees multiply to the world size and
    that ep fits the fully-sharded ranks it borrows."""
    if type(ep) is not int or ep < 1:  # not a factor of the world: no -1 for "the rest"
        raise ConfigError(f"parallel.ep={ep!r} must be a positive integer (1: no expert parallelism)")
    given = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "pp": pp, "cp": cp}
    for name, value in given.items():
        if value == 0 or value < -1:
            raise ConfigError(f"parallel.{name}={value} is invalid; use a positive degree or -1 for "
                              "'the remaining processes'")
    unknown = [name for name, value in given.items() if value == -1]
    # -1 ("the remaining processes") is dp_replicate's default: the messages name what it means,
    # never a `dp_replicate=-1` the user may not have written.
    if len(unknown) > 1:
        raise ConfigError(f"only one parallel degree may take the remaining processes (-1; dp_replicate's default), "
                          f"but {' and '.join(f'parallel.{n}' for n in unknown)} both do; give all but one a number "
                          f"(e.g. parallel.{unknown[0]}=1)")
    known = math.prod(value for value in given.values() if value != -1)
    if unknown:
        if world_size % known != 0:
            named = _degrees({name: value for name, value in given.items() if value != -1})
            raise ConfigError(f"the world size {world_size} is not divisible by {known} ({named}), so "
                              f"parallel.{unknown[0]} cannot take the remaining processes; change the degrees or "
                              "the number of processes")
        given[unknown[0]] = world_size // known
    layout = Layout(pp=given["pp"], dp_replicate=given["dp_replicate"], dp_shard=given["dp_shard"], tp=given["tp"],
                    cp=given["cp"], ep=ep)
    if layout.world_size != world_size:
        raise ConfigError(f"parallel degrees {_degrees(given)} multiply to {layout.world_size} but the job has "
                          f"{world_size} process(es); make the product equal the world size (or set one degree to -1)")
    check_expert_degree(layout)
    return layout


def check_expert_degree(layout: Layout) -> None:
    """What ep > 1 needs of the other degrees: its ranks are dp_shard's, and it composes with
    nothing else yet (triax.parallel.expert_parallel builds its mesh over the dp_shard ranks alone)."""
    if layout.ep == 1:
        return
    if layout.dp_shard % layout.ep:
        raise ConfigError(f"parallel.ep={layout.ep} does not divide parallel.dp_shard={layout.dp_shard}; expert "
                          "parallelism borrows its ranks from the fully-sharded ones: make dp_shard a multiple of ep")
    if layout.tp > 1 or layout.pp > 1 or layout.cp > 1 or layout.dp_replicate > 1:
        raise ConfigError(f"parallel.ep={layout.ep} composes with parallel.dp_shard only (got {layout.describe()}); "
                          "set tp, pp, cp and dp_replicate to 1")


def _degrees(given: dict) -> str:
    # cp, the newest degree, only where it is used: a message names what the user set.
    return " x ".join(f"{name}={value}" for name, value in given.items() if name != "cp" or value != 1)


def pipeline_microbatches(requested: int, pp: int) -> int:
    return requested if requested > 0 else 2 * pp


def validate_layout(layout: Layout, *, n_layer: int, n_head: int, block_size: int, batch_size: int,
                    grad_accum: int = 1, pp_schedule: str = "1f1b", pp_microbatches: int = 0,
                    pp_balance: list[int] | None = None, activation_checkpointing: str = "none",
                    tie_embeddings: bool = False, cpu_offload: bool = False, n_kv_head: int | None = None,
                    num_experts: int = 0, arch: str = "gpt2") -> None:
    """Every check a layout must pass for a model of this shape; raises ConfigError naming the key.
    `n_kv_head`: key/value heads of grouped-query attention (None: one per query head);
    `num_experts`: routed experts per layer (0: a dense model), `arch` the architecture's name."""
    check_cpu_offload(layout, cpu_offload)
    check_expert_parallel(layout, num_experts, arch)
    check_context_parallel(layout, block_size)
    if activation_checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ConfigError(f"parallel.activation_checkpointing={activation_checkpointing!r} is unknown; "
                          f"choose one of {', '.join(ACTIVATION_CHECKPOINTING)}")
    if layout.tp > 1:
        _check_tensor_parallel(layout, n_head, n_kv_head, block_size, tie_embeddings)
    if pp_schedule not in PP_SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule={pp_schedule!r} is unknown; choose one of {', '.join(PP_SCHEDULES)}")
    if layout.pp == 1:
        return
    if tie_embeddings:
        raise ConfigError("model.tie_embeddings=true is not supported with parallel.pp > 1 (the embedding and "
                          "the head live on different stages); set model.tie_embeddings=false")
    stages = num_stages(layout.pp, pp_schedule)
    if stages > n_layer:
        what = (f"parallel.pp={layout.pp}" if stages == layout.pp else
                f"parallel.pp={layout.pp} x {STAGES_PER_RANK_INTERLEAVED} stages per rank ({pp_schedule})")
        raise ConfigError(f"{what} needs {stages} pipeline stages but the model has only {n_layer} layers "
                          f"(model.n_layer); lower parallel.pp or use a deeper model")
    if pp_balance:
        if len(pp_balance) != stages or sum(pp_balance) != n_layer or min(pp_balance) < 1:
            raise ConfigError(f"parallel.pp_balance={list(pp_balance)} must give {stages} positive layer counts that "
                              f"sum to model.n_layer={n_layer}")
    if grad_accum != 1:
        raise ConfigError(f"trainer.grad_accum={grad_accum} is not used with parallel.pp > 1; the pipeline's "
                          "micro-batches are the accumulation: set grad_accum=1 and raise parallel.pp_microbatches")
    _check_microbatches(layout, batch_size, pp_schedule, pp_microbatches)


def _check_tensor_parallel(layout: Layout, n_head: int, n_kv_head: int | None, block_size: int,
                           tie_embeddings: bool) -> None:
    """What tp > 1 needs of the model: heads and the sequence divided by tp, embeddings untied."""
    if n_head % layout.tp != 0:
        raise ConfigError(f"parallel.tp={layout.tp} does not divide model.n_head={n_head}; tensor parallelism "
                          "splits attention by heads, so choose tp among the divisors of n_head")
    if n_kv_head is not None and n_kv_head % layout.tp != 0:
        raise ConfigError(f"parallel.tp={layout.tp} does not divide model.n_kv_head={n_kv_head}; tensor "
                          "parallelism gives each rank whole key/value heads with their query heads, so choose "
                          "tp among the divisors of n_kv_head")
    if block_size % layout.tp != 0:
        raise ConfigError(f"parallel.tp={layout.tp} does not divide the sequence length {block_size} "
                          "(data.block_size); sequence parallelism splits it, so make it a multiple of tp")
    if tie_embeddings:
        raise ConfigError("model.tie_embeddings=true is not supported with parallel.tp > 1; "
                          "set model.tie_embeddings=false")


def _check_microbatches(layout: Layout, batch_size: int, pp_schedule: str, pp_microbatches: int) -> None:
    """What pp > 1 needs of the pipeline's micro-batches: a count that divides the batch and suits the schedule."""
    micro = pipeline_microbatches(pp_microbatches, layout.pp)
    if pp_microbatches < 0:
        raise ConfigError(f"parallel.pp_microbatches={pp_microbatches} must be >= 0 (0 means 2 x pp)")
    # A count the user never set is named as what it follows, so the message points at keys they did set.
    given = (f"parallel.pp_microbatches={micro}" if pp_microbatches else
             f"{micro} pipeline micro-batches (parallel.pp_microbatches unset: 2 x parallel.pp={layout.pp})")
    if batch_size % micro != 0:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0 and d >= min(layout.pp, batch_size)]
        choice = (f"parallel.pp_microbatches={divisors[0]}" if len(divisors) == 1 else
                  f"parallel.pp_microbatches to one of {', '.join(map(str, divisors[:6]))}")
        raise ConfigError(f"{given} {'does' if pp_microbatches else 'do'} not divide trainer.batch_size={batch_size} (samples per data-parallel "
                          f"rank); set {choice} or make trainer.batch_size a multiple of {micro}")
    if pp_schedule == "1f1b" and micro < layout.pp:
        raise ConfigError(f"parallel.pp_schedule=1f1b needs at least pp={layout.pp} micro-batches, got "
                          f"{given}; raise it (and keep it dividing trainer.batch_size)")
    if pp_schedule in MULTI_STAGE_SCHEDULES:
        rounds = max(1, micro // layout.pp)
        if micro % rounds != 0 or micro < layout.pp:
            raise ConfigError(f"parallel.pp_schedule={pp_schedule} needs a multiple of pp={layout.pp} micro-batches, "
                              f"got {given}; use e.g. {2 * layout.pp}")


def check_expert_parallel(layout: Layout, num_experts: int, arch: str) -> None:
    """What ep > 1 needs: the other degrees' part (check_expert_degree), and a model whose experts
    split evenly over the ep ranks."""
    check_expert_degree(layout)
    if layout.ep == 1:
        return
    if not num_experts:
        raise ConfigError(f"parallel.ep={layout.ep} with model.arch={arch}, which has no experts; set parallel.ep=1 "
                          "or use a mixture-of-experts architecture (docs/moe.md)")
    if num_experts % layout.ep:
        raise ConfigError(f"parallel.ep={layout.ep} does not divide model.num_experts={num_experts}; each rank holds "
                          "an equal share of the experts: choose ep among its divisors")


def check_cpu_offload(layout: Layout, cpu_offload: bool) -> None:
    """CPU offload is FSDP's (parameters, gradients and optimizer state of the shards in host
    memory): it needs a layout that shards parameters, and is not built for the experts' own units."""
    if cpu_offload and layout.dp_shard == 1:
        raise ConfigError(f"parallel.cpu_offload=true needs FSDP sharding, but parallel.dp_shard=1 (layout: "
                          f"{layout.describe()}); set parallel.dp_shard > 1 (or -1 for all processes), "
                          "or parallel.cpu_offload=false")
    if cpu_offload and layout.ep > 1:
        raise ConfigError(f"parallel.ep={layout.ep} composes with parallel.dp_shard only, not with "
                          "parallel.cpu_offload=true; set parallel.cpu_offload=false or parallel.ep=1")


def check_context_parallel(layout: Layout, block_size: int, compile: bool = False,
                           length_key: str = "data.block_size", degree_key: str = "parallel.cp") -> None:
    """Context parallelism cuts each sequence into 2 x cp chunks (a rank holds one early and one
    late chunk, so the causal mask gives every rank the same work). `length_key`, `degree_key`:
    what the user set the sequence length and cp with (a config key, or a command's --option)."""
    if layout.cp == 1:
        return
    if block_size % (2 * layout.cp) != 0:
        given = [f"{key} {value}" if key.startswith("--") else f"{key}={value}"
                 for key, value in ((degree_key, layout.cp), (length_key, block_size))]
        raise ConfigError(f"{given[0]} needs the sequence length ({given[1]}) to be a multiple of 2 x cp = "
                          f"{2 * layout.cp}; change {length_key} or {degree_key}")
    if layout.pp > 1:
        raise ConfigError(f"parallel.cp={layout.cp} does not run with parallel.pp={layout.pp}: pipeline stages pass "
                          "hidden states without the sequence's positions; use parallel.pp=1 (or parallel.cp=1)")
    if compile:
        raise ConfigError(f"parallel.compile=true does not run with parallel.cp={layout.cp}: the key/value all-gather "
                          "inside attention breaks the compiled block; use parallel.compile=false")
    if layout.tp > 1 and (block_size // layout.cp) % layout.tp != 0:
        raise ConfigError(f"parallel.tp={layout.tp} does not divide each context-parallel rank's "
                          f"{block_size // layout.cp} tokens (data.block_size={block_size} / parallel.cp="
                          f"{layout.cp}); make data.block_size a multiple of cp x tp")


def num_stages(pp: int, pp_schedule: str) -> int:
    return pp * (STAGES_PER_RANK_INTERLEAVED if pp_schedule in MULTI_STAGE_SCHEDULES else 1)


# On a GPU the vocabulary's matmuls (the head, the embedding's gradient) reach the fast tensor-core
# kernels only with a row count that is a multiple of 64: GPT-2's 50257 rows ran on unaligned
# fallback kernels that took 46% of an H200 step (triax doctor --gpu-suite's profile). nanoGPT pads
# to 50304 for the same reason.
GPU_VOCAB_MULTIPLE = 64


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 1) -> int:
    """Round the vocabulary up to a multiple of tp x `multiple` (as Megatron does) so the embedding
    and head split evenly (and, on a GPU, align). The extra rows stay zero (their logits are masked),
    so the padding belongs to the layout, not to the trained model: a snapshot loads into any
    padding by its real rows."""
    step = tp * multiple
    return -(-vocab_size // step) * step


def build_mesh(layout: Layout, device_type: str):
    """The 5-D DeviceMesh (pp, dp_replicate, dp_shard, cp, tp); size-1 dimensions are kept so the
    same names exist in every layout. None for a single process."""
    if layout.world_size == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
