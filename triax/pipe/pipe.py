"""`Pipe`: an `nn.Sequential` cut into partitions on several devices, fed micro-batches (GPipe).

    model = nn.Sequential(a, b, c, d)
    model = Pipe(model, balance=[2, 2], devices=["cuda:0", "cuda:1"], chunks=8)
    output = model(input)          # lands on the last device
    loss_fn(output, target.to(output.device)).backward()

The API follows FairScale's `fairscale.nn.Pipe`, so scripts written for it run with only the
import changed. One process drives all devices: each partition gets a worker thread, micro-batch
i runs on partition j at clock tick i + j (see schedule.py), and tensors are copied between
devices with ordinary `.to()`, which autograd records. Backward needs no scheduling of ours:
autograd walks the recorded graph in reverse, across the copies, recomputing checkpointed
micro-batches as it reaches them. (On GPUs autograd runs each device's backward in its own
thread, so backward overlaps too; several 'cpu' partitions share one backward thread.)

This door is for scripts written for FairScale: one process, several devices. Pipelines across
processes and machines belong to triax's multi-process pipeline stages, which compose
`torch.distributed.pipelining` rather than this module.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections import OrderedDict
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from triax.pipe.batchnorm import DeferredBatchNorm
from triax.pipe.recompute import (CHECKPOINT_MODES, checkpoint_stop, draws_random_numbers,
                                   generator_lock, run_partition)
from triax.pipe.errors import PipeIndexError, PipeTypeError, PipeValueError
from triax.pipe.microbatch import Batch, check_batch, check_tensors, coerce_chunks, join, split, to_device
from triax.pipe.schedule import clock_cycles
from triax.pipe.skip.layout import inspect_skip_layout
from triax.pipe.skip.skippable import verify_skippables
from triax.pipe.skip.tracker import SkipTrackerThroughPortals, use_skip_tracker
from triax.pipe.worker import capture_caller_state, spawn_workers


def _recommend_balancing(message: str) -> str:
    # FairScale's balance errors point to its balancing helpers, and users' tests look for that name.
    return (f"{message}. To measure a balance instead, use triax.pipe.balance (in place of fairscale.nn.pipe.balance): "
            "balance = balance_by_time(partitions, module, sample) or balance_by_size(partitions, module, input)")


def _check_module(module: object) -> list[tuple[str, nn.Module]]:
    # FairScale's messages first (its users' tests match them), then what triax adds.
    if not isinstance(module, nn.Sequential):
        raise PipeTypeError(f"module must be nn.Sequential to be partitioned, got {type(module).__name__}; "
                            "write the model as nn.Sequential(layer1, layer2, ...)")
    # (name, layer) pairs; unlike named_children(), _modules does not hide a module listed twice.
    layers = list(module._modules.items())
    first_seen: dict[int, int] = {}
    for index, (_, layer) in enumerate(layers):
        if id(layer) in first_seen:
            raise PipeValueError(f"module with duplicate children is not supported: layers {first_seen[id(layer)]} "
                                 f"and {index} of the nn.Sequential are the same module ({type(layer).__name__}); "
                                 "a layer can live on only one device, so use separate modules (copy.deepcopy) "
                                 "or one layer that loops inside")
        first_seen[id(layer)] = index
    return layers


def _check_balance(balance: object, num_layers: int) -> list[int]:
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Iterable):
        raise PipeTypeError(f"balance must be a list of layer counts, got {balance!r}; e.g. balance=[2, 2]")
    balance = list(balance)  # a tuple, a range or a generator, as FairScale takes them
    counts = []
    for count in balance:
        try:  # numpy and torch integers are counts too; floats and bools are not
            counts.append(operator.index(count) if not isinstance(count, bool) else None)
        except TypeError:
            counts.append(None)
    if any(count is None for count in counts):
        raise PipeValueError(_recommend_balancing(f"all balance numbers must be positive integer (balance: {balance}); "
                                                  "give whole numbers of layers"))
    if sum(counts) != num_layers:
        raise PipeValueError(_recommend_balancing(
            f"module and sum of balance have different length (module: {num_layers}, sum of balance: {sum(counts)}); "
            f"balance {counts} must add up to the {num_layers} layers of the module"))
    if any(count <= 0 for count in counts):
        raise PipeValueError(_recommend_balancing(f"all balance numbers must be positive integer (balance: {counts}); "
                                                  "every partition needs at least one layer"))
    return counts


def _check_checkpoint(mode: object) -> str:
    mode = str(mode)  # as FairScale: anything whose str() is a mode name is that mode
    if mode not in CHECKPOINT_MODES:
        raise PipeValueError(f"checkpoint is not one of 'always', 'except_last', or 'never' (got {mode!r})")
    return mode


class PipeDevicesError(PipeIndexError, ValueError):
    """Fewer devices than partitions: FairScale raises IndexError; a ValueError catch works too."""


def _resolve_devices(devices: Sequence[torch.device | int | str] | None, num_partitions: int) -> list[torch.device]:
    if devices is None:
        count = torch.cuda.device_count()
        if count < num_partitions:
            raise PipeDevicesError(f"too few devices to hold given partitions (devices: {count}, partitions: "
                                   f"{num_partitions}): devices=None means the {count} visible GPUs; pass "
                                   f"devices={['cpu'] * num_partitions} to run the partitions on the CPU")
        devices = list(range(count))
    if isinstance(devices, (str, int, torch.device)):
        raise PipeTypeError(f"devices must be a list with one device per partition, got {devices!r}; "
                         f"e.g. devices={[str(devices)] * num_partitions}")
    resolved = []
    for entry in devices:
        try:
            device = torch.device("cuda", entry) if isinstance(entry, int) else torch.device(entry)
        except (RuntimeError, TypeError):
            raise PipeValueError(f"devices entry {entry!r} is not a device; use 'cpu', 'cuda:0', 0, ...") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise PipeValueError(f"devices entry {entry!r} asks for a GPU but none is visible; use 'cpu'")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            if device.index >= torch.cuda.device_count():
                raise PipeValueError(f"devices entry {entry!r} names GPU {device.index} but only "
                                 f"{torch.cuda.device_count()} are visible")
        resolved.append(device)
    if len(resolved) < num_partitions:
        raise PipeDevicesError(f"too few devices to hold given partitions (devices: {len(resolved)}, partitions: "
                               f"{num_partitions}): balance has {num_partitions} partitions but the devices are "
                               f"{[str(d) for d in resolved]}; give one device per partition (repeating one is allowed)")
    # Like FairScale, extra devices are simply left unused.
    return resolved[:num_partitions]


def _check_no_shared_parameters(layers: list[tuple[str, nn.Module]], balance: list[int],
                                devices: list[torch.device]) -> None:
    owner: dict[int, tuple[int, int]] = {}  # parameter id -> (layer index, partition index)
    layer_index = 0
    for partition_index, size in enumerate(balance):
        for _, layer in layers[layer_index:layer_index + size]:
            for parameter in layer.parameters():
                seen = owner.setdefault(id(parameter), (layer_index, partition_index))
                # Partitions on one device may share a parameter (as in FairScale); on two, it cannot live on both.
                if seen[1] != partition_index and devices[seen[1]] != devices[partition_index]:
                    raise PipeValueError(f"module with duplicate parameters on distinct devices is not supported: "
                                         f"layers {seen[0]} and {layer_index} share a parameter (tied weights) but "
                                         f"balance {balance} puts them in partitions {seen[1]} and {partition_index} "
                                         f"on {devices[seen[1]]} and {devices[partition_index]}; a parameter can "
                                         "live on only one device, so keep them in one partition or on one device")
            layer_index += 1


def _turns(tick: list[tuple[int, int]], locks: list) -> list[list[tuple[int, int]]]:
    """The (micro-batch, partition) pairs of one clock tick in waves that run at the same time.

    Partitions that share a generator lock take turns in partition order, one per wave, so their
    random draws come in the same order on every run (as in FairScale, where partitions on one
    device share a worker thread); all others run in the first wave.
    """
    waves: list[list[tuple[int, int]]] = []
    turns_taken: dict[int, int] = {}  # id of a lock -> how many of this tick's pairs have held it
    for index, partition_index in tick:
        lock = locks[partition_index]
        wave = 0 if lock is None else turns_taken.get(id(lock), 0)
        if lock is not None:
            turns_taken[id(lock)] = wave + 1
        while len(waves) <= wave:
            waves.append([])
        waves[wave].append((index, partition_index))
    return waves


class Pipe(nn.Module):
    """Pipeline-parallel wrapper of an `nn.Sequential` across devices of one process (GPipe).

    Args:
        module: the `nn.Sequential` to cut; its layers are moved onto `devices`.
        balance: how many consecutive layers each partition takes, e.g. [3, 5].
        devices: one device per partition ('cpu', 'cuda:1', 1, torch.device). Defaults to the
            visible GPUs in order. A device may repeat.
        chunks: how many micro-batches a mini-batch is cut into along dimension 0.
        checkpoint: 'always', 'except_last' (all micro-batches but the last) or 'never': which
            micro-batches keep only their inputs and are recomputed during backward. Ignored in
            eval mode and when gradients are off.
        deferred_batch_norm: update BatchNorm running statistics once per mini-batch.
    """

    def __init__(self, module: nn.Sequential, balance: Iterable[int] | None = None, *,
                 devices: Sequence[torch.device | int | str] | None = None, chunks: int = 1,
                 checkpoint: str = "except_last", deferred_batch_norm: bool = False):
        super().__init__()
        # In FairScale's order, so that a call with several mistakes reports the same one first.
        if balance is None:
            raise PipeValueError(_recommend_balancing("balance is required: Pipe(module, balance=[layers per "
                                                      "partition], ...), e.g. balance=[2, 2]"))
        self.chunks = coerce_chunks(chunks)
        self.checkpoint = _check_checkpoint(checkpoint)
        layers = _check_module(module)
        verify_skippables(module)  # static, so checked before anything runs (as FairScale)
        balance = _check_balance(balance, len(layers))
        self.devices = _resolve_devices(devices, len(balance))
        self.balance = balance
        _check_no_shared_parameters(layers, balance, self.devices)
        if deferred_batch_norm:
            layers = [(name, DeferredBatchNorm.convert_deferred_batch_norm(layer, self.chunks)) for name, layer in layers]
        # Layers keep their names, so parameter names read partitions.<j>.<name in the Sequential>.<...>
        self.partitions = nn.ModuleList()
        start = 0
        for size, device in zip(balance, self.devices):
            self.partitions.append(nn.Sequential(OrderedDict(layers[start:start + size])).to(device))
            start += size
        self._skip_layout = inspect_skip_layout(self.partitions)

    # -- the layers, as if this were still the Sequential -------------------------------------

    def __len__(self) -> int:
        return sum(len(partition) for partition in self.partitions)

    def __iter__(self):
        for partition in self.partitions:
            yield from partition

    def __getitem__(self, index: int) -> nn.Module:
        layers = list(self)
        try:
            return layers[index]
        except (IndexError, TypeError):
            raise PipeIndexError(f"Pipe has {len(layers)} layers; no layer {index!r}") from None

    # -- device moves are refused: partitions are pinned to their devices ----------------------

    def _refuse_move(self, target: object) -> None:
        raise PipeTypeError(f"denied to move parameters and buffers, because Pipe should manage device placement: "
                            f"its partitions are pinned to devices {[str(d) for d in self.devices]}, and moving "
                            f"the whole Pipe to {target} would undo the split. Choose devices with "
                            "Pipe(..., devices=[...]) instead (changing dtype with .to(torch.float16) is fine)")

    def to(self, *args: Any, **kwargs: Any):
        # FairScale's rule, read from the arguments themselves: a device (torch.device, index or
        # name) or a tensor, first or by keyword, is a move; only a dtype alone is let through.
        # (torch's own parser is not asked: for an index it needs an accelerator to exist.)
        if "device" in kwargs or "tensor" in kwargs:
            self._refuse_move(kwargs.get("device", "the device of the tensor given"))
        if args and isinstance(args[0], (torch.device, int, str)) and not isinstance(args[0], bool):
            self._refuse_move(args[0])
        if args and torch.is_tensor(args[0]):
            self._refuse_move(args[0].device)
        return super().to(*args, **kwargs)

    def cuda(self, device: int | torch.device | None = None):
        self._refuse_move("cuda" if device is None else f"cuda:{device}")

    def cpu(self):
        self._refuse_move("cpu")

    # -- forward ------------------------------------------------------------------------------

    def forward(self, batch: Batch) -> Batch:
        """Run a mini-batch (tensor or tuple of tensors) through the pipe; the output is on the last device."""
        if not self.partitions:
            check_tensors(batch)  # as FairScale: an empty pipe passes any tensor or tuple of tensors through
            return batch
        check_batch(batch)
        micro_batches = split(batch, self.chunks)
        num_partitions = len(self.partitions)
        stop = checkpoint_stop(self.checkpoint, len(micro_batches), self.training)
        # A checkpointed micro-batch replays its random draws from the generator state saved when it
        # started, so no other partition may draw from that generator while it runs; and any layer
        # may draw (F.dropout inside a custom module is invisible from outside). So while anything
        # is checkpointed, partitions sharing a generator (those on one device) take turns, as they
        # do in FairScale, whose partitions on one device share one worker thread. Otherwise only
        # partitions holding known random layers take turns, for repeatable draws.
        locks = [generator_lock(device) if stop > 0 or draws_random_numbers(partition) else None
                 for partition, device in zip(self.partitions, self.devices)]
        caller_state = capture_caller_state()
        skip_trackers = [SkipTrackerThroughPortals(self._skip_layout) for _ in micro_batches]

        @contextlib.contextmanager
        def micro_batch_state(index: int):
            # What micro-batch `index` runs under, in its forward pass and in its recomputation:
            # the caller's autograd and autocast modes, and the micro-batch's stashed skip tensors.
            with caller_state(), use_skip_tracker(skip_trackers[index]):
                yield

        def task(index: int, partition_index: int, micro_batch: Batch):
            # Runs in the partition's worker thread.
            device = self.devices[partition_index]
            lock = locks[partition_index] or contextlib.nullcontext()
            on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
            with micro_batch_state(index), on_device, lock:
                micro_batch = to_device(micro_batch, device)
                for _, namespace, name in self._skip_layout.copy_policy(partition_index):
                    micro_batch = skip_trackers[index].copy(micro_batch, namespace, name, device)
                label = f"output of partition {partition_index}"
                output = run_partition(self.partitions[partition_index], micro_batch, index < stop, device,
                                       functools.partial(micro_batch_state, index), label)
            check_batch(output, label)
            return output

        # outputs[i]: micro-batch i as far as it has gone through the pipe
        outputs = list(micro_batches)
        deferred = [layer for layer in self.modules() if isinstance(layer, DeferredBatchNorm)]
        try:
            _run_clock_cycles(self.devices, num_partitions, locks, task, outputs)
        except BaseException:
            for layer in deferred:  # half a mini-batch must not leak into the next one's statistics
                layer.discard()
            raise
        if self.training:
            for layer in deferred:
                layer.commit()
        return join(outputs)


def _run_clock_cycles(devices: list[torch.device], num_partitions: int, locks: list,
                      task: Callable[[int, int, Batch], Batch], outputs: list[Batch]) -> None:
    """Push every micro-batch through every partition, tick by tick of the schedule, each partition in
    its worker thread; `outputs[i]` is replaced by micro-batch i's output of each partition it passes.
    The first error of a wave is raised once the whole wave has finished."""
    with spawn_workers(devices) as workers:
        for tick in clock_cycles(len(outputs), num_partitions):
            for wave in _turns(tick, locks):
                for index, partition_index in wave:
                    workers[partition_index].submit(
                        lambda i=index, j=partition_index, x=outputs[index]: task(i, j, x))
                errors = []
                for index, partition_index in wave:
                    ok, value = workers[partition_index].result()
                    if ok:
                        outputs[index] = value
                    else:
                        errors.append(value)
                if errors:
                    raise errors[0]
