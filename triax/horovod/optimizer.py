"""`hvd.DistributedOptimizer`: gradients are averaged across ranks while backward still runs.

Each parameter gets a post-accumulate-grad hook. When a parameter's gradient is final (after
`backward_passes_per_step` passes) it counts towards its fusion bucket; a full bucket is flattened
into one buffer and its allreduce starts asynchronously, so communication overlaps the rest of
backward. Buckets launch strictly in bucket order, the same on every rank. `step()` waits for the
allreduces, writes the averaged gradients back, then runs the wrapped optimizer's own step.

The optimizer object the user passed is kept (its class is swapped for a subclass with these
methods), so its state, learning-rate schedulers and `isinstance` checks keep working.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from triax.horovod.errors import HorovodAssertionError, HorovodNotImplementedError, HorovodTypeError, HorovodValueError
from triax.horovod import adasum, basics, check, collectives, fusion, handles, joining, reduce_ops
from triax.horovod import process_sets
from triax.horovod.process_sets import ProcessSet, global_process_set
from triax.horovod.compression import Compression, Compressor
from triax.horovod.fusion import Bucket
from triax.horovod.elastic import worker as elastic_worker


class _DistributedOptimizer:
    """Methods mixed in front of the user's optimizer class."""

    # ---- the public methods Horovod has ------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None):
        if self._hvd.should_synchronize:
            if self._hvd.synchronized and self._hvd.included:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.", stacklevel=2)
            self.synchronize()
        result = super().step() if closure is None else super().step(closure)
        self._hvd.synchronized = False
        self._opt_called = True  # tells LR schedulers that step() ran
        return result

    def zero_grad(self, set_to_none: bool = True):
        if any(bucket.pending is not None for bucket in self._hvd.buckets):
            raise HorovodAssertionError("optimizer.zero_grad() was called while the gradient allreduces of the "
                             "last loss.backward() are still in flight; call optimizer.step() (or "
                             "optimizer.synchronize()) first, then zero_grad()")
        return super().zero_grad(set_to_none=set_to_none)

    def synchronize(self):
        """Finish every gradient allreduce now (e.g. before clipping or GradScaler.unscale_)."""
        if self._hvd.synchronized or not self._hvd.included:
            return  # done since the last step() (a second exchange would reduce twice), or nothing to exchange
        if not self._hvd.step_started:
            self._hvd_begin_step()
        for bucket in self._hvd.buckets:
            bucket.ready = len(bucket.params)  # a gradient that never came is sent as it is (or 0)
        self._hvd_launch_ready()
        for bucket in self._hvd.buckets:
            self._hvd_finish(bucket)
        self._hvd.passes.clear()
        self._hvd.step_started = False
        self._hvd.next_bucket = 0
        self._hvd.synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block step() trusts that synchronize() was already called."""
        self._hvd.should_synchronize = False
        try:
            yield
        finally:
            self._hvd.should_synchronize = True

    def set_backward_passes_per_step(self, passes: int):
        self.backward_passes_per_step = _check_passes(passes)

    # ---- internals -----------------------------------------------------------------------------
    def _hvd_on_gradient(self, param: torch.Tensor):
        key = id(param)
        count = self._hvd.passes.get(key, 0) + 1
        self._hvd.passes[key] = count
        self._hvd.synchronized = False
        if count > self.backward_passes_per_step:
            raise HorovodAssertionError(
                f"parameter {self._hvd.names[key]!r} got a gradient {count} times before "
                f"optimizer.step(), but backward_passes_per_step={self.backward_passes_per_step}; "
                f"call step() after every {self.backward_passes_per_step} backward pass(es), or pass "
                f"backward_passes_per_step={count} to accumulate gradients locally")
        if count < self.backward_passes_per_step:
            return
        bucket = self._hvd.bucket_of[key]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            if not self._hvd.step_started:
                self._hvd_begin_step()
            self._hvd_launch_ready()

    def _hvd_begin_step(self):
        # One small metadata round per step (when the check is on): catches ranks whose models
        # differ and tells joined ranks (hvd.join) that a gradient exchange follows.
        self._hvd.step_started = True
        with process_sets.scoped(self._hvd.process_set):
            check.agree("optimizer step", extra=self._hvd.layout, name="DistributedOptimizer")

    def _hvd_launch_ready(self):
        buckets = self._hvd.buckets
        while self._hvd.next_bucket < len(buckets):
            bucket = buckets[self._hvd.next_bucket]
            if bucket.ready < len(bucket.params):
                return  # later buckets wait: every rank must launch in the same order
            self._hvd_launch(bucket)
            self._hvd.next_bucket += 1

    def _hvd_launch(self, bucket: Bucket):
        if bucket.flat is None:
            first = bucket.params[0]
            bucket.flat = torch.empty(bucket.numel, dtype=first.dtype, device=first.device)
        for param, offset in zip(bucket.params, bucket.offsets):
            target = bucket.flat[offset:offset + param.numel()]
            grad = param.grad
            if grad is None:
                target.zero_()
                continue
            if grad.is_sparse:
                if not self._hvd.sparse_as_dense:
                    # As Horovod: gather every rank's (indices, values) instead of densifying.
                    target.zero_()
                    op = reduce_ops.Sum if self._hvd.op == reduce_ops.Sum else reduce_ops.Average
                    self._hvd.sparse[id(param)] = collectives.sparse_allreduce_async(
                        grad, name=self._hvd.names[id(param)], op=op, process_set=self._hvd.process_set)
                    continue
                grad = grad.to_dense()
            target.copy_(grad.reshape(-1))
        wire, ctx = self._hvd.compression.compress(bucket.flat)
        reduce_ops.scale_(wire, self._hvd.prescale)
        if self._hvd.op == reduce_ops.Adasum:
            works = []  # combined parameter by parameter in _hvd_finish
        else:
            works = [dist.all_reduce(wire, group=self._hvd.process_set._group, async_op=True)] if self._hvd_set_size() > 1 else []
        bucket.pending = (works, wire, ctx)

    def _hvd_set_size(self) -> int:
        # Read at every step: an elastic reset changes the world's size under the same optimizer.
        return len(self._hvd.process_set.ranks) if self._hvd.process_set.ranks else basics.size()

    def _hvd_forget_in_flight(self):
        """The group the exchange ran on is gone (hvd.shutdown, an elastic reset): drop the step
        in progress, as if backward had not run, so the next one starts clean."""
        for bucket in self._hvd.buckets:
            bucket.pending = None
            bucket.ready = 0
        self._hvd.sparse.clear()
        self._hvd.passes.clear()
        self._hvd.next_bucket = 0
        self._hvd.step_started = False
        self._hvd.synchronized = False

    def _hvd_finish(self, bucket: Bucket):
        works, wire, ctx = bucket.pending
        handles.wait_all(works)  # a lost peer surfaces as HorovodInternalError
        postscale = self._hvd.postscale
        if self._hvd.op == reduce_ops.Average:
            postscale /= self._hvd_set_size()  # Horovod averages over the whole set
        if self._hvd.op == reduce_ops.Adasum and basics.size() > 1:
            # Adasum's coefficients come from each gradient's own dot products: one tensor at a time.
            with process_sets.scoped(self._hvd.process_set):
                for param, offset in zip(bucket.params, bucket.offsets):
                    adasum.adasum_(wire[offset:offset + param.numel()])
        flat = self._hvd.compression.decompress(wire, ctx)
        for param, offset in zip(bucket.params, bucket.offsets):
            sparse = self._hvd.sparse.pop(id(param), None)
            if sparse is not None:
                param.grad = sparse()  # Horovod's sparse allreduce hands back a function
                continue
            reduced = flat[offset:offset + param.numel()].view_as(param)
            if param.grad is not None and param.grad.is_sparse:
                # sparse_as_dense: exchanged dense, handed back sparse, for optimizers that need it (SparseAdam)
                param.grad = (reduced * postscale).to_sparse()
                continue
            if param.grad is None:
                param.grad = torch.empty_like(param)
            # Scale while copying back: one pass over the gradients instead of two.
            torch.mul(reduced, postscale, out=param.grad)
        bucket.pending = None
        bucket.ready = 0

    def _serve_joined_step(self):
        """This rank has joined: send neutral gradients for every bucket (see joining.py)."""
        for bucket in self._hvd.buckets:
            first = bucket.params[0]
            zeros = torch.zeros(bucket.numel, dtype=first.dtype, device=first.device)
            wire, _ = self._hvd.compression.compress(zeros)
            handles.wait_one(dist.all_reduce(wire, group=self._hvd.process_set._group, async_op=True))


def _check_passes(passes: object) -> int:
    if not isinstance(passes, int) or passes < 1:
        raise HorovodValueError(f"backward_passes_per_step={passes!r} must be a positive integer")
    return passes


@dataclass
class _Exchange:
    """Everything the wrapper keeps about the gradient exchange: one attribute (`_hvd`) on the
    user's optimizer instead of many, so its own attributes and state_dict stay untouched."""

    names: dict  # id(param) -> name
    buckets: list
    compression: Any
    op: int
    prescale: float
    postscale: float
    sparse_as_dense: bool
    process_set: ProcessSet
    layout: int  # digest of buckets and options, the same on every rank with the same model
    included: bool = True  # False on a rank outside the process set: no exchange at all
    bucket_of: dict = field(default_factory=dict)  # id(param) -> its bucket
    sparse: dict = field(default_factory=dict)  # id(param) -> the sparse allreduce in flight (a function)
    passes: dict = field(default_factory=dict)  # id(param) -> backward passes since the last step
    next_bucket: int = 0
    step_started: bool = False
    synchronized: bool = False
    should_synchronize: bool = True
    hook_handles: list = field(default_factory=list)


