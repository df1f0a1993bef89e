"""Accelerate's public constants, with Accelerate's values (accelerate.utils re-exports them).

The file names are those of Accelerate's checkpoints; triax's save_state writes its own snapshot
layout (docs/snapshots.md), so they matter only to scripts that build paths from them.
"""

from torch.distributed.run import get_args_parser

# Accelerate's checkpoint and weight file names.
MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
WEIGHTS_NAME = f"{MODEL_NAME}.bin"
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
SAFE_WEIGHTS_NAME = f"{SAFE_MODEL_NAME}.safetensors"
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SAMPLER_NAME = "sampler"
SCALER_NAME = "scaler.pt"
RNG_STATE_NAME = "random_states"
PROFILE_PATTERN_NAME = "profile_{suffix}.json"

# The distributed types that run torch.distributed collectives (Accelerate's list, including "TP").
TORCH_DISTRIBUTED_OPERATION_TYPES = ["DEEPSPEED", "MULTI_GPU", "FSDP", "MEGATRON_LM", "TP", "MULTI_NPU", "MULTI_MLU",
                                     "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_CPU", "MULTI_HPU", "MULTI_NEURON"]


def _torchrun_options() -> list[str]:
    # torchrun's own option names, from the installed torch's parser (Accelerate keeps a list).
    return [action.dest for action in get_args_parser()._actions
            if action.option_strings and action.dest != "help"]


TORCH_LAUNCH_PARAMS = _torchrun_options()
