"""Every mistake a Pipe user can make gets a one-line TriaxError that says what to do."""

import pytest
import torch
from torch import nn

from triax.errors import TriaxError
from triax.pipe import Pipe, balance_by_size, balance_by_time


def model(layers: int = 3) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])


def cpu_pipe(**kwargs) -> Pipe:
    arguments = dict(balance=[1, 2], devices=["cpu", "cpu"])
    arguments.update(kwargs)
    return Pipe(model(), **arguments)


@pytest.mark.parametrize("module, message", [
    (nn.Linear(4, 4), "module must be nn.Sequential to be partitioned, got Linear"),
    (nn.ModuleList([nn.Linear(4, 4)]), "got ModuleList"),
])
def test_module_must_be_a_sequential(module, message):
    with pytest.raises(TriaxError, match=message):
        Pipe(module, balance=[1], devices=["cpu"])


def test_repeated_layer_is_refused():
    layer = nn.Linear(4, 4)
    with pytest.raises(TriaxError, match=r"duplicate children is not supported: layers 0 and 2 of the nn.Sequential are the same module \(Linear\)"):
        Pipe(nn.Sequential(layer, nn.ReLU(), layer), balance=[2, 1], devices=["cpu", "cpu"])


def test_parameters_shared_across_devices_are_refused():
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    with pytest.raises(TriaxError, match=r"duplicate parameters on distinct devices is not supported: layers 0 and 1 share a parameter "
                                         r".* partitions 0 and 1 on cpu and meta"):
        Pipe(nn.Sequential(first, second), balance=[1, 1], devices=["cpu", "meta"])
    Pipe(nn.Sequential(first, second), balance=[2], devices=["cpu"])  # one partition: fine
    Pipe(nn.Sequential(first, second), balance=[1, 1], devices=["cpu", "cpu"])  # one device: fine


@pytest.mark.parametrize("balance, message", [
    (None, r"balance is required: Pipe\(module, balance=\[layers per partition\].*triax.pipe.balance.*balance_by_time"),
    (3, "balance must be a list of layer counts, got 3"),
    ("12", "balance must be a list of layer counts, got '12'"),
    ([], r"module and sum of balance have different length \(module: 3, sum of balance: 0\)"),
    ([0, 3], r"all balance numbers must be positive integer \(balance: \[0, 3\]\); every partition needs"),
    ([-1, 4], "all balance numbers must be positive integer"),
    ([1.5, 1.5], r"all balance numbers must be positive integer \(balance: \[1.5, 1.5\]\); give whole numbers"),
    ([True, 2], "all balance numbers must be positive integer"),
    ([1, 1], r"sum of balance: 2\); balance \[1, 1\] must add up to the 3 layers of the module"),
    ([2, 2], "sum of balance: 4"),
])
def test_bad_balance(balance, message):
    with pytest.raises(TriaxError, match=message):
        Pipe(model(), balance=balance, devices=["cpu", "cpu"])


@pytest.mark.parametrize("chunks", [0, -2, 1.5, "four", None])
def test_bad_chunks(chunks):
    with pytest.raises(TriaxError, match=f"chunks must be a whole number of micro-batches >= 1, got {chunks!r}"):
        cpu_pipe(chunks=chunks)


@pytest.mark.parametrize("checkpoint", ["sometimes", None, True, "Always"])  # str() of each is no mode
def test_bad_checkpoint(checkpoint):
    with pytest.raises(TriaxError, match=f"checkpoint is not one of 'always', 'except_last', or 'never' "
                                         f"\\(got '{checkpoint}'\\)"):
        cpu_pipe(checkpoint=checkpoint)


def test_too_few_devices():
    with pytest.raises(TriaxError, match=r"too few devices to hold given partitions \(devices: 1, partitions: 2\): balance has 2 "
                                         r"partitions but the devices are \['cpu'\]"):
        cpu_pipe(devices=["cpu"])


def test_extra_devices_are_left_unused():
    assert cpu_pipe(devices=["cpu"] * 3).devices == [torch.device("cpu")] * 2


