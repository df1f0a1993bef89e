"""Who this process is (PartialState, AcceleratorState) and what a step shares (GradientState).

PartialState is Accelerate's process-wide view of the job: every instance shares one state, so
`PartialState()` anywhere in a script (before or after the Accelerator) answers the same, and the
first one joins the process group (triax.runtime.process_group). Its helpers — main_process_first, the on_*
decorators, split_between_processes — are also the Accelerator's, which delegates here.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import sys
import warnings
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from triax.accelerate._internal.errors import AcceleratorRuntimeError, AcceleratorValueError
from triax.accelerate._internal.flags import check_accelerate_environment, parse_flag_from_env
from triax.accelerate._internal.surface import serve_absent
from triax.accelerate.utils.dataclasses import DistributedType, DynamoBackend
from triax.runtime.failure_agreement import raise_together
from triax.runtime.place import detect_place, pick_device
from triax.runtime.process_group import init_distributed, is_distributed, shutdown_distributed
from triax.runtime.shared_decisions import barrier

__all__ = ["AcceleratorState", "GradientState", "PartialState", "is_initialized"]


def _of_the_state(getter: Callable):
    """A property read from the process state: after _reset_state() it raises AttributeError, so
    the class's __getattr__ says the state was reset (as Accelerate's do)."""

    @functools.wraps(getter)
    def read(self):
        if not self.initialized:
            raise AttributeError(getter.__name__)
        return getter(self)

    return property(read)


def _after_reset(class_name: str, name: str) -> str:
    return (f"`{class_name}` object has no attribute `{name}`. This happens if `{class_name}._reset_state()` was "
            f"called after it was made; create the Accelerator (or {class_name}()) again before using it")


class PartialState:
    """Process information, shared by every instance (Accelerate's `PartialState`).

    cpu: use the CPU even where a GPU exists. timeout: the process group's collective timeout
    (used only when this call creates the group)."""

    _shared_state: dict = {}

    def __init__(self, cpu: bool = False, timeout: datetime.timedelta | None = None, backend: str | None = None,
                 **unused: Any):
        self.__dict__ = self._shared_state
        if self._shared_state.get("_initialized"):
            return  # the job's state exists already: this instance shares it
        check_accelerate_environment()
        place = detect_place()
        # ACCELERATE_TORCH_DEVICE names the device outright (as in Accelerate), e.g. "cuda:3".
        self.device = pick_device(os.environ.get("ACCELERATE_TORCH_DEVICE") or ("cpu" if cpu else None),
                                  place.local_rank)
        # Uses a process group the script already created (e.g. under torchrun), or creates one.
        timeout_s = timeout.total_seconds() if timeout is not None else None  # None: triax.runtime.timeouts' default
        self.place = init_distributed(self.device, place, backend=backend, timeout_s=timeout_s)
        if self.device.type == "cpu" and self.device.index is None and self.place.world_size > 1:
            # Accelerate's device of a process among several on CPUs: cpu:<local index modulo the
            # CPU "devices">, which is cpu:0 (torch.cpu.device_count() is 1). The same memory as "cpu".
            self.device = torch.device("cpu", 0)
        self.backend = dist.get_backend() if dist.is_initialized() else None
        self.fsdp = False  # the Accelerator sets this for parallel='fsdp' (distributed_type FSDP)
        self.fsdp_plugin = None  # and the FullyShardedDataParallelPlugin it runs with
        # Accelerate's flags from the environment: its debug mode (triax's collectives always check
        # shapes across processes, so it changes nothing here) and notebook_launcher's fork.
        self.debug = parse_flag_from_env("ACCELERATE_DEBUG_MODE")
        self.fork_launched = parse_flag_from_env("FORK_LAUNCHED")
        self._initialized = True

    @staticmethod
    def _reset_state() -> None:
        """Forget the process information (the process group stays); the next PartialState()
        finds it again. For starting over in one process, as Accelerate's."""
        PartialState._shared_state.clear()
        # Accelerate's own PartialState is left alone: it holds only this process's place, which a reset
        # does not change, and Accelerate's helpers a script kept (its get_logger) need it to exist.
        # share_with_accelerate renews it when the place has changed.

    @property
    def initialized(self) -> bool:
        return self.__dict__.get("_initialized", False)

    def __getattr__(self, name: str):
        # Reached for attributes the shared state lacks: a name it never had, or (after
        # _reset_state()) one of the state's own, whose properties then raise AttributeError too.
        if name.startswith("__") or self.initialized:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        raise AttributeError(_after_reset(type(self).__name__, name))

    # ---- who am I -------------------------------------------------------------------------------

    @_of_the_state
    def num_processes(self) -> int:
        return dist.get_world_size() if is_distributed() else 1

    @_of_the_state
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
    def distributed_type(self) -> DistributedType:
        if not self.use_distributed:
            return DistributedType.NO
        if self.fsdp:
            return DistributedType.FSDP
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    @property
    def default_device(self) -> torch.device:
        """The device kind this machine would train on (triax drives CUDA or the CPU)."""
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    def set_device(self) -> None:
        """Make this process's device the current one (its device is chosen when the state is made)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def wait_for_everyone(self) -> None:
        barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print once per machine (on each machine's local main process), as Accelerate does."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    # ---- one process first ----------------------------------------------------------------------

    @contextlib.contextmanager
    def main_process_first(self):
        """The main process runs the block first (e.g. to download or preprocess), then the rest."""
        with self._first(self.is_main_process, "main"):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self):
        with self._first(self.is_local_main_process, "local main"):
            yield

    @contextlib.contextmanager
    def _first(self, leader: bool, who: str):
        # One agreement on "did a leader fail?" replaces the barrier: the leaders take part after
        # their block, the others before theirs. A leader's exception is then raised on every
        # process instead of leaving the others blocked in a barrier until the timeout.
        doing = f"running the block inside {who.replace(' ', '_')}_process_first"
        if not leader:
            with raise_together(doing, AcceleratorRuntimeError):
                pass
            yield
            return
        with raise_together(doing, AcceleratorRuntimeError):
            yield

    # ---- run on some processes only -------------------------------------------------------------

    def on_main_process(self, function: Callable):
        """Decorator: run `function` on the main process only (the others get None)."""
        return _only_on(lambda: self.is_main_process, function)

    def on_local_main_process(self, function: Callable):
        return _only_on(lambda: self.is_local_main_process, function)

    def on_last_process(self, function: Callable):
        return _only_on(lambda: self.is_last_process, function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None):
        if process_index is None:
            raise AcceleratorValueError("on_process needs process_index=<int>")
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return _only_on(lambda: self.process_index == process_index, function)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None):
        if local_process_index is None:
            raise AcceleratorValueError("on_local_process needs local_process_index=<int>")
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return _only_on(lambda: self.local_process_index == local_process_index, function)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False):
        """This process's share of `inputs` (list, tuple, tensor, or dict of them)."""
        from triax.accelerate.utils.operations import slice_for_process

        yield slice_for_process(inputs, self.process_index, self.num_processes, apply_padding)

    def destroy_process_group(self, group: object | None = None) -> None:
        shutdown_distributed(group)

    def __repr__(self) -> str:
        return (f"Distributed environment: {self.distributed_type}\nNum processes: {self.num_processes}\n"
                f"Process index: {self.process_index}\nLocal process index: {self.local_process_index}\n"
                f"Device: {self.device}\n")


def _only_on(condition: Callable, function: Callable):
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any):
        return function(*args, **kwargs) if condition() else None
    return wrapper


