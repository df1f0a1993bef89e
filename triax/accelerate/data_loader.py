"""Prepared dataloaders, drawing the same random numbers in the same order as Accelerate's.

A prepared dataloader is a new torch DataLoader over the user's dataset that keeps their
sampler, collate function, workers and generator, and hands this process its share of each step
(_internal/sharding.py). It must give a script Accelerate's numbers bit for bit, and those depend on every
draw from torch's global generator, not only on the batches. So the rules below are Accelerate
1.15's, draw for draw:

- One process: the user's own batch sampler, unchanged. A shuffled DataLoader's RandomSampler
  without a generator draws its seed from torch's global generator at the start of each pass.
- N processes: a RandomSampler without a generator gets one at prepare time, seeded by one draw
  from torch's global generator; before each pass, process 0's generator state is handed to
  every process (rng_types=["generator"], the Accelerator's default), so every process draws the
  same order. Batches are dealt out with BatchSamplerShard; streams are cut by
  IterableDatasetShard, or read on process 0 only and broadcast (DataLoaderDispatcher, the
  default for an IterableDataset when batches are placed on the device).
- Every pass draws the DataLoader's base seed for workers (from the DataLoader's generator, else
  torch's global one), as any DataLoader does, and the loader reads one batch ahead, so it knows
  the last batch is the last (end_of_dataloader) when it hands it out: a collate function that
  draws random numbers does so one batch earlier than in a plain loop, as in Accelerate.
- use_seedable_sampler replaces a RandomSampler with SeedableRandomSampler, whose order is a
  function of (seed, epoch); the loader tells it the epoch (its `iteration`) before each pass.
- save_state keeps no data position (load_state restores the random states only, and scripts skip
  what they have seen with skip_first_batches), except with use_stateful_dataloader=True: then
  the loader is a torchdata StatefulDataLoader and its state_dict is saved and restored.

triax's own choice, off by default: data_order="seeded" (Accelerator) replaces a RandomSampler
with SeededOrderSampler, an order that is a function of (seed, epoch) and draws nothing.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from triax.accelerate._internal.errors import AcceleratorRuntimeError, AcceleratorTypeError, AcceleratorValueError
from triax.accelerate._internal.sharding import (
    BatchSamplerShard,
    IterableDatasetShard,
    SeededOrderSampler,
    SkipBatchSampler,
)
from triax.accelerate._internal.surface import serve_absent
from triax.accelerate.state import GradientState, PartialState
from triax.accelerate.utils.operations import broadcast, broadcast_object_list, is_mapping, map_tensors, send_to_device
from triax.accelerate.utils.random import SeedableRandomSampler, synchronize_rng_states

# The DataLoader arguments a prepared loader copies from the user's (with their defaults); the
# sampling ones (batch_size, shuffle, sampler, batch_sampler, drop_last) are replaced instead.
LOADER_OPTIONS = {
    "num_workers": 0, "collate_fn": None, "pin_memory": False, "timeout": 0, "worker_init_fn": None,
    "multiprocessing_context": None, "generator": None, "prefetch_factor": 2, "persistent_workers": False,
    "pin_memory_device": "",
}
if "in_order" in inspect.signature(DataLoader.__init__).parameters:
    LOADER_OPTIONS["in_order"] = True


def _loader_options(dataloader: DataLoader) -> dict:
    return {name: getattr(dataloader, name, default) for name, default in LOADER_OPTIONS.items()}


def _default_generator() -> torch.Generator:
    return torch.Generator(device=torch.get_default_device() if hasattr(torch, "get_default_device") else "cpu")


class DataLoaderStateMixin:
    """Where a prepared loader is in its pass, for the GradientState: end_of_dataloader is True
    while the last batch is out; remainder is the number of real samples in the last global
    batch (-1 when unknown), which gather_for_metrics keeps."""

    end_of_dataloader = False
    remainder = -1

    def reset(self) -> None:
        self.end_of_dataloader = False
        self.remainder = -1

    def begin(self) -> None:
        self.reset()
        with suppress(Exception):  # a loader without a length (or a drop_last) keeps -1
            if not self._drop_last:
                length = getattr(self.dataset, "total_dataset_length", len(self.dataset))
                self.remainder = length % self.total_batch_size
        self.gradient_state._add_dataloader(self)

    def end(self) -> None:
        self.gradient_state._remove_dataloader(self)


class DataLoaderAdapter(DataLoader):
    """The base of prepared loaders: a torch DataLoader, or with use_stateful_dataloader=True a
    torchdata StatefulDataLoader (the class is then a subclass of both, made on first use).

    In Accelerate the prepared loader wraps a second DataLoader, `base_dataloader`; here the
    prepared loader is that DataLoader itself, and `base_dataloader` names it."""

    def __new__(cls, *args: Any, use_stateful_dataloader: bool = False, **kwargs: Any):
        if use_stateful_dataloader and not issubclass(cls, _StatefulPosition):
            cls = _stateful_variant(cls)
        return super().__new__(cls)

    def __init__(self, dataset: torch.utils.data.Dataset, use_stateful_dataloader: bool = False,
                 batch_sampler: torch.utils.data.BatchSampler | None = None, **kwargs: Any):
        if use_stateful_dataloader and "in_order" in kwargs and not _stateful_takes("in_order"):
            kwargs.pop("in_order")  # torchdata before 0.11 does not know it
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self.use_stateful_dataloader = use_stateful_dataloader
        self._record_initial_position()

    def __getattr__(self, name: str):
        # Only for instances: `DataLoaderShard.base_dataloader` is an AttributeError, as in Accelerate.
        if name == "base_dataloader":
            return self
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _record_initial_position(self) -> None:
        """Stateful loaders only (see _StatefulPosition)."""

    def _update_state_dict(self) -> None:
        """Record the position to save (stateful loaders only: see _StatefulPosition)."""

    def adjust_state_dict_for_prefetch(self) -> None:
        """Correct a recorded position for batches read ahead of the user: nothing to correct
        unless the loader reads more than one batch ahead (DataLoaderDispatcher)."""

    def get_sampler(self):
        return get_sampler(self)

    def set_sampler(self, sampler: torch.utils.data.Sampler) -> None:
        """Make `sampler` the one the (sharded) batch sampler draws indices from."""
        if isinstance(self.sampler, BatchSampler):
            self.sampler.sampler = sampler
        else:
            self.batch_sampler.sampler = sampler
            if hasattr(self.batch_sampler, "batch_sampler"):
                self.batch_sampler.batch_sampler.sampler = sampler


class _StatefulPosition:
    """With use_stateful_dataloader: the loader is also a StatefulDataLoader. Because it reads one
    batch ahead, its live state is one batch past what the user holds, so the state is recorded
    before each read ahead and state_dict() returns that record."""

    def state_dict(self) -> dict:
        return self._saved_position

    def load_state_dict(self, state_dict: dict) -> None:
        _stateful_class().load_state_dict(self, state_dict)

    def _record_initial_position(self) -> None:
        # As Accelerate: asking a new StatefulDataLoader for its state starts its iterator (the
        # base seed is drawn now), which the first pass then uses.
        self._saved_position = _stateful_class().state_dict(self)

    def _update_state_dict(self) -> None:
        self._saved_position = _stateful_class().state_dict(self)
        self.adjust_state_dict_for_prefetch()
        self._saved_position["_iterator_finished"] = self.end_of_dataloader
        # adjust_state_dict_for_prefetch is the loader class's own (DataLoaderDispatcher's corrects
        # for the reads ahead of a step): this mixin comes first in the stateful variant's bases, so
        # the default lives in DataLoaderAdapter, behind the classes that override it.


def _stateful_class():
    try:  # deferred: torchdata is optional, and needed only with use_stateful_dataloader=True
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        raise ImportError("use_stateful_dataloader=True needs torchdata 0.8 or later (pip install torchdata); "
                          "or leave it False and skip seen batches with skip_first_batches") from None
    return StatefulDataLoader


def _stateful_takes(argument: str) -> bool:
    return argument in inspect.signature(_stateful_class().__init__).parameters


def _stateful_variant(cls):
    """`cls` as a StatefulDataLoader too (made once per class, kept in this module for pickle)."""
    name = f"Stateful{cls.__name__}"
    variant = globals().get(name)
    if variant is None:
        variant = type(name, (_StatefulPosition, cls, _stateful_class()), {"__module__": __name__})
        globals()[name] = variant
    return variant


class DataLoaderShard(DataLoaderAdapter, DataLoaderStateMixin):
    """This process's share of a DataLoader (Accelerate's class of the same name): batches moved
    to `device` (if given), the generators in `rng_types` synchronised from process 0 before each
    pass, `skip_batches` left out at the start of each pass; `iteration` counts finished passes
    and is the epoch given to samplers and datasets that take one (set_epoch)."""

    def __init__(self, dataset: torch.utils.data.Dataset, device: torch.device | str | int | None = None,
                 rng_types: list[str] | None = None, synchronized_generator: torch.Generator | None = None,
                 skip_batches: int = 0, use_stateful_dataloader: bool = False, _drop_last: bool = False,
                 _non_blocking: bool = False, torch_device_mesh: object | None = None, iteration: int = 0,
                 **kwargs: Any):
        self.gradient_state = GradientState()
        self._drop_last = _drop_last
        super().__init__(dataset, use_stateful_dataloader=use_stateful_dataloader, **kwargs)
        self.device = device
        self.rng_types = rng_types
        self.synchronized_generator = synchronized_generator
        self.skip_batches = skip_batches
        self._non_blocking = _non_blocking
        self.torch_device_mesh = torch_device_mesh
        self.iteration = iteration

    def adjust_state_dict_for_prefetch(self) -> None:
        """Each process reads its own shard one batch ahead, and the state is recorded before that
        read: nothing to correct."""

    def __iter__(self):
        if self.rng_types is not None:
            synchronize_rng_states(self.rng_types, self.synchronized_generator)
        self.begin()
        self.set_epoch(self.iteration)
        batches = super().__iter__()
        try:
            current = next(batches)
        except StopIteration:
            self.end()
            return
        index = 0
        while True:
            if self.device is not None:
                current = send_to_device(current, self.device, non_blocking=self._non_blocking)
            self._update_state_dict()
            try:
                following = next(batches)
            except StopIteration:
                self.end_of_dataloader = True
                self._update_state_dict()
                if index >= self.skip_batches:
                    yield current
                break
            if index >= self.skip_batches:
                yield current
            index += 1
            current = following
        # As in Accelerate, a pass left early (break) is neither counted nor ended.
        self.iteration += 1
        self.end()

    def set_epoch(self, epoch: int) -> None:
        """The epoch for the batch sampler, its sampler and (otherwise) the dataset, where they
        take one; it becomes this loader's `iteration`."""
        self.iteration = epoch
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)
        if hasattr(self.batch_sampler, "sampler") and hasattr(self.batch_sampler.sampler, "set_epoch"):
            self.batch_sampler.sampler.set_epoch(epoch)
        inner = getattr(getattr(self.batch_sampler, "batch_sampler", None), "sampler", None)
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    @property
    def total_batch_size(self) -> int:
        batch_sampler = self.sampler if isinstance(self.sampler, BatchSampler) else self.batch_sampler
        while isinstance(batch_sampler, SkipBatchSampler):  # a resumed loader counts the batches it skips over
            batch_sampler = batch_sampler.batch_sampler
        if getattr(batch_sampler, "split_batches", False):
            return batch_sampler.batch_size
        return batch_sampler.batch_size * getattr(batch_sampler, "num_processes", 1)

    @property
    def total_dataset_length(self) -> int:
        return self.dataset.total_length if hasattr(self.dataset, "total_length") else len(self.dataset)


