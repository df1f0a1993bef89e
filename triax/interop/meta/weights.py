"""Llama weights in Meta's layout, for triax's Llama: what Meta's `consolidated.00.pth` and
torchtitan's DCP checkpoints hold (triax/interop/meta/folder.py and torchtitan.py read the
files; this is what they share): Meta's tensor names, its `params.json`, and the rotary row order.

Names: `tok_embeddings`, `layers.N.attention.wq/wk/wv/wo`, `layers.N.feed_forward.w1/w2/w3` (w1 the
gate, w3 the up projection, w2 the down one), `layers.N.attention_norm`, `layers.N.ffn_norm`,
`norm`, `output`; every Linear stored (out, in), as triax's, without biases.

Rotary order: Meta's rotary embedding (complex multiplication) turns neighbouring values of a
head together, (x0, x1), (x2, x3)...; triax's, as transformers', turns value i of a head's first
half with value i of its second half. The same model in triax's order has the rows of wq and wk
permuted within each head: row j * (head_dim / 2) + i of a head is Meta's row 2i + j (j = 0, 1),
the permutation transformers' convert_llama_weights_to_hf.py applies. The permutation never
crosses a head, so any run of whole heads is permuted on its own: a rank reads the whole heads
its rows lie in, and nothing more.
"""

from __future__ import annotations

import torch

from triax.models import parameter_shapes
from triax.models.config import MAX_OPTIONAL_SIZES, MAX_SIZES, GPTConfig
from triax.interop.hf.files import CheckpointError, Source, check_source
from triax.interop.hf.safetensors_header import TORCH_DTYPE_NAMES, TensorEntry

# triax module name -> Meta's, inside a layer.
LAYER_NAMES = {"ln_1": "attention_norm", "ln_2": "ffn_norm", "attn.q_proj": "attention.wq",
               "attn.k_proj": "attention.wk", "attn.v_proj": "attention.wv", "attn.out_proj": "attention.wo",
               "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2", "mlp.up_proj": "feed_forward.w3"}
OUTSIDE_LAYERS = {"tok_emb.weight": "tok_embeddings.weight", "ln_f.weight": "norm.weight",
                  "lm_head.weight": "output.weight"}
ROTATED = ("attention.wq.weight", "attention.wk.weight")  # rows in Meta's rotary order
# Tensors a checkpoint may hold that are not weights: the rotary table Meta's Llama 2 saves
# (rope.freqs) and torchtitan's model keeps as a buffer (freqs_cis); triax computes its own.
NOT_WEIGHTS = ("rope.freqs", "freqs_cis")

# params.json keys and what each must be. Meta's reference ModelArgs (llama, llama-models) has
# these; max_batch_size only sizes its inference cache. A key not listed changes the model in a
# way triax does not build (mixture of experts, vision layers) and is refused, never ignored.
PARAMS = {"dim": int, "n_layers": int, "n_heads": int, "n_kv_heads": (int, type(None)), "vocab_size": int,
          "multiple_of": int, "ffn_dim_multiplier": (int, float, type(None)), "norm_eps": (int, float),
          "rope_theta": (int, float), "use_scaled_rope": bool, "rope_scaling_factor": (int, float, type(None)),
          "high_freq_factor": (int, float, type(None)), "max_seq_len": int, "max_batch_size": int}
