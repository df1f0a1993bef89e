"""triax.Accelerator: keep your own training loop; triax places, wraps, shards and saves.

A thin façade over the triax core (docs/architecture.md, "The doors", "The core"):
runtime (rank, device, process group), precision (autocast, loss scaling), parallel (DDP),
data (GlobalSampler order), checkpoint (snapshots) and metrics (JSONL, TensorBoard).
Names and behaviour follow Hugging Face Accelerate's Accelerator so its users feel at home.

The class conducts; its concerns are components, each in its own module of _internal/:
- preparation: the prepared models, optimizers, dataloaders and schedulers, and how each is made
- gradient_sync: backward, gradient accumulation and sync, joining uneven inputs, unscaling
- state_saving: save_state / load_state, the registered objects and hooks, save_model
- experiment_tracking: the trackers of log_with
- gathering (gather_for_metrics) and process_setup (the process group and precision)
The attributes Accelerate's users read (`device_placement`, `trackers`, `_models`, ...) stay
readable and settable here under their names, held by the component they belong to.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from triax.accelerate._internal import gathering, state_saving
from triax.accelerate._internal.dynamo import resolve_dynamo
from triax.accelerate._internal.errors import AcceleratorRuntimeError, UnsupportedFeatureError
from triax.accelerate._internal.experiment_tracking import ExperimentTracking
from triax.accelerate._internal.flags import check_accelerate_environment
from triax.accelerate._internal.gradient_sync import GradientSync, start_accumulation
from triax.accelerate._internal.prepared_models import extract_model_from_parallel
from triax.accelerate._internal.options import refuse_unsupported, resolve
from triax.accelerate._internal.preparation import Preparation, named_parameters, remap_optimizer_parameters
from triax.accelerate._internal.process_setup import join_process_state
from triax.accelerate._internal.state_saving import StateSaving
from triax.accelerate.data_loader import skip_first_batches
from triax.accelerate.tracking import GeneralTracker, filter_trackers
from triax.accelerate.utils import operations
from triax.parallel.grad_clip import clip_grad_norm
from triax.parallel.no_sync import no_sync, sync_in_backward
from triax.runtime.shared_decisions import any_rank

if TYPE_CHECKING:
    from triax.accelerate._internal.fsdp_plugin import FullyShardedDataParallelPlugin
    from triax.accelerate.utils.dataclasses import (
        DataLoaderConfiguration,
        GradientAccumulationPlugin,
        ProjectConfiguration,
    )

__all__ = ["Accelerator"]


def _held_by(component: str, name: str) -> property:
    """An Accelerator attribute that one of its components holds, readable and settable under
    Accelerate's name."""
    holder = operator.attrgetter(component)
    return property(lambda accelerator: getattr(holder(accelerator), name),
                    lambda accelerator, value: setattr(holder(accelerator), name, value))