class DataLoaderDispatcher(DataLoaderAdapter, DataLoaderStateMixin):
    """Batches read on process 0 only and sent to every process (Accelerate's class of the same
    name, its dispatch_batches=True): each step process 0 reads N batches (one with
    split_batches), joins them, broadcasts the result, and every process keeps its slice. The
    last, short step is completed from the first one unless drop_last."""

    def __init__(self, dataset: torch.utils.data.Dataset, split_batches: bool = False, skip_batches: int = 0,
                 use_stateful_dataloader: bool = False, _drop_last: bool = False, _non_blocking: bool = False,
                 slice_fn: Callable | None = None, torch_device_mesh: object | None = None, iteration: int = 0,
                 **kwargs: Any):
        shuffle = _datapipe_shuffle(dataset)
        self.gradient_state = GradientState()
        self._drop_last = _drop_last
        self.split_batches = split_batches
        super().__init__(dataset, use_stateful_dataloader=use_stateful_dataloader, **kwargs)
        if shuffle:  # DataLoader turned a datapipe's shuffling off; it was on
            torch.utils.data.graph_settings.apply_shuffle_settings(dataset, shuffle=True)
        self.state = PartialState()
        self._non_blocking = _non_blocking
        self.skip_batches = skip_batches
        self.torch_device_mesh = torch_device_mesh
        self.slice_fn = slice_fn if slice_fn is not None else slice_tensors
        self.iteration = iteration
        mesh_names = getattr(torch_device_mesh, "mesh_dim_names", None) or ()
        if "tp" in mesh_names and ("dp" in mesh_names or "fsdp" in mesh_names):
            raise AcceleratorValueError("dispatch_batches does not support tensor parallel combined with data "
                                        "parallel or FSDP in the device mesh; use dispatch_batches=False")
        self._tensor_parallel = "tp" in mesh_names

    def adjust_state_dict_for_prefetch(self) -> None:
        """Process 0 records the state before its last read of a step's N batches: N - 1 reads
        ahead of the step boundary it must resume from."""
        if not self.state.use_distributed:
            return
        ahead = self.state.num_processes - 1
        state = self._saved_position
        if state.get("_sampler_iter_yielded", 0) > 0:
            state["_sampler_iter_yielded"] -= ahead
        if state.get("_num_yielded", 0) > 0:
            state["_num_yielded"] -= ahead
        sampler_state = state.get("_index_sampler_state")
        if isinstance(sampler_state, dict) and sampler_state.get("samples_yielded", 0) > 0:
            sampler_state["samples_yielded"] -= self.batch_size * ahead

    def _read_step(self, batches: Any):
        """Process 0 reads the next step's data; every process learns its structure, or that the
        pass has ended. Returns (batch or None, [structure, finished])."""
        joined, group = None, []
        if self.state.process_index == 0:
            try:
                if self.split_batches or self._tensor_parallel:
                    self._update_state_dict()
                    joined = next(batches)
                    if not self.split_batches:  # tensor parallel: every process gets the same batch
                        group = [joined] * self.state.num_processes
                else:
                    for _ in range(self.state.num_processes):
                        self._update_state_dict()
                        group.append(next(batches))
                if group:
                    joined = _join(group)
                info = [_structure(joined), False]
            except StopIteration:
                info = [None, True]
        else:
            info = [None, self._finished]
        broadcast_object_list(info)
        self._finished = info[1]
        if self._finished and not self.split_batches and not self._drop_last:
            # A last step with fewer than N batches is still handed out.
            if self.state.process_index == 0 and group:
                joined = _join(group)
                info = [_structure(joined), False]
            else:
                info = [None, True]
            broadcast_object_list(info)
        return joined, info

    def __iter__(self):
        self.begin()
        self.set_epoch(self.iteration)
        # Every process makes the iterator (a datapipe's seed is shared through it, and so the
        # base seed is drawn everywhere); only process 0 reads from it.
        batches = super().__iter__()
        self._finished = False
        first_slice = None
        following, following_info = self._read_step(batches)
        index, stop = 0, False
        count, me = self.state.num_processes, self.state.process_index
        while not stop:
            batch, info = following, following_info
            if me != 0:
                batch = _empty_like_structure(info[0])
            batch = send_to_device(batch, self.state.device, non_blocking=self._non_blocking)
            batch = broadcast(batch, from_process=0)
            if not self._drop_last and first_slice is None:
                first_slice = self.slice_fn(batch, slice(0, count), process_index=me, num_processes=count)
            if batch is None:
                raise AcceleratorValueError(f"a dispatched batch holds no data ({batch}); the dataset ended before "
                                            "its announced end")
            observed = _batch_size(batch)
            size = observed // count
            stop = self._finished
            if not stop:
                following, following_info = self._read_step(batches)
                if self._finished and following_info[0] is None:
                    stop = True
            if not self._drop_last and stop and observed % count:
                batch = _join([batch, first_slice])  # complete the last step from the first
                size += 1
            batch = self.slice_fn(batch, slice(me * size, (me + 1) * size), process_index=me, num_processes=count)
            if stop:
                self.end_of_dataloader = True
                self._update_state_dict()
                self.remainder = observed
            if index >= self.skip_batches:
                yield batch
            index += 1
        self.iteration += 1
        self.end()

    def set_epoch(self, epoch: int) -> None:
        self.iteration = epoch
        if hasattr(self.batch_sampler, "sampler") and hasattr(self.batch_sampler.sampler, "set_epoch"):
            self.batch_sampler.sampler.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        whole = super().__len__()
        if self.split_batches:
            return whole
        if self._drop_last:
            return whole // self.state.num_processes
        return -(-whole // self.state.num_processes)

    @property
    def total_batch_size(self) -> int:
        size = self.batch_size if self.batch_size is not None else getattr(self.batch_sampler, "batch_size", 1)
        return size if self.split_batches else size * self.state.num_processes

    @property
    def total_dataset_length(self) -> int:
        return len(self.dataset)


class SkipDataLoader(DataLoaderAdapter, DataLoaderStateMixin):
    """A DataLoader whose passes leave out their first `skip_batches` batches (Accelerate's
    class); skip_first_batches makes one for an unprepared loader over a stream."""

    def __init__(self, dataset: torch.utils.data.Dataset, skip_batches: int = 0, use_stateful_dataloader: bool = False,
                 **kwargs: Any):
        super().__init__(dataset, use_stateful_dataloader=use_stateful_dataloader, **kwargs)
        self.skip_batches = skip_batches
        self.gradient_state = GradientState()

    def __iter__(self):
        self.begin()
        for index, batch in enumerate(super().__iter__()):
            if index >= self.skip_batches:
                self._update_state_dict()
                yield batch
        self.end()

    def __len__(self) -> int:
        return super().__len__() - self.skip_batches


# ---- nested batches -------------------------------------------------------------------------------


def slice_tensors(data: Any, tensor_slice: slice, process_index: int | None = None, num_processes: int | None = None):
    """Every tensor of a nested batch sliced along its first dimension (Accelerate's helper)."""
    return map_tensors(lambda tensor: tensor[tensor_slice], data)


def _join(batches: list):
    """Concatenate batches of the same structure along the first dimension; a single batch of
    anything is returned as it is."""
    first = batches[0]
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(_join([b[i] for b in batches]) for i in range(len(first))))
    if isinstance(first, (tuple, list)):
        return type(first)(_join([b[i] for b in batches]) for i in range(len(first)))
    if is_mapping(first):
        return type(first)({key: _join([b[key] for b in batches]) for key in first.keys()})
    if isinstance(first, torch.Tensor):
        try:
            return torch.cat(batches, dim=0)
        except RuntimeError as error:
            raise AcceleratorRuntimeError(
                f"dispatch_batches cannot join batches of different shapes ({error}); pass dispatch_batches=False "
                "so each process reads its own batches, or split_batches=True") from error
    if len(batches) == 1:
        return first
    raise AcceleratorTypeError(f"dispatch_batches can only join tensors, got a {type(first).__name__}; pass "
                               "dispatch_batches=False so each process reads its own batches")