# Accelerate's process types that run torch.distributed collectives across devices: the ones where
# join_uneven_inputs applies (any other type, FSDP included, only warns).
MULTI_DEVICE_TYPES = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.MULTI_NPU,
                      DistributedType.MULTI_MLU, DistributedType.MULTI_SDAA, DistributedType.MULTI_MUSA,
                      DistributedType.MULTI_XPU, DistributedType.MULTI_HPU, DistributedType.MULTI_NEURON)


class AcceleratorState(PartialState):
    """PartialState plus what the Accelerator chose: mixed precision and the layout.

    Its shared state is its own (as in Accelerate): `AcceleratorState._reset_state()` forgets the
    Accelerator's choices, and a prepare on an Accelerator made before the reset raises
    AttributeError, while the process information (PartialState's) stays; pass
    reset_partial_state=True to forget that too."""

    _shared_state: dict = {}

    def __init__(self, mixed_precision: str | None = None, cpu: bool = False, **kwargs: Any):
        partial = PartialState(cpu=cpu, **kwargs)
        self.__dict__ = AcceleratorState._shared_state
        if not self._shared_state:
            self.__dict__.update(partial.__dict__)
            self.mixed_precision = "no"
            self.distributed_type_override = None
        if mixed_precision is not None:
            self.mixed_precision = mixed_precision

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        AcceleratorState._shared_state.clear()
        _reset_accelerate("AcceleratorState")
        if reset_partial_state:
            PartialState._reset_state()

    @property
    def initialized(self) -> bool:
        return bool(self._shared_state)

    # Process information is PartialState's (it survives a reset of this state there); read through
    # an AcceleratorState that was reset, it raises AttributeError, as Accelerate's.
    @_of_the_state
    def num_processes(self) -> int:
        return PartialState().num_processes

    @_of_the_state
    def process_index(self) -> int:
        return PartialState().process_index

    @_of_the_state
    def local_process_index(self) -> int:
        return PartialState().local_process_index

    # Asked of PartialState directly, as Accelerate's: these keep working after a reset of this state.
    is_main_process = property(lambda self: PartialState().is_main_process)
    is_local_main_process = property(lambda self: PartialState().is_local_main_process)
    is_last_process = property(lambda self: PartialState().is_last_process)
    use_distributed = property(lambda self: PartialState().use_distributed)

    def wait_for_everyone(self) -> None:
        PartialState().wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        PartialState().print(*args, **kwargs)

    def main_process_first(self):
        return PartialState().main_process_first()

    def local_main_process_first(self):
        return PartialState().local_main_process_first()

    def split_between_processes(self, inputs: Any, apply_padding: bool = False):
        return PartialState().split_between_processes(inputs, apply_padding=apply_padding)

    def destroy_process_group(self, group: object | None = None) -> None:
        PartialState().destroy_process_group(group)

    @property
    def distributed_type(self) -> DistributedType:
        if not self.initialized:
            raise AttributeError("distributed_type")  # after _reset_state(): __getattr__ says so
        override = self.__dict__.get("distributed_type_override")
        return override if override is not None else PartialState.distributed_type.fget(self)

    @distributed_type.setter
    def distributed_type(self, value: DistributedType) -> None:
        self.distributed_type_override = value

    @property
    def multi_device(self) -> bool:
        return self.distributed_type in MULTI_DEVICE_TYPES

    @property
    def use_fp16(self) -> bool:
        return self.mixed_precision != "no"

    @property
    def is_fsdp2(self) -> bool:
        return self.distributed_type == DistributedType.FSDP  # triax's FSDP is always FSDP2

    # Features triax leaves out (refused when asked for): Accelerate's values when they are off.
    deepspeed_plugin = deepspeed_plugins = device_mesh = parallelism_config = torch_tp_plugin = property(
        lambda self: None)

    @property
    def dynamo_plugin(self):
        """Accelerate's TorchDynamoPlugin fields as a plain record (the plugin class itself is not part of
        triax): the torch.compile settings the Accelerator compiles prepared models with; backend NO when
        it compiles nothing."""
        return self.__dict__.get("_dynamo_plugin") or SimpleNamespace(
            backend=DynamoBackend.NO, mode="default", fullgraph=False, dynamic=None, options=None, disable=False,
            use_regional_compilation=False)

    def get_deepspeed_plugin(self, name: str):
        raise AcceleratorValueError("DeepSpeed is not enabled: triax does not support DeepSpeed; use "
                                    "parallel='fsdp' (FSDP2 shards like ZeRO-3)")

    select_deepspeed_plugin = get_deepspeed_plugin