def _parameter_names(optimizer: torch.optim.Optimizer, params: list,
                     named_parameters: Iterable[tuple[str, torch.Tensor]] | None) -> dict[int, str]:
    if named_parameters is None:  # Horovod's names: allreduce.noname.<group>.<index>
        return {id(p): f"allreduce.noname.{i}.{j}" for i, group in enumerate(optimizer.param_groups)
                for j, p in enumerate(group["params"])}
    named = list(named_parameters)
    if any(not (isinstance(item, (tuple, list)) and len(item) == 2 and torch.is_tensor(item[1]))
           for item in named):
        raise HorovodValueError("named_parameters must be (name, parameter) pairs, usually "
                         "model.named_parameters()")
    names = [name for name, _ in named]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise HorovodValueError(f"named_parameters has duplicate names {duplicates[:5]}; each parameter "
                         "needs a unique name (pass model.named_parameters())")
    by_id: dict[int, str] = {}
    for name, param in named:
        by_id.setdefault(id(param), name)
    unnamed = [i for i, p in enumerate(params) if id(p) not in by_id]
    if unnamed:
        shapes = [tuple(params[i].shape) for i in unnamed[:3]]
        raise HorovodValueError(f"{len(unnamed)} optimizer parameter(s) are missing from named_parameters "
                         f"(shapes {shapes}); pass named_parameters of the model the optimizer was "
                         "built from, covering every parameter it optimizes")
    return by_id