def _structure(batch: Any):
    """The batch with each tensor replaced by (shape, dtype): what other processes need to receive it."""
    return map_tensors(lambda tensor: _TensorInformation((tuple(tensor.shape), tensor.dtype)), batch)


class _TensorInformation(tuple):
    """(shape, dtype) of a tensor to be received."""


def _empty_like_structure(structure: Any):
    if isinstance(structure, _TensorInformation):
        return torch.empty(*structure[0], dtype=structure[1])
    if isinstance(structure, tuple) and hasattr(structure, "_fields"):
        return type(structure)(*(_empty_like_structure(item) for item in structure))
    if isinstance(structure, (list, tuple)):
        return type(structure)(_empty_like_structure(item) for item in structure)
    if is_mapping(structure):
        return type(structure)({key: _empty_like_structure(item) for key, item in structure.items()})
    return structure


def _batch_size(batch: Any) -> int:
    if (isinstance(batch, (tuple, list)) or is_mapping(batch)) and not len(batch):
        raise AcceleratorValueError(f"cannot find the batch size of an empty {type(batch).__name__}")
    if isinstance(batch, (tuple, list)):
        return _batch_size(batch[0])
    if is_mapping(batch):
        return _batch_size(batch[next(iter(batch.keys()))])
    if not isinstance(batch, torch.Tensor):
        raise AcceleratorValueError(f"cannot find the batch size of a {type(batch).__name__}; batches must hold "
                                    "tensors to be dispatched")
    return batch.shape[0]


