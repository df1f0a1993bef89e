"""The Accelerator's prepared objects and how each kind is prepared.

`Accelerator.prepare` hands every model, optimizer, dataloader and LR scheduler to `Preparation`,
which wraps it for this process (placement, precision, DDP or FSDP2, this process's share of the
data, stepping only on real optimizer updates) and keeps it, in the order prepared: save_state,
load_state and free_memory work on these lists (Accelerate's `_models`, `_optimizers`,
`_schedulers`, `_dataloaders`, which the Accelerator shows under those names).

The settings that decide how an object is prepared (device_placement, parallel, scheduler_steps,
data_order, ...) live here too; the Accelerator reads and writes them under Accelerate's names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from triax.accelerate._internal.errors import AcceleratorValueError
from triax.accelerate._internal.dynamo import compile_model
from triax.accelerate._internal.fsdp import shard_model
from triax.accelerate._internal.prepared_models import extract_model_from_parallel
from triax.accelerate._internal.nested import convert_to_fp32
from triax.accelerate._internal.options import unsupported
from triax.accelerate._internal.wrappers import PreparedOptimizer, PreparedScheduler
from triax.accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard, prepare_data_loader
from triax.accelerate.state import AcceleratorState, GradientState
from triax.accelerate.utils import operations
from triax.parallel.ddp import apply_ddp, unwrap
from triax.runtime.precision import Precision

if TYPE_CHECKING:
    from triax.accelerate._internal.options import Options

KINDS = ("model", "optimizer", "dataloader", "scheduler")  # the order prepare handles them in


def kind_of(obj: Any) -> str | None:
    """Which of KINDS `obj` is (None: prepare returns it unchanged)."""
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


def already_prepared(obj: Any, prepared: list, raw_attribute: str | None = None) -> Any:
    """The prepared object for `obj` if it (or what it wraps) was prepared before, else None."""
    for item in prepared:
        if item is obj or (raw_attribute and getattr(item, raw_attribute, None) is obj):
            return item
    return None


def refuse_device_map(model: torch.nn.Module) -> None:
    """A model placed by a device map over several devices, or quantized with offloaded weights,
    cannot be trained here: say so before anything is moved."""
    device_map = getattr(model, "hf_device_map", None)
    quantized = getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)
    if quantized and isinstance(device_map, dict) and {"cpu", "disk"} & {str(d) for d in device_map.values()}:
        raise AcceleratorValueError(f"prepare got a model loaded in 8-bit or 4-bit precision with CPU or disk "
                                    f"offload (hf_device_map {device_map}); a quantized model cannot be trained "
                                    "with offloaded weights: load it whole onto the training device")
    if isinstance(device_map, dict) and len({str(d) for d in device_map.values()}) > 1:
        raise unsupported("device maps", "prepare got a model loaded with a device_map over several devices")


def autocast_forward(model: torch.nn.Module, precision: Precision, device: torch.device) -> None:
    """Run the model's forward under autocast and hand its fp16/bf16 outputs back in fp32, like
    Accelerate (convert_outputs_to_fp32), so loops need no change and the loss is computed in fp32."""
    original = model.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with precision.autocast(device):
            outputs = original(*args, **kwargs)
        return convert_to_fp32(outputs)

    forward.__wrapped_by_triax__ = True
    model.forward = forward


class Preparation:
    """What `prepare` made, and how it makes it, for one Accelerator."""

    def __init__(self, state: AcceleratorState, precision: Precision, options: Options,
                 gradient_state: GradientState, grad_scaler: torch.amp.GradScaler, device_placement: bool,
                 step_scheduler_with_optimizer: bool, seed: int | None, rng_types: list[str]):
        self.state = state
        self.precision = precision
        self.gradient_state = gradient_state
        self.grad_scaler = grad_scaler
        self.parallel = options.parallel
        self.dataloader_config = options.dataloader
        self.ddp_options = options.ddp_options
        self.fsdp = options.fsdp
        self.grad_compression = options.grad_compression
        self.scheduler_steps = options.scheduler_steps
        self.data_order = options.data_order
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.seed = seed
        self.rng_types = rng_types
        self.models: list[torch.nn.Module] = []
        self.optimizers: list[PreparedOptimizer] = []
        self.schedulers: list[PreparedScheduler] = []
        self.dataloaders: list = []  # DataLoaderShard / DataLoaderDispatcher
        # id(a parameter before prepare_model) -> the one the prepared model holds (FSDP's shards, a move)
        self.replaced_parameters: dict[int, torch.nn.Parameter] = {}

    def prepare(self, objects: tuple, device_placement: list[bool] | None,
                preparer: Callable[[str], Callable]) -> Any:
        """Accelerator.prepare: models first (optimizers and schedulers refer to their parameters),
        then optimizers, dataloaders, and schedulers last (they wrap prepared optimizers).
        preparer(kind) is the Accelerator's prepare_<kind>, so a subclass's own is used."""
        placement = device_placement or [self.device_placement] * len(objects)
        if len(placement) != len(objects):
            raise AcceleratorValueError(f"prepare got {len(objects)} objects but device_placement has "
                                        f"{len(placement)} entries")
        results = list(objects)
        kinds = [kind_of(obj) for obj in objects]
        for kind in KINDS:
            for index, obj in enumerate(objects):
                if kinds[index] == kind:
                    results[index] = preparer(kind)(obj, device_placement=placement[index])
                    # As Accelerate: what prepare made says so (libraries check it before preparing again).
                    results[index]._is_accelerate_prepared = True
        return results[0] if len(results) == 1 else tuple(results)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        already = already_prepared(model, self.models) or next((m for m in self.models if unwrap(m) is model), None)
        if already is not None:
            return already  # a second prepare of the same model: registering it twice would break save_state
        refuse_device_map(model)
        if device_placement is None:
            device_placement = self.device_placement
        original, before = model, dict(model.named_parameters())
        device = self.state.device
        trainable = any(p.requires_grad for p in model.parameters())
        wrap = self.parallel if self.state.use_distributed and trainable and not evaluation_mode else None
        if device_placement and wrap != "fsdp":  # fully_shard places the shards itself
            model = model.to(device)
        if self.precision.param_dtype != torch.float32:
            model = model.to(dtype=self.precision.param_dtype)
        if wrap == "ddp":
            model = apply_ddp(model, device, grad_compression=self.grad_compression, ddp_options=self.ddp_options)
        elif wrap == "fsdp":
            model = self._apply_fsdp(model)
        if self.precision.uses_autocast:
            autocast_forward(model, self.precision, device)
        model = compile_model(model, self.state.dynamo_plugin)  # last, as Accelerate compiles
        # Moving (with torch.__future__'s overwrite flag) and sharding may put new Parameter objects in
        # the model (all of them in place, in `original`): an optimizer made before is pointed at them.
        after = dict(original.named_parameters())
        self.replaced_parameters.update({id(parameter): after[name] for name, parameter in before.items()
                                         if name in after and after[name] is not parameter})
        self.models.append(model)
        return model

    def _apply_fsdp(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard parameters, gradients and optimizer state with FSDP2 (triax.parallel.fsdp).
        fully_shard replaces parameters with DTensors: an optimizer made before prepare is
        pointed at the new ones in prepare_optimizer, by parameter name."""
        from torch.distributed.device_mesh import init_device_mesh  # deferred: only FSDP needs a mesh

        mesh = init_device_mesh(self.state.device.type, (self.state.num_processes,))
        mixed_precision = self.precision.name if self.precision.uses_autocast else "no"
        shard_model(model, self.fsdp, mesh, self.state.device, mixed_precision, self.state.process_index)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
                          ) -> PreparedOptimizer:
        already = already_prepared(optimizer, self.optimizers, "optimizer")
        if already is not None:
            return already
        mapping = {p: self.replaced_parameters[id(p)] for group in optimizer.param_groups for p in group["params"]
                   if id(p) in self.replaced_parameters}
        if mapping and optimizer.state and self.parallel == "fsdp":
            raise AcceleratorValueError("with parallel='fsdp', prepare the optimizer before it has taken a "
                                        "step (its state cannot follow the parameters into shards)")
        switch_parameters(optimizer, mapping)
        if optimizer.state and device_placement is not False:
            # Optimizer.load_state_dict casts state onto each parameter's (new) device.
            optimizer.load_state_dict(optimizer.state_dict())
        prepared = PreparedOptimizer(optimizer, self.gradient_state, self.grad_scaler)
        self.optimizers.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: torch.optim.lr_scheduler.LRScheduler,
                          device_placement: bool | None = None) -> PreparedScheduler:
        already = already_prepared(scheduler, self.schedulers, "scheduler")
        if already is not None:
            return already
        owners = [opt for opt in self.optimizers if scheduler.optimizer is opt or scheduler.optimizer is opt.optimizer]
        per_process = self.scheduler_steps == "per_process"
        steps = self.state.num_processes if per_process and not self.dataloader_config.split_batches else 1
        prepared = PreparedScheduler(scheduler, owners, self.gradient_state, self.step_scheduler_with_optimizer,
                                     steps_per_update=steps, count_micro_steps=per_process)
        self.schedulers.append(prepared)
        return prepared

    def prepare_data_loader(self, dataloader: DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Callable | None = None) -> DataLoader:
        if isinstance(dataloader, (DataLoaderShard, DataLoaderDispatcher)):
            if not any(dataloader is known for known in self.dataloaders):
                self.dataloaders.append(dataloader)
            return dataloader
        if device_placement is None:
            device_placement = self.device_placement
        config = self.dataloader_config
        prepared = prepare_data_loader(
            dataloader, self.state.device, num_processes=self.state.num_processes,
            process_index=self.state.process_index, split_batches=config.split_batches,
            put_on_device=device_placement, rng_types=list(self.rng_types),
            dispatch_batches=config.dispatch_batches, even_batches=config.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch, use_seedable_sampler=config.use_seedable_sampler,
            data_seed=config.data_seed, non_blocking=config.non_blocking,
            use_stateful_dataloader=config.use_stateful_dataloader, order_seed=self._order_seed(dataloader))
        self.dataloaders.append(prepared)
        return prepared

    def _order_seed(self, dataloader: DataLoader) -> int | None:
        """The seed of triax's "seeded" data order (None for Accelerate's "loader" order)."""
        if self.data_order != "seeded":
            return None
        order_seed = self.seed
        if order_seed is None:
            generator = getattr(dataloader, "generator", None)
            order_seed = generator.initial_seed() if generator is not None else torch.initial_seed()
        # Every process must draw the same order: process 0's seed wins.
        return operations.broadcast_object_list([int(order_seed) % 2**63])[0]

    def forget(self) -> None:
        """free_memory: forget every prepared object."""
        self.models.clear()
        self.optimizers.clear()
        self.schedulers.clear()
        self.dataloaders.clear()
        self.replaced_parameters.clear()


