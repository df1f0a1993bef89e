"""`triax export RUN_DIR OUT --format nanogpt`: the run's weights as nanoGPT's ckpt.pt, which
nanoGPT's sample.py (init_from='resume', out_dir=OUT) loads: `model` (nanoGPT's names, c_attn
fused again), `model_args`, `iter_num` (the snapshot's step), `best_val_loss`, `config` (the run's
settings under nanoGPT's names) and `optimizer` (AdamW's state as nanoGPT's configure_optimizers
groups it), so nanoGPT's train.py, or triax's trainer.continue_from, continues the run.

Only what nanoGPT's GPT computes can be written: the gpt2 architecture with the exact GELU, the
head tied to the embedding, an MLP of 4 x n_embd and LayerNorm eps 1e-5 (a run started from a
nanoGPT ckpt.pt has all of these); anything else is refused in one line naming the key.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

from triax import safe_files
from triax.arguments import check_output_directory, written_by_triax_pickle
from triax.checkpoint import snapshot_step
from triax.checkpoint.export import optimizer_source, tensor_source
from triax.interop.nanogpt.checkpoint import to_nanogpt_state
from triax.interop.shared.adamw_state import MOMENTS
from triax.interop.nanogpt.run import exported_config, optimizer_state
from triax.interop.shared.pickled import pickled_bytes
from triax.errors import UsageError, printable

if TYPE_CHECKING:
    from triax.interop.export_types import ExportedRun, ExportOptions

# model.* key -> the value nanoGPT's GPT has (None: derived, below).
REQUIRED = {"arch": "gpt2", "gelu": "exact", "tie_embeddings": True, "norm_eps": 1e-5, "intermediate_size": None}


def check_expressible(config: dict) -> None:
    wanted = dict(REQUIRED, intermediate_size=4 * config["n_embd"])
    for key, value in wanted.items():
        have = config.get(key)
        if key == "intermediate_size" and have is None:
            continue  # unset: 4 x n_embd
        if have != value:
            raise UsageError(f"--format nanogpt: the run's model.{key}={have!r} is not what nanoGPT's GPT computes "
                             f"({value!r}); export it with --format safetensors or --format hf instead")


def _data_parallel(state: dict, config: dict) -> int:
    """The run's data-parallel processes (nanoGPT counts gradient accumulation over all of them)."""
    parallel = config.get("parallel") if isinstance(config.get("parallel"), dict) else {}
    world, tp, pp = state.get("world_size", 1), parallel.get("tp", 1), parallel.get("pp", 1)
    if not all(isinstance(value, int) and value >= 1 for value in (world, tp, pp)):
        return 1
    return max(1, world // (tp * pp))


def export_nanogpt(run_dir: str, output: str, opened: tuple, true_shapes: Callable[..., tuple[dict, dict]]
                   ) -> tuple[str, int]:
    """Write OUTPUT/ckpt.pt from the run's newest good snapshot; (its path, values written).
    `opened`: (the snapshot's reader, the run's model config, its vocabulary); `true_shapes`: the
    run's architecture and every tensor's shape without the layout's vocabulary padding."""
    reader, model_config, vocab = opened
    true_config, shapes = true_shapes(model_config, vocab)
    check_expressible(true_config)
    tensors = tensor_source(reader, shapes)
    state = to_nanogpt_state(tensors)
    model_args = {key: true_config[key] for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")}
    bias = true_config.get("bias")  # unset: the gpt2 architecture's, biases
    model_args.update(bias=True if bias is None else bool(bias), dropout=float(true_config.get("dropout", 0.0)))
    run_config = reader.state.get("config") if isinstance(reader.state.get("config"), dict) else {}
    config = {"exported_by": "triax", "run_dir": os.path.abspath(run_dir),
              **exported_config(run_config, _data_parallel(reader.state, run_config))}
    checkpoint = {"model": state, "model_args": model_args, "iter_num": snapshot_step(reader.snapshot),
                  "best_val_loss": 1e9,  # nanoGPT's own starting value: no evaluation is carried over
                  "config": config}
    moments = {key: optimizer_source(reader, key, shapes) for key in MOMENTS}
    if all(set(moments[key]) >= set(tensors) - {"lm_head.weight"} for key in MOMENTS):
        # AdamW's state as nanoGPT's train.py saves it: its init_from='resume' (or triax's
        # trainer.continue_from) continues the run from here.
        steps = optimizer_source(reader, "step")
        step = float(steps[next(iter(steps))]) if len(steps) else float(checkpoint["iter_num"])
        scheduler = reader.state.get("scheduler") if isinstance(reader.state.get("scheduler"), dict) else {}
        last = scheduler.get("_last_lr")
        rate = last[0] if isinstance(last, list) and last and isinstance(last[0], (int, float)) else 0.0
        checkpoint["optimizer"] = optimizer_state({key: to_nanogpt_state(moments[key]) for key in MOMENTS}, step,
                                                  model_args, config, float(rate))
    safe_files.make_directory(output)
    path = os.path.join(output, "ckpt.pt")
    safe_files.write_atomic(path, pickled_bytes(checkpoint))
    values = sum(tensor.numel() for name, tensor in state.items() if name != "lm_head.weight")
    print(printable(f"wrote nanoGPT's ckpt.pt ({values / 1e6:.2f}M values, iter_num {checkpoint['iter_num']}) "
                    f"from {reader.snapshot} to {path}"))
    return path, values


def write_nanogpt(run: ExportedRun, output: str, options: ExportOptions) -> None:
    """`triax export RUN OUTPUT --format nanogpt` (triax/interop/exporters.py): OUTPUT/ckpt.pt from
    the run's newest good snapshot, OUTPUT checked before any snapshot is read."""
    run.check_not_in_run(output, "OUTPUT")
    check_output_directory("OUTPUT", output, {"ckpt.pt": written_by_triax_pickle}, options.force)
    run.with_fallback(lambda *opened: export_nanogpt(run.run_dir, output, opened, run.true_shapes))
