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
import weakref

import torch
import torch.distributed as dist

from triax.horovod import adasum, basics, check, collectives, engine, fusion, joining, reduce_ops
from triax.horovod import process_sets
from triax.horovod.compression import Compression
from triax.horovod.errors import HorovodAssertionError, HorovodNotImplementedError, HorovodTypeError, HorovodValueError
from triax.horovod.process_sets import global_process_set
from triax.kept_works import wait_and_keep


class _DistributedOptimizer:
    """Methods mixed in front of the user's optimizer class."""

    # ---- the public methods Horovod has ------------------------------------------------------
    def step(self, closure=None):
        if self._hvd_should_synchronize:
            self.synchronize()
        result = super().step() if closure is None else super().step(closure)
        self._hvd_synchronized = False
        self._opt_called = True  # tells LR schedulers that step() ran
        return result

    def zero_grad(self, set_to_none: bool = True):
        if any(bucket.pending is not None for bucket in self._hvd_buckets):
            raise HorovodAssertionError("optimizer.zero_grad() was called while the gradient allreduces of the "
                             "last loss.backward() are still in flight; call optimizer.step() (or "
                             "optimizer.synchronize()) first, then zero_grad()")
        return super().zero_grad(set_to_none=set_to_none)

    def synchronize(self):
        """Finish every gradient allreduce now (e.g. before clipping or GradScaler.unscale_)."""
        if self._hvd_synchronized:
            return  # already done since the last step(): a second exchange would reduce twice
        if not self._hvd_step_started:
            self._hvd_begin_step()
        for bucket in self._hvd_buckets:
            bucket.ready = len(bucket.params)  # a gradient that never came is sent as it is (or 0)
        self._hvd_launch_ready()
        for bucket in self._hvd_buckets:
            self._hvd_finish(bucket)
        self._hvd_passes.clear()
        self._hvd_step_started = False
        self._hvd_next_bucket = 0
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block step() trusts that synchronize() was already called."""
        self._hvd_should_synchronize = False
        try:
            yield
        finally:
            self._hvd_should_synchronize = True

    def set_backward_passes_per_step(self, passes: int):
        self.backward_passes_per_step = _check_passes(passes)

    # ---- internals -----------------------------------------------------------------------------
    def _hvd_on_gradient(self, param):
        key = id(param)
        count = self._hvd_passes.get(key, 0) + 1
        self._hvd_passes[key] = count
        self._hvd_synchronized = False
        if count > self.backward_passes_per_step:
            raise HorovodAssertionError(
                f"parameter {self._hvd_names[key]!r} got a gradient {count} times before "
                f"optimizer.step(), but backward_passes_per_step={self.backward_passes_per_step}; "
                f"call step() after every {self.backward_passes_per_step} backward pass(es), or pass "
                f"backward_passes_per_step={count} to accumulate gradients locally")
        if count < self.backward_passes_per_step:
            return
        bucket = self._hvd_bucket_of[key]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            if not self._hvd_step_started:
                self._hvd_begin_step()
            self._hvd_launch_ready()

    def _hvd_begin_step(self):
        # One small metadata round per step (when the check is on): catches ranks whose models
        # differ and tells joined ranks (hvd.join) that a gradient exchange follows.
        self._hvd_step_started = True
        with process_sets.scoped(self._hvd_process_set):
            agreement = check.agree("optimizer step", extra=self._hvd_layout, name="DistributedOptimizer")
            self._hvd_contributors = agreement.active_count if agreement is not None else process_sets.active_size()

    def _hvd_launch_ready(self):
        buckets = self._hvd_buckets
        while self._hvd_next_bucket < len(buckets):
            bucket = buckets[self._hvd_next_bucket]
            if bucket.ready < len(bucket.params):
                return  # later buckets wait: every rank must launch in the same order
            self._hvd_launch(bucket)
            self._hvd_next_bucket += 1

    def _hvd_launch(self, bucket):
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
                if not self._hvd_sparse_as_dense:
                    # As Horovod: gather every rank's (indices, values) instead of densifying.
                    target.zero_()
                    op = reduce_ops.Sum if self._hvd_op == reduce_ops.Sum else reduce_ops.Average
                    self._hvd_sparse[id(param)] = collectives.sparse_allreduce_async(
                        grad, name=self._hvd_names[id(param)], op=op, process_set=self._hvd_process_set)
                    continue
                grad = grad.to_dense()
            target.copy_(grad.reshape(-1))
        wire, ctx = self._hvd_compression.compress(bucket.flat)
        reduce_ops.scale_(wire, self._hvd_prescale)
        group_size = len(self._hvd_process_set.ranks) if self._hvd_process_set.ranks else basics.size()
        if self._hvd_op == reduce_ops.Adasum:
            works = []  # combined parameter by parameter in _hvd_finish
        else:
            works = [dist.all_reduce(wire, group=self._hvd_process_set._group, async_op=True)] if group_size > 1 else []
        bucket.pending = (works, wire, ctx)

    def _hvd_finish(self, bucket):
        works, wire, ctx = bucket.pending
        engine.wait_all(works)  # a lost peer surfaces as HorovodInternalError
        postscale = self._hvd_postscale
        if self._hvd_op == reduce_ops.Average:
            postscale /= self._hvd_contributors
        if self._hvd_op == reduce_ops.Adasum and basics.size() > 1:
            # Adasum's coefficients come from each gradient's own dot products: one tensor at a time.
            with process_sets.scoped(self._hvd_process_set):
                for param, offset in zip(bucket.params, bucket.offsets):
                    adasum.adasum_(wire[offset:offset + param.numel()])
        flat = self._hvd_compression.decompress(wire, ctx)
        for param, offset in zip(bucket.params, bucket.offsets):
            sparse = self._hvd_sparse.pop(id(param), None)
            if sparse is not None:
                param.grad = collectives.synchronize(sparse)
                continue
            reduced = flat[offset:offset + param.numel()].view_as(param)
            if param.grad is None or param.grad.is_sparse:
                param.grad = torch.empty_like(param)
            # Scale while copying back: one pass over the gradients instead of two.
            torch.mul(reduced, postscale, out=param.grad)
        bucket.pending = None
        bucket.ready = 0

    def _serve_joined_step(self):
        """This rank has joined: send neutral gradients for every bucket (see joining.py)."""
        for bucket in self._hvd_buckets:
            first = bucket.params[0]
            zeros = torch.zeros(bucket.numel, dtype=first.dtype, device=first.device)
            wire, _ = self._hvd_compression.compress(zeros)
            wait_and_keep(dist.all_reduce(wire, group=self._hvd_process_set._group, async_op=True))


def _check_passes(passes) -> int:
    if not isinstance(passes, int) or passes < 1:
        raise HorovodValueError(f"backward_passes_per_step={passes!r} must be a positive integer")
    return passes


def _parameter_names(params: list, named_parameters) -> dict[int, str]:
    if named_parameters is None:
        return {id(p): f"allreduce.noname.{i}" for i, p in enumerate(params)}
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


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=reduce_ops.Average,
                         gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=global_process_set):
    """Wrap `optimizer` so gradients are averaged (op=Average) or summed across ranks."""
    basics.world()  # a clear error before hvd.init()
    with process_sets.scoped(process_set) as process_set:  # registered, and this rank is in it
        group_size = process_sets.active_size()
    if isinstance(optimizer, _DistributedOptimizer):
        raise HorovodValueError("this optimizer is already a hvd.DistributedOptimizer; wrap it only once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise HorovodTypeError(f"DistributedOptimizer takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
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
    passes = _check_passes(backward_passes_per_step)

    seen, params = set(), []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    names = _parameter_names(params, named_parameters)
    trainable = [p for p in params if p.requires_grad]
    # Gradients arrive roughly from the last layer back to the first: bucket in that order.
    buckets = fusion.plan_buckets(list(reversed(trainable)), names, fusion.fusion_threshold(),
                                  groups if groups is not None else (num_groups or None))

    cls = _classes.get(type(optimizer))
    if cls is None:
        cls = type(type(optimizer).__name__, (_DistributedOptimizer, type(optimizer)), {})
        _classes[type(optimizer)] = cls
    optimizer.__class__ = cls
    if "step" in optimizer.__dict__:
        # An LR scheduler made before wrapping stored the unwrapped step on the instance. Route
        # it to the class's step (which synchronizes), keeping the scheduler's marker.
        owner_ref = weakref.ref(optimizer)

        def step(*args, **kwargs):
            opt = owner_ref()
            return type(opt).step(opt, *args, **kwargs)

        step._wrapped_by_lr_sched = True
        optimizer.step = step
    optimizer.backward_passes_per_step = passes
    optimizer._hvd_names = names
    optimizer._hvd_buckets = buckets
    optimizer._hvd_bucket_of = {id(p): b for b in buckets for p in b.params}
    optimizer._hvd_compression = compression
    optimizer._hvd_op = op
    optimizer._hvd_prescale = 1.0 / gradient_predivide_factor
    optimizer._hvd_postscale = gradient_predivide_factor
    optimizer._hvd_sparse_as_dense = sparse_as_dense
    optimizer._hvd_sparse = {}  # id(param) -> handle of its sparse allreduce in flight
    optimizer._hvd_passes = {}
    optimizer._hvd_next_bucket = 0
    optimizer._hvd_step_started = False
    optimizer._hvd_synchronized = False
    optimizer._hvd_should_synchronize = True
    optimizer._hvd_contributors = group_size
    optimizer._hvd_process_set = process_set
    layout = "|".join(b.describe() for b in buckets)
    layout += f"|{getattr(compression, '__name__', type(compression).__name__)}|{op}|{passes}"
    optimizer._hvd_layout = check.digest(layout)
    joining.optimizers_by_layout[optimizer._hvd_layout] = weakref.ref(optimizer)

    owner = weakref.ref(optimizer)

    def on_gradient(param):
        opt = owner()
        if opt is not None:
            opt._hvd_on_gradient(param)

    optimizer._hvd_hook_handles = [p.register_post_accumulate_grad_hook(on_gradient) for p in trainable]
    # Same model, same order, same options on every rank? One round now rather than a hang later.
    with process_sets.scoped(process_set):
        check.agree("optimizer layout", extra=optimizer._hvd_layout, name="DistributedOptimizer")
    return optimizer
