"""Tests written the way a FairScale user's suite is: the built-in exception classes they catch,
FairScale's argument coercion, and checkpointing as it shows in the autograd graph."""

import inspect

import pytest
import torch
from torch import nn

from triax.errors import TriaxError
from triax.pipe import Pipe, balance_by_size, balance_by_time


def count_grad_fn(grad_fn, name, visited=None):
    """How many paths from the output reach a node of class `name` (stopping at the first)."""
    visited = set() if visited is None else visited
    if grad_fn is None or grad_fn in visited:
        return 0
    visited.add(grad_fn)
    if type(grad_fn).__name__ == name:
        return 1
    return sum(count_grad_fn(next_fn, name, visited) for next_fn, _ in grad_fn.next_functions)


@pytest.mark.parametrize("mode, checkpointed", [("always", 2), ("except_last", 1), ("never", 0)])
def test_checkpoint_nodes_in_the_graph(mode, checkpointed):
    pipe = Pipe(nn.Sequential(nn.Linear(1, 1)), balance=[1], devices=["cpu"], chunks=2, checkpoint=mode)
    output = pipe(torch.rand(2, 1))
    assert count_grad_fn(output.grad_fn, "CheckpointBackward") == checkpointed
    assert count_grad_fn(output.grad_fn, "RecomputeBackward") == checkpointed
    output.sum().backward()  # parameters get gradients although the input needs none
    assert all(p.grad is not None for p in pipe.parameters())


def test_no_checkpoint_nodes_in_eval_or_without_grad():
    pipe = Pipe(nn.Sequential(nn.Linear(1, 1)), balance=[1], devices=["cpu"], chunks=2, checkpoint="always")
    pipe.eval()
    assert count_grad_fn(pipe(torch.rand(2, 1)).grad_fn, "CheckpointBackward") == 0
    pipe.train()
    with torch.no_grad():
        assert pipe(torch.rand(2, 1)).grad_fn is None


class Mode:
    def __str__(self):
        return "always"


def test_arguments_are_coerced_like_fairscale():
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), balance=(1, 1), devices=("cpu", "cpu"),
                chunks=4.0, checkpoint=Mode())
    assert (pipe.chunks, pipe.checkpoint, pipe.balance) == (4, "always", [1, 1])
    assert type(pipe.chunks) is int
    assert pipe(torch.rand(8, 2)).shape == (8, 2)


@pytest.mark.parametrize("build, builtin", [
    (lambda: Pipe(nn.Module(), balance=[1], devices=["cpu"]), TypeError),
    (lambda: Pipe(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), balance=[1], devices=["cpu"]), ValueError),
    (lambda: Pipe(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), balance=[3], devices=["cpu"]), ValueError),
    (lambda: Pipe(nn.Sequential(nn.Linear(1, 1)), devices=["cpu"]), ValueError),  # no balance
    (lambda: Pipe(nn.Sequential(nn.Linear(1, 1)), balance=[1], devices=["cpu"], chunks=0), ValueError),
    (lambda: Pipe(nn.Sequential(nn.Linear(1, 1)), balance=[1], devices=["cpu"], checkpoint="INVALID"), ValueError),
    (lambda: Pipe(nn.Sequential(*[nn.Linear(1, 1)] * 2), balance=[1, 1], devices=["cpu"] * 2), ValueError),
    (lambda: Pipe(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), balance=[1, 1], devices=["cpu"]), IndexError),
    (lambda: Pipe(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), balance=[1, 1], devices=["cpu"]), ValueError),
])
def test_bad_arguments_raise_the_builtin_class(build, builtin):
    with pytest.raises(builtin) as raised:
        build()
    assert isinstance(raised.value, TriaxError)


def test_sequential_like_indexing():
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    pipe = Pipe(nn.Sequential(a, b), balance=[1, 1], devices=["cpu", "cpu"])
    assert len(pipe) == 2 and list(pipe) == [a, b]
    assert pipe[0] is a and pipe[-1] is b and pipe[-2] is a
    with pytest.raises(IndexError):
        pipe[2]


class NonTensor(nn.Module):
    def forward(self, _):
        return "hello"


