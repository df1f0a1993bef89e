"""`triax export RUN OUT --format peft`: a LoRA run's adapters (its newest good snapshot) as the
directory PEFT's `PeftModel.from_pretrained(base, OUT)` loads (adapter.py writes it), and
`--format hf --merge`: the run's base with the adapters merged into their layers, as a transformers
directory. Both writers are looked up by the command in triax/interop/exporters.py."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from triax.arguments import check_output_directory
from triax.checkpoint.export import tensor_source
from triax.errors import TriaxError, UsageError, printable
from triax.interop.hf.export import export_hf
from triax.interop.peft.adapter import output_files, write_adapter
from triax.models.config import GPTConfig
from triax.models.family import ARCHITECTURES
from triax.models.lora_config import LoRAConfig, is_adapter
from triax.runtime.threads import apply_thread_choice

if TYPE_CHECKING:
    from triax.interop.export_types import ExportedRun, ExportOptions



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
    peft_arches = [arch for arch, spec in ARCHITECTURES.items() if spec.peft_names]
    if model_config.arch not in peft_arches:
        raise UsageError(f"--format peft writes the adapters of {', '.join(peft_arches)} models; this run's model "
                         f"is {model_config.arch}: export it with --format hf --merge")
    lora, base = run_lora(reader.state, reader.snapshot)
    source = tensor_source(reader)
    tensors = {name: source[name] for name in source.keys() if is_adapter(name)}
    if not tensors:
        raise TriaxError(f"snapshot {reader.snapshot} holds no LoRA adapter tensors")
    return reader.snapshot, write_adapter(tensors, lora, base, out_dir, model_config), lora


@torch.no_grad()
def merge_adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's tensors with every adapter merged into its layer: W + (alpha / r) B A."""
    for module in model.modules():
        if hasattr(module, "lora_A"):
            module.weight += module.lora_scaling * (module.lora_B.weight @ module.lora_A.weight)
    return {name: tensor for name, tensor in model.state_dict().items() if not is_adapter(name)}


def write_peft(run: ExportedRun, out_dir: str, options: ExportOptions) -> None:
    """--format peft: the adapters of the run's newest good snapshot, OUT_DIR checked first."""
    run.check_not_in_run(out_dir, "OUT_DIR")
    check_output_directory("OUT_DIR", out_dir, output_files(), options.force)

    # Not the run's whole-model reader: its check that model.json fits the snapshot's tensors counts
    # the base, which a LoRA snapshot does not hold; the adapters' own shapes are what is written.
    reader = run.newest_snapshot()
    snapshot, count, lora = write_run_adapters(reader, run.model_config(), out_dir)
    print(printable(f"wrote a PEFT LoRA adapter (rank {lora.rank}, {count} tensors) from {snapshot} to {out_dir}: "
                    "load it with peft.PeftModel.from_pretrained(base_model, OUT_DIR)"))


def write_merged(run: ExportedRun, out_dir: str, options: ExportOptions) -> None:
    """--format hf --merge: a LoRA run's base with its adapters merged in, as a transformers directory."""
    run.check_not_in_run(out_dir, "OUT_DIR")
    config = run.config()
    if not config.model.lora.rank:
        raise UsageError(f"{run.run_dir!r} is not a LoRA run (model.lora.rank was not set); export it with --format hf")
    apply_thread_choice()  # the merge computes on this CPU: the cores idle now (triax.runtime.threads: why)
    model = run.whole_model(config, torch.device("cpu"))
    tokenizer = os.path.join(run.run_dir, "tokenizer.json")
    kept = run.kept_dir
    values = export_hf(model.config, merge_adapters(model), out_dir, tokenizer if os.path.isfile(tokenizer) else None,
                       kept if os.path.isdir(kept) else None)
    print(printable(f"wrote a transformers {model.config.arch} model ({values / 1e6:.2f}M values) with the LoRA "
                    f"adapters of {run.run_dir} merged into its base, to {out_dir}"))
