"""Accelerate's public names, module by module, and what triax has for each.

Every public module a script imports from (`accelerate`, `accelerate.utils`, `accelerate.logging`, ...)
has a counterpart of the same name under `triax.accelerate`. A counterpart's `__all__` holds the
names triax provides. ABSENT holds the names triax deliberately lacks, each with what to use instead:
they still import, so a script's import block runs, and the moment one is called or instantiated it
raises UnsupportedFeatureError (a NotImplementedError), one line naming the alternative. DIFFERS
says how a provided name behaves otherwise than Accelerate's; ELSEWHERE lists names a counterpart
provides although Accelerate keeps them in another module.

tests/unit/accelerate/test_accelerate_names.py holds these tables against the installed Accelerate (a name a new
release adds fails it until it is provided or listed here), and the table in docs/accelerate.md is
rendered from them when the site is built (scripts/accelerate_names.py).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from triax.accelerate._internal.errors import UnsupportedFeatureError

# The public modules of Accelerate that triax mirrors, as triax.accelerate.<same>. Not mirrored:
# accelerate.commands (the CLI: `triax config / launch / env`), accelerate.test_utils (Accelerate's
# own test helpers), accelerate.memory_utils (deprecated, holds no names), and the submodules of
# accelerate.utils (their public names are all in accelerate.utils itself).
MODULES = ("accelerate", "accelerate.accelerator", "accelerate.big_modeling", "accelerate.checkpointing",
           "accelerate.data_loader", "accelerate.hooks", "accelerate.launchers",
           "accelerate.local_sgd", "accelerate.logging", "accelerate.optimizer", "accelerate.parallelism_config",
           "accelerate.scheduler", "accelerate.state", "accelerate.tracking", "accelerate.utils")

# ---- why a name is absent: what to use instead -------------------------------------------------

DEEPSPEED = "DeepSpeed is not part of triax; shard with FSDP instead (Accelerator(parallel='fsdp'))"
MEGATRON = ("Megatron-LM is not part of triax; for tensor and pipeline parallelism use `triax train` "
            "(docs/parallelism.md)")
FP8 = "fp8 training (Transformer Engine, MS-AMP, torchao) is not part of triax; use mixed_precision='bf16'"
BITSANDBYTES = ("quantized (bitsandbytes 8/4-bit) loading is not part of triax; train in bf16, or quantize with "
                "transformers' own BitsAndBytesConfig outside the Accelerator")
BIG_MODEL = ("big-model inference (device maps, CPU/disk offload, dispatch hooks) is not part of triax; shard the "
             "model with Accelerator(parallel='fsdp') or split it into stages with triax.pipe.Pipe")
META_INIT = ("empty-weight initialisation helpers are not part of triax; build the model under "
             "`with torch.device('meta'):` and materialise it with model.to_empty(device=...)")
LAUNCH = ("Accelerate's launcher internals are not part of triax; start processes with `triax launch` "
          "(docs/accelerate.md)")
CONFIG_FILE = "Accelerate's config file writer is not part of triax; write one with `triax config`"
XLA = "XLA/TPU is not supported by triax; run on CPU or CUDA devices"
SAGEMAKER = "Amazon SageMaker launching is not part of triax; start processes with `triax launch`"
FSDP_INTERNALS = ("Accelerate's FSDP helpers are not part of triax; the Accelerator applies FSDP2 itself and "
                  "save_state / load_state / get_state_dict read and write its shards")
LAYOUTS = ("Accelerate's tensor/context-parallel configuration is not part of triax; use `triax train` layouts "
           "(docs/parallelism.md)")
COMPILE = "Accelerate's compilation helpers are not part of triax; call torch.compile(model) before prepare"
PROFILER = "Accelerate's profiler handler is not part of triax; use torch.profiler.profile around your loop"
CHECKPOINT_INTERNALS = ("Accelerate's checkpoint file writers are not part of triax; use Accelerator.save_state / "
                        "load_state (triax snapshots) and register_for_checkpointing")
DISPATCH = ("Accelerate's batch-dispatch internals are not part of triax: every process reads its own share "
            "of each batch (prepare your DataLoader with Accelerator.prepare)")
STATE_INTERNALS = "an Accelerate internal; use PartialState / AcceleratorState"
OPTIMIZER_INTERNALS = "an Accelerate internal; prepare the optimizer with Accelerator.prepare"
TRACKERS = ("triax logs to tensorboard, wandb, mlflow and jsonl; for another service, subclass GeneralTracker and "
            "pass it in log_with (or register_tracker_class)")
DEVICE_PROBES = ("Accelerate's hardware probes are not part of triax; ask torch directly (torch.cuda, "
                 "torch.backends) or run `triax env`")
MODEL_SIZES = ("Accelerate's model-size helpers are not part of triax; sum p.numel() * p.element_size() over "
               "model.parameters()")
PEFT = "use isinstance(model, peft.PeftModel) directly"
PRECISION_INTERNALS = ("an Accelerate internal; the Accelerator's autocast() and its scaler (accelerator.scaler) "
                       "are triax's mixed precision")

# Per Accelerate module: (why, "the names it covers"). A name is listed once.
_ABSENT_GROUPS = {
    "accelerate": [
        (DEEPSPEED, "DeepSpeedPlugin"),
        (LAYOUTS, "ParallelismConfig"),
        (PROFILER, "ProfileKwargs"),
        (BIG_MODEL, "cpu_offload cpu_offload_with_hook disk_offload dispatch_model infer_auto_device_map "
                    "load_checkpoint_and_dispatch load_checkpoint_in_model"),
        (META_INIT, "init_empty_weights init_on_device"),
    ],
    "accelerate.big_modeling": [
        (BIG_MODEL, "attach_layerwise_casting_hooks cpu_offload cpu_offload_with_hook disk_offload dispatch_model "
                    "load_checkpoint_and_dispatch"),
        (META_INIT, "init_empty_weights init_on_device"),
    ],
    "accelerate.checkpointing": [
        (CHECKPOINT_INTERNALS, "load_accelerator_state load_custom_state save_accelerator_state save_custom_state"),
    ],
    "accelerate.hooks": [
        (BIG_MODEL, "AlignDevicesHook CpuOffload LayerwiseCastingHook ModelHook SequentialHook UserCpuOffloadHook "
                    "add_hook_to_module attach_align_device_hook attach_align_device_hook_on_blocks "
                    "attach_execution_device_hook remove_hook_from_module remove_hook_from_submodules"),
    ],
    "accelerate.launchers": [],
    "accelerate.optimizer": [
        (OPTIMIZER_INTERNALS, "move_to_device patch_optimizer_step"),
    ],
    "accelerate.parallelism_config": [
        (LAYOUTS, "ParallelismConfig"),
    ],
    "accelerate.state": [
        (STATE_INTERNALS, "ThreadLocalSharedDict do_nothing"),
    ],
    "accelerate.tracking": [
        (TRACKERS, "AimTracker ClearMLTracker CometMLTracker DVCLiveTracker SwanLabTracker TrackioTracker"),
    ],
    "accelerate.utils": [
        (DEEPSPEED, "DeepSpeedPlugin DeepSpeedSequenceParallelConfig GatheredParameters deepspeed_required "
                    "compile_regions_deepspeed prepare_deepspeed_cmd_env"),
        (MEGATRON, "MegatronLMPlugin AbstractTrainStep BertTrainStep GPTTrainStep T5TrainStep "
                   "MegatronLMDummyDataLoader MegatronLMDummyScheduler add_model_config_to_megatron_parser "
                   "avg_losses_across_data_parallel_group"),
        (FP8, "AORecipeKwargs TERecipeKwargs apply_fp8_autowrap "
              "contextual_fp8_autocast convert_model has_transformer_engine_layers convert_model_to_fp8_ao "
              "filter_first_and_last_linear_layers has_ao_layers torchao_required check_cuda_fp8_capability"),
        (BITSANDBYTES, "BnbQuantizationConfig has_4bit_bnb_layers load_and_quantize_model CustomDtype"),
        (BIG_MODEL, "OffloadedWeightsLoader PrefixedDataset extract_submodules_state_dict load_offloaded_weight "
                    "load_offloaded_weights offload_state_dict offload_weight save_offload_index align_module_device "
                    "check_device_map get_balanced_memory get_max_layer_size get_max_memory infer_auto_device_map "
                    "load_checkpoint_in_model set_module_tensor_to_device has_offloaded_params named_module_tensors "
                    "check_tied_parameters_on_same_device check_tied_parameters_in_config find_tied_parameters "
                    "retie_parameters load_state_dict"),
        (MODEL_SIZES, "calculate_maximum_sizes compute_module_sizes dtype_byte_size convert_file_size_to_int "
                      "id_tensor_storage"),
        (LAUNCH, "PrepareForLaunch prepare_multi_gpu_env prepare_simple_launcher_cmd_env "
                 "convert_dict_to_env_variables purge_accelerate_environment get_cpu_distributed_information "
                 "set_numa_affinity are_libraries_initialized"),
        (CONFIG_FILE, "write_basic_config"),
        (XLA, "install_xla prepare_tpu"),
        (SAGEMAKER, "prepare_sagemager_args_inputs"),
        (FSDP_INTERNALS, "ensure_weights_retied fsdp2_apply_ac "
                         "fsdp2_canonicalize_names fsdp2_load_full_state_dict fsdp2_prepare_model "
                         "fsdp2_switch_optimizer_parameters get_fsdp2_grad_scaler load_fsdp_model load_fsdp_optimizer "
                         "merge_fsdp_weights save_fsdp_model save_fsdp_optimizer"),
        (LAYOUTS, "ParallelismConfig TorchContextParallelConfig TorchTensorParallelConfig TorchTensorParallelPlugin "
                  "get_model_tp_size model_has_dtensor"),
        (COMPILE, "TorchDynamoPlugin compile_regions compile_regions_fsdp2 get_module_children_bottom_up"),
        (PROFILER, "ProfileKwargs"),
        (DEVICE_PROBES, "check_cuda_p2p_ib_support get_gpu_info get_current_device_type"),
        (DISPATCH, "TensorInformation copy_tensor_to_devices get_data_structure initialize_tensors "
                   "is_tensor_information slice_tensors pad_input_tensors"),
        (PEFT, "is_peft_model"),
        (PRECISION_INTERNALS, "get_grad_scaler get_mixed_precision_context_manager"),
        (CHECKPOINT_INTERNALS, "clean_state_dict_for_safetensors"),
    ],
}

# Provided, but not quite as Accelerate has it: (how, "the names").
_FILE_NAMES = ("the names of Accelerate's checkpoint files, with Accelerate's values; triax's save_state writes "
               "its own snapshot layout, not these files")
_DATA_LOADER_CONFIGURATION = ("dispatch_batches=True is accepted with a warning: every process reads its own "
                              "share of each batch")
_COMM_HOOKS = "fp16/bf16/power_sgd map onto triax's gradient compression"
_DEBUG_LAUNCHER = ("the processes find each other through torchrun's variables on a free port (Accelerate's: a "
                   "rendezvous file, port 29500)")
_FSDP_PLUGIN = ("always runs FSDP2 (fully_shard): fsdp_version=1 is mapped as `accelerate to-fsdp2` maps it, and "
                "sync_module_states / forward_prefetch are honoured with FSDP2 too (docs/accelerate.md, FSDP)")
_DIFFERS_GROUPS = {
    "accelerate": [
        (_FSDP_PLUGIN, "FullyShardedDataParallelPlugin"),
        ("triax's own Accelerator on triax's core: the rest of this page says where it differs", "Accelerator"),
        (_DATA_LOADER_CONFIGURATION, "DataLoaderConfiguration"),
        (_COMM_HOOKS, "DDPCommunicationHookType"),
        ("one machine only (several: `triax launch --num-machines`)", "notebook_launcher"),
        (_DEBUG_LAUNCHER, "debug_launcher"),
    ],
    "accelerate.accelerator": [
        ("triax's own Accelerator on triax's core: the rest of this page says where it differs", "Accelerator"),
    ],
    "accelerate.launchers": [
        ("one machine only (several: `triax launch --num-machines`)", "notebook_launcher"),
        (_DEBUG_LAUNCHER, "debug_launcher"),
    ],
    "accelerate.optimizer": [
        ("triax's prepared optimizer: made by Accelerator.prepare (its constructor takes triax's arguments)",
         "AcceleratedOptimizer"),
    ],
    "accelerate.scheduler": [
        ("triax's prepared scheduler: made by Accelerator.prepare (its constructor takes triax's arguments)",
         "AcceleratedScheduler"),
    ],
    "accelerate.tracking": [
        ("writes the configuration as a text summary, not hparams plus an hparams.yml file", "TensorBoardTracker"),
        ("the trackers triax has (tensorboard, wandb, mlflow) plus the ones registered", "LOGGER_TYPE_TO_CLASS"),
    ],
    "accelerate.utils": [
        (_FSDP_PLUGIN, "FullyShardedDataParallelPlugin"),
        (_DATA_LOADER_CONFIGURATION, "DataLoaderConfiguration"),
        (_COMM_HOOKS, "DDPCommunicationHookType"),
        ("checks every process's structure, dtypes and shapes first and raises DistributedOperationException on "
         "all of them (Accelerate: only with state.debug)", "gather reduce broadcast pad_across_processes"),
        ("applies scale= on every backend (Accelerate: on XLA only)", "reduce"),
        (_FILE_NAMES, "MODEL_NAME OPTIMIZER_NAME RNG_STATE_NAME SAFE_MODEL_NAME SAFE_WEIGHTS_NAME "
                      "SAFE_WEIGHTS_INDEX_NAME SAFE_WEIGHTS_PATTERN_NAME SAMPLER_NAME SCALER_NAME SCHEDULER_NAME "
                      "WEIGHTS_NAME WEIGHTS_INDEX_NAME WEIGHTS_PATTERN_NAME"),
        ("torchrun's option names, read from the installed torch's own parser", "TORCH_LAUNCH_PARAMS"),
        ("always False: triax drives none of these (Megatron-LM, bitsandbytes on CPU, MXFP8, Gaudi 1), so a "
         "script that asks takes its other path", "is_megatron_lm_available "
         "is_bitsandbytes_multi_backend_available is_transformer_engine_mxfp8_available is_habana_gaudi1"),
    ],
}


def _by_name(groups: dict) -> dict[str, dict[str, str]]:
    table: dict[str, dict[str, str]] = {}
    for module, entries in groups.items():
        names = table.setdefault(module, {})
        for text, listed in entries:
            for name in listed.split():
                names[name] = f"{names[name]}; {text}" if name in names else text
    return table


ABSENT = _by_name(_ABSENT_GROUPS)
DIFFERS = _by_name(_DIFFERS_GROUPS)

# Names a counterpart provides that Accelerate keeps in another module: where Accelerate has them.
ELSEWHERE: dict[str, dict[str, str]] = {
    "accelerate": {
        "AcceleratorState": "accelerate.state",
        "GradientAccumulationPlugin": "accelerate.utils",
        "GradientState": "accelerate.state",
        "ProjectConfiguration": "accelerate.utils",
    },
    "accelerate.tracking": {
        "JsonlTracker": "triax's own: metrics.jsonl",
    },
    "accelerate.utils": {
        **{name: "accelerate.data_loader" for name in (
            "BatchSamplerShard", "DataLoaderAdapter", "DataLoaderDispatcher", "DataLoaderShard", "DataLoaderStateMixin",
            "IterableDatasetShard", "SkipBatchSampler", "SkipDataLoader", "get_sampler")},
        "DistributedOperationException": "accelerate.utils.operations",
        "SeedableRandomSampler": "accelerate.data_loader",
        "are_the_same_tensors": "accelerate.test_utils",
        "notebook_launcher": "accelerate.launchers",
        "prepare_data_loader": "accelerate.data_loader",
        "should_reduce_batch_size": "accelerate.utils.memory",
        "skip_first_batches": "accelerate.data_loader",
    },
}


def triax_module_name(accelerate_module: str) -> str:
    return "triax." + accelerate_module


def _stand_in(accelerate_module: str, name: str, why: str, home: str):
    """What `from <home> import <name>` gives for an absent name: a class (for a CapWords name, so
    class statements and annotations that mention it still load) or a function, either of which
    raises one line when called."""
    message = f"{accelerate_module}.{name}: {why}"

    def refuse(*args: Any, **kwargs: Any):
        raise UnsupportedFeatureError(message)

    if name[:1].isupper() and not name.isupper():
        return type(name, (), {"__new__": lambda cls, *args, **kwargs: refuse(), "__module__": home,
                               "__doc__": message})
    refuse.__name__ = refuse.__qualname__ = name
    refuse.__module__ = home
    refuse.__doc__ = message
    return refuse


def serve_absent(home: str):
    """A counterpart module's `__getattr__` and `__dir__` (PEP 562): Accelerate's names that
    triax lacks resolve to stand-ins, made once each."""
    accelerate_module = home.removeprefix("triax.")
    absent = ABSENT.get(accelerate_module, {})
    module = sys.modules[home]

    def __getattr__(name: str):
        why = absent.get(name)
        if why is None:
            raise AttributeError(f"module {home!r} has no attribute {name!r}")
        stand_in = _stand_in(accelerate_module, name, why, home)
        setattr(module, name, stand_in)
        return stand_in

    def __dir__():
        return sorted(set(vars(module)) | set(absent))

    return __getattr__, __dir__


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """docs/accelerate.md's table: per Accelerate module, the names triax has as they are, the ones
    it has otherwise (how) and the ones it lacks (what instead). Read from the counterpart modules'
    `__all__` and the tables above, so the page follows the code."""
    lines = []
    for accelerate_module in MODULES:
        home = triax_module_name(accelerate_module)
        provided = sorted(importlib.import_module(home).__all__)
        differs = DIFFERS.get(accelerate_module, {})
        elsewhere = ELSEWHERE.get(accelerate_module, {})
        same = [name for name in provided if name not in differs and name not in elsewhere]
        lines += [f"### `{accelerate_module}` → `{home}`", ""]
        if same:
            lines += ["Same: " + ", ".join(f"`{name}`" for name in same) + ".", ""]
        if elsewhere:
            lines += ["Also here (Accelerate keeps them elsewhere): "
                      + ", ".join(f"`{name}` ({where})" for name, where in sorted(elsewhere.items())) + ".", ""]
        rows = [("differs", text, names) for text, names in _grouped(differs)]
        rows += [("absent", text, names) for text, names in _grouped(ABSENT.get(accelerate_module, {}))]
        if rows:
            lines += ["| names | | how / instead |", "| --- | --- | --- |"]
            lines += [f"| {', '.join(f'`{name}`' for name in names)} | {kind} | {_cell(text)} |"
                      for kind, text, names in rows]
            lines.append("")
    return "\n".join(lines)


def _grouped(table: dict[str, str]) -> list[tuple[str, list[str]]]:
    """(text, names sharing it), in first-seen order."""
    groups: dict[str, list[str]] = {}
    for name, text in table.items():
        groups.setdefault(text, []).append(name)
    return [(text, sorted(names)) for text, names in groups.items()]