def _datapipe_shuffle(dataset: torch.utils.data.Dataset) -> bool:
    try:  # deferred: torch's datapipes are deprecated; imported only for a dispatched loader
        from torch.utils.data.datapipes.iter.combinatorics import ShufflerIterDataPipe
    except ImportError:  # datapipes were removed from torch: nothing to keep
        return False
    return isinstance(dataset, ShufflerIterDataPipe) and dataset._shuffle_enabled


# ---- preparing and skipping ---------------------------------------------------------------------


def get_sampler(dataloader: torch.utils.data.DataLoader):
    """The sampler of indices inside a dataloader's batch sampler (None for a custom one)."""
    if isinstance(dataloader.sampler, BatchSampler):
        return getattr(dataloader.sampler, "sampler", None)
    return getattr(dataloader.batch_sampler, "sampler", None)


def _data_processes(state: PartialState, num_processes: int, process_index: int, torch_device_mesh: object | None):
    """(number, index) of this process among those that get different data: processes that
    differ only in a tensor-parallel or context-parallel coordinate read the same batches."""
    if torch_device_mesh is None:
        return num_processes, process_index
    names = torch_device_mesh.mesh_dim_names or ()

    def size(name: str):
        return torch_device_mesh[name].size() if name in names else 1

    same_data = size("tp") * size("cp")
    return size("dp_replicate") * size("dp_shard"), process_index // same_data


