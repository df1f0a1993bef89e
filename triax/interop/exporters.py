"""`triax export RUN OUT --format F`: one writer per format, every one of the same form
`writer(run, output, options)`, so the command looks its writer up once in `EXPORTERS` and never
switches on the format itself:

- safetensors: the run's tensors as one .safetensors file, with its architecture and vocabulary as
  metadata (below: it is triax's own layout, loadable with safetensors alone);
- hf: a directory transformers' AutoModelForCausalLM loads (triax/interop/hf/export.py); with
  `--merge`, a LoRA run's base with its adapters merged in (triax/interop/peft/export.py);
- nanogpt: nanoGPT's ckpt.pt (triax/interop/nanogpt/export.py);
- peft: a LoRA run's adapters as PEFT's adapter directory (triax/interop/peft/export.py).

The run is given as an `ExportedRun` (a triax run directory, opened by its own room:
triax/runs/export.py), so the wing reads the run's snapshots and files without importing
the room that writes them. Each writer checks its output before it reads any snapshot. The types
a writer is written against live in triax/interop/export_types.py, which the writers import
without importing this table of them.
"""

from __future__ import annotations

import json
from typing import Any

from triax.arguments import check_output_file, written_by_triax_safetensors
from triax.checkpoint.export import export_safetensors
from triax.errors import printable
from triax.interop.export_types import ExportedRun, ExportOptions, Writer
from triax.interop.hf.export import write_hf
from triax.interop.nanogpt.export import write_nanogpt
from triax.interop.peft.export import write_merged, write_peft
from triax.models.config import GPTConfig


def write_safetensors(run: ExportedRun, output: str, options: ExportOptions) -> None:
    """The run's newest good snapshot as one .safetensors file at `output`."""
    # The output is checked before any snapshot is read (the run's snapshot root found once).
    run.check_not_in_run(output)
    check_output_file("output", output, options.force, written_by_triax_safetensors)

    def export(reader: Any, model_config: GPTConfig, vocab: object) -> tuple:
        true_config, shapes = run.true_shapes(model_config, vocab)
        # Plain tensors with plain names, and the architecture and vocabulary as string metadata:
        # loadable with safetensors alone, no triax classes needed. Written tensor by tensor.
        metadata = {"format": "pt", "triax_model": json.dumps(true_config)}
        if vocab is not None and hasattr(vocab, "to_json"):
            metadata["triax_vocab"] = vocab.to_json()
        return (reader.snapshot, *export_safetensors(reader, output, shapes, metadata))

    snapshot, count, values = run.with_fallback(export)
    print(printable(f"wrote {count} tensors ({values / 1e6:.2f}M values) from {snapshot} to {output}"))


def write_transformers(run: ExportedRun, output: str, options: ExportOptions) -> None:
    """--format hf: the run's model, or with --merge a LoRA run's merged model, as a transformers directory."""
    (write_merged if options.merge else write_hf)(run, output, options)


# --format -> its writer (triax/commands/export.py's choices are these names)
EXPORTERS: dict[str, Writer] = {"safetensors": write_safetensors, "hf": write_transformers,
                                "nanogpt": write_nanogpt, "peft": write_peft}
# --format -> (the name its errors give the output, whether the output is a directory)
OUTPUT_PLACES: dict[str, tuple[str, bool]] = {"safetensors": ("output", False), "hf": ("OUT_DIR", True),
                                              "nanogpt": ("OUT_DIR", True), "peft": ("OUT_DIR", True)}
