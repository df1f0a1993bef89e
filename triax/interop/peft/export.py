"""`triax export RUN OUT --format peft`'s writing half: a LoRA run's adapters (a snapshot's) as the
directory PEFT's `PeftModel.from_pretrained(base, OUT)` loads (adapter.py writes it), and the merge
of the adapters into their layers for `--format hf --merge`. The command itself (its parser, the
run directory's checks) is triax/train/peft_export.py's."""

from __future__ import annotations

import torch

from triax.checkpoint.export import tensor_source
from triax.errors import TriaxError, UsageError
from triax.interop.peft.adapter import write_adapter
from triax.models.config import GPTConfig
from triax.models.lora import LoRAConfig, is_adapter

# model.arch values whose adapters PEFT's llama-family layout names
PEFT_ARCHES = ("llama", "qwen2", "mistral", "qwen3", "mixtral", "qwen3_moe")


def run_lora(state: dict, snapshot: str) -> tuple[LoRAConfig, str | None]:
    """The model.lora and model.init_from a snapshot's run was trained with."""
    model = (state.get("config") or {}).get("model") or {}
    lora = model.get("lora") or {}
    if not isinstance(lora, dict) or not lora.get("rank"):
        raise UsageError(f"snapshot {snapshot} is not of a LoRA run (model.lora.rank was not set); export it "
                         "with --format hf or safetensors")
    try:
        config = LoRAConfig(rank=lora["rank"], alpha=lora["alpha"], dropout=lora["dropout"],
                            targets=list(lora["targets"]))
    except (KeyError, TypeError) as error:
        raise TriaxError(f"snapshot {snapshot}: its config's model.lora is incomplete ({error})") from None
    return config, model.get("init_from")


def write_run_adapters(reader: object, model_config: GPTConfig, out_dir: str) -> tuple[str, int, LoRAConfig]:
    """Write the adapters of the snapshot `reader` opened (a run of `model_config`) into `out_dir`;
    returns (the snapshot, the number of tensors written, the run's model.lora)."""
    if model_config.arch not in PEFT_ARCHES:
        raise UsageError(f"--format peft writes llama-family adapters; this run's model is {model_config.arch}")
    lora, base = run_lora(reader.state, reader.snapshot)
    source = tensor_source(reader)
    tensors = {name: source[name] for name in source.keys() if is_adapter(name)}
    if not tensors:
        raise TriaxError(f"snapshot {reader.snapshot} holds no LoRA adapter tensors")
    return reader.snapshot, write_adapter(tensors, lora, base, out_dir), lora


@torch.no_grad()
def merge_adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's tensors with every adapter merged into its layer: W + (alpha / r) B A."""
    for module in model.modules():
        if hasattr(module, "lora_A"):
            module.weight += module.lora_scaling * (module.lora_B.weight @ module.lora_A.weight)
    return {name: tensor for name, tensor in model.state_dict().items() if not is_adapter(name)}