REQUIRED_PARAMS = ("dim", "n_layers", "n_heads")
# Llama 3.1's rope scaling as Meta's apply_scaling hard-codes it (low and high frequency factors,
# the pre-training context); llama-models' later ModelArgs let params.json set the factor
# (rope_scaling_factor) and high_freq_factor. The factor is 8 for Llama 3.1 and 3.3 but 32 for
# Llama 3.2's 1B and 3B, whose params.json do not say so: without rope_scaling_factor it is the
# run's model.rope_factor (triax's default, 8, is Llama 3.1's).
META_ROPE_SCALING = {"rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0, "rope_original_context": 8192}
MAX_FFN_MULTIPLIER = 64.0  # Meta's are 1.3 to 1.5; a larger one is a damaged file (and would overflow)


def meta_name(name: str) -> str:
    """Meta's name of triax Llama parameter `name`."""
    if name in OUTSIDE_LAYERS:
        return OUTSIDE_LAYERS[name]
    parts = name.split(".")
    module, kind = ".".join(parts[2:-1]), parts[-1]
    if parts[0] != "layers" or module not in LAYER_NAMES:
        raise CheckpointError(f"triax parameter {name!r} has no equivalent in Meta's Llama layout")
    return f"layers.{parts[1]}.{LAYER_NAMES[module]}.{kind}"


def mlp_width(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """The SwiGLU hidden width Meta's FeedForward computes from params.json: 2/3 of 4 x dim, times
    ffn_dim_multiplier when given, rounded up to a multiple of multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def architecture_from_params(params: object, where: str, vocab_rows: int | None, rope_factor: float = 8.0) -> dict:
    """triax's GPTConfig fields for the model params.json describes; `vocab_rows` (the stored
    embedding's rows) stands for a vocab_size of -1 (Llama 2's: the tokenizer decided it);
    `rope_factor` (the run's) for a use_scaled_rope without rope_scaling_factor."""
    if not isinstance(params, dict):
        raise CheckpointError(f"{where} holds a JSON {type(params).__name__}, not an object; not Meta's params.json")
    for key, value in params.items():
        if key not in PARAMS:
            raise CheckpointError(f"{where}: {key}={value!r:.60} is a setting triax's Llama does not implement "
                                  f"(it reads {', '.join(PARAMS)}); convert the model some other way")
        kind = PARAMS[key]
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise CheckpointError(f"{where}: {key}={value!r:.60} is not the {getattr(kind, '__name__', 'number')} "
                                  "Meta's params.json holds")
    missing = [key for key in REQUIRED_PARAMS if key not in params]
    if missing:
        raise CheckpointError(f"{where} lacks {', '.join(missing)}; not Meta's params.json")
    dim, heads = params["dim"], params["n_heads"]
    # Bounded before any arithmetic on them (a width of 10**30 would make the MLP's width huge
    # before GPTConfig's own bounds could say which key is wrong).
    for key, limit in (("dim", MAX_SIZES["n_embd"]), ("n_layers", MAX_SIZES["n_layer"]),
                       ("n_heads", MAX_SIZES["n_head"]), ("multiple_of", MAX_OPTIONAL_SIZES["intermediate_size"])):
        if key in params and not 0 < params[key] <= limit:
            raise CheckpointError(f"{where}: {key}={params[key]} is outside 1..{limit}; the file is damaged")
    multiplier = params.get("ffn_dim_multiplier")
    if multiplier is not None and not 0 < multiplier <= MAX_FFN_MULTIPLIER:
        raise CheckpointError(f"{where}: ffn_dim_multiplier={multiplier} is outside (0, {MAX_FFN_MULTIPLIER}]; "
                              "the file is damaged")
    vocab = params.get("vocab_size", -1)
    if vocab <= 0:
        if vocab_rows is None:
            raise CheckpointError(f"{where}: vocab_size={vocab} and no embedding to take it from")
        vocab = vocab_rows
    if dim % heads:
        raise CheckpointError(f"{where}: dim={dim} is not divisible by n_heads={heads}")
    fields = {"arch": "llama", "vocab_size": vocab, "n_layer": params["n_layers"], "n_head": heads, "n_embd": dim,
              "n_kv_head": params.get("n_kv_heads") or heads, "head_dim": dim // heads,
              "intermediate_size": mlp_width(dim, params.get("multiple_of", 256), multiplier),
              "norm_eps": float(params.get("norm_eps", 1e-5)), "rope_theta": float(params.get("rope_theta", 10000.0)),
              "bias": False, "gelu": "tanh", "rope_scaling": "none"}
    if params.get("use_scaled_rope", False):
        fields.update(rope_scaling="llama3", rope_factor=float(params.get("rope_scaling_factor") or rope_factor),
                      **META_ROPE_SCALING)
        if params.get("high_freq_factor") is not None:
            fields["rope_high_freq_factor"] = float(params["high_freq_factor"])
    # The context a model was trained with is not in params.json (but for max_seq_len, which few
    # write); rotary positions have no table to run out of, so none but triax's own bound is set.
    fields["block_size"] = params.get("max_seq_len", MAX_SIZES["block_size"])
    return fields


def to_rotate_half(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Whole heads of wq or wk rows in Meta's rotary order -> triax's (see the module's docstring)."""
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, head_dim // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def to_meta_order(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of to_rotate_half: whole heads in triax's (transformers') order -> Meta's."""
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, 2, head_dim // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


class MetaWeights:
    """Tensors stored in Meta's layout, served to copy_into (`has`, `entry`, `shape`, `slice`) by
    triax's names and in triax's rotary order. `stored` reads them: `entries()` gives {Meta name:
    (dtype, shape)}, `read(name, box)` the values of a box, a tuple of (start, stop) per dimension."""

    def __init__(self, stored: object, head_dim: int):
        self.stored = stored
        self.head_dim = head_dim
        self.entries = stored.entries()

    def source_of(self, name: str) -> Source:
        stored = meta_name(name)
        if name == "lm_head.weight" and stored not in self.entries:
            return Source("tok_embeddings.weight")  # tied: stored once, as the embedding
        return Source(stored)

    def has(self, name: str) -> bool:
        return name in self.entries

    def entry(self, name: str) -> TensorEntry:
        dtype, shape = self.entries[name]
        dtype = str(dtype).removeprefix("torch.")
        return TensorEntry(TORCH_DTYPE_NAMES.get(dtype, dtype), tuple(shape))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name][1])

    def slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        box = [(part.start or 0, part.stop if part.stop is not None else size)
               for part, size in zip(index, self.shape(name))]
        if not name.endswith(ROTATED):
            return self.stored.read(name, tuple(box))
        # The whole heads the rows lie in, permuted, then the rows asked for.
        (first, last), rest = box[0], box[1:]
        start, stop = first // self.head_dim * self.head_dim, -(-last // self.head_dim) * self.head_dim
        heads = to_rotate_half(self.stored.read(name, ((start, stop), *rest)), self.head_dim)
        return heads[first - start:last - start]



def check_weights(weights: MetaWeights, config: GPTConfig, folder: str, described_by: str) -> None:
    """Every tensor of a model of `config` is stored, with its shape and a floating dtype, and
    nothing else is (a layer more than params.json says is a damaged or mismatched folder, not
    weights to drop): from the shapes alone, before the model is allocated."""
    used = set()
    for name, shape in parameter_shapes(config).items():
        source = weights.source_of(name).name
        check_source(weights, source, name, shape, False, 0, False, config.vocab_size, described_by)
        used.add(source)
    extra = sorted(set(weights.entries) - used)
    if extra:
        raise CheckpointError(f"{folder} holds {extra[0]}" + (f" and {len(extra) - 1} more tensors" if len(extra) > 1
                              else "") + " that a Llama of its shapes does not have; the weights do not belong to it")
