"""`triax export RUN OUT --format peft` (triax.commands.export): a LoRA run's adapters (its newest
good snapshot) as the directory PEFT's `PeftModel.from_pretrained(base, OUT)` loads (written by
triax/interop/peft/export.py)."""

from __future__ import annotations

import os

import torch

from triax.errors import UsageError, printable


def export_peft_main(run_dir: str, out_dir: str, force: bool = False) -> int:
    from triax.interop.peft.export import write_run_adapters  # deferred: imports torch
    # deferred: `triax --help` stays fast
    from triax.train.runs import check_not_in_run, newest_good_snapshot, run_snapshot_root
    from triax.train.run_files import read_model_config  # deferred: `triax --help` stays fast

    from triax.arguments import check_output_directory  # deferred: `triax --help` stays fast
    from triax.interop.peft.adapter import output_files  # deferred: as above

    root = run_snapshot_root(run_dir)
    check_not_in_run(out_dir, run_dir, root, "OUT_DIR")
    check_output_directory("OUT_DIR", out_dir, output_files(), force)

    # Not open_run: its check that model.json fits the snapshot's tensors counts the base, which a
    # LoRA snapshot does not hold; the adapters' own shapes are what is written.
    reader = newest_good_snapshot(root, run_dir, 0)
    snapshot, count, lora = write_run_adapters(reader, read_model_config(run_dir), out_dir)
    print(printable(f"wrote a PEFT LoRA adapter (rank {lora.rank}, {count} tensors) from {snapshot} to {out_dir}: "
                    "load it with peft.PeftModel.from_pretrained(base_model, OUT_DIR)"))
    return 0


def export_merged_main(run_dir: str, out_dir: str) -> int:
    # deferred: torch and the models, after --help
    from triax.train.chat_generate import load_chat_model, run_config
    # deferred: as above
    from triax.train.runs import check_not_in_run, run_snapshot_root
    # deferred: as above
    from triax.interop.hf.export import export_hf
    from triax.interop.peft.export import merge_adapters  # deferred: as above
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