class NonTensorTuple(nn.Module):
    def forward(self, x):
        return (x, "hello")


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_non_tensor_inputs_and_outputs_raise_type_error(checkpoint):
    for layer in (NonTensor(), NonTensorTuple()):
        pipe = Pipe(nn.Sequential(layer), balance=[1], devices=["cpu"], checkpoint=checkpoint)
        with pytest.raises(TypeError):
            pipe(torch.rand(1))
    pipe = Pipe(nn.Sequential(nn.Identity()), balance=[1], devices=["cpu"])
    with pytest.raises(TypeError):
        pipe("hello")
    with pytest.raises(TypeError):
        pipe((torch.rand(1), "hello"))
    with pytest.raises(TypeError):
        pipe(torch.rand(1), torch.rand(1))  # forward takes one batch


@pytest.mark.parametrize("move", [lambda p: p.cuda(), lambda p: p.cpu(), lambda p: p.to("cpu"),
                                  lambda p: p.to(device="cpu"), lambda p: p.to(torch.rand(1))])
def test_moving_a_pipe_raises_type_error(move):
    pipe = Pipe(nn.Sequential(nn.Linear(1, 1)), balance=[1], devices=["cpu"])
    with pytest.raises(TypeError):
        move(pipe)
    assert pipe.to(torch.float64) is pipe  # a dtype change stays allowed
    assert next(pipe.parameters()).dtype == torch.float64


def test_balancing_helpers_have_fairscale_signatures():
    assert list(inspect.signature(balance_by_time).parameters)[:3] == ["partitions", "module", "sample"]
    assert list(inspect.signature(balance_by_size).parameters)[:3] == ["partitions", "module", "input"]
    assert {"timeout", "device"} <= set(inspect.signature(balance_by_time).parameters)
    assert {"chunks", "param_scale", "device"} <= set(inspect.signature(balance_by_size).parameters)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    balance = balance_by_size(2, model, input=torch.rand(8, 4), chunks=2, param_scale=4.0, device="cpu")
    assert sum(balance) == 4 and len(balance) == 2
    with pytest.raises(ValueError):
        balance_by_time(5, model, torch.rand(8, 4), device="cpu")
    with pytest.raises(TypeError):
        balance_by_time(1, nn.Linear(4, 4), torch.rand(8, 4), device="cpu")



@pytest.mark.parametrize("build, builtin, message", [
    (lambda: Pipe(nn.Linear(1, 1), balance=[1], devices=["cpu"]), TypeError,
     "module must be nn.Sequential to be partitioned"),
    (lambda: Pipe(nn.Sequential(*[nn.Linear(1, 1)] * 2), balance=[1, 1], devices=["cpu"] * 2), ValueError,
     "module with duplicate children is not supported"),
    (lambda: Pipe(nn.Sequential(nn.Linear(1, 1)), balance=[1], devices=["cpu"], checkpoint="sometimes"),
     ValueError, "checkpoint is not one of 'always', 'except_last', or 'never'"),
    (lambda: Pipe(nn.Sequential(nn.Linear(1, 1))), ValueError, "balance is required"),
    (lambda: Pipe(nn.Sequential(nn.Linear(1, 1)), balance=[2], devices=["cpu"]), ValueError,
     r"module and sum of balance have different length \(module: 1, sum of balance: 2\)"),
    (lambda: Pipe(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), balance=[2, 0], devices=["cpu"] * 2),
     ValueError, r"all balance numbers must be positive integer \(balance: \[2, 0\]\)"),
    (lambda: Pipe(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), balance=[1, 1], devices=["cpu"]), IndexError,
     r"too few devices to hold given partitions \(devices: 1, partitions: 2\)"),
])
def test_errors_start_with_fairscales_message(build, builtin, message):
    # FairScale users' tests match its messages; triax's own explanation follows them.
    with pytest.raises(builtin, match=message):
        build()


