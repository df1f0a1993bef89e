"""Dataloaders sharded across processes, as Accelerate shards them.

A prepared dataloader keeps the user's dataset, sampler, collate function and workers. What it
hands out depends on how the DataLoader was built:

- batch_size=... over a map-style dataset (the common case): the epoch's sample order comes from
  the DataLoader's own sampler (Accelerate's rule, `data_order="loader"`): a RandomSampler (or
  SeedableRandomSampler) draws it from its generator, whose state is first made equal on every
  process (process 0's), so every process draws the same order, exactly the order one process
  would draw. A step takes the next `global batch` of that order and process r takes the r-th
  contiguous slice, so N processes with batch B see the samples one process sees with batch N*B.
  With `data_order="seeded"` the order is triax's permutation of (seed, epoch) instead
  (triax.data.sampler.GlobalSampler): independent of any generator and resumable exactly at any
  number of processes.
- batch_sampler=... (or a BatchSampler given as sampler with batch_size=None): the batches are the
  user's; step k gives process r batch k*N + r (split_batches: one batch, cut into N pieces).
- an IterableDataset: every process reads the stream and takes its batch of each group of N.

even_batches (the default) repeats data from the start of the epoch so every process gets the
same number of batches; gather_for_metrics drops the repeats again. The position in the epoch is
the number of steps taken, which save_state/load_state and skip_first_batches use.
"""

from __future__ import annotations

import base64
import itertools

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from triax.accelerate.errors import AcceleratorValueError
from triax.accelerate.operations import broadcast_object_list, map_tensors, send_to_device
from triax.accelerate.random import SeedableRandomSampler, synchronize_generator
from triax.accelerate.state import GradientState, PartialState
from triax.accelerate.surface import serve_absent
from triax.data.sampler import GlobalSampler


class ShardedBatchSampler:
    """What `prepared.batch_sampler` shows, as Accelerate's BatchSamplerShard: the user's batch
    sampler (`.batch_sampler`) and how it is shared out (`even_batches` can be changed, e.g. by
    join_uneven_inputs, and applies from the next pass)."""

    def __init__(self, loader: "PreparedDataLoader", batch_sampler):
        self._loader = loader
        self.batch_sampler = batch_sampler
        self.num_processes = loader.num_processes
        self.process_index = loader.process_index
        self.split_batches = loader.split_batches

    @property
    def even_batches(self) -> bool:
        return self._loader.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self._loader.even_batches = value

    @property
    def batch_size(self):
        return getattr(self.batch_sampler, "batch_size", None)

    def __len__(self) -> int:
        return len(self._loader)