class GradientState:
    """What the Accelerator, its dataloaders, optimizers and schedulers share during a step.

    The dataloader says when an epoch ends, `accumulate` decides whether this micro-step
    synchronises gradients, and the optimizer and scheduler wrappers read that decision.
    """

    _shared_state: dict = {}

    def __init__(self, accumulation_steps: int | None = None, sync_with_dataloader: bool = True,
                 sync_each_batch: bool = False, adjust_scheduler: bool = False, plugin_kwargs: dict | None = None):
        # Shared by every instance, as in Accelerate: GradientState() anywhere sees the step the
        # Accelerator is in. An Accelerator passes its settings, which replace the previous ones.
        self.__dict__ = GradientState._shared_state
        if not self._shared_state:
            self.sync_gradients = True
            self.micro_step = 0  # micro-steps since the last synchronising one, inside `accumulate`
            # Weak references: a dataloader in the middle of a pass must not outlive its owner
            # (the shared state lives as long as the process).
            self._loader_references: list = []
            self.accumulation_steps = 1
            self.sync_with_dataloader, self.sync_each_batch, self.adjust_scheduler = True, False, False
            self.plugin_kwargs = {}  # Accelerate's record of the GradientAccumulationPlugin (its to_kwargs())
        if accumulation_steps is not None:
            self.accumulation_steps = accumulation_steps
            self.sync_with_dataloader = sync_with_dataloader
            self.sync_each_batch = sync_each_batch
            self.adjust_scheduler = adjust_scheduler
            self.plugin_kwargs = {"num_steps": accumulation_steps} if plugin_kwargs is None else dict(plugin_kwargs)
            self.micro_step = 0

    @staticmethod
    def _reset_state() -> None:
        """Forget the shared step state; the next Accelerator (or GradientState()) starts afresh."""
        GradientState._shared_state.clear()
        _reset_accelerate("GradientState")

    @property
    def initialized(self) -> bool:
        return bool(self._shared_state)

    @property
    def num_steps(self) -> int:
        return self.accumulation_steps

    # XLA's gradient flag (XLA is refused): under FSDP always True, as Accelerate answers.
    @property
    def is_xla_gradients_synced(self) -> bool:
        return parse_flag_from_env("ACCELERATE_USE_FSDP")

    @property
    def dataloader_references(self) -> list:
        """The dataloaders being iterated, innermost last (None for one that no longer exists),
        after a leading None, as Accelerate lists them."""
        return [None] + [reference() for reference in self._loader_references]

    def _add_dataloader(self, dataloader: torch.utils.data.DataLoader) -> None:
        self._loader_references = self._loader_references + [weakref.ref(dataloader)]

    def _remove_dataloader(self, dataloader: torch.utils.data.DataLoader) -> None:
        self._loader_references = [reference for reference in self._loader_references
                                   if reference() is not dataloader]

    @property
    def active_dataloader(self):
        references = self._loader_references
        return references[-1]() if references else None

    @property
    def in_dataloader(self) -> bool:
        return self.active_dataloader is not None

    @property
    def end_of_dataloader(self) -> bool:
        loader = self.active_dataloader
        return bool(loader is not None and loader.end_of_dataloader)

    @property
    def remainder(self) -> int:
        """Accelerate's meaning: how many real samples the last global batch holds (0 when the
        dataset divides evenly, -1 when unknown or outside a dataloader)."""
        loader = self.active_dataloader
        return loader.remainder if loader is not None else -1

    def next_micro_step(self) -> bool:
        """Advance `accumulate`'s counter; True when this micro-step must synchronise: every
        `accumulation_steps`-th one, and (sync_with_dataloader) the last batch of a dataloader,
        so no gradient is carried across epochs."""
        self.micro_step += 1
        self.sync_gradients = (self.micro_step % self.accumulation_steps == 0) or (
            self.sync_with_dataloader and self.end_of_dataloader)
        if self.sync_gradients:
            self.micro_step = 0
        return self.sync_gradients