def switch_parameters(optimizer: torch.optim.Optimizer, mapping: dict) -> None:
    """Point `optimizer` at new Parameter objects ({old: new}); a moved parameter's state goes with it."""
    for group in optimizer.param_groups:
        group["params"] = [mapping.get(p, p) for p in group["params"]]
    for old, new in mapping.items():
        if old in optimizer.state:
            optimizer.state[new] = optimizer.state.pop(old)


def named_parameters(objects: tuple, drop_refs: bool = False) -> dict:
    """Accelerate's Accelerator._get_named_parameters: the parameters of the models among `objects` by name
    (each model's names prefixed by its index when there are several); with drop_refs, a key that names a
    parameter's storage (device, address, bytes) instead of the parameter itself."""
    models = [obj for obj in objects if isinstance(obj, torch.nn.Module)]
    found = {}
    for index, model in enumerate(models):
        model = extract_model_from_parallel(model, keep_torch_compile=False)
        for name, parameter in model.named_parameters(prefix=str(index) if len(models) > 1 else ""):
            found[name] = (parameter.device, parameter.data_ptr(), parameter.untyped_storage().nbytes()) \
                if drop_refs else parameter
    return found


def remap_optimizer_parameters(old_named_parameters: dict, objects: tuple) -> None:
    """Accelerate's Accelerator._remap_optimizer_parameters: the optimizers among `objects` follow their
    models' parameters that were replaced since `old_named_parameters` was taken (same names)."""
    new = named_parameters(objects)
    mapping = {old: new[name] for name, old in old_named_parameters.items() if name in new and new[name] is not old}
    for obj in objects:
        if isinstance(obj, torch.optim.Optimizer) or hasattr(obj, "optimizer"):
            switch_parameters(getattr(obj, "optimizer", obj), mapping)