def prepare_data_loader(dataloader: DataLoader, device: torch.device | None = None, num_processes: int | None = None,
                        process_index: int | None = None, split_batches: bool = False, put_on_device: bool = False,
                        rng_types: list | None = None, dispatch_batches: bool | None = None, even_batches: bool = True,
                        slice_fn_for_dispatch: Callable | None = None, use_seedable_sampler: bool = False,
                        data_seed: int | None = None, non_blocking: bool = False, use_stateful_dataloader: bool = False,
                        torch_device_mesh: object | None = None, order_seed: int | None = None) -> DataLoader:
    """Accelerate's function of the same name: `dataloader` as this process's DataLoaderShard
    (or DataLoaderDispatcher). Process information comes from PartialState unless given.
    order_seed (triax's data_order="seeded") replaces a RandomSampler with SeededOrderSampler."""
    if dispatch_batches is None:
        dispatch_batches = put_on_device and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and not put_on_device:
        raise AcceleratorValueError("dispatch_batches=True needs put_on_device=True (the batches are broadcast "
                                    "from process 0's device)")
    state = PartialState()
    num_processes = state.num_processes if num_processes is None else num_processes
    process_index = state.process_index if process_index is None else process_index
    num_processes, process_index = _data_processes(state, num_processes, process_index, torch_device_mesh)
    if split_batches:
        _check_split(dataloader, num_processes)

    dataset = dataloader.dataset
    batch_sampler = None if isinstance(dataset, IterableDataset) else dataloader.batch_sampler
    synchronized_generator = None
    sampler, replacement = _replace_random_sampler(get_sampler(dataloader), use_seedable_sampler, data_seed,
                                                   order_seed)
    if num_processes != 1 and not dispatch_batches:
        dataset, batch_sampler, synchronized_generator = _share_among_processes(
            dataloader, sampler, num_processes, process_index, split_batches, even_batches, use_seedable_sampler)

    if rng_types is not None and synchronized_generator is None and "generator" in rng_types:
        rng_types.remove("generator")
    options = _loader_options(dataloader)
    if batch_sampler is None:
        options["drop_last"] = dataloader.drop_last
        options["batch_size"] = (dataloader.batch_size // num_processes if split_batches and not dispatch_batches
                                 else dataloader.batch_size)
    options.update(_drop_last=dataloader.drop_last, _non_blocking=non_blocking,
                   use_stateful_dataloader=use_stateful_dataloader)
    if dispatch_batches:
        options.pop("generator")
        prepared = DataLoaderDispatcher(dataset, split_batches=split_batches, batch_sampler=batch_sampler,
                                        slice_fn=slice_fn_for_dispatch, torch_device_mesh=torch_device_mesh, **options)
    else:
        prepared = _shard_loader(dataloader, dataset, batch_sampler, device if put_on_device else None, rng_types,
                                 synchronized_generator, options)
    if replacement is not None:
        prepared.set_sampler(replacement)
    return prepared


