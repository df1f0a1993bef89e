"""model.lora's settings and the names LoRA uses (PEFT's module names, the adapters' mark in a
parameter name): what the config and the readers of other tools' files need, without the adapters
themselves (triax.models.lora, which imports torch.distributed's tensors)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Mapping, Optional

from triax.errors import ConfigError
from triax.models.family import lora_layers

# model.lora.targets -> the linear layer inside a block (PEFT's module names are accepted too). Each
# family says which of them its blocks have, and where (FamilySpec.lora_targets); the latent
# projections are latent attention's (DeepSeek-V3: the query latent's down and up projections, the
# key/value latent's).
TARGETS = {"q": "attn.q_proj", "q_a": "attn.q_a_proj", "q_b": "attn.q_b_proj", "k": "attn.k_proj",
           "v": "attn.v_proj", "kv_a": "attn.kv_a_proj_with_mqa", "kv_b": "attn.kv_b_proj", "o": "attn.out_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
PEFT_NAMES = {"q_proj": "q", "q_a_proj": "q_a", "q_b_proj": "q_b", "k_proj": "k", "v_proj": "v",
              "kv_a_proj_with_mqa": "kv_a", "kv_b_proj": "kv_b", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
              "down_proj": "down"}
TRIAX_NAMES = {short: peft for peft, short in PEFT_NAMES.items()}  # q -> q_proj, o -> o_proj, ...
ALL_LINEAR = "all-linear"
ADAPTER_MARK = ".lora_"


@dataclass
class LoRAConfig:
    """model.lora: LoRA adapters on a frozen base."""

    rank: int = 0
    """Rank r of each adapter (0 = no LoRA: every weight trains)."""

    alpha: float = 16.0
    """The adapter's output is scaled by alpha / rank (PEFT's lora_alpha)."""

    dropout: float = 0.0
    """Dropout on the adapter's input (PEFT's lora_dropout)."""

    targets: List[str] = field(default_factory=lambda: ["q", "v"])
    """Layers to adapt: any of q, q_a, q_b, k, v, kv_a, kv_b, o, gate, up, down that the model's family
    adapts (or PEFT's q_proj, ...), or all-linear: every one of them it adapts."""

    init_from: Optional[str] = None
    """Start the adapters from a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""


def target_keys(targets: object, available: Mapping[str, object] = TARGETS) -> list[str]:
    """The short names (q, k, ...) of model.lora.targets, in TARGETS order; one line for a bad one.
    all-linear: the `available` ones (a model's: triax.models.family.lora_layers)."""
    if isinstance(targets, str):
        targets = [targets]
    if list(targets) == [ALL_LINEAR]:
        return [key for key in TARGETS if key in available]
    keys = []
    for target in targets:
        key = PEFT_NAMES.get(target, target)
        if key not in TARGETS:
            raise ConfigError(f"model.lora.targets has {target!r}; use any of {', '.join(TARGETS)} "
                              f"(or PEFT's {', '.join(PEFT_NAMES)}), or {ALL_LINEAR}")
        keys.append(key)
    if not keys:
        raise ConfigError("model.lora.targets is empty; name the layers to adapt, e.g. [q,v] or [all-linear]")
    return [key for key in TARGETS if key in keys]


def model_target_keys(targets: object, model_config: object) -> list[str]:
    """model.lora.targets' short names on a model of `model_config` (a GPTConfig), each one a layer
    its family adapts (triax.models.family.lora_layers); one line for another."""
    available = lora_layers(model_config)
    keys = target_keys(targets, available)
    missing = [key for key in keys if key not in available]
    if missing:
        names = ", ".join(f"{key} ({TRIAX_NAMES[key]})" for key in TARGETS if key in available)
        raise ConfigError(f"model.lora.targets has {missing[0]!r} ({TRIAX_NAMES[missing[0]]}), which LoRA on a "
                          f"model.arch={model_config.arch} model does not adapt; choose among {names}, or all-linear")
    return keys


def check_lora(config: LoRAConfig) -> None:
    if config.rank == 0:
        return
    if type(config.rank) is not int or not 0 < config.rank <= 4096:
        raise ConfigError(f"model.lora.rank={config.rank!r}; use 1 .. 4096 (or 0 for no LoRA)")
    if not (math.isfinite(config.alpha) and config.alpha > 0):
        raise ConfigError(f"model.lora.alpha={config.alpha!r}; use a positive number such as 16")
    if not (math.isfinite(config.dropout) and 0 <= config.dropout < 1):
        raise ConfigError(f"model.lora.dropout={config.dropout!r}; use 0 <= dropout < 1")
    target_keys(config.targets)


def is_adapter(name: str) -> bool:
    return ADAPTER_MARK in name