class PreparedDataLoader:
    def __init__(self, dataloader: DataLoader, *, device: torch.device | None, process_index: int,
                 num_processes: int, gradient_state, seed: int, split_batches: bool = False,
                 even_batches: bool = True, data_order: str = "loader", use_seedable_sampler: bool = False,
                 data_seed: int | None = None):
        self.base_dataloader = dataloader
        self.dataset = dataloader.dataset
        self.device = device
        self.process_index = process_index
        self.num_processes = num_processes
        self.gradient_state = gradient_state
        self.even_batches = even_batches
        self.split_batches = split_batches
        self.drop_last = dataloader.drop_last
        self.data_order = data_order
        if isinstance(dataloader.dataset, IterableDataset):
            self.mode = "stream"
        elif dataloader.batch_size is None:
            self.mode = "batches"
        else:
            self.mode = "samples"
        size = dataloader.batch_size
        if size is None and self.mode == "batches":
            size = getattr(dataloader.batch_sampler if dataloader.batch_sampler is not None else dataloader.sampler,
                           "batch_size", None)
        if split_batches:
            if size is None:
                raise AcceleratorValueError("split_batches=True needs a batch size: the DataLoader's batch_size or a "
                                            "batch_sampler with a batch_size attribute")
            if size > 1 and size % num_processes:
                raise AcceleratorValueError(f"split_batches=True needs a batch_size divisible by the {num_processes} "
                                            f"processes, got batch_size={size}")
        self.batch_size = size // num_processes if split_batches and size else size
        self.total_batch_size = (self.batch_size or 1) * num_processes

        sampler = dataloader.sampler
        if use_seedable_sampler and type(sampler) is RandomSampler:
            # Accelerate's use_seedable_sampler: the order is a function of (seed, epoch).
            sampler = SeedableRandomSampler(sampler.data_source, replacement=sampler.replacement,
                                            num_samples=sampler._num_samples, generator=sampler.generator,
                                            data_seed=data_seed)
            sampler.initial_seed = broadcast_object_list([sampler.initial_seed])[0]
        elif isinstance(sampler, RandomSampler) and sampler.generator is None and self.mode == "samples":
            # As Accelerate: the sampler gets a generator of its own, seeded from torch's, whose
            # state process 0 hands to the others before every pass.
            sampler.generator = torch.Generator().manual_seed(int(torch.empty((), dtype=torch.int64).random_()))
        self.order_source = sampler
        self._generator_at_pass_start: torch.Tensor | None = None

        if self.mode == "samples":
            self._custom_sampler = None if isinstance(sampler, (RandomSampler, SequentialSampler)) else sampler
            self.num_samples = len(sampler)
            shown = BatchSampler(sampler, dataloader.batch_size, dataloader.drop_last)
        elif self.mode == "batches":
            self._custom_sampler = dataloader.batch_sampler if dataloader.batch_sampler is not None else sampler
            self.num_samples = len(self._custom_sampler)  # batches, here
            self.total_batch_size = num_processes
            shown = self._custom_sampler
        else:
            self._custom_sampler = None
            self.num_samples = 0  # unknown until the stream ends
            self.total_batch_size = num_processes
            shown = None
        self.batch_sampler = ShardedBatchSampler(self, shown) if shown is not None else None
        self.sampler = GlobalSampler(max(self.num_samples, 1), seed,
                                     shuffle=isinstance(sampler, RandomSampler))
        self._custom_orders: dict[int, list] = {}

        self.epoch = 0
        self.batch_in_epoch = 0  # steps handed out so far in this epoch: the saved position
        self.at_end = False
        self._start_batch = 0  # where the next pass begins (load_state / skip_first_batches)
        self._stream_tail = (0, 0)  # stream mode: real and repeated samples of the last step
        self._loader_options = dict(
            collate_fn=dataloader.collate_fn, num_workers=dataloader.num_workers,
            pin_memory=dataloader.pin_memory, timeout=dataloader.timeout,
            worker_init_fn=dataloader.worker_init_fn,
            multiprocessing_context=dataloader.multiprocessing_context,
        )
        if dataloader.num_workers > 0:
            self._loader_options["prefetch_factor"] = dataloader.prefetch_factor

    # ---- sizes and positions -------------------------------------------------------------------

    def _items_per_step(self) -> int:
        """How many order items one step consumes: samples (samples mode) or batches."""
        if self.mode == "samples":
            return self.total_batch_size
        return 1 if self.split_batches else self.num_processes

    def __len__(self) -> int:
        """Batches this process gets per epoch (with even_batches=False the last, partial step may
        give some processes one fewer)."""
        if self.mode == "stream":
            return self._shares(len(self.base_dataloader))
        return self._shares(self.num_samples)

    def _shares(self, items: int) -> int:
        per_step = self._items_per_step()
        full, rest = divmod(items, per_step)
        if not rest or (self.drop_last and self.mode == "samples"):
            return full
        if self.even_batches or self.split_batches and self.mode != "samples":
            return full + 1
        unit = self.batch_size if self.mode == "samples" else 1
        return full + (1 if rest > self.process_index * unit else 0)

    @property
    def remainder(self) -> int:
        """Real samples in the last step's global batch (0 when the data divides evenly), as
        Accelerate's GradientState.remainder."""
        if self.mode == "samples":
            return 0 if self.drop_last else self.num_samples % self.total_batch_size
        return self._stream_tail[0]

    @property
    def padding_in_last_batch(self) -> int:
        """Samples repeated to fill the last step (0 when it is full or not padded)."""
        if not self.at_end or not self._pads:
            return 0
        if self.mode != "samples":
            return self._stream_tail[1]
        rest = self.num_samples % self.total_batch_size
        if not rest or self.drop_last:
            return 0
        return self.total_batch_size - rest

    @property
    def _pads(self) -> bool:
        """Whether the last step is filled with repeats: even_batches, and only with several
        processes (one process gets the DataLoader's own batches, as in Accelerate)."""
        return self.even_batches and self.num_processes > 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "batch": self.batch_in_epoch, "num_samples": self.num_samples,
                 "total_batch_size": self.total_batch_size, "seed": self.sampler.seed}
        if self._generator_at_pass_start is not None:
            # The sampler's generator as the current pass began: resuming draws the same order.
            state["generator"] = base64.b64encode(self._generator_at_pass_start.numpy().tobytes()).decode()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position: the next pass yields the rest of the saved epoch.
        The position is kept as a global index, so a different number of processes (or batch
        size) resumes from the same sample when the index falls on a step boundary."""
        global_index = state["batch"] * state["total_batch_size"]
        if global_index % self.total_batch_size:
            raise AcceleratorValueError(f"cannot resume at global sample {global_index}: it is not a multiple of "
                                        f"this run's global batch {self.total_batch_size}; keep the global batch size")
        if state["num_samples"] != self.num_samples:
            raise AcceleratorValueError(f"the saved dataloader had {state['num_samples']} samples, this one has "
                                        f"{self.num_samples}; resume with the same dataset")
        generator = state.get("generator")
        if generator is not None:
            if not isinstance(generator, str) or self._generator() is None:
                raise AcceleratorValueError("the saved dataloader has a generator state this dataloader cannot "
                                            "take; resume with the same DataLoader (shuffle and sampler)")
            try:
                raw = torch.frombuffer(bytearray(base64.b64decode(generator, validate=True)), dtype=torch.uint8)
                self._generator().set_state(raw)
            except (ValueError, RuntimeError) as failure:
                raise AcceleratorValueError(f"the saved dataloader's generator state is damaged ({failure}); "
                                            "resume from another checkpoint") from None
            self._restored_generator = True
        self.sampler = GlobalSampler(max(self.num_samples, 1), state["seed"], shuffle=self.sampler.shuffle)
        self.epoch = state["epoch"]
        self._start_batch = global_index // self.total_batch_size
        self.batch_in_epoch = self._start_batch

    # ---- which samples ---------------------------------------------------------------------------

    def _generator(self) -> torch.Generator | None:
        return getattr(self.order_source, "generator", None)

    def _begin_pass(self) -> None:
        """Make the order's random state equal on every process (process 0's), and keep it so a
        saved position can redraw this pass's order."""
        if self.data_order != "loader" or self.mode != "samples":
            return
        if isinstance(self.order_source, SeedableRandomSampler):
            self.order_source.set_epoch(self.epoch)
        generator = self._generator()
        if generator is None or not isinstance(self.order_source, RandomSampler):
            return
        if not getattr(self, "_restored_generator", False):
            synchronize_generator(generator)
        self._restored_generator = False
        self._generator_at_pass_start = generator.get_state()

    def _order(self, epoch: int) -> list:
        """The epoch's order: sample ids (samples mode) or the user's batches (batches mode)."""
        if self.mode == "samples" and self.data_order == "seeded" and self._custom_sampler is None:
            return self.sampler.epoch_order(epoch).tolist()
        if self.mode == "samples" and self._custom_sampler is None:
            return list(iter(self.order_source))  # every process draws alike (_begin_pass)
        if epoch not in self._custom_orders:
            # Any other sampler is asked on process 0, and its order is shared.
            if hasattr(self._custom_sampler, "set_epoch"):
                self._custom_sampler.set_epoch(epoch)
            shared = broadcast_object_list([[_plain(item) for item in iter(self._custom_sampler)]])
            self._custom_orders = {epoch: shared[0]}
        return self._custom_orders[epoch]

    def batch_indices(self, order: list, batch: int):
        """What this process takes at step `batch` of an epoch whose order is `order`."""
        if self.mode == "batches":
            return self._batch_of_batches(order, batch)
        start = batch * self.total_batch_size
        begin = self.process_index * self.batch_size
        if start + self.total_batch_size <= len(order):
            return order[start + begin:start + begin + self.batch_size]
        real = order[start:]
        if not self._pads:
            # As Accelerate: the short global batch is cut into per-process batches in process
            # order, so the last processes may get a short batch or none.
            return real[begin:begin + self.batch_size]
        # Even batches: fill the last global batch from the start of the epoch's order, so every
        # process steps the same number of times; gather_for_metrics drops the repeats again.
        filled = list(real)
        while len(filled) < self.total_batch_size:
            filled += order[:self.total_batch_size - len(filled)]
        return filled[begin:begin + self.batch_size]

    def _batch_of_batches(self, batches: list, step: int):
        if self.split_batches:
            whole = batches[step] if step < len(batches) else []
            size = self.batch_size or -(-len(whole) // self.num_processes)
            piece = list(whole[self.process_index * size:(self.process_index + 1) * size])
            if self._pads and len(piece) < size:
                piece += list(batches[0])[:size - len(piece)]
            return piece
        index = step * self.num_processes + self.process_index
        if index < len(batches):
            return batches[index]
        return batches[(index - len(batches)) % len(batches)]  # even_batches: repeat from the start

    def _tail(self, batches: list) -> tuple[int, int]:
        """Real and repeated samples in the last step of a batches-mode epoch."""
        if self.split_batches:
            last = len(batches[-1]) if batches else 0
            size = self.batch_size * self.num_processes if self.batch_size else last
            return (last, size - last) if last < size else (0, 0)
        rest = len(batches) % self.num_processes
        if not rest:
            return 0, 0
        real = sum(len(batch) for batch in batches[-rest:])
        repeated = sum(len(batches[i % len(batches)]) for i in range(self.num_processes - rest))
        return real, repeated

    # ---- iteration -------------------------------------------------------------------------------

    def __iter__(self):
        if self.mode == "stream":
            yield from self._iter_stream()
            return
        start, self._start_batch = self._start_batch, 0
        epoch, total = self.epoch, len(self)
        self._begin_pass()
        loader_mode = self.data_order == "loader"
        # The user's generator (if any) draws the workers' base seed before the sampler draws the
        # order, as a plain DataLoader does, so one prepared process equals the plain loop.
        # Otherwise a generator of our own draws it: drawing from torch's global one would shift
        # the user's random stream (dropout...) after load_state, which restores that stream.
        generator = self.base_dataloader.generator if loader_mode else None
        if generator is None:
            generator = torch.Generator().manual_seed(self.sampler.seed * 1_000_003 + epoch)
        steps = _PassSteps(self, epoch, start, total)
        if self.mode == "batches" and self.base_dataloader.batch_sampler is None:
            loader = DataLoader(self.dataset, sampler=steps, batch_size=None, generator=generator,
                                **self._loader_options)
        else:
            loader = DataLoader(self.dataset, batch_sampler=steps, generator=generator, **self._loader_options)
        yield from self._hand_out(loader, start, total)

    def _hand_out(self, batches, start: int, total: int | None):
        non_blocking = self.device is not None and self.device.type == "cuda"
        self.batch_in_epoch, self.at_end = start, total is not None and start >= total
        self.gradient_state.active_loaders.append(self)
        try:
            for batch in batches:
                self.batch_in_epoch += 1
                if total is not None:
                    self.at_end = self.batch_in_epoch == total
                yield batch if self.device is None else send_to_device(batch, self.device, non_blocking)
        finally:
            self.gradient_state.active_loaders.remove(self)
        # Only a pass that ran to the end moves on to the next epoch.
        self.epoch += 1
        self.batch_in_epoch, self.at_end = 0, False

    # ---- iterable datasets -----------------------------------------------------------------------

    def _iter_stream(self):
        start, self._start_batch = self._start_batch, 0
        self._stream_tail = (0, 0)
        yield from self._hand_out(self._stream_steps(start), start, None)

    def _stream_steps(self, start: int):
        """This process's batch of each step, read from the user's own DataLoader: the r-th batch
        of each group of N (split_batches: the r-th piece of each batch). One step is read ahead,
        so the last one is known to be the last (end_of_dataloader) when it is handed out."""
        steps = iter(self._stream_groups())
        first_group, current = None, next(steps, None)
        index = 0
        while current is not None:
            following = next(steps, None)
            if first_group is None:
                first_group = current
            if following is None:
                self.at_end = True
            mine = self._stream_share(current, first_group, last=following is None)
            if index >= start and mine is not None:
                yield mine
            index += 1
            current = following

    def _stream_groups(self):
        group = []
        for batch in self.base_dataloader:
            if self.split_batches:
                yield [batch]
                continue
            group.append(batch)
            if len(group) == self.num_processes:
                yield group
                group = []
        if group:
            yield group

    def _stream_share(self, group: list, first_group: list, last: bool):
        if self.split_batches:
            whole = group[0]
            size = _length(whole)
            piece = -(-size // self.num_processes) if not self.batch_size else self.batch_size
            if last and size < piece * self.num_processes:
                self._stream_tail = (size, piece * self.num_processes - size)
            return _slice(whole, self.process_index * piece, (self.process_index + 1) * piece)
        if last and len(group) < self.num_processes:
            self._stream_tail = (sum(_length(b) for b in group),
                                 sum(_length(first_group[i % len(first_group)])
                                     for i in range(self.num_processes - len(group))))
        if self.process_index < len(group):
            return group[self.process_index]
        if not self._pads:
            return None
        return first_group[(self.process_index - len(group)) % len(first_group)]


class _PassSteps:
    """The sampler a pass's inner DataLoader reads: this process's indices (or batches) for steps
    start..total-1. The order is drawn on the first next(), after the DataLoader drew its base
    seed, exactly as a plain DataLoader's sampler is."""

    def __init__(self, loader: PreparedDataLoader, epoch: int, start: int, total: int):
        self.loader, self.epoch, self.start, self.total = loader, epoch, start, total

    def __len__(self) -> int:
        return max(self.total - self.start, 0)

    def __iter__(self):
        order = self.loader._order(self.epoch)
        if self.loader.mode == "batches":
            self.loader._stream_tail = self.loader._tail(order)
        for step in range(self.start, self.total):
            yield self.loader.batch_indices(order, step)


def _plain(item):
    """A sampler's item as plain Python (ints, or lists of them) for sharing between processes."""
    if isinstance(item, torch.Tensor):
        return item.tolist()
    if isinstance(item, (list, tuple)):
        return [_plain(x) for x in item]
    return int(item) if hasattr(item, "__index__") else item


def _length(batch) -> int:
    sizes = []
    map_tensors(lambda tensor: sizes.append(tensor.shape[0] if tensor.dim() else 1), batch)
    if sizes:
        return sizes[0]
    return len(batch) if hasattr(batch, "__len__") else 1


def _slice(batch, begin: int, end: int):
    if isinstance(batch, (list, tuple)) and not any(isinstance(x, torch.Tensor) for x in batch):
        return batch[begin:end]
    return map_tensors(lambda tensor: tensor[begin:end], batch)


class SkipFirstBatches:
    """A view of a prepared dataloader whose next pass starts `num_batches` into the epoch."""

    def __init__(self, dataloader: PreparedDataLoader, num_batches: int):
        self.dataloader = dataloader
        self.num_batches = num_batches

    def __len__(self) -> int:
        return max(len(self.dataloader) - self.num_batches, 0)

    def __iter__(self):
        self.dataloader._start_batch = self.num_batches
        self.dataloader.batch_in_epoch = self.num_batches
        yield from self.dataloader

    def __getattr__(self, name):
        return getattr(self.dataloader, name)


def skip_first_batches(dataloader, num_batches: int = 0):
    if isinstance(dataloader, PreparedDataLoader):
        return SkipFirstBatches(dataloader, num_batches)
    if isinstance(dataloader, SkipFirstBatches):
        return SkipFirstBatches(dataloader.dataloader, num_batches)

    class _Skipped:  # a plain iterable (not prepared): drop the first batches of its next pass
        def __len__(self):
            return max(len(dataloader) - num_batches, 0)

        def __iter__(self):
            return itertools.islice(iter(dataloader), num_batches, None)

    return _Skipped()


def prepare_data_loader(dataloader: DataLoader, device: torch.device | None = None, num_processes: int | None = None,
                        process_index: int | None = None, split_batches: bool = False, put_on_device: bool = False,
                        rng_types=None, dispatch_batches: bool | None = None, even_batches: bool = True,
                        slice_fn_for_dispatch=None, use_seedable_sampler: bool = False, data_seed: int | None = None,
                        non_blocking: bool = False, use_stateful_dataloader: bool = False, **unused):
    """Accelerate's function of the same name: `dataloader` sharded for this process, without an
    Accelerator (process information from PartialState). Batches are moved to `device` only with
    put_on_device=True. dispatch_batches, rng_types and the stateful options are accepted: every
    process reads its own share, and the order is always drawn alike on every process."""
    state = PartialState()
    return PreparedDataLoader(
        dataloader, device=(device or state.device) if put_on_device else None,
        process_index=state.process_index if process_index is None else process_index,
        num_processes=state.num_processes if num_processes is None else num_processes,
        gradient_state=GradientState(), seed=0, split_batches=split_batches, even_batches=even_batches,
        use_seedable_sampler=use_seedable_sampler, data_seed=data_seed)


# accelerate.data_loader's counterpart: these names, and its other names as stand-ins (surface.py).
__all__ = ["SeedableRandomSampler", "prepare_data_loader", "skip_first_batches"]

__getattr__, __dir__ = serve_absent(__name__)