@pytest.mark.parametrize("devices, message", [
    ("cpu", "devices must be a list with one device per partition, got 'cpu'"),
    (["cpu", "tpu-ish"], "devices entry 'tpu-ish' is not a device"),
])
def test_bad_devices(devices, message):
    with pytest.raises(TriaxError, match=message):
        cpu_pipe(devices=devices)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages given when no GPU is visible")
def test_gpu_devices_without_a_gpu():
    with pytest.raises(TriaxError, match=r"too few devices to hold given partitions \(devices: 0, partitions: 2\): devices=None "
                                         r"means the 0 visible GPUs; pass devices=\['cpu', 'cpu'\]"):
        Pipe(model(), balance=[1, 2])
    with pytest.raises(TriaxError, match="devices entry 'cuda:1' asks for a GPU but none is visible"):
        cpu_pipe(devices=["cpu", "cuda:1"])
    with pytest.raises(TriaxError, match="devices entry 0 asks for a GPU"):
        cpu_pipe(devices=[0, 1])


@pytest.mark.parametrize("move", [
    lambda pipe: pipe.to("cpu"),
    lambda pipe: pipe.to(torch.device("cuda", 0)),
    lambda pipe: pipe.to("cpu", torch.float64),
    lambda pipe: pipe.to(device="cpu"),
    lambda pipe: pipe.to(torch.zeros(1)),
    lambda pipe: pipe.cuda(),
    lambda pipe: pipe.cuda(1),
    lambda pipe: pipe.cpu(),
])
def test_moving_the_whole_pipe_is_refused(move):
    pipe = cpu_pipe()
    with pytest.raises(TriaxError, match=r"denied to move parameters and buffers, because Pipe should manage device "
                                         r"placement: its partitions are pinned to devices \['cpu', 'cpu'\], and "
                                         r"moving the whole Pipe to .* would undo the split.*devices=\[\.\.\.\]"):
        move(pipe)
    assert {p.dtype for p in pipe.parameters()} == {torch.float32}  # nothing changed on the way


@pytest.mark.parametrize("inputs, message", [
    ([torch.zeros(2, 4)], "Pipe input must be a tensor or a tuple of tensors, got list"),
    ((), "got tuple; wrap"),
    ((torch.zeros(2, 4), 3), "Pipe input element 1 is a int, not a tensor"),
    ((torch.zeros(2, 4), torch.zeros(3, 4)), r"different batch sizes \[2, 3\]"),
    (torch.tensor(1.0), "0-dimensional tensor"),
])
def test_bad_inputs(inputs, message):
    with pytest.raises(TriaxError, match=message):
        cpu_pipe()(inputs)


class ReturnsList(nn.Module):
    def forward(self, x):
        return [x, x]


def test_partition_output_must_be_a_batch():
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), ReturnsList(), nn.Identity()), balance=[2, 1],
                devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(TriaxError, match="output of partition 0 must be a tensor or a tuple of tensors, got list"):
        pipe(torch.zeros(4, 4))


class Fails(nn.Module):
    def forward(self, x):
        raise ValueError("layer failed on purpose")


def test_an_error_in_a_partition_reaches_the_caller():
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), Fails()), balance=[1, 1], devices=["cpu", "cpu"], chunks=3)
    with pytest.raises(ValueError, match="layer failed on purpose"):
        pipe(torch.zeros(6, 4))
    pipe[1].forward = lambda x: x  # the pipe is still usable afterwards
    assert pipe(torch.zeros(6, 4)).shape == (6, 4)


@pytest.mark.parametrize("helper", [balance_by_time, balance_by_size])
def test_balancing_helpers_refuse_bad_arguments(helper):
    sample = torch.zeros(2, 4)
    with pytest.raises(TriaxError, match="cannot cut 3 layers into 4 partitions; .* at most 3"):
        helper(4, model(), sample)
    with pytest.raises(TriaxError, match="partitions must be a whole number >= 1, got 0"):
        helper(0, model(), sample)
    with pytest.raises(TriaxError, match="balancing needs the nn.Sequential you will give Pipe, got Linear"):
        helper(1, nn.Linear(4, 4), sample)
    with pytest.raises(TriaxError, match="(sample|input) element 0 is a str"):
        helper(1, model(), ("x",))