def _replace_random_sampler(sampler: object, use_seedable_sampler: bool, data_seed: int | None,
                            order_seed: int | None) -> tuple[object, object | None]:
    """(the sampler the prepared loader draws from, the replacement to set on it or None): a
    RandomSampler becomes a SeedableRandomSampler (use_seedable_sampler) or, with order_seed, a
    SeededOrderSampler when it draws each sample once."""
    if isinstance(sampler, RandomSampler) and use_seedable_sampler:
        replacement = SeedableRandomSampler(
            data_source=sampler.data_source, replacement=sampler.replacement, num_samples=sampler._num_samples,
            generator=sampler.generator, data_seed=data_seed)
        return replacement, replacement
    if (isinstance(sampler, RandomSampler) and order_seed is not None and not sampler.replacement
            and sampler._num_samples is None):
        replacement = SeededOrderSampler(len(sampler.data_source), order_seed)
        return replacement, replacement
    return sampler, None


def _share_among_processes(dataloader: DataLoader, sampler: object, num_processes: int, process_index: int,
                           split_batches: bool, even_batches: bool,
                           use_seedable_sampler: bool) -> tuple[object, BatchSampler | None, torch.Generator | None]:
    """(dataset, batch sampler, generator every process must share) giving this process its share:
    a Hugging Face IterableDataset by its own shards, another stream sample by sample, map-style
    data by dealing the DataLoader's batches."""
    dataset = dataloader.dataset
    batch_sampler = None if isinstance(dataset, IterableDataset) else dataloader.batch_sampler
    hf_datasets = sys.modules.get("datasets")  # a Hugging Face IterableDataset has it imported
    if (hf_datasets is not None and isinstance(dataset, getattr(hf_datasets, "IterableDataset", ()))
            and not split_batches and dataset.n_shards >= num_processes):
        return dataset.shard(num_shards=num_processes, index=process_index), batch_sampler, None
    if isinstance(dataset, IterableDataset):
        synchronized_generator = getattr(dataloader.dataset, "generator", None)
        dataset = IterableDatasetShard(dataset, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last,
                                       num_processes=num_processes, process_index=process_index,
                                       split_batches=split_batches)
        return dataset, batch_sampler, synchronized_generator
    synchronized_generator = None
    if not use_seedable_sampler and hasattr(sampler, "generator"):
        if sampler.generator is None:
            # One draw from torch's generator seeds the order's own; process 0's state
            # is handed to every process before each pass.
            sampler.generator = _default_generator()
            sampler.generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        synchronized_generator = sampler.generator
    sampler_is_batch_sampler = isinstance(dataloader.sampler, BatchSampler)
    batch_sampler = BatchSamplerShard(dataloader.sampler if sampler_is_batch_sampler else dataloader.batch_sampler,
                                      num_processes=num_processes, process_index=process_index,
                                      split_batches=split_batches, even_batches=even_batches)
    return dataset, batch_sampler, synchronized_generator


