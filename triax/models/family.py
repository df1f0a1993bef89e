"""What a model family is, declared once: `FamilySpec`, and the table of the registered ones.

A family is one folder, triax/models/<name>/, exporting a `SPEC`, plus one line in
triax/models/registry.py, which registers it here. Everything outside the folder that depends on
a family (building its model, checking its config, tensor parallelism, `triax plan`, LoRA, the
Hugging Face and PEFT readers and writers) looks the family up in this table instead of naming it.

This module is a leaf: it imports no family and not triax.models.config (the config looks its
architecture's checks up here, and every family imports the config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

from triax.errors import ConfigError


@dataclass(frozen=True)
class FamilySpec:
    """One model family. `model.arch` names one of its `architectures` (transformers' model_type
    values, which `triax export --format hf` writes back)."""

    name: str
    """The family's folder under triax/models/."""

    architectures: tuple[str, ...]
    """The model.arch values this family builds."""

    model: Callable[..., Any]
    """The Decoder subclass: model(config, **parts) builds it (parts: a pipeline stage's layers, ...)."""

    check: Callable[[Any], None]
    """check(config): validates the family's model.* fields and fills their unset defaults (called by
    GPTConfig.__post_init__ after the fields every family shares are checked)."""

    presets: Mapping[str, dict] = field(default_factory=dict)
    """{preset name: GPTConfig fields} (`model=NAME`, `triax plan --model NAME`); "vocab_size" is only
    the vocabulary `triax plan` assumes."""

    hf: Any = None
    """The Hugging Face adapter (the family's hf.py): MODEL_TYPES, CONFIG_NAMES, architecture(config_dict)
    -> fields, sources(weights, model_config), hf_config(config), hf_tensors(config, source); optionally
    CLASSES (for messages), hf_name(name) (a parameter's transformers name, which PEFT's adapter
    names follow; the llama block's when absent), wrap_weights, sliding_window, export_problem, and
    TRAINER_TYPES with trainer_parameters and trainer_dropout (a transformers Trainer's checkpoint
    continued)."""

    tp_plan: Optional[Callable[[Any], dict]] = None
    """tp_plan(block) -> one block's parallelize_module plan (names relative to the block)."""

    tp_split_dims: Mapping[str, int] = field(default_factory=dict)
    """{parameter name ending: the dim tensor parallelism splits} (what `triax plan` counts per rank)."""

    lora_targets: Mapping[str, str] | Callable[[Any], Mapping[str, str]] = field(default_factory=dict)
    """model.lora.targets' short names (triax.models.lora_config.TARGETS) -> the linear layer inside a
    block ("q" -> "attn.q_proj"); or a function of the config giving them, where the layers a block
    has depend on the model's fields (lora_layers)."""

    peft_names: bool = False
    """Whether PEFT names this family's adapters (so `triax export --format peft` can write them)."""

    layer_widths: Optional[Callable[[Any], int]] = None
    """layer_widths(config) -> the values per token one block keeps for backward (`triax plan`'s
    activation memory); None: GPT-2's 17 x n_embd."""

    qkv_bias: Optional[Callable[[Any], bool]] = None
    """qkv_bias(config): biases on the query/key/value projections even without model.bias (Qwen2's)."""

    honours: frozenset[str] = frozenset()
    """The optional mechanisms' fields (triax.models.config.MECHANISMS: attention sinks, latent
    attention, ...) this family computes; set away from its default, any other is refused in one line
    before the family's check runs, instead of being silently ignored."""


def lora_layers(config: Any) -> Mapping[str, str]:
    """The LoRA targets a model of `config` has: short name -> its layer in a block."""
    targets = spec_of(config.arch).lora_targets
    return targets(config) if callable(targets) else targets


_SPECS: dict[str, FamilySpec] = {}  # model.arch -> its family
_FAMILIES: dict[str, FamilySpec] = {}  # family name -> spec
# Every registered family's presets, in registration order: the one preset table.
PRESETS: dict[str, dict] = {}
# The read-only views the rest of triax iterates (filled as the registry registers).
ARCHITECTURES: Mapping[str, FamilySpec] = MappingProxyType(_SPECS)
FAMILIES: Mapping[str, FamilySpec] = MappingProxyType(_FAMILIES)


def register(spec: FamilySpec) -> FamilySpec:
    """Adds `spec` to the table (registering one spec again changes nothing; another family
    claiming a taken name or architecture is an error)."""
    if _FAMILIES.get(spec.name, spec) is not spec:
        raise ValueError(f"model family {spec.name!r} is registered twice")
    if spec.name in _FAMILIES:
        return spec
    taken = [arch for arch in spec.architectures if arch in _SPECS]
    if taken:
        raise ValueError(f"model.arch={taken[0]!r} of family {spec.name!r} is already {_SPECS[taken[0]].name!r}'s")
    twice = [name for name in spec.presets if name in PRESETS]
    if twice:
        raise ValueError(f"model preset {twice[0]!r} of family {spec.name!r} is already taken")
    _FAMILIES[spec.name] = spec
    for arch in spec.architectures:
        _SPECS[arch] = spec
    PRESETS.update(spec.presets)
    return spec


def spec_of(arch: object) -> FamilySpec:
    """The family of model.arch=`arch`; one line naming the known ones if there is none."""
    if not isinstance(arch, str) or arch not in _SPECS:
        raise ConfigError(f"model.arch={arch!r} is unknown; choose one of {', '.join(_SPECS)}")
    return _SPECS[arch]