_classes: dict[type, type] = {}
_wrapped = weakref.WeakSet()  # every DistributedOptimizer made, for forget_in_flight


def forget_in_flight() -> None:
    """hvd.shutdown(): every DistributedOptimizer drops the gradient exchange in progress."""
    for optimizer in list(_wrapped):
        optimizer._hvd_forget_in_flight()


def _validated_op(op: int, gradient_predivide_factor: float, group_size: int) -> int:
    op = reduce_ops.resolve(op)
    if op not in (reduce_ops.Average, reduce_ops.Sum, reduce_ops.Adasum):
        raise HorovodValueError(f"DistributedOptimizer(op={reduce_ops.NAMES[op]}) is not supported; use "
                                "hvd.Average, hvd.Sum or hvd.Adasum")
    if op == reduce_ops.Adasum:
        problem = adasum.power_of_two_problem(group_size)
        if problem:
            raise HorovodNotImplementedError(problem)
    if gradient_predivide_factor != 1.0 and op != reduce_ops.Average:
        raise HorovodValueError(f"gradient_predivide_factor={gradient_predivide_factor} needs op=hvd.Average")
    return op


def _unique_params(optimizer: torch.optim.Optimizer) -> list:
    seen, params = set(), []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def _swap_class(optimizer: torch.optim.Optimizer) -> None:
    """Put _DistributedOptimizer's methods in front of the optimizer's own class."""
    cls = _classes.get(type(optimizer))
    if cls is None:
        cls = type(type(optimizer).__name__, (_DistributedOptimizer, type(optimizer)), {})
        _classes[type(optimizer)] = cls
    optimizer.__class__ = cls
    if "step" in optimizer.__dict__:
        # An LR scheduler made before wrapping stored the unwrapped step on the instance. Route
        # it to the class's step (which synchronizes), keeping the scheduler's marker.
        owner_ref = weakref.ref(optimizer)

        def step(*args: Any, **kwargs: Any):
            opt = owner_ref()
            return type(opt).step(opt, *args, **kwargs)

        step._wrapped_by_lr_sched = True
        optimizer.step = step