@pytest.mark.parametrize("build", [
    lambda: Pipe(nn.Sequential()),
    lambda: Pipe(nn.Sequential(), [1]),
    lambda: Pipe(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), [1]),
    lambda: Pipe(nn.Sequential(nn.Linear(1, 1)), [0, 1], devices=["cpu"] * 2),
])
def test_balance_errors_point_to_the_balancing_helpers(build):
    # FairScale's errors about balance name its helpers' module; triax's name both that and its own.
    with pytest.raises(ValueError, match=r"triax\.pipe\.balance \(in place of fairscale\.nn\.pipe\.balance\)"):
        build()


def test_errors_come_in_fairscales_order():
    # A call with several mistakes reports the one FairScale reports first.
    with pytest.raises(ValueError, match="balance is required"):
        Pipe(nn.Linear(1, 1), chunks=0, checkpoint="sometimes")
    with pytest.raises(ValueError, match="chunks"):
        Pipe(nn.Linear(1, 1), [1], chunks=0, checkpoint="sometimes")
    with pytest.raises(ValueError, match="checkpoint is not one of"):
        Pipe(nn.Linear(1, 1), [1], checkpoint="sometimes")
    with pytest.raises(TypeError, match="module must be nn.Sequential"):
        Pipe(nn.Linear(1, 1), [5], devices=[])


def test_an_empty_sequential_passes_its_input_through():
    pipe = Pipe(nn.Sequential(), [])  # no layers, no partitions, so no device is needed
    assert len(pipe) == 0 and list(pipe.parameters()) == []
    scalar, batch = torch.tensor(42), torch.rand(3, 2)
    assert pipe(scalar) is scalar and pipe(batch) is batch
    pair = (scalar, batch)
    assert pipe(pair) is pair
    for not_tensors in (42, [batch], (batch, 42)):
        with pytest.raises(TypeError):
            pipe(not_tensors)


@pytest.mark.parametrize("move", [
    lambda p: p.to(0), lambda p: p.to(device=0), lambda p: p.to("cuda"), lambda p: p.to(torch.device("cuda")),
    lambda p: p.to("cuda:1", torch.float64), lambda p: p.to(tensor=torch.rand(1)), lambda p: p.cuda(0),
])
def test_moves_to_a_gpu_are_refused_without_asking_for_one(move):
    # Refused from the arguments alone, as FairScale: on a machine without a GPU this is still a
    # TypeError about moving, not an error from torch about a missing accelerator.
    pipe = Pipe(nn.Sequential(nn.Linear(1, 1)), balance=[1], devices=["cpu"])
    with pytest.raises(TypeError, match="denied to move parameters and buffers"):
        move(pipe)
    assert {(p.device.type, p.dtype) for p in pipe.parameters()} == {("cpu", torch.float32)}


def test_fairscales_pipe_names_all_import_and_the_ones_not_provided_say_what_to_use():
    """Every name of fairscale.nn.pipe's __all__ (FairScale 0.4.13), so a script's imports run; the
    pipelines across processes are refused in one line when made."""
    import triax.pipe

    fairscale_all = ["Pipe", "is_checkpointing", "is_recomputing", "LazyModule"]
    assert set(fairscale_all) <= set(triax.pipe.__all__)
    for name in ("LazyModule", "AsyncPipe", "PipeRPCWrapper"):
        with pytest.raises(NotImplementedError) as caught:
            getattr(triax.pipe, name)(nn.Linear(1, 1))
        assert isinstance(caught.value, TriaxError) and "\n" not in str(caught.value)
        assert f"fairscale.nn.pipe.{name}" in str(caught.value) and "triax.pipe.Pipe" in str(caught.value)


def test_fairscales_checkpoint_module_path_imports():
    """`from fairscale.nn.pipe.checkpoint import is_checkpointing, is_recomputing` becomes
    `from triax.pipe.checkpoint import ...`: FairScale's module name, answered by triax.pipe.recompute."""
    import importlib

    import triax.pipe
    import triax.pipe.recompute
    from triax.pipe.checkpoint import is_checkpointing, is_recomputing

    assert importlib.import_module("triax.pipe.checkpoint") is triax.pipe.recompute is triax.pipe.checkpoint
    assert (is_checkpointing, is_recomputing) == (triax.pipe.is_checkpointing, triax.pipe.is_recomputing)
    assert not is_checkpointing() and not is_recomputing()