def _shard_loader(dataloader: DataLoader, dataset: object, batch_sampler: BatchSampler | None,
                  device: torch.device | None, rng_types: list | None, synchronized_generator: torch.Generator | None,
                  options: dict) -> DataLoaderShard:
    """The DataLoaderShard over this process's share; a DataLoader whose sampler is itself a
    BatchSampler keeps it as its sampler, as Accelerate's does."""
    if isinstance(dataloader.sampler, BatchSampler):
        return DataLoaderShard(dataset, device=device, sampler=batch_sampler, batch_size=dataloader.batch_size,
                               rng_types=rng_types, synchronized_generator=synchronized_generator, **options)
    return DataLoaderShard(dataset, device=device, batch_sampler=batch_sampler, rng_types=rng_types,
                           synchronized_generator=synchronized_generator, **options)


def _check_split(dataloader: DataLoader, num_processes: int) -> None:
    size = dataloader.batch_size
    if size is None:
        size = getattr(dataloader.batch_sampler, "batch_size", None)
        if size is None:
            raise AcceleratorValueError(
                "split_batches=True needs a batch_size on the DataLoader or on its batch_sampler "
                f"({type(dataloader.batch_sampler).__name__} has none)")
    if size > 1 and size % num_processes:
        raise AcceleratorValueError(f"split_batches=True needs the batch size ({size}) to be a round multiple of "
                                    f"the number of processes ({num_processes})")