def _hook_gradients(optimizer: torch.optim.Optimizer, trainable: list) -> list:
    owner = weakref.ref(optimizer)

    def on_gradient(param: torch.Tensor):
        opt = owner()
        if opt is not None:
            opt._hvd_on_gradient(param)

    return [p.register_post_accumulate_grad_hook(on_gradient) for p in trainable]


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: type[Compressor] = Compression.none, backward_passes_per_step: int = 1,
                         op: int = reduce_ops.Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: list | None = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set):
    """Wrap `optimizer` so gradients are averaged (op=Average) or summed across ranks.

    On a rank outside `process_set` the optimizer steps on its own gradients, as in Horovod."""
    basics.world()  # a clear error before hvd.init()
    if isinstance(optimizer, _DistributedOptimizer):
        raise HorovodValueError("this optimizer is already a hvd.DistributedOptimizer; wrap it only once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise HorovodTypeError(f"DistributedOptimizer takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
    included = process_set.included() if process_set is not global_process_set else True
    scope = process_sets.scoped(process_set) if included else contextlib.nullcontext(process_set)
    with scope as process_set:  # registered, and this rank is in it
        group_size = process_sets.active_size() if included else 1
    op = _validated_op(op, gradient_predivide_factor, group_size)
    passes = _check_passes(backward_passes_per_step)
    params = _unique_params(optimizer)
    names = _parameter_names(optimizer, params, named_parameters)
    trainable = [p for p in params if p.requires_grad]
    # Gradients arrive roughly from the last layer back to the first: bucket in that order.
    buckets = fusion.plan_buckets(list(reversed(trainable)), names, fusion.fusion_threshold(),
                                  groups if groups is not None else (num_groups or None))
    layout = "|".join(b.describe() for b in buckets)
    layout += f"|{getattr(compression, '__name__', type(compression).__name__)}|{op}|{passes}"

    _swap_class(optimizer)
    optimizer.backward_passes_per_step = passes
    optimizer._parameter_names = {p: names[id(p)] for p in params}  # Horovod's attribute: param -> name
    optimizer._hvd = _Exchange(names, buckets, compression, op, 1.0 / gradient_predivide_factor,
                               gradient_predivide_factor, sparse_as_dense, process_set,
                               check.digest(layout))
    optimizer._hvd.bucket_of = {id(p): b for b in buckets for p in b.params}
    _wrapped.add(optimizer)
    if not included:  # nothing to exchange: step() runs the optimizer's own step
        optimizer._hvd.included = False
        return optimizer
    joining.optimizers_by_layout[optimizer._hvd.layout] = weakref.ref(optimizer)
    optimizer._hvd.hook_handles = _hook_gradients(optimizer, trainable)
    # Same model, same order, same options on every rank? One round now rather than a hang later.
    # Not under the elastic driver: a worker added to a running job builds its optimizer while the
    # others are in their training function (Horovod's constructor is not a collective either);
    # the first step's round checks the same layout.
    if not elastic_worker.under_driver():
        with process_sets.scoped(process_set):
            check.agree("optimizer layout", extra=optimizer._hvd.layout, name="DistributedOptimizer")
    return optimizer