class Accelerator:
    """Accelerate's Accelerator, on triax's core: the arguments are Accelerate's, plus a few of
    triax's own (parallel, logging_dir, scheduler_steps, data_order, seed). DeepSpeed, Megatron-LM,
    XLA, fp8 and ParallelismConfig raise UnsupportedFeatureError here, naming what to use instead;
    dynamo_backend compiles each prepared model last, as Accelerate does.

    Args:
        device_placement: Move prepared models and batches to `device`.
        split_batches: Shortcut for the DataLoaderConfiguration field of that name.
        mixed_precision: "no" | "bf16" | "fp16" (also triax's "fp32", "bf16-pure"); default from
            $TRIAX_MIXED_PRECISION (set by `triax launch`) or $ACCELERATE_MIXED_PRECISION, else "no".
        gradient_accumulation_steps: Micro-steps per optimizer update inside `accumulate` (or
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=...)).
        cpu: Use the CPU even where a GPU exists.
        dataloader_config: DataLoaderConfiguration (split_batches, even_batches,
            use_seedable_sampler...).
        fsdp_plugin: Any value selects parallel="fsdp" (PyTorch's fully_shard through triax.parallel).
        log_with: "tensorboard", "jsonl", "wandb", "mlflow", "all" (the installed ones), a tracker
            object of your own, or a list of those, for init_trackers/log (triax.accelerate.tracking).
        project_dir: Where save_state and trackers write.
        project_config: ProjectConfiguration: project_dir, automatic checkpoint naming, total_limit.
        step_scheduler_with_optimizer: A prepared scheduler steps only when the optimizer really did.
        kwargs_handlers: DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs.
        even_batches: Shortcut for the DataLoaderConfiguration field of that name.
        parallel: triax's: "ddp" (default), "fsdp" or "none".
        logging_dir: triax's: where trackers write (default: project_dir).
        seed: triax's: the "seeded" data order's seed (default: the DataLoader's generator seed,
            else torch.initial_seed() of process 0).
        scheduler_steps: triax's: "per_process" (Accelerate's: a prepared scheduler steps
            num_processes times per optimizer update unless split_batches) or "per_update" (once
            per update).
        data_order: triax's: "loader" (Accelerate's: the DataLoader's own sampler and generator,
            drawn alike on every process) or "seeded" (triax's permutation of (seed, epoch),
            resumable at any world size).
    """

    def __init__(self, device_placement: bool = True, split_batches: bool | None = None,
                 mixed_precision: str | None = None, gradient_accumulation_steps: int | None = None,
                 cpu: bool = False, dataloader_config: DataLoaderConfiguration | None = None,
                 deepspeed_plugin: object | None = None, fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
                 torch_tp_plugin: object | None = None, megatron_lm_plugin: object | None = None,
                 rng_types: list[str] | None = None, log_with: str | list | GeneralTracker | None = None,
                 project_dir: str | None = None, project_config: ProjectConfiguration | None = None,
                 gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
                 step_scheduler_with_optimizer: bool = True, kwargs_handlers: list | None = None,
                 dynamo_backend: object | None = None, dynamo_plugin: object | None = None,
                 deepspeed_plugins: object | None = None, parallelism_config: object | None = None,
                 even_batches: bool | None = None, parallel: str | None = None,
                 logging_dir: str | None = None, seed: int | None = None, scheduler_steps: str = "per_process",
                 data_order: str = "loader"):
        check_accelerate_environment()
        refuse_unsupported(mixed_precision, deepspeed_plugin, megatron_lm_plugin, parallelism_config,
                           torch_tp_plugin, deepspeed_plugins)
        options = resolve(
            mixed_precision=mixed_precision, gradient_accumulation_steps=gradient_accumulation_steps,
            gradient_accumulation_plugin=gradient_accumulation_plugin, cpu=cpu, parallel=parallel,
            fsdp_plugin=fsdp_plugin, dataloader_config=dataloader_config, split_batches=split_batches,
            even_batches=even_batches, project_config=project_config, project_dir=project_dir,
            logging_dir=logging_dir, kwargs_handlers=kwargs_handlers, scheduler_steps=scheduler_steps,
            data_order=data_order, dynamo=resolve_dynamo(dynamo_backend, dynamo_plugin))
        self.state, precision = join_process_state(options)
        self.gradient_state, self._grad_scaler = start_accumulation(options, precision, self.state.device)
        # As Accelerate: the shuffling generator of a prepared dataloader is synchronised.
        self._preparation = Preparation(
            self.state, precision, options, self.gradient_state, self._grad_scaler, device_placement,
            step_scheduler_with_optimizer, seed=seed if seed is not None else options.dataloader.data_seed,
            rng_types=["generator"] if rng_types is None else rng_types)
        self._gradient_sync = GradientSync(self.gradient_state, self._grad_scaler, self._preparation)
        self._state_saving = StateSaving(self._preparation, options.project, self._gradient_sync)
        self._tracking = ExperimentTracking(self.state, filter_trackers(log_with, self.logging_dir))
        self._handlers = options.handlers
        self._trigger = False

    # ---- what the components hold, under Accelerate's names ---------------------------------------

    precision = _held_by("_preparation", "precision")
    parallel = _held_by("_preparation", "parallel")
    dataloader_config = _held_by("_preparation", "dataloader_config")
    device_placement = _held_by("_preparation", "device_placement")
    step_scheduler_with_optimizer = _held_by("_preparation", "step_scheduler_with_optimizer")
    scheduler_steps = _held_by("_preparation", "scheduler_steps")
    data_order = _held_by("_preparation", "data_order")
    seed = _held_by("_preparation", "seed")
    rng_types = _held_by("_preparation", "rng_types")
    _ddp_options = _held_by("_preparation", "ddp_options")
    _fsdp = _held_by("_preparation", "fsdp")
    _models = _held_by("_preparation", "models")
    _optimizers = _held_by("_preparation", "optimizers")
    _schedulers = _held_by("_preparation", "schedulers")
    _dataloaders = _held_by("_preparation", "dataloaders")
    # Accelerate's micro-step counter: +1 per `accumulate` block, 0 again after a dataloader's
    # last batch (sync_with_dataloader); scripts read it, the decision is GradientState's.
    step = _held_by("_gradient_sync", "step")
    project_configuration = _held_by("_state_saving", "project")
    _custom_objects = _held_by("_state_saving", "custom_objects")
    _save_model_state_pre_hook = _held_by("_state_saving", "save_pre_hooks")
    _load_model_state_pre_hook = _held_by("_state_saving", "load_pre_hooks")
    log_with = _held_by("_tracking", "log_with")
    trackers = _held_by("_tracking", "trackers")  # started by init_trackers, on the main process only

    # ---- who am I (PartialState's answers) ------------------------------------------------------

    num_processes = property(lambda self: self.state.num_processes)
    process_index = property(lambda self: self.state.process_index)
    local_process_index = property(lambda self: self.state.local_process_index)
    is_main_process = property(lambda self: self.state.is_main_process)
    is_local_main_process = property(lambda self: self.state.is_local_main_process)
    is_last_process = property(lambda self: self.state.is_last_process)
    use_distributed = property(lambda self: self.state.use_distributed)
    distributed_type = property(lambda self: self.state.distributed_type)
    multi_device = use_distributed

    # Read through the state, as Accelerate does: after AcceleratorState._reset_state() they raise
    # AttributeError (the Accelerator must be made again), so prepare cannot use a forgotten state.
    device = property(lambda self: self.state.device)
    place = property(lambda self: self.state.place)

    @property
    def mixed_precision(self) -> str:
        return self.state.mixed_precision

    @property
    def is_fsdp2(self) -> bool:
        """True when prepared models are sharded: triax's FSDP is always FSDP2 (fully_shard)."""
        return self.state.is_fsdp2

    is_composable_parallelism_enabled = is_fsdp2  # as Accelerate

    # ---- what scripts read of Accelerate's configuration ------------------------------------------

    dispatch_batches = property(lambda self: self.dataloader_config.dispatch_batches)
    use_seedable_sampler = property(lambda self: self.dataloader_config.use_seedable_sampler)
    non_blocking = property(lambda self: self.dataloader_config.non_blocking)
    use_stateful_dataloader = property(lambda self: self.dataloader_config.use_stateful_dataloader)
    # The kwargs_handlers given (None where none was), as Accelerate keeps them.
    ddp_handler = property(lambda self: self._handler("DistributedDataParallelKwargs"))
    scaler_handler = property(lambda self: self._handler("GradScalerKwargs"))
    init_handler = property(lambda self: self._handler("InitProcessGroupKwargs"))
    autocast_handler = property(lambda self: self._handler("AutocastKwargs"))

    # The loss scaler of fp16 on CUDA; None otherwise, as Accelerate's (scripts test `is not None`).
    scaler = property(lambda self: self._grad_scaler if self._grad_scaler.is_enabled() else None)

    def _handler(self, class_name: str):
        return next((handler for cls, handler in self._handlers.items() if cls.__name__ == class_name), None)

    # Features triax leaves out (refused when asked for: DeepSpeed, ParallelismConfig, fp8, profiling
    # handlers, LOMO): Accelerate's values when they are off, so a script's checks take the plain path.
    deepspeed_plugin = property(lambda self: None)
    parallelism_config = property(lambda self: None)
    torch_device_mesh = property(lambda self: None)
    profile_handler = property(lambda self: None)
    fp8_recipe_handler = ao_recipe_handler = te_recipe_handler = msamp_recipe_handler = profile_handler
    has_fp8_handler = fp8_enabled = delayed_fp8_autocast = property(lambda self: False)
    fp8_backend = property(lambda self: "NO")  # Accelerate's FP8BackendType.NO, a str enum equal to "NO"
    has_lomo_optimizer = property(lambda self: False)
    # Accelerate saves from every process when its ParallelismConfig is unset, as here.
    should_save_model = property(lambda self: True)

    @property
    def flag_tensor(self):
        """Accelerate's set_trigger flag: a tensor once set_trigger was called (until check_trigger)."""
        return torch.tensor(1, device=self.device) if self._trigger else None

    @property
    def data_parallel_rank(self) -> int:
        raise AcceleratorRuntimeError("Data parallelism is not configured. Set `parallelism_config` first. "
                                      "(triax refuses ParallelismConfig; use process_index)")

    data_parallel_shard_rank = tensor_parallel_rank = data_parallel_rank

    @property
    def context_parallel_rank(self) -> int:
        raise UnsupportedFeatureError("context parallelism is not supported (in Accelerate neither)")

    pipeline_parallel_rank = context_parallel_rank

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers: list | None = None, buffer_seq_dims: list | None = None,
                               no_restore_buffers: object | None = None):
        """Context parallelism is off (no ParallelismConfig): the block runs as it is, as in Accelerate."""
        yield

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        """True if a module of `model` was placed by a device map over more than one entry."""
        return any(len(getattr(module, "hf_device_map", None) or {}) > 1 for module in model.modules())

    def profile(self, profile_handler: object | None = None):
        raise UnsupportedFeatureError("Accelerator.profile is not supported (triax refuses ProfileKwargs); "
                                      "use torch.profiler.profile(...) around the steps")

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        raise UnsupportedFeatureError("LOMO optimizers are not supported; use accelerator.backward(loss) with "
                                      "a torch.optim optimizer")

    def deepspeed_ulysses_dl_adapter(self, dl: torch.utils.data.DataLoader, model: torch.nn.Module):
        """Sequence parallelism is off (no ParallelismConfig): the dataloader as it is, as in Accelerate."""
        return dl

    @property
    def native_amp(self) -> bool:
        return self.precision.uses_autocast

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        self.gradient_state.accumulation_steps = steps

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

    def wait_for_everyone(self) -> None:
        self.state.wait_for_everyone()

    def main_process_first(self):
        """The main process runs the block first (e.g. to download or preprocess), then the rest.
        If it raises there, every process raises (none waits for the timeout)."""
        return self.state.main_process_first()

    def local_main_process_first(self):
        return self.state.local_main_process_first()

    def split_between_processes(self, inputs: Any, apply_padding: bool = False):
        """This process's share of `inputs` (list, tuple, tensor, or dict of them)."""
        return self.state.split_between_processes(inputs, apply_padding=apply_padding)

    # The on_* decorators: run the function on some processes only (the others get None).
    def on_main_process(self, function: Callable):
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable):
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable):
        return self.state.on_last_process(function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None):
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None):
        return self.state.on_local_process(function, local_process_index=local_process_index)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print once per machine."""
        self.state.print(*args, **kwargs)

    # ---- stopping together ----------------------------------------------------------------------

    def set_trigger(self) -> None:
        """Mark that this process wants everyone to act (e.g. stop); see check_trigger."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every process if any process called set_trigger since the last check (which
        resets it). A collective: call it on every process at the same point."""
        fired = any_rank(self._trigger)
        if fired:
            self._trigger = False
        return fired

    def prepare(self, *objects: Any, device_placement: list[bool] | None = None):
        """Models, optimizers, dataloaders and LR schedulers in any order; returned in that order.
        Models go first (optimizers and schedulers refer to their parameters), then optimizers,
        dataloaders, and schedulers last (they wrap prepared optimizers). Preparing an object a
        second time returns the prepared one unchanged."""
        return self._preparation.prepare(objects, device_placement, lambda kind: getattr(self, f"prepare_{kind}"))

    def _get_named_parameters(self, *objects: Any, drop_refs: bool = False) -> dict:
        return named_parameters(objects, drop_refs)

    def _remap_optimizer_parameters(self, old_named_params: dict, *objects: Any) -> None:
        remap_optimizer_parameters(old_named_params, objects)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        return self._preparation.prepare_model(model, device_placement, evaluation_mode)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None):
        return self._preparation.prepare_optimizer(optimizer, device_placement)

    def prepare_scheduler(self, scheduler: torch.optim.lr_scheduler.LRScheduler, device_placement: bool | None = None):
        return self._preparation.prepare_scheduler(scheduler, device_placement)

    def prepare_data_loader(self, dataloader: DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Callable | None = None):
        """This process's share of `dataloader`: a DataLoaderShard (or DataLoaderDispatcher), drawing
        the same random numbers as Accelerate's (triax.accelerate.data_loader)."""
        return self._preparation.prepare_data_loader(dataloader, device_placement, slice_fn_for_dispatch)

    prepare_dataloader = prepare_data_loader

    def skip_first_batches(self, dataloader: torch.utils.data.DataLoader, num_batches: int = 0):
        """The same dataloader, whose next pass starts `num_batches` batches into the epoch."""
        return skip_first_batches(dataloader, num_batches)

    # ---- the step -------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """loss.backward(), divided for accumulation and scaled for fp16."""
        self._gradient_sync.backward(loss, **kwargs)

    def accumulate(self, *models: torch.nn.Module):
        """One micro-step: gradients are synchronised (and the optimizer/scheduler step) only on
        every gradient_accumulation_steps-th micro-step and, with sync_with_dataloader (the
        default), on the last batch of a dataloader. sync_each_batch reduces gradients on every
        micro-step but still steps only on those."""
        return self._gradient_sync.accumulate(models)

    def no_sync(self, model: torch.nn.Module):
        """Skip the gradient all-reduce for backward passes in this block (DDP's no_sync; FSDP2
        skips its reduce-scatter)."""
        return no_sync(model)

    @staticmethod
    def trigger_sync_in_backward(model: torch.nn.Module):
        """The backward inside this block reduces gradients even after forwards under no_sync."""
        return sync_in_backward(model)

    def join_uneven_inputs(self, joinables: list, even_batches: bool | None = None):
        """Train or evaluate on data that gives processes different numbers of batches: processes
        that run out shadow the others' collectives (torch.distributed.algorithms.Join).
        even_batches overrides the prepared map-style dataloaders' setting inside the block (pass
        False to stop padding the last batch); Join is on only when batches are not evened out.
        As in Accelerate, it only warns (and does nothing) unless the processes are plain data
        parallel (distributed_type MULTI_CPU, MULTI_GPU, ...)."""
        return self._gradient_sync.join_uneven_inputs(joinables, even_batches)

    def autocast(self, autocast_handler: object | None = None):
        """Forward under the mixed-precision policy's autocast (no-op for fp32)."""
        return self.precision.autocast(self.device)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Divide fp16 gradients by the loss scale (once per step) before inspecting them."""
        self._gradient_sync.unscale_gradients(optimizer)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2):
        """Clip to a global norm across processes and layouts (triax.parallel.grad_clip); returns
        the norm before clipping."""
        self.unscale_gradients()
        return clip_grad_norm(list(parameters), float(max_norm), norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return self._gradient_sync.optimizer_step_was_skipped

    # ---- collectives ----------------------------------------------------------------------------

    def gather(self, tensor: Any):
        return operations.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False):
        """gather, then drop the samples repeated to even out the last batch, so each sample of
        the dataset is counted once."""
        return gathering.gather_for_metrics(input_data, use_gather_object, self.gradient_state)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
        return operations.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0):
        return operations.reduce(tensor, reduction=reduction, scale=scale)

    def broadcast(self, tensor: Any, from_process: int = 0):
        return operations.broadcast(tensor, from_process=from_process)

    # ---- models and state -----------------------------------------------------------------------

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        """The model as the script made it: without DDP (or DataParallel) around it; without the
        mixed-precision forward with keep_fp32_wrapper=False; and with keep_torch_compile=False
        without its torch.compile wrapper either (triax.accelerate._internal.prepared_models.extract_model_from_parallel)."""
        return extract_model_from_parallel(model, keep_fp32_wrapper=keep_fp32_wrapper,
                                           keep_torch_compile=keep_torch_compile)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict:
        """The full, name-keyed state of a (possibly wrapped or sharded) model, on CPU. Weights
        that offloading hooks keep off the model (Accelerate's big-model dispatch leaves them on the
        meta device) are read from the hooks."""
        return state_saving.get_state_dict(model)

    def save_model(self, model: torch.nn.Module, save_directory: str, safe_serialization: bool = True,
                   **unused: Any) -> str | None:
        """Write the model's full weights to save_directory/model.safetensors (main process).
        A collective: if the main process cannot write, every process raises."""
        return state_saving.save_model(self.get_state_dict(model), save_directory, safe_serialization,
                                       self.is_main_process)

    def save(self, obj: Any, path: str, safe_serialization: bool = False) -> None:
        """torch.save on the main process only."""
        if self.is_main_process:
            torch.save(obj, path)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """save_state / load_state also save and restore these objects (each has state_dict() and
        load_state_dict()). A ValueError, as Accelerate's, names every object that has not."""
        self._state_saving.register_for_checkpointing(objects)

    def register_save_state_pre_hook(self, hook: Callable):
        """hook(models, weights, output_dir) runs in save_state before anything is written. A hook
        that saves a model its own way removes it from `models` (or its entry from `weights`);
        save_state then leaves that model out. Returns a handle whose remove() unregisters it."""
        return self._state_saving.register_hook(self._save_model_state_pre_hook, hook)

    def register_load_state_pre_hook(self, hook: Callable):
        """hook(models, input_dir) runs in load_state before anything is read; a model the hook
        loads itself is removed from `models` (it must have been left out of save_state too)."""
        return self._state_saving.register_hook(self._load_model_state_pre_hook, hook)

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **unused: Any) -> str:
        """Save everything needed to continue: models, optimizers, schedulers, scaler, dataloader
        positions, RNG states, registered objects. Collective: call on every process. Writes
        Accelerate's folder (model.safetensors, optimizer.bin, random_states_<rank>.pkl, ...: see
        _internal/accelerate_folder.py) plus triax's manifest into output_dir, or with
        automatic_checkpoint_naming into <project_dir>/checkpoints/checkpoint_<iteration> (keeping
        at most total_limit), or else <project_dir>/checkpoints; returns that folder. Under FSDP
        the models and optimizers go in Accelerate's FSDP layout (_internal/fsdp_folder.py): sharded, each
        process writing its shards, or whole by process 0 (state_dict_type)."""
        return self._state_saving.save_state(output_dir, safe_serialization)

    def load_state(self, input_dir: str | None = None, **unused: Any) -> str:
        """Restore what save_state wrote: an Accelerate checkpoint folder (written by Accelerate
        or triax), a triax snapshot step_* folder, or the latest snapshot under a root; with
        automatic_checkpoint_naming and no directory, the newest checkpoint_<n>. Prepare the same
        objects first; the dataloaders' next pass continues the saved epoch."""
        return self._state_saving.load_state(input_dir)

    # ---- tracking -------------------------------------------------------------------------------

    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Start the trackers of log_with (main process only): each named one is made with
        project_name (and logging_dir when it writes files: <logging_dir>/<project_name>) and
        init_kwargs[name], then every tracker's start() runs, then `config` is stored with each."""
        self._tracking.start(project_name, config, init_kwargs, self.logging_dir)

    def get_tracker(self, name: str, unwrap: bool = False):
        """The tracker called `name` (its library's own object with unwrap=True); a tracker that
        does nothing on processes without trackers, as Accelerate's."""
        return self._tracking.get(name, unwrap)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Log `values` to every tracker (main process only); log_kwargs[name] goes to that tracker."""
        self._tracking.log(values, step, log_kwargs)

    def end_training(self) -> None:
        """Finish the trackers and leave the process group, as Accelerate's end_training."""
        self._tracking.finish()
        self.state.destroy_process_group()

    def free_memory(self, *objects: Any):
        """Forget every prepared object (and empty the CUDA cache); returns `objects` as Nones."""
        self._preparation.forget()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return [None] * len(objects) if len(objects) != 1 else None

    clear = free_memory

