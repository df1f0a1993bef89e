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

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from triax.accelerate import operations
from triax.accelerate.data_loader import PreparedDataLoader, SkipFirstBatches, skip_first_batches
from triax.accelerate.saving import load_state as _load_state
from triax.accelerate.saving import save_state as _save_state
from triax.accelerate.state import GradientState
from triax.accelerate.tracking import Trackers, parse_log_with
from triax.accelerate.wrappers import PreparedOptimizer, PreparedScheduler
from triax.errors import ConfigError, TriaxError
from triax.parallel.ddp import apply_ddp, unwrap
from triax.precision import Precision
from triax.launch import settings as launch_settings
from triax.runtime import barrier, detect_place, init_distributed, is_distributed, pick_device

# What `triax launch` hands over (names, choices, environment variables): triax/launch/settings.py.
PRECISION_ALIASES = launch_settings.PRECISION_POLICIES
PARALLEL_CHOICES = launch_settings.PARALLEL_CHOICES


class Accelerator:
    """
    mixed_precision: "no" | "bf16" | "fp16" (also triax's "fp32", "bf16-pure"); default from
        $TRIAX_MIXED_PRECISION (set by `triax launch`), else "no".
    gradient_accumulation_steps: micro-steps per optimizer update inside `accumulate`.
    parallel: "ddp" (default with more than one process), "fsdp" (PyTorch's fully_shard), or "none".
    cpu: use the CPU even where a GPU exists.
    log_with: "tensorboard", "jsonl", "all", or a list of those, for init_trackers/log.
    project_dir: where trackers write and save_state() without a directory saves.
    split_batches: a dataloader's batch_size is the global batch (divided among processes)
        instead of the per-process batch.
    even_batches: pad the last global batch by repeating samples from the start, so every process
        steps equally often; gather_for_metrics removes the repeats.
    step_scheduler_with_optimizer: a prepared scheduler steps only when the optimizer really did.
    seed: seed of the dataloaders' shuffling; default: the DataLoader's generator seed, else
        torch.initial_seed() of process 0.
    """

    def __init__(self, mixed_precision: str | None = None, gradient_accumulation_steps: int | None = None,
                 parallel: str | None = None, cpu: bool = False, log_with=None,
                 project_dir: str | None = None, logging_dir: str | None = None,
                 split_batches: bool = False, even_batches: bool = True,
                 step_scheduler_with_optimizer: bool = True, device_placement: bool = True,
                 seed: int | None = None):
        mixed_precision = mixed_precision or launch_settings.from_environment("mixed_precision") or "no"
        if mixed_precision not in PRECISION_ALIASES:
            raise ConfigError(f"mixed_precision={mixed_precision!r} is not supported; use one of "
                              f"{', '.join(PRECISION_ALIASES)}")
        self.precision = Precision(PRECISION_ALIASES[mixed_precision])
        if gradient_accumulation_steps is None:
            gradient_accumulation_steps = int(launch_settings.from_environment("gradient_accumulation_steps") or 1)
        if int(gradient_accumulation_steps) < 1:
            raise ConfigError(f"gradient_accumulation_steps={gradient_accumulation_steps} must be 1 or more")
        parallel = parallel or launch_settings.from_environment("parallel") or "ddp"
        if parallel not in PARALLEL_CHOICES:
            raise ConfigError(f"parallel={parallel!r} is not a layout the Accelerator knows; use one of "
                              f"{', '.join(PARALLEL_CHOICES)}")
        self.parallel = parallel

        cpu = cpu or launch_settings.flag_from_environment("use_cpu")
        place = detect_place()
        self.device = pick_device("cpu" if cpu else None, place.local_rank)
        # Uses a process group the script already created (e.g. under torchrun --standalone),
        # or creates one: the Accelerator works either way.
        self.place = init_distributed(self.device, place)
        if self.precision.needs_loss_scaling and self.device.type != "cuda":
            # precision.check_device would refuse too, in the trainer's words; say it in ours.
            raise ConfigError(f"mixed_precision='fp16' needs a CUDA device (this process uses "
                              f"{self.device.type}); use mixed_precision='bf16' on CPU")
        self.precision.check_device(self.device)

        self.gradient_state = GradientState(int(gradient_accumulation_steps))
        self.scaler = self.precision.make_scaler(self.device)
        self.project_dir = project_dir
        self.logging_dir = logging_dir or project_dir
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.device_placement = device_placement
        self.seed = seed
        self.log_with = parse_log_with(log_with)
        self.trackers: Trackers | None = None
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[PreparedOptimizer] = []
        self._schedulers: list[PreparedScheduler] = []
        self._dataloaders: list[PreparedDataLoader] = []
        self._custom_objects: list = []
        self._replaced_parameters: dict[int, torch.nn.Parameter] = {}  # FSDP: id(old) -> sharded
        self._save_count = 0

    # ---- who am I -------------------------------------------------------------------------------

    @property
    def num_processes(self) -> int:
        return dist.get_world_size() if is_distributed() else 1

    @property
    def process_index(self) -> int:
        return dist.get_rank() if is_distributed() else 0

    @property
    def local_process_index(self) -> int:
        return self.place.local_rank

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def distributed_type(self) -> str:
        if not self.use_distributed:
            return "NO"
        return "MULTI_GPU" if self.device.type == "cuda" else "MULTI_CPU"

    @property
    def mixed_precision(self) -> str:
        return {"fp32": "no"}.get(self.precision.name, self.precision.name)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        self.gradient_state.accumulation_steps = steps

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    def wait_for_everyone(self) -> None:
        barrier()

    @contextlib.contextmanager
    def main_process_first(self):
        """The main process runs the block first (e.g. to download or preprocess), then the rest."""
        with self._first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self):
        with self._first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _first(self, leader: bool):
        if not leader:
            barrier()
        yield
        if leader:
            barrier()

    def on_main_process(self, function):
        """Decorator: run `function` on the main process only (others get None)."""
        return self._only_on(lambda: self.is_main_process, function)

    def on_local_main_process(self, function):
        return self._only_on(lambda: self.is_local_main_process, function)

    def on_process(self, function=None, process_index: int = 0):
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._only_on(lambda: self.process_index == process_index, function)

    @staticmethod
    def _only_on(condition, function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            return function(*args, **kwargs) if condition() else None
        return wrapper

    def print(self, *args, **kwargs) -> None:
        """print on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    # ---- prepare --------------------------------------------------------------------------------

    def prepare(self, *objects, device_placement: list[bool] | None = None):
        """Models, optimizers, dataloaders and LR schedulers in any order; returned in that order.
        Models go first (optimizers and schedulers refer to their parameters), then optimizers,
        dataloaders, and schedulers last (they wrap prepared optimizers)."""
        placement = device_placement or [self.device_placement] * len(objects)
        if len(placement) != len(objects):
            raise TriaxError(f"prepare got {len(objects)} objects but device_placement has {len(placement)} entries")
        results = list(objects)
        kinds = [self._kind(obj) for obj in objects]
        for kind in ("model", "optimizer", "dataloader", "scheduler"):
            for index, obj in enumerate(objects):
                if kinds[index] == kind:
                    results[index] = getattr(self, f"prepare_{kind}")(obj, device_placement=placement[index])
        return results[0] if len(results) == 1 else tuple(results)

    @staticmethod
    def _kind(obj) -> str | None:
        if isinstance(obj, torch.nn.Module):
            return "model"
        if isinstance(obj, torch.optim.Optimizer):
            return "optimizer"
        if isinstance(obj, DataLoader):
            return "dataloader"
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
                hasattr(obj, "step") and hasattr(obj, "optimizer") and hasattr(obj, "state_dict")):
            return "scheduler"
        return None

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        if device_placement is None:
            device_placement = self.device_placement
        if device_placement:
            model = model.to(self.device)
        if self.precision.param_dtype != torch.float32:
            model = model.to(dtype=self.precision.param_dtype)
        trainable = any(p.requires_grad for p in model.parameters())
        if self.use_distributed and trainable and not evaluation_mode:
            if self.parallel == "ddp":
                model = apply_ddp(model, self.device)
            elif self.parallel == "fsdp":
                model = self._apply_fsdp(model)
        if self.precision.uses_autocast:
            self._autocast_forward(model)
        self._models.append(model)
        return model

    def _apply_fsdp(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard parameters, gradients and optimizer state with PyTorch's fully_shard (FSDP2).

        Each block of a ModuleList/ModuleDict (a transformer's layers) becomes its own unit, so
        only one block's full parameters exist at a time, then the root takes the rest.
        fully_shard replaces parameters with DTensors: an optimizer made before prepare is
        pointed at the new ones in prepare_optimizer, by parameter name.
        """
        # Not triax.parallel.fsdp.apply_fsdp: that one knows the GPT's layout (model.layers) and
        # casts parameters through FSDP's MixedPrecisionPolicy, while a user's model can be any
        # nn.Module and the Accelerator's precision comes from autocast around forward. Merging the
        # two (a generic unit finder + one precision rule) is open work.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        before = dict(model.named_parameters())
        mesh = init_device_mesh(self.device.type, (self.num_processes,))
        for module in list(model.modules()):
            if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                for block in module.children():
                    if any(p.requires_grad for p in block.parameters()):
                        fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        after = dict(model.named_parameters())
        self._replaced_parameters.update({id(before[name]): after[name] for name in before if name in after})
        return model

    def _autocast_forward(self, model: torch.nn.Module) -> None:
        """Run the model's forward under autocast, like Accelerate, so loops need no change."""
        original = model.forward
        precision, device = self.precision, self.device

        @functools.wraps(original)
        def forward(*args, **kwargs):
            with precision.autocast(device):
                return original(*args, **kwargs)

        forward.__wrapped_by_triax__ = True
        model.forward = forward

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None):
        if isinstance(optimizer, PreparedOptimizer):
            return optimizer
        if self._replaced_parameters:
            if optimizer.state:
                raise TriaxError("with parallel='fsdp', prepare the optimizer before it has taken a "
                                 "step (its state cannot follow the parameters into shards)")
            for group in optimizer.param_groups:
                group["params"] = [self._replaced_parameters.get(id(p), p) for p in group["params"]]
        if optimizer.state and device_placement is not False:
            # Optimizer.load_state_dict casts state onto each parameter's (new) device.
            optimizer.load_state_dict(optimizer.state_dict())
        prepared = PreparedOptimizer(optimizer, self.gradient_state, self.scaler)
        self._optimizers.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler, device_placement: bool | None = None):
        owners = [opt for opt in self._optimizers
                  if scheduler.optimizer is opt or scheduler.optimizer is opt.optimizer]
        prepared = PreparedScheduler(scheduler, owners, self.gradient_state, self.step_scheduler_with_optimizer)
        self._schedulers.append(prepared)
        return prepared

    def prepare_data_loader(self, dataloader: DataLoader, device_placement: bool | None = None):
        seed = self.seed
        if seed is None:
            generator = getattr(dataloader, "generator", None)
            seed = generator.initial_seed() if generator is not None else torch.initial_seed()
        # Every process must draw the same order: process 0's seed wins.
        seed = operations.broadcast_object_list([int(seed) % 2**31])[0]
        prepared = PreparedDataLoader(
            dataloader, device=self.device if device_placement is not False else None,
            process_index=self.process_index, num_processes=self.num_processes,
            gradient_state=self.gradient_state, seed=seed, split_batches=self.split_batches,
            even_batches=self.even_batches)
        self._dataloaders.append(prepared)
        return prepared

    prepare_dataloader = prepare_data_loader

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        """The same dataloader, whose next pass starts `num_batches` batches into the epoch."""
        return skip_first_batches(dataloader, num_batches)

    # ---- the step -------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """loss.backward(), divided for accumulation and scaled for fp16."""
        if self.gradient_state.accumulation_steps > 1:
            loss = loss / self.gradient_state.accumulation_steps
        self.scaler.scale(loss).backward(**kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models):
        """One micro-step: gradients are synchronised (and the optimizer/scheduler step) only on
        every gradient_accumulation_steps-th micro-step and on the last batch of an epoch."""
        sync = self.gradient_state.next_micro_step()
        with contextlib.ExitStack() as stack:
            if not sync:
                for model in models:
                    stack.enter_context(self.no_sync(model))
            yield

    @contextlib.contextmanager
    def no_sync(self, model):
        """Skip the gradient all-reduce for backward passes in this block (DDP's no_sync)."""
        if isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield
        elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        else:
            yield

    def autocast(self):
        """Forward under the mixed-precision policy's autocast (no-op for fp32)."""
        return self.precision.autocast(self.device)

    def unscale_gradients(self, optimizer=None) -> None:
        """Divide fp16 gradients by the loss scale (once per step) before inspecting them."""
        if not self.scaler.is_enabled() or not self.sync_gradients:
            return
        targets = self._optimizers if optimizer is None else (
            optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])
        for target in targets:
            if isinstance(target, PreparedOptimizer) and not target.gradients_unscaled:
                self.scaler.unscale_(target.optimizer)
                target.gradients_unscaled = True

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2):
        self.unscale_gradients()
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(optimizer.step_was_skipped for optimizer in self._optimizers)

    # ---- collectives ----------------------------------------------------------------------------

    def gather(self, tensor):
        return operations.gather(tensor)

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """gather, then drop the samples repeated to even out the last batch, so each sample of
        the dataset is counted once."""
        tensors_only = []
        operations.map_tensors(lambda t: tensors_only.append(t), input_data)
        if use_gather_object or not tensors_only:
            items = input_data if isinstance(input_data, list) else [input_data]
            data = operations.gather_object(items)
        else:
            data = operations.gather(input_data)
        padding = self.gradient_state.padding_in_last_batch
        if padding and self.gradient_state.end_of_dataloader:
            keep = self.gradient_state.active_loader.total_batch_size - padding
            if isinstance(data, list):
                return data[:keep]
            return operations.map_tensors(lambda t: t[:keep], data)
        return data

    def pad_across_processes(self, tensor, dim: int = 0, pad_index=0, pad_first: bool = False):
        return operations.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        return operations.reduce(tensor, reduction=reduction, scale=scale)

    def broadcast(self, tensor, from_process: int = 0):
        return operations.broadcast(tensor, from_process=from_process)

    @contextlib.contextmanager
    def split_between_processes(self, inputs, apply_padding: bool = False):
        """This process's share of `inputs` (list, tuple, tensor, or dict of them)."""
        yield operations.slice_for_process(inputs, self.process_index, self.num_processes, apply_padding)

    # ---- models and state -----------------------------------------------------------------------

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True) -> torch.nn.Module:
        if not keep_fp32_wrapper:
            forward = model.__dict__.get("forward")
            if forward is not None and getattr(forward, "__wrapped_by_triax__", False):
                del model.forward
        return unwrap(model)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict:
        """The full, name-keyed state of a (possibly wrapped or sharded) model, on CPU."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_model(self, model: torch.nn.Module, save_directory: str, safe_serialization: bool = True,
                   **unused) -> str | None:
        """Write the model's full weights to save_directory/model.safetensors (main process)."""
        state = self.get_state_dict(model)
        path = None
        if self.is_main_process:
            os.makedirs(save_directory, exist_ok=True)
            if safe_serialization:
                from safetensors.torch import save_file

                path = os.path.join(save_directory, "model.safetensors")
                # Tied weights share storage, which safetensors refuses: give each name a copy.
                save_file({name: tensor.detach().clone().contiguous() for name, tensor in state.items()}, path)
            else:
                path = os.path.join(save_directory, "pytorch_model.bin")
                torch.save(state, path)
        self.wait_for_everyone()
        return path

    def save(self, obj, path: str) -> None:
        """torch.save on the main process only."""
        if self.is_main_process:
            torch.save(obj, path)

    def register_for_checkpointing(self, *objects) -> None:
        for obj in objects:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TriaxError(f"register_for_checkpointing needs objects with state_dict() and "
                                 f"load_state_dict(); got a {type(obj).__name__}")
        self._custom_objects.extend(objects)

    def _checkpoint_root(self, directory: str | None) -> str:
        if directory is not None:
            return directory
        if self.project_dir is None:
            raise TriaxError("save_state/load_state without a directory need Accelerator(project_dir=...)")
        return os.path.join(self.project_dir, "checkpoints")

    def save_state(self, output_dir: str | None = None, **unused) -> str:
        """Snapshot everything needed to continue: models, optimizers, schedulers, scaler,
        dataloader positions, RNG states, registered objects. Collective: call on every process.
        Writes <output_dir>/step_<optimizer steps>/ and returns that path."""
        steps = max((opt.num_steps for opt in self._optimizers), default=self._save_count)
        self._save_count += 1
        return _save_state(self, self._checkpoint_root(output_dir), steps)

    def load_state(self, input_dir: str | None = None, **unused) -> str:
        """Restore what save_state wrote (a step_* folder, or the latest one under a root).
        Prepare the same objects first; the dataloaders' next pass continues the saved epoch."""
        return _load_state(self, self._checkpoint_root(input_dir))

    # ---- tracking -------------------------------------------------------------------------------

    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        root = self.logging_dir or "."
        self.trackers = Trackers(self.log_with, os.path.join(root, project_name), self.is_main_process, config)

    def get_tracker(self, name: str):
        if self.trackers is None or name not in self.trackers.names:
            raise TriaxError(f"no tracker {name!r}; pass log_with=[{name!r}] and call init_trackers first")
        return self.trackers.logger

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        if self.trackers is not None:
            self.trackers.log(values, step)

    def end_training(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None
        self.wait_for_everyone()

    def free_memory(self) -> None:
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


__all__ = ["Accelerator", "SkipFirstBatches"]
