"""triax.Accelerator: keep your own training loop; triax places, wraps, shards and saves.

A thin façade over the triax core (docs/architecture.md, "The doors", "The core"):
runtime (rank, device, process group), precision (autocast, loss scaling), parallel (DDP),
data (GlobalSampler order), checkpoint (snapshots) and metrics (JSONL, TensorBoard).
Names and behaviour follow Hugging Face Accelerate's Accelerator so its users feel at home.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

from triax.accelerate._internal import accelerate_folder, checkpoints
from triax.accelerate._internal.errors import (
    AcceleratorRuntimeError,
    AcceleratorTypeError,
    AcceleratorValueError,
    UnsupportedFeatureError,
)
from triax.accelerate._internal.flags import check_accelerate_environment
from triax.accelerate._internal.fsdp import FULL, shard_model, state_dict_type
from triax.accelerate._internal.models import extract_model_from_parallel, offloaded_state_dict
from triax.accelerate._internal.nested import convert_to_fp32
from triax.accelerate._internal.options import refuse_unsupported, resolve, unsupported
from triax.accelerate._internal.saving import load_state as _load_state
from triax.accelerate._internal.wrappers import PreparedOptimizer, PreparedScheduler
from triax.accelerate.data_loader import (
    DataLoaderDispatcher,
    DataLoaderShard,
    prepare_data_loader,
    skip_first_batches,
)
from triax.accelerate.state import AcceleratorState, GradientState, share_with_accelerate
from triax.accelerate.tracking import GeneralTracker, filter_trackers, start_trackers
from triax.accelerate.utils import operations
from triax.accelerate.utils.dataclasses import DistributedType
from triax.parallel.ddp import apply_ddp, unwrap
from triax.parallel.grad_clip import clip_grad_norm
from triax.parallel.no_sync import no_sync, sync_in_backward
from triax.runtime.failure_agreement import raise_together
from triax.runtime.precision import Precision
from triax.runtime.shared_decisions import any_rank

if TYPE_CHECKING:
    from triax.accelerate._internal.fsdp_plugin import FullyShardedDataParallelPlugin
    from triax.accelerate._internal.options import Options
    from triax.accelerate.utils.dataclasses import (
        DataLoaderConfiguration,
        GradientAccumulationPlugin,
        ProjectConfiguration,
    )

__all__ = ["Accelerator"]


class Accelerator:
    """Accelerate's Accelerator, on triax's core: the arguments are Accelerate's, plus a few of
    triax's own (parallel, logging_dir, scheduler_steps, data_order, seed). DeepSpeed, Megatron-LM,
    XLA, fp8, ParallelismConfig and dynamo_backend raise UnsupportedFeatureError here, naming what
    to use instead.

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
                           dynamo_backend, dynamo_plugin, torch_tp_plugin, deepspeed_plugins)
        options = resolve(
            mixed_precision=mixed_precision, gradient_accumulation_steps=gradient_accumulation_steps,
            gradient_accumulation_plugin=gradient_accumulation_plugin, cpu=cpu, parallel=parallel,
            fsdp_plugin=fsdp_plugin, dataloader_config=dataloader_config, split_batches=split_batches,
            even_batches=even_batches, project_config=project_config, project_dir=project_dir,
            logging_dir=logging_dir, kwargs_handlers=kwargs_handlers, scheduler_steps=scheduler_steps,
            data_order=data_order)
        self.precision = Precision(options.precision_policy)
        self._mixed_precision = options.mixed_precision
        self.parallel = options.parallel
        self.dataloader_config = options.dataloader
        self.project_configuration = options.project
        self._ddp_options = options.ddp_options
        self._fsdp = options.fsdp
        self._grad_compression = options.grad_compression
        self._join_process_state(options)
        self._start_accumulation(options)
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.scheduler_steps = options.scheduler_steps
        self.data_order = options.data_order
        self.device_placement = device_placement
        self.seed = seed if seed is not None else self.dataloader_config.data_seed
        # As Accelerate: the shuffling generator of a prepared dataloader is synchronised.
        self.rng_types = ["generator"] if rng_types is None else rng_types
        self.log_with = filter_trackers(log_with, self.logging_dir)
        self.trackers: list = []  # started by init_trackers, on the main process only
        self._start_empty()
        self._handlers = options.handlers
        # Accelerate's micro-step counter: +1 per `accumulate` block, 0 again after a dataloader's
        # last batch (sync_with_dataloader); scripts read it, the decision is GradientState's.
        self.step = 0

    def _join_process_state(self, options: Options) -> None:
        """Join the process group (or use the one the script created) once per process, and settle
        the precision on the device it gives."""
        self.state = AcceleratorState(mixed_precision={"fp32": "no"}.get(self._mixed_precision, self._mixed_precision),
                                      cpu=options.cpu, timeout=options.init_timeout, backend=options.init_backend)
        self.state.fsdp = self.parallel == "fsdp"
        self.state.fsdp_plugin = options.fsdp_plugin
        if self.precision.needs_loss_scaling and self.state.device.type == "cpu":
            # As Accelerate: fp16 on CPU is accepted and runs without autocast or loss scaling
            # (fp32 arithmetic); the state still reports "fp16".
            self.precision = Precision("fp32")
        self.precision.check_device(self.state.device)
        share_with_accelerate(self.state.mixed_precision, cpu=self.state.device.type == "cpu")

    def _start_accumulation(self, options: Options) -> None:
        """The GradientState of gradient accumulation, and the loss scaler."""
        plugin = options.accumulation
        # Accelerate's GradientState keeps the plugin's to_kwargs() (the fields changed from their
        # defaults) and reads adjust_scheduler from it with default False: the plugin's default True
        # never reaches the scheduler. Followed, since the scheduler's saved _step_count depends on it.
        recorded = plugin.to_kwargs()
        self.gradient_state = GradientState(plugin.num_steps, sync_with_dataloader=plugin.sync_with_dataloader,
                                            sync_each_batch=plugin.sync_each_batch,
                                            adjust_scheduler=recorded.get("adjust_scheduler", False),
                                            plugin_kwargs=recorded)
        # Always a GradScaler inside (a disabled one passes losses and steps through unchanged);
        # `scaler` shows it only when it scales, as Accelerate's is None without fp16.
        self._grad_scaler = self.precision.make_scaler(self.device)
        if self._grad_scaler.is_enabled() and options.scaler_options:
            self._grad_scaler = torch.amp.GradScaler(self.device.type, **options.scaler_options)

    def _start_empty(self) -> None:
        """What prepare, register_for_checkpointing and the state hooks fill in."""
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[PreparedOptimizer] = []
        self._schedulers: list[PreparedScheduler] = []
        self._dataloaders: list = []  # DataLoaderShard / DataLoaderDispatcher
        self._custom_objects: list = []
        self._replaced_parameters: dict[int, torch.nn.Parameter] = {}  # FSDP: id(old) -> sharded
        # OrderedDicts: torch's RemovableHandle keeps a weak reference to them (plain dicts refuse).
        self._save_model_state_pre_hook: OrderedDict = OrderedDict()
        self._load_model_state_pre_hook: OrderedDict = OrderedDict()
        self._trigger = False

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
    def _saves_full_state_dict(self) -> bool:
        """FSDP with state_dict_type FULL_STATE_DICT: save_state gathers the model and optimizer on
        process 0's CPU, which writes them alone (Accelerate's rule); otherwise each process
        writes its own shards."""
        return self.is_fsdp2 and self.state.fsdp_plugin is not None and state_dict_type(self.state.fsdp_plugin) == FULL

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

    # ---- prepare --------------------------------------------------------------------------------

    def prepare(self, *objects: Any, device_placement: list[bool] | None = None):
        """Models, optimizers, dataloaders and LR schedulers in any order; returned in that order.
        Models go first (optimizers and schedulers refer to their parameters), then optimizers,
        dataloaders, and schedulers last (they wrap prepared optimizers). Preparing an object a
        second time returns the prepared one unchanged."""
        placement = device_placement or [self.device_placement] * len(objects)
        if len(placement) != len(objects):
            raise AcceleratorValueError(f"prepare got {len(objects)} objects but device_placement has "
                                        f"{len(placement)} entries")
        results = list(objects)
        kinds = [self._kind(obj) for obj in objects]
        for kind in ("model", "optimizer", "dataloader", "scheduler"):
            for index, obj in enumerate(objects):
                if kinds[index] == kind:
                    results[index] = getattr(self, f"prepare_{kind}")(obj, device_placement=placement[index])
                    # As Accelerate: what prepare made says so (libraries check it before preparing again).
                    results[index]._is_accelerate_prepared = True
        return results[0] if len(results) == 1 else tuple(results)

    @staticmethod
    def _kind(obj: Any) -> str | None:
        if isinstance(obj, torch.nn.Module):
            return "model"
        if isinstance(obj, torch.optim.Optimizer):
            return "optimizer"
        if isinstance(obj, DataLoader):
            return "dataloader"
        if isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, PreparedScheduler)) or (
                hasattr(obj, "step") and hasattr(obj, "optimizer") and hasattr(obj, "state_dict")):
            return "scheduler"
        return None

    def _already_prepared(self, obj: Any, prepared: list, raw_attribute: str | None = None):
        """The prepared object for `obj` if it (or what it wraps) was prepared before, else None."""
        for item in prepared:
            if item is obj or (raw_attribute and getattr(item, raw_attribute, None) is obj):
                return item
        return None

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        already = self._already_prepared(model, self._models) or next(
            (m for m in self._models if unwrap(m) is model), None)
        if already is not None:
            return already  # a second prepare of the same model: registering it twice would break save_state
        device_map = getattr(model, "hf_device_map", None)
        quantized = getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)
        if quantized and isinstance(device_map, dict) and {"cpu", "disk"} & {str(d) for d in device_map.values()}:
            raise AcceleratorValueError(f"prepare got a model loaded in 8-bit or 4-bit precision with CPU or disk "
                                        f"offload (hf_device_map {device_map}); a quantized model cannot be trained "
                                        "with offloaded weights: load it whole onto the training device")
        if isinstance(device_map, dict) and len({str(d) for d in device_map.values()}) > 1:
            raise unsupported("device maps", "prepare got a model loaded with a device_map over several devices")
        if device_placement is None:
            device_placement = self.device_placement
        trainable = any(p.requires_grad for p in model.parameters())
        wrap = self.parallel if self.use_distributed and trainable and not evaluation_mode else None
        if device_placement and wrap != "fsdp":  # fully_shard places the shards itself
            model = model.to(self.device)
        if self.precision.param_dtype != torch.float32:
            model = model.to(dtype=self.precision.param_dtype)
        if wrap == "ddp":
            model = apply_ddp(model, self.device, grad_compression=self._grad_compression,
                              ddp_options=self._ddp_options)
        elif wrap == "fsdp":
            model = self._apply_fsdp(model)
        if self.precision.uses_autocast:
            self._autocast_forward(model)
        self._models.append(model)
        return model

    def _apply_fsdp(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard parameters, gradients and optimizer state with FSDP2 (triax.parallel.fsdp).
        fully_shard replaces parameters with DTensors: an optimizer made before prepare is
        pointed at the new ones in prepare_optimizer, by parameter name."""
        from torch.distributed.device_mesh import init_device_mesh

        before = dict(model.named_parameters())
        mesh = init_device_mesh(self.device.type, (self.num_processes,))
        mixed_precision = self.precision.name if self.precision.uses_autocast else "no"
        shard_model(model, self._fsdp, mesh, self.device, mixed_precision, self.process_index)
        after = dict(model.named_parameters())
        self._replaced_parameters.update({id(before[name]): after[name] for name in before if name in after})
        return model

    def _autocast_forward(self, model: torch.nn.Module) -> None:
        """Run the model's forward under autocast and hand its fp16/bf16 outputs back in fp32, like
        Accelerate (convert_outputs_to_fp32), so loops need no change and the loss is computed in fp32."""
        original = model.forward
        precision, device = self.precision, self.device

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any):
            with precision.autocast(device):
                outputs = original(*args, **kwargs)
            return convert_to_fp32(outputs)

        forward.__wrapped_by_triax__ = True
        model.forward = forward

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None):
        already = self._already_prepared(optimizer, self._optimizers, "optimizer")
        if already is not None:
            return already
        if self._replaced_parameters:
            if optimizer.state:
                raise AcceleratorValueError("with parallel='fsdp', prepare the optimizer before it has taken a "
                                            "step (its state cannot follow the parameters into shards)")
            for group in optimizer.param_groups:
                group["params"] = [self._replaced_parameters.get(id(p), p) for p in group["params"]]
        if optimizer.state and device_placement is not False:
            # Optimizer.load_state_dict casts state onto each parameter's (new) device.
            optimizer.load_state_dict(optimizer.state_dict())
        prepared = PreparedOptimizer(optimizer, self.gradient_state, self._grad_scaler)
        self._optimizers.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: torch.optim.lr_scheduler.LRScheduler, device_placement: bool | None = None):
        already = self._already_prepared(scheduler, self._schedulers, "scheduler")
        if already is not None:
            return already
        owners = [opt for opt in self._optimizers
                  if scheduler.optimizer is opt or scheduler.optimizer is opt.optimizer]
        per_process = self.scheduler_steps == "per_process"
        steps = self.num_processes if per_process and not self.split_batches else 1
        prepared = PreparedScheduler(scheduler, owners, self.gradient_state, self.step_scheduler_with_optimizer,
                                     steps_per_update=steps, count_micro_steps=per_process)
        self._schedulers.append(prepared)
        return prepared

    def prepare_data_loader(self, dataloader: DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Callable | None = None):
        """This process's share of `dataloader`: a DataLoaderShard (or DataLoaderDispatcher), drawing
        the same random numbers as Accelerate's (triax.accelerate.data_loader)."""
        if isinstance(dataloader, (DataLoaderShard, DataLoaderDispatcher)):
            if not any(dataloader is known for known in self._dataloaders):
                self._dataloaders.append(dataloader)
            return dataloader
        if device_placement is None:
            device_placement = self.device_placement
        config = self.dataloader_config
        order_seed = None
        if self.data_order == "seeded":
            order_seed = self.seed
            if order_seed is None:
                generator = getattr(dataloader, "generator", None)
                order_seed = generator.initial_seed() if generator is not None else torch.initial_seed()
            # Every process must draw the same order: process 0's seed wins.
            order_seed = operations.broadcast_object_list([int(order_seed) % 2**63])[0]
        prepared = prepare_data_loader(
            dataloader, self.device, num_processes=self.num_processes, process_index=self.process_index,
            split_batches=config.split_batches, put_on_device=device_placement, rng_types=list(self.rng_types),
            dispatch_batches=config.dispatch_batches, even_batches=config.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch, use_seedable_sampler=config.use_seedable_sampler,
            data_seed=config.data_seed, non_blocking=config.non_blocking,
            use_stateful_dataloader=config.use_stateful_dataloader, order_seed=order_seed)
        self._dataloaders.append(prepared)
        return prepared

    prepare_dataloader = prepare_data_loader

    def skip_first_batches(self, dataloader: torch.utils.data.DataLoader, num_batches: int = 0):
        """The same dataloader, whose next pass starts `num_batches` batches into the epoch."""
        return skip_first_batches(dataloader, num_batches)

    # ---- the step -------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """loss.backward(), divided for accumulation and scaled for fp16."""
        if self.gradient_state.accumulation_steps > 1:
            loss = loss / self.gradient_state.accumulation_steps
        self._grad_scaler.scale(loss).backward(**kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module):
        """One micro-step: gradients are synchronised (and the optimizer/scheduler step) only on
        every gradient_accumulation_steps-th micro-step and, with sync_with_dataloader (the
        default), on the last batch of a dataloader. sync_each_batch reduces gradients on every
        micro-step but still steps only on those."""
        state = self.gradient_state
        self.step = 0 if state.sync_with_dataloader and state.end_of_dataloader else self.step + 1
        sync = state.next_micro_step() or state.sync_each_batch
        with contextlib.ExitStack() as stack:
            if not sync:
                for model in models:
                    stack.enter_context(no_sync(model))
            yield

    def no_sync(self, model: torch.nn.Module):
        """Skip the gradient all-reduce for backward passes in this block (DDP's no_sync; FSDP2
        skips its reduce-scatter)."""
        return no_sync(model)

    @staticmethod
    def trigger_sync_in_backward(model: torch.nn.Module):
        """The backward inside this block reduces gradients even after forwards under no_sync."""
        return sync_in_backward(model)

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list, even_batches: bool | None = None):
        """Train or evaluate on data that gives processes different numbers of batches: processes
        that run out shadow the others' collectives (torch.distributed.algorithms.Join).
        even_batches overrides the prepared map-style dataloaders' setting inside the block (pass
        False to stop padding the last batch); Join is on only when batches are not evened out.
        As in Accelerate, it only warns (and does nothing) unless the processes are plain data
        parallel (distributed_type MULTI_CPU, MULTI_GPU, ...)."""
        from torch.distributed.algorithms.join import Join, Joinable

        if not self.state.multi_device:
            if self.distributed_type != DistributedType.NO:
                warnings.warn("join_uneven_inputs is only supported for multi-GPU and multi-CPU data parallel "
                              f"training (this is {self.distributed_type}); it has no effect here", stacklevel=3)
            yield
            return
        saved = []
        if even_batches is not None:
            for loader in self._dataloaders:
                if isinstance(loader, DataLoaderDispatcher) or not hasattr(loader.batch_sampler, "even_batches"):
                    continue
                saved.append((loader, loader.batch_sampler.even_batches))
                loader.batch_sampler.even_batches = even_batches
            if any(isinstance(loader, DataLoaderDispatcher) for loader in self._dataloaders):
                warnings.warn("join_uneven_inputs(even_batches=...) is only supported for map-style datasets; "
                              "the prepared dataloaders over iterable datasets keep their setting", stacklevel=3)
        else:
            even_batches = self.even_batches
        items = [getattr(item, "optimizer", item) if isinstance(item, PreparedOptimizer) else item
                 for item in joinables]
        items = [item for item in items if isinstance(item, Joinable)]
        try:
            if items and not even_batches:
                with Join(items, enable=True, throw_on_early_termination=False):
                    yield
            else:
                yield
        finally:
            for loader, value in saved:
                loader.batch_sampler.even_batches = value

    def autocast(self, autocast_handler: object | None = None):
        """Forward under the mixed-precision policy's autocast (no-op for fp32)."""
        return self.precision.autocast(self.device)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Divide fp16 gradients by the loss scale (once per step) before inspecting them."""
        if not self._grad_scaler.is_enabled() or not self.sync_gradients:
            return
        targets = self._optimizers if optimizer is None else (
            optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])
        for target in targets:
            if isinstance(target, PreparedOptimizer) and not target.gradients_unscaled:
                self._grad_scaler.unscale_(target.optimizer)
                target.gradients_unscaled = True

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
        return any(optimizer.step_was_skipped for optimizer in self._optimizers)

    # ---- collectives ----------------------------------------------------------------------------

    def gather(self, tensor: Any):
        return operations.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False):
        """gather, then drop the samples repeated to even out the last batch, so each sample of
        the dataset is counted once."""
        tensors_only = []
        operations.map_tensors(lambda t: tensors_only.append(t), input_data)
        if use_gather_object or not tensors_only:
            items = input_data if isinstance(input_data, list) else [input_data]
            data = operations.gather_object(items)
        else:
            data = operations.gather(input_data)
        # At the end of a dataloader, the last global batch keeps only its real samples (the rest
        # repeat the start of the epoch to even the batches out).
        keep = self.gradient_state.remainder
        if self.gradient_state.end_of_dataloader and keep > 0:
            if isinstance(data, list):
                return data[:keep]
            return operations.map_tensors(lambda t: t[:keep], data)
        return data

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
        without its torch.compile wrapper either (triax.accelerate._internal.models.extract_model_from_parallel)."""
        return extract_model_from_parallel(model, keep_fp32_wrapper=keep_fp32_wrapper,
                                           keep_torch_compile=keep_torch_compile)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict:
        """The full, name-keyed state of a (possibly wrapped or sharded) model, on CPU. Weights
        that offloading hooks keep off the model (Accelerate's big-model dispatch leaves them on the
        meta device) are read from the hooks."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if any(tensor.is_meta for tensor in model.state_dict().values()):
            return offloaded_state_dict(extract_model_from_parallel(model))
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_model(self, model: torch.nn.Module, save_directory: str, safe_serialization: bool = True,
                   **unused: Any) -> str | None:
        """Write the model's full weights to save_directory/model.safetensors (main process).
        A collective: if the main process cannot write, every process raises."""
        state = self.get_state_dict(model)
        path, error = None, None
        if self.is_main_process:
            try:
                path = _write_weights(state, save_directory, safe_serialization)
            except OSError as failure:
                error = AcceleratorRuntimeError(f"save_model could not write to {save_directory!r} "
                                                f"({type(failure).__name__}: {failure.strerror or failure})")
        with raise_together("saving the model (save_model)", AcceleratorRuntimeError):
            if error is not None:
                raise error
        return path

    def save(self, obj: Any, path: str, safe_serialization: bool = False) -> None:
        """torch.save on the main process only."""
        if self.is_main_process:
            torch.save(obj, path)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """save_state / load_state also save and restore these objects (each has state_dict() and
        load_state_dict()). A ValueError, as Accelerate's, names every object that has not."""
        invalid = [f"Item at index {index} ({type(obj).__name__})" for index, obj in enumerate(objects)
                   if not all(callable(getattr(obj, method, None)) for method in ("state_dict", "load_state_dict"))]
        if invalid:
            raise AcceleratorValueError(f"register_for_checkpointing needs objects with state_dict() and "
                                        f"load_state_dict(); {', '.join(invalid)} lack them: wrap each in an object "
                                        "that has both")
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable):
        """hook(models, weights, output_dir) runs in save_state before anything is written. A hook
        that saves a model its own way removes it from `models` (or its entry from `weights`);
        save_state then leaves that model out. Returns a handle whose remove() unregisters it."""
        handle = RemovableHandle(self._save_model_state_pre_hook)
        self._save_model_state_pre_hook[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable):
        """hook(models, input_dir) runs in load_state before anything is read; a model the hook
        loads itself is removed from `models` (it must have been left out of save_state too)."""
        handle = RemovableHandle(self._load_model_state_pre_hook)
        self._load_model_state_pre_hook[handle.id] = hook
        return handle

    def _checkpoint_root(self, directory: str | None, for_save: bool) -> str:
        project = self.project_configuration
        if directory is not None and not (for_save and project.automatic_checkpoint_naming):
            # As Accelerate, automatic naming decides where save_state writes, whatever it is given.
            # A snapshot is one directory that every process writes its part of: process 0's
            # (a script may name a different one per process, e.g. each process's own tempdir).
            return operations.broadcast_object_list([os.path.expanduser(str(directory))])[0]
        if project.automatic_checkpoint_naming:
            if for_save:
                return checkpoints.next_automatic_dir(project, self.is_main_process)
            return checkpoints.latest_automatic_dir(project)
        if project.project_dir is None:
            raise AcceleratorValueError("save_state/load_state without a directory need "
                                        "Accelerator(project_dir=...) or automatic_checkpoint_naming")
        return os.path.join(project.project_dir, "checkpoints")

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **unused: Any) -> str:
        """Save everything needed to continue: models, optimizers, schedulers, scaler, dataloader
        positions, RNG states, registered objects. Collective: call on every process. Writes
        Accelerate's folder (model.safetensors, optimizer.bin, random_states_<rank>.pkl, ...: see
        _internal/accelerate_folder.py) plus triax's manifest into output_dir, or with
        automatic_checkpoint_naming into <project_dir>/checkpoints/checkpoint_<iteration> (keeping
        at most total_limit), or else <project_dir>/checkpoints; returns that folder. Under FSDP
        the models and optimizers go in Accelerate's FSDP layout (_internal/fsdp_folder.py): sharded, each
        process writing its shards, or whole by process 0 (state_dict_type)."""
        root = self._checkpoint_root(output_dir, for_save=True)
        models = list(self._models)
        # As Accelerate, the models' own names: its list holds each model as given to prepare,
        # without DDP's "module." or torch.compile's "_orig_mod.".
        weights = [extract_model_from_parallel(model, keep_torch_compile=False).state_dict() for model in self._models]
        before_hooks = list(weights)
        for hook in self._save_model_state_pre_hook.values():
            hook(models, weights, root)
        kept_weights = {id(weight) for weight in weights}
        saved = [index for index, model in enumerate(self._models)
                 if any(model is m for m in models) and id(weights[index]) in kept_weights]
        if self.is_fsdp2:
            path = accelerate_folder.save_folder(self, root, [], safe_serialization, fsdp_models=saved)
        else:
            path = accelerate_folder.save_folder(self, root, [before_hooks[index] for index in saved],
                                                 safe_serialization)
        self.project_configuration.iteration += 1
        return path

    def load_state(self, input_dir: str | None = None, **unused: Any) -> str:
        """Restore what save_state wrote: an Accelerate checkpoint folder (written by Accelerate
        or triax), a triax snapshot step_* folder, or the latest snapshot under a root; with
        automatic_checkpoint_naming and no directory, the newest checkpoint_<n>. Prepare the same
        objects first; the dataloaders' next pass continues the saved epoch."""
        if input_dir is not None:
            input_dir = operations.broadcast_object_list([os.path.expanduser(str(input_dir))])[0]
        if input_dir is not None and not os.path.isdir(input_dir):
            raise AcceleratorValueError(f"load_state: {input_dir!r} is not a directory")
        root = self._checkpoint_root(input_dir, for_save=False)
        models = list(self._models)
        for hook in self._load_model_state_pre_hook.values():
            hook(models, root)
        loaded = [index for index, model in enumerate(self._models) if any(model is m for m in models)]
        if accelerate_folder.is_accelerate_folder(root):
            return accelerate_folder.load_folder(self, root, [self._models[index] for index in loaded],
                                                 fsdp=self.is_fsdp2)
        return _load_state(self, root, loaded)

    # ---- tracking -------------------------------------------------------------------------------

    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Start the trackers of log_with (main process only): each named one is made with
        project_name (and logging_dir when it writes files: <logging_dir>/<project_name>) and
        init_kwargs[name], then every tracker's start() runs, then `config` is stored with each."""
        if not self.is_main_process:
            return
        self.trackers.extend(start_trackers(self.log_with, project_name, self.logging_dir, init_kwargs or {}))
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

    def get_tracker(self, name: str, unwrap: bool = False):
        """The tracker called `name` (its library's own object with unwrap=True); a tracker that
        does nothing on processes without trackers, as Accelerate's."""
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if self.trackers:
            raise AcceleratorValueError(f"{name} is not an available tracker stored inside the Accelerator "
                                        f"(it has {', '.join(t.name for t in self.trackers)})")
        return GeneralTracker(_blank=True)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Log `values` to every tracker (main process only); log_kwargs[name] goes to that tracker."""
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def end_training(self) -> None:
        """Finish the trackers and leave the process group, as Accelerate's end_training."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.finish()
        self.state.destroy_process_group()

    def free_memory(self, *objects: Any):
        """Forget every prepared object (and empty the CUDA cache); returns `objects` as Nones."""
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self._replaced_parameters.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return [None] * len(objects) if len(objects) != 1 else None

    clear = free_memory


def _write_weights(state: dict, save_directory: str, safe_serialization: bool) -> str:
    os.makedirs(save_directory, exist_ok=True)
    if safe_serialization:
        from safetensors.torch import save_file

        path = os.path.join(save_directory, "model.safetensors")
        # Tied weights share storage, which safetensors refuses: give each name a copy.
        save_file({name: tensor.detach().clone().contiguous() for name, tensor in state.items()}, path)
    else:
        path = os.path.join(save_directory, "pytorch_model.bin")
        torch.save(state, path)
    return path
