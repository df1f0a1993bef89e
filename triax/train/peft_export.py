"""`triax export RUN OUT --format peft`: a LoRA run's adapters (its newest good snapshot) as the
directory PEFT's `PeftModel.from_pretrained(base, OUT)` loads (triax/interop/peft/adapter.py)."""

from __future__ import annotations

import os

import torch

from triax.errors import TriaxError, UsageError, printable
from triax.models.lora import LoRAConfig, is_adapter


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


def export_main(argv: list[str]) -> int:
    """`triax export`: --format peft here; every other format is triax.train.commands' export."""
    from triax.train import commands  # deferred: torch and the checkpoint layer, after --help

    asked = "--format=peft" in argv or any(a == "--format" and b == "peft" for a, b in zip(argv, argv[1:]))
    if "--merge" in argv:
        # deferred: `triax --help` stays fast
        from triax.arguments import ArgumentParser

        parser = ArgumentParser(prog="triax export --format hf --merge",
                                description="write a LoRA run's base with its adapters merged in, for transformers")
        parser.add_argument("run_dir")
        parser.add_argument("output", help="a new directory")
        parser.add_argument("--format", choices=("hf",), required=True)
        parser.add_argument("--merge", action="store_true", required=True)
        args = parser.parse_args(argv)
        return export_merged_main(args.run_dir, args.output)
    if not asked:
        return commands.export_main(argv)
    from triax.arguments import ArgumentParser  # deferred: `triax --help` stays fast

    parser = ArgumentParser(prog="triax export --format peft",
                            description="write a LoRA run's adapters as PEFT's adapter directory")
    parser.add_argument("run_dir")
    parser.add_argument("output", help="a new directory: adapter_config.json and adapter_model.safetensors")
    parser.add_argument("--format", choices=("peft",), required=True)
    parser.add_argument("--force", action="store_true", help="replace adapter files in OUT_DIR that triax did not write")
    args = parser.parse_args(argv)
    return export_peft_main(args.run_dir, args.output, args.force)


def export_peft_main(run_dir: str, out_dir: str, force: bool = False) -> int:
    from triax.checkpoint.export import tensor_source  # deferred: imports torch
    from triax.interop.peft.adapter import write_adapter  # deferred: `triax --help` stays fast
    # deferred: `triax --help` stays fast
    from triax.train.commands import check_not_in_run, newest_good_snapshot, run_snapshot_root
    from triax.train.run_files import read_model_config  # deferred: `triax --help` stays fast

    from triax.arguments import check_output_directory  # deferred: `triax --help` stays fast
    from triax.interop.peft.adapter import output_files  # deferred: as above

    root = run_snapshot_root(run_dir)
    check_not_in_run(out_dir, run_dir, root, "OUT_DIR")
    check_output_directory("OUT_DIR", out_dir, output_files(), force)

    def export(reader, model_config, vocab):
        if model_config.arch not in ("llama", "qwen2", "mistral", "qwen3", "mixtral", "qwen3_moe"):
            raise UsageError(f"--format peft writes llama-family adapters; this run's model is {model_config.arch}")
        lora, base = run_lora(reader.state, reader.snapshot)
        source = tensor_source(reader)
        tensors = {name: source[name] for name in source.keys() if is_adapter(name)}
        if not tensors:
            raise TriaxError(f"snapshot {reader.snapshot} holds no LoRA adapter tensors")
        return reader.snapshot, write_adapter(tensors, lora, base, out_dir), lora

    # Not open_run: its check that model.json fits the snapshot's tensors counts the base, which a
    # LoRA snapshot does not hold; the adapters' own shapes are what is written.
    reader = newest_good_snapshot(root, run_dir, 0)
    snapshot, count, lora = export(reader, read_model_config(run_dir), None)
    print(printable(f"wrote a PEFT LoRA adapter (rank {lora.rank}, {count} tensors) from {snapshot} to {out_dir}: "
                    "load it with peft.PeftModel.from_pretrained(base_model, OUT_DIR)"))
    return 0


@torch.no_grad()
def merge_adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's tensors with every adapter merged into its layer: W + (alpha / r) B A."""
    for module in model.modules():
        if hasattr(module, "lora_A"):
            module.weight += module.lora_scaling * (module.lora_B.weight @ module.lora_A.weight)
    return {name: tensor for name, tensor in model.state_dict().items() if not is_adapter(name)}


def export_merged_main(run_dir: str, out_dir: str) -> int:
    # deferred: torch and the models, after --help
    from triax.train.chat_generate import load_chat_model, run_config
    # deferred: as above
    from triax.train.commands import check_not_in_run, run_snapshot_root
    # deferred: as above
    from triax.interop.hf.export import export_hf
    # deferred: as above
    from triax.train.run_files import KEPT_SOURCE_DIR

    root = run_snapshot_root(run_dir)
    check_not_in_run(out_dir, run_dir, root, "OUT_DIR")
    config = run_config(run_dir)
    if not config.model.lora.rank:
        raise UsageError(f"{run_dir!r} is not a LoRA run (model.lora.rank was not set); export it with --format hf")
    from triax.runtime.threads import apply_thread_choice  # deferred: as above

    apply_thread_choice()  # the merge computes on this CPU: the cores idle now (triax.runtime.threads: why)
    model = load_chat_model(run_dir, config, torch.device("cpu"))
    tokenizer = os.path.join(run_dir, "tokenizer.json")
    kept = os.path.join(run_dir, KEPT_SOURCE_DIR)
    values = export_hf(model.config, merge_adapters(model), out_dir, tokenizer if os.path.isfile(tokenizer) else None,
                       kept if os.path.isdir(kept) else None)
    print(printable(f"wrote a transformers {model.config.arch} model ({values / 1e6:.2f}M values) with the LoRA "
                    f"adapters of {run_dir} merged into its base, to {out_dir}"))
    return 0
