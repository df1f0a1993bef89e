"""Dataloaders sharded across processes by global sample index.

A prepared dataloader keeps the user's dataset, collate function and workers, but draws its
sample order from triax's GlobalSampler: the order depends only on (seed, epoch), a step takes
the next `global batch` indices of it, and process r takes the r-th contiguous slice. So
N processes with batch B see exactly the samples one process sees with batch N*B, and the
position in the data is one number that save_state/load_state and skip_first_batches can use.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from triax.accelerate.errors import AcceleratorValueError
from triax.accelerate.operations import broadcast_object_list, send_to_device
from triax.data.sampler import GlobalSampler


class PreparedDataLoader:
    def __init__(self, dataloader: DataLoader, *, device: torch.device | None, process_index: int,
                 num_processes: int, gradient_state, seed: int, split_batches: bool = False,
                 even_batches: bool = True):
        if isinstance(dataloader.dataset, IterableDataset):
            raise AcceleratorValueError("prepare got a DataLoader over an IterableDataset; triax shards map-style "
                             "datasets (with __len__ and __getitem__) only, so wrap yours in one")
        if dataloader.batch_size is None:
            raise AcceleratorValueError("prepare got a DataLoader built with batch_sampler=...; pass batch_size= "
                             "(and shuffle= or sampler=) instead so triax can shard it by sample index")
        if split_batches and dataloader.batch_size % num_processes:
            raise AcceleratorValueError(f"split_batches=True needs a batch_size divisible by the {num_processes} "
                             f"processes, got batch_size={dataloader.batch_size}")
        self.base_dataloader = dataloader
        self.dataset = dataloader.dataset
        self.device = device
        self.process_index = process_index
        self.num_processes = num_processes
        self.gradient_state = gradient_state
        self.even_batches = even_batches
        self.drop_last = dataloader.drop_last
        self.batch_size = dataloader.batch_size // num_processes if split_batches else dataloader.batch_size
        self.total_batch_size = self.batch_size * num_processes

        sampler = dataloader.sampler
        # Random and sequential orders come from GlobalSampler (reproducible from the seed alone);
        # any other sampler is asked for its order on process 0, which is then shared.
        self._custom_sampler = None if isinstance(sampler, (RandomSampler, SequentialSampler)) else sampler
        num_samples = len(sampler) if self._custom_sampler is not None else len(self.dataset)
        self.sampler = GlobalSampler(num_samples, seed, shuffle=isinstance(sampler, RandomSampler))
        self.num_samples = num_samples
        self._custom_orders: dict[int, torch.Tensor] = {}

        self.epoch = 0
        self.batch_in_epoch = 0  # batches handed out so far in this epoch: the saved position
        self.at_end = False
        self._start_batch = 0  # where the next pass begins (load_state / skip_first_batches)
        self._loader_options = dict(
            collate_fn=dataloader.collate_fn, num_workers=dataloader.num_workers,
            pin_memory=dataloader.pin_memory, timeout=dataloader.timeout,
            worker_init_fn=dataloader.worker_init_fn,
            multiprocessing_context=dataloader.multiprocessing_context,
        )
        if dataloader.num_workers > 0:
            self._loader_options["prefetch_factor"] = dataloader.prefetch_factor

    # ---- sizes and positions -------------------------------------------------------------------

    def __len__(self) -> int:
        """Batches this process gets per epoch (with even_batches=False the last, partial global
        batch may give some processes one fewer)."""
        full, rest = divmod(self.num_samples, self.total_batch_size)
        if not rest or self.drop_last:
            return full
        if self.even_batches:
            return full + 1
        return full + (1 if rest > self.process_index * self.batch_size else 0)

    @property
    def remainder(self) -> int:
        """Real samples in the last global batch (0 when the dataset divides evenly), as
        Accelerate's GradientState.remainder."""
        return 0 if self.drop_last else self.num_samples % self.total_batch_size

    @property
    def padding_in_last_batch(self) -> int:
        """Samples repeated to fill the last global batch (0 when it is full or not padded)."""
        rest = self.num_samples % self.total_batch_size
        if not rest or self.drop_last or not self.even_batches or not self.at_end:
            return 0
        return self.total_batch_size - rest

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch_in_epoch, "num_samples": self.num_samples,
                "total_batch_size": self.total_batch_size, "seed": self.sampler.seed}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position: the next pass yields the rest of the saved epoch.
        The position is kept as a global sample index, so a different number of processes
        (or batch size) resumes from the same sample when the index falls on a batch boundary."""
        global_index = state["batch"] * state["total_batch_size"]
        if global_index % self.total_batch_size:
            raise AcceleratorValueError(f"cannot resume at global sample {global_index}: it is not a multiple of "
                             f"this run's global batch {self.total_batch_size}; keep the global batch size")
        if state["num_samples"] != self.num_samples:
            raise AcceleratorValueError(f"the saved dataloader had {state['num_samples']} samples, this one has "
                             f"{self.num_samples}; resume with the same dataset")
        self.sampler = GlobalSampler(self.num_samples, state["seed"], shuffle=self.sampler.shuffle)
        self.epoch = state["epoch"]
        self._start_batch = global_index // self.total_batch_size
        self.batch_in_epoch = self._start_batch

    # ---- which samples ---------------------------------------------------------------------------

    def _order(self, epoch: int) -> torch.Tensor:
        if self._custom_sampler is None:
            return self.sampler.epoch_order(epoch)
        if epoch not in self._custom_orders:
            if hasattr(self._custom_sampler, "set_epoch"):
                self._custom_sampler.set_epoch(epoch)
            shared = broadcast_object_list([list(iter(self._custom_sampler))])
            self._custom_orders = {epoch: torch.as_tensor(shared[0], dtype=torch.long)}
        return self._custom_orders[epoch]

    def batch_indices(self, epoch: int, batch: int) -> list[int]:
        """Sample ids this process takes for batch `batch` of `epoch`."""
        order = self._order(epoch)
        start = batch * self.total_batch_size
        if start + self.total_batch_size <= self.num_samples:
            begin = start + self.process_index * self.batch_size
            return order[begin:begin + self.batch_size].tolist()
        real = order[start:]
        if not self.even_batches:
            # As Accelerate: the short global batch is cut into per-process batches in process
            # order, so the last processes may get a short batch or none.
            begin = self.process_index * self.batch_size
            return real[begin:begin + self.batch_size].tolist()
        # Even batches: fill the last global batch from the start of the epoch's order, so every
        # process steps the same number of times; gather_for_metrics drops the repeats again.
        repeats = -(-(self.total_batch_size - len(real)) // len(order))
        filled = torch.cat([real, order.repeat(repeats)])[: self.total_batch_size]
        begin = self.process_index * self.batch_size
        return filled[begin:begin + self.batch_size].tolist()

    # ---- iteration -------------------------------------------------------------------------------

    def __iter__(self):
        start, self._start_batch = self._start_batch, 0
        epoch, total = self.epoch, len(self)
        batches = [self.batch_indices(epoch, batch) for batch in range(start, total)]
        # Our own generator: creating a DataLoader iterator draws a seed from it, and drawing from
        # the global one would shift the user's random stream (dropout...) after load_state.
        generator = torch.Generator().manual_seed(self.sampler.seed * 1_000_003 + epoch)
        loader = DataLoader(self.dataset, batch_sampler=batches, generator=generator, **self._loader_options)
        non_blocking = self.device is not None and self.device.type == "cuda"
        self.batch_in_epoch, self.at_end = start, start >= total
        self.gradient_state.active_loaders.append(self)
        try:
            for batch in loader:
                self.batch_in_epoch += 1
                self.at_end = self.batch_in_epoch == total
                yield batch if self.device is None else send_to_device(batch, self.device, non_blocking)
        finally:
            self.gradient_state.active_loaders.remove(self)
        # Only a pass that ran to the end moves on to the next epoch.
        self.epoch += 1
        self.batch_in_epoch, self.at_end = 0, False


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
    import itertools

    class _Skipped:  # a plain iterable (not prepared): drop the first batches of its next pass
        def __len__(self):
            return max(len(dataloader) - num_batches, 0)

        def __iter__(self):
            return itertools.islice(iter(dataloader), num_batches, None)

    return _Skipped()