def is_initialized() -> bool:
    """True once an Accelerator (or AcceleratorState) has set up the state, until it is reset."""
    return bool(AcceleratorState._shared_state)


# ---- Accelerate's own helpers beside triax's Accelerator ----------------------------------------


def share_with_accelerate(mixed_precision: str, cpu: bool) -> None:
    """Let helpers the script keeps from Accelerate itself see this job.

    A script that switched its Accelerator to triax's may still call Accelerate's own helpers
    (accelerate.test_utils, accelerate.utils' operations). Those build Accelerate's AcceleratorState,
    which refuses to exist unless an Accelerate Accelerator made it first. So when the script has
    imported Accelerate, triax's Accelerator initialises Accelerate's state as well, for the same
    process group (already joined: Accelerate only finds it), device and precision. Where the
    script has not imported Accelerate, nothing is imported and nothing is done.
    """
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is None:
        return
    try:
        # triax's Accelerator may change the precision of an existing state; Accelerate's refuses
        # to, so its copy is made afresh each time (the process information stays, unless this
        # process's place has changed since, e.g. another process group).
        place = accelerate_state.PartialState._shared_state
        ours = PartialState()
        stale = place and (place.get("num_processes"), place.get("process_index")) != (ours.num_processes,
                                                                                        ours.process_index)
        accelerate_state.AcceleratorState._reset_state(reset_partial_state=bool(stale))
        # What Accelerate's Accelerator passes (its state reads the plugin): no compilation.
        dynamo = sys.modules["accelerate.utils.dataclasses"].TorchDynamoPlugin()
        accelerate_state.AcceleratorState(mixed_precision=mixed_precision, cpu=cpu, dynamo_plugin=dynamo,
                                          _from_accelerator=True)
        accelerate_state.GradientState()
    except Exception as error:  # another Accelerate version's checks: triax's own Accelerator is unaffected
        warnings.warn(f"triax: Accelerate's own helpers will not see this Accelerator "
                      f"({type(error).__name__}: {error})", stacklevel=3)


def _reset_accelerate(class_name: str) -> None:
    # A reset of triax's state resets Accelerate's counterpart too, so the next Accelerator can
    # set it up again with other choices (Accelerate refuses to change an initialised state).
    accelerate_state = sys.modules.get("accelerate.state")
    reset = getattr(getattr(accelerate_state, class_name, None), "_reset_state", None)
    if reset is not None:
        reset()


__getattr__, __dir__ = serve_absent(__name__)