def skip_first_batches(dataloader: torch.utils.data.DataLoader, num_batches: int = 0):
    """A new dataloader like `dataloader` whose passes begin `num_batches` batches in (Accelerate's
    function): a prepared loader stays prepared, keeping its generators and its epoch count."""
    dataset = dataloader.dataset
    sampler_is_batch_sampler = False
    if isinstance(dataset, IterableDataset):
        skipping = None
    else:
        sampler_is_batch_sampler = isinstance(dataloader.sampler, BatchSampler)
        skipping = SkipBatchSampler(dataloader.sampler if sampler_is_batch_sampler else dataloader.batch_sampler,
                                    skip_batches=num_batches)
    options = _loader_options(dataloader)
    if skipping is None:
        options["drop_last"] = dataloader.drop_last
        options["batch_size"] = dataloader.batch_size

    if isinstance(dataloader, DataLoaderDispatcher):
        if skipping is None:
            options["skip_batches"] = num_batches
        return DataLoaderDispatcher(dataset, split_batches=dataloader.split_batches, batch_sampler=skipping,
                                    _drop_last=dataloader._drop_last, _non_blocking=dataloader._non_blocking,
                                    slice_fn=dataloader.slice_fn, torch_device_mesh=dataloader.torch_device_mesh,
                                    iteration=dataloader.iteration, **options)
    if isinstance(dataloader, DataLoaderShard):
        if skipping is None:
            options["skip_batches"] = num_batches
        elif sampler_is_batch_sampler:
            options["sampler"] = skipping
            options["batch_size"] = dataloader.batch_size
        else:
            options["batch_sampler"] = skipping
        return DataLoaderShard(dataset, device=dataloader.device, rng_types=dataloader.rng_types,
                               synchronized_generator=dataloader.synchronized_generator,
                               _drop_last=dataloader._drop_last, _non_blocking=dataloader._non_blocking,
                               torch_device_mesh=dataloader.torch_device_mesh, iteration=dataloader.iteration,
                               **options)
    if skipping is None:
        return SkipDataLoader(dataset, skip_batches=num_batches, **options)
    return DataLoader(dataset, batch_sampler=skipping, **options)


# accelerate.data_loader's counterpart (triax.accelerate._internal.surface).
__all__ = ["BatchSamplerShard", "DataLoaderAdapter", "DataLoaderDispatcher", "DataLoaderShard", "DataLoaderStateMixin",
           "IterableDatasetShard", "SeedableRandomSampler", "SkipBatchSampler", "SkipDataLoader", "get_sampler",
           "prepare_data_loader", "skip_first_batches"]

__getattr__, __dir__ = serve_absent(__name__)
