"""`triax export RUN_DIR OUT_DIR --format hf`: a directory Hugging Face transformers loads with
`AutoModelForCausalLM.from_pretrained(OUT_DIR)`, computing the same logits as the run's model: the
config and tensors are the family's adapter's (triax/models/<family>/hf.py: GPT2LMHeadModel for GPT-2,
LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM / Qwen3ForCausalLM for the llama family, the
same tensors renamed, Mixtral and Qwen3-MoE); this module writes the files.

For GPT-2 the mapping is exact because triax's GPT is GPT-2's architecture: pre-LayerNorm blocks (eps 1e-5),
GELU with the tanh approximation (transformers' "gelu_new"), attention scaled by 1/sqrt(head size),
learned position embeddings. What differs is layout only:
- q/k/v are three Linears in triax (so tensor parallelism can split heads); GPT-2 has one fused
  c_attn. Its weight is their concatenation.
- GPT-2's projections are Conv1D modules storing weight as (in, out): the transpose of a Linear's.
- bias=false has no GPT-2 switch, but a zero bias is the same function, so zeros are written.

A run started from a transformers checkpoint (model.init_from) kept copies of the checkpoint's
config, generation config and tokenizer files (triax/train/init_from.py); they are written back
(`drop_in_files`), so the export replaces the checkpoint it was tuned from: the same token ids,
sliding window, positions, rotary settings and dtype, GenerationConfig and AutoTokenizer.

The converter reads a name -> tensor source (anything with `keys()` and `[name]`) and converts one
output tensor at a time, so it works the same over a dict in memory or a lazy snapshot reader.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch

from triax import safe_files
from triax.checkpoint.export import tensor_source
from triax.errors import ConfigError, TriaxError, UsageError, printable
from triax.interop.hf import directory as hf
from triax.models.config import GPTConfig, architecture_fields
from triax.models.family import spec_of

if TYPE_CHECKING:
    from triax.interop.export_types import ExportedRun, ExportOptions

# GPTConfig fields the transformers config can express (the rotary ones and gelu each family's
# GPTConfig checks hold at their defaults where they do not apply). A field added to GPTConfig later
# must be mapped here (or left at its default) before export accepts it, so nothing is silently dropped.
MAPPED_FIELDS = {"arch", "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_kv_head", "head_dim",
                 "intermediate_size", "dropout", "bias", "tie_embeddings", "gelu", "norm_eps", "rope_theta",
                 "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                 "rope_original_context", "qk_norm", "num_experts", "experts_per_token", "moe_intermediate_size",
                 "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
                 "router_z_loss_coef", "attention_sinks", "sliding_window", "layer_types", "swiglu_limit",
                 "swiglu_alpha", "rope_beta_fast", "rope_beta_slow", "rope_truncate", "rope_attention_factor"}


class ExportError(TriaxError, ValueError):
    """The run cannot be written in the requested format (an option without an equivalent, a bad target)."""


def check_mappable(config: GPTConfig) -> None:
    problem = getattr(spec_of(config.arch).hf, "export_problem", None)
    if problem is not None and problem(config) is not None:
        raise ExportError(problem(config))
    mapped = MAPPED_FIELDS | set(getattr(spec_of(config.arch).hf, "MAPPED_FIELDS", ()))  # a family's own
    for field in fields(config):
        if field.name not in mapped and getattr(config, field.name) != field.default:
            raise ExportError(f"model option {field.name}={getattr(config, field.name)!r} has no equivalent in "
                              f"transformers' {config.arch}; export this run with the plain safetensors format instead")


def hf_config(config: GPTConfig) -> dict:
    """config.json for the transformers class of the run's architecture."""
    return spec_of(config.arch).hf.hf_config(config)


def hf_tensors(config: GPTConfig, source: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, Callable[[], torch.Tensor], tuple]]:
    """(transformers name, a function that builds that tensor from `source`, its shape), in order.

    Each builder reads only the one to three source tensors it needs, when called."""
    return spec_of(config.arch).hf.hf_tensors(config, source)


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


def write_safetensors_streaming(path: str, entries: list, dtype: torch.dtype) -> int:
    """Write a .safetensors file one tensor at a time: the header (names, shapes, offsets) is known
    from the shapes alone, so no more than one tensor is ever held. Returns the number of values."""
    if dtype not in _SAFETENSORS_DTYPES:
        raise ExportError(f"weights of dtype {dtype} cannot be exported; expected one of {list(_SAFETENSORS_DTYPES)}")
    entries = list(entries)
    itemsize = torch.empty((), dtype=dtype).element_size()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, _, shape in entries:
        size = itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    values = 0
    with safe_files.create_new(path) as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for name, build, shape in entries:
            tensor = build().detach().to("cpu")
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ExportError(f"{name}: the snapshot gives shape {tuple(tensor.shape)} {tensor.dtype}, expected "
                                  f"{tuple(shape)} {dtype}; the snapshot does not match the run's model.json")
            # Little-endian raw bytes in C order, as the format specifies (uint8 view avoids numpy's bf16 gap).
            handle.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            values += tensor.numel()
    return values


TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def drop_in_files(config: GPTConfig, ours: dict, kept_dir: str) -> tuple[dict, dict[str, bytes]]:
    """(config.json, {name: contents} of the other files) for an export that replaces the
    transformers checkpoint the run started from, whose files the run kept in `kept_dir`.

    The checkpoint's own config.json is written back when it describes the run's model (every
    field triax takes from it unchanged): so every field triax does not compute survives as it
    was (token ids, sliding_window with its layer settings, the checkpoint's max_position_embeddings
    above a context capped at the window, rope_scaling/rope_theta in the form it was written, the
    torch_dtype it loads in, initializer_range...). Only what the run itself changed is triax's:
    tie_word_embeddings (tensor and pipeline parallelism untie the head) and the class (a checkpoint
    saved without its head comes back with one). A kept config that does not describe the model
    (model.json edited since) gives way to triax's own, keeping only the token ids."""
    kept = hf.description_files(kept_dir, follow_links=False)  # files the run wrote: a planted link is refused
    files = {name: safe_files.read_bytes(path, hf.MAX_DESCRIPTION_BYTES) for name, path in kept.items()
             if name != "config.json"}
    if "config.json" not in kept:
        return ours, files
    source = hf.read_hf_config(kept_dir, follow_links=False)
    try:
        fixed = dict(hf.architecture(kept_dir), tie_embeddings=config.tie_embeddings)
    except ConfigError:  # CheckpointError: not a model triax builds any more
        fixed = None
    if fixed != architecture_fields(config):
        return dict(ours, **{key: source[key] for key in TOKEN_IDS if key in source}), files
    merged = dict(source, tie_word_embeddings=ours["tie_word_embeddings"], architectures=ours["architectures"])
    merged.pop("quantization_config", None)  # the weights written are the dequantized ones
    if "torch_dtype" not in source and "dtype" not in source:
        merged["torch_dtype"] = ours["torch_dtype"]
    # The weights are written as the snapshot holds them (fp32 for a run trained in mixed precision):
    # the checkpoint's torch_dtype stays, so `from_pretrained(..., dtype="auto")` loads the export in
    # the dtype the checkpoint loaded in, at no loss.
    return merged, files


def export_hf(config: GPTConfig, source: Mapping[str, torch.Tensor], out_dir: str, tokenizer_file: str | None = None,
              kept_dir: str | None = None) -> int:
    """Write config.json, model.safetensors and (if given) the tokenizer into `out_dir`; with
    `kept_dir` (a fine-tuned transformers checkpoint's kept files) as a drop-in replacement of it."""
    check_mappable(config)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ExportError(f"{out_dir!r} already exists and is not an empty directory; choose a new OUT_DIR")
    entries = list(hf_tensors(config, source))
    dtype = source["tok_emb.weight"].dtype
    hf_values = hf_config(config)
    hf_values["torch_dtype"] = {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype, "float32")
    files = {}
    if kept_dir is not None:
        hf_values, files = drop_in_files(config, hf_values, kept_dir)
    files["config.json"] = json.dumps(hf_values, indent=1).encode()
    if tokenizer_file is not None:
        # The tokenizer the run encoded its text with (the checkpoint's own, when it had one).
        files["tokenizer.json"] = safe_files.read_bytes(tokenizer_file)
        # PreTrainedTokenizerFast reads tokenizer.json as it is: AutoTokenizer.from_pretrained(OUT_DIR) works.
        files.setdefault("tokenizer_config.json", json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.block_size}, indent=1).encode())
    created = not os.path.lexists(out_dir)
    safe_files.make_directory(out_dir)
    temporary = os.path.join(out_dir, "model.safetensors.tmp")
    try:
        values = write_safetensors_streaming(temporary, entries, dtype)
        os.replace(temporary, os.path.join(out_dir, "model.safetensors"))
        for name, data in files.items():
            safe_files.write_atomic(os.path.join(out_dir, name), data)
    except BaseException:
        # A failed export leaves nothing behind, so the retry is not refused as "not empty".
        for name in ("model.safetensors.tmp", "model.safetensors", *files):
            safe_files.remove_file(os.path.join(out_dir, name))
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return values


def write_hf(run: ExportedRun, out_dir: str, options: ExportOptions) -> None:
    """`triax export RUN OUT_DIR --format hf` (triax/interop/exporters.py): the run's newest good
    snapshot as a transformers directory, with the run's tokenizer and the kept files of the
    checkpoint it was started from."""
    run.check_not_in_run(out_dir, "OUT_DIR")
    tokenizer = os.path.join(run.run_dir, "tokenizer.json")
    tokenizer = tokenizer if safe_files.is_regular(tokenizer) else None
    # A run started from a transformers checkpoint kept its config and tokenizer files there.
    kept = run.kept_dir
    if os.path.lexists(kept) and not safe_files.is_directory(kept):
        # Left out silently, the export would lack the checkpoint's generation config and token ids.
        raise UsageError(f"{kept} is a link or not a directory; it should hold the copies triax made of the files "
                         "of the run's model.init_from checkpoint: remove it and start the run again (triax train "
                         "keeps them anew), or export with the plain safetensors format")
    kept = kept if safe_files.is_directory(kept) else None

    def export(reader: Any, model_config: GPTConfig, vocab: object) -> tuple:
        true_config, shapes = run.true_shapes(model_config, vocab)
        # The converter reads one tensor at a time from the validated snapshot (padding rows cut).
        source = tensor_source(reader, shapes)
        return reader.snapshot, (export_hf(GPTConfig(**true_config), source, out_dir, tokenizer, kept),
                                 model_config.arch)

    snapshot, (values, arch) = run.with_fallback(export)
    note = " with its tokenizer" if tokenizer else (" (character vocabulary: no Hugging Face tokenizer written)"
                                                    if os.path.exists(os.path.join(run.run_dir, "vocab.json")) else "")
    if kept is not None:
        note += ", and the config, generation and tokenizer files of the checkpoint it was started from"
    print(printable(f"wrote a transformers {arch} model ({values / 1e6:.2f}M values) from {snapshot} to "
                    f"{out_dir}{note}"))
