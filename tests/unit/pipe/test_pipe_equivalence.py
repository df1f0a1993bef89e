"""Pipe equals the plain nn.Sequential it was cut from: outputs, gradients, BatchNorm statistics."""

import copy
import functools
import time

import pytest
import torch
from torch import nn

from triax.pipe import Pipe

# Micro-batches are computed by other threads with their own intra-op thread count, so sums may be
# rounded in another order than in the plain model: float32 rounding, nothing more.
assert_close = functools.partial(torch.testing.assert_close, rtol=1e-4, atol=1e-5)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 8), nn.GELU(), nn.Linear(8, 3))


def outputs_and_gradients(model, inputs, parameters=None):
    inputs = inputs.detach().clone().requires_grad_()
    output = model(inputs)
    (output.square().sum() + output.sum()).backward()
    parameters = model.parameters() if parameters is None else parameters
    return output.detach(), inputs.grad, [p.grad.clone() for p in parameters]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_outputs_and_gradients_equal_plain_model(chunks, checkpoint):
    plain = mlp()
    pipe = Pipe(copy.deepcopy(plain), balance=[2, 3, 2], devices=["cpu"] * 3, chunks=chunks,
                checkpoint=checkpoint)
    inputs = torch.randn(10, 6)  # 10 does not divide by 3 or 4: uneven micro-batches too
    expected = outputs_and_gradients(plain, inputs)
    got = outputs_and_gradients(pipe, inputs)
    assert_close(got[0], expected[0])
    assert_close(got[1], expected[1])
    assert len(got[2]) == len(expected[2])
    for got_grad, expected_grad in zip(got[2], expected[2]):
        assert_close(got_grad, expected_grad)


def test_several_steps_of_training_equal_plain_model():
    plain = mlp()
    pipe = Pipe(copy.deepcopy(plain), balance=[4, 3], devices=["cpu", "cpu"], chunks=4)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (plain, pipe)]
    torch.manual_seed(1)
    for _ in range(3):
        inputs, target = torch.randn(8, 6), torch.randn(8, 3)
        for model, optimizer in zip((plain, pipe), optimizers):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(inputs), target).backward()
            optimizer.step()
    for got, expected in zip(pipe.parameters(), plain.parameters()):
        assert_close(got, expected)


class CountingLinear(nn.Linear):
    """A linear layer that counts its forward calls (recomputation calls it again)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = 0

    def forward(self, input):
        self.calls += 1
        return super().forward(input)


def counting_pipe(checkpoint):
    model = nn.Sequential(CountingLinear(4, 4), nn.ReLU(), CountingLinear(4, 2))
    return Pipe(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=4, checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint, recomputed", [("always", 4), ("except_last", 3), ("never", 0)])
def test_training_recomputes_checkpointed_micro_batches(checkpoint, recomputed):
    pipe = counting_pipe(checkpoint)
    pipe(torch.randn(8, 4)).sum().backward()
    assert [pipe[0].calls, pipe[2].calls] == [4 + recomputed, 4 + recomputed]


def test_eval_mode_skips_recomputation():
    pipe = counting_pipe("always").eval()
    inputs = torch.randn(8, 4, requires_grad=True)
    pipe(inputs).sum().backward()  # gradients still flow in eval mode, without recomputation
    assert [pipe[0].calls, pipe[2].calls] == [4, 4]
    assert inputs.grad is not None and pipe[0].weight.grad is not None


def test_no_grad_gives_plain_outputs():
    plain = mlp()
    pipe = Pipe(copy.deepcopy(plain), balance=[3, 4], devices=["cpu", "cpu"], chunks=2, checkpoint="always")
    inputs = torch.randn(5, 6)
    with torch.no_grad():
        output = pipe(inputs)
    assert output.grad_fn is None
    assert_close(output, plain(inputs).detach())


class AddPair(nn.Module):
    """Takes (x, y), returns (x + W y, y): tuples travel through partitions."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, pair):
        x, y = pair
        return x + self.linear(y), y * 2


class Merge(nn.Module):
    def forward(self, pair):
        return pair[0] * pair[1]


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_tuple_inputs_and_outputs(checkpoint):
    torch.manual_seed(0)
    plain = nn.Sequential(AddPair(), AddPair(), AddPair())
    pipe = Pipe(copy.deepcopy(plain), balance=[1, 2], devices=["cpu", "cpu"], chunks=3, checkpoint=checkpoint)
    x, y = torch.randn(7, 3), torch.randn(7, 3)
    results = []
    for model in (plain, pipe):
        xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
        out_x, out_y = model((xs, ys))
        (out_x * out_y).sum().backward()
        results.append((out_x, out_y, xs.grad, ys.grad, [p.grad for p in model.parameters()]))
    (ex, ey, exg, eyg, eparams), (gx, gy, gxg, gyg, gparams) = results
    for got, expected in [(gx, ex), (gy, ey), (gxg, exg), (gyg, eyg), *zip(gparams, eparams)]:
        assert_close(got, expected)
    # and a tuple can turn back into a tensor at the end
    merged = Pipe(nn.Sequential(copy.deepcopy(plain[0]), Merge()), balance=[1, 1], devices=["cpu", "cpu"], chunks=2)
    assert_close(merged((x, y)), Merge()(plain[0]((x, y))))


def bn_model(kind: str) -> nn.Sequential:
    # One BatchNorm each: a BatchNorm behind another one sees different inputs in the pipe (the first
    # normalises micro-batches) than in the plain model, so only the first can be compared exactly.
    torch.manual_seed(0)
    if kind == "2d":
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.BatchNorm2d(4), nn.Flatten(),
                             nn.Linear(4 * 5 * 5, 2))
    return nn.Sequential(nn.Flatten(), nn.Linear(75, 6), nn.Tanh(), nn.BatchNorm1d(6, momentum=None),
                         nn.Linear(6, 2))


def assert_close_to_scale(got, expected, relative=1e-4):
    """Equal up to round-off measured against the tensor's own largest value. With more than one
    thread, the batch-norm kernel that updates running statistics (the plain model's BatchNorm)
    and the one that does not (the pipe's DeferredBatchNorm) reduce in different orders, and
    normalising a 3-sample micro-batch divides that round-off by its small standard deviation: an
    element near zero then misses assert_close's absolute 1e-5 while the tensor agrees to a few
    millionths of its scale (8e-6 was the worst seen, 2 threads, ATEN_CPU_CAPABILITY=default; with
    one thread the two are bitwise equal). A wrong statistic moves outputs by a sizeable fraction
    of the scale."""
    assert_close(got, expected, rtol=relative, atol=relative * float(expected.abs().max()))


@pytest.mark.parametrize("kind", ["2d", "1d, cumulative average"])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_deferred_batch_norm_running_statistics_match_unsplit_batch(checkpoint, kind):
    plain = bn_model(kind)
    pipe = Pipe(copy.deepcopy(plain), balance=[2, 3], devices=["cpu", "cpu"], chunks=4,
                checkpoint=checkpoint, deferred_batch_norm=True)
    torch.manual_seed(2)
    for _ in range(3):
        inputs = torch.randn(12, 3, 5, 5) * 3 + 1
        # Outputs and gradients: each micro-batch is normalised with its own statistics, which is
        # what the plain model computes when fed the micro-batches one by one.
        reference = copy.deepcopy(plain)
        expected = outputs_and_gradients(
            lambda x: torch.cat([reference(chunk) for chunk in x.chunk(4)]), inputs, reference.parameters())
        got = outputs_and_gradients(pipe, inputs)
        (output, input_grad, grads), (expected_output, expected_input_grad, expected_grads) = got, expected
        for got_part, expected_part in zip([output, input_grad, *grads], [expected_output, expected_input_grad, *expected_grads]):
            assert_close_to_scale(got_part, expected_part)
        pipe.zero_grad()
        plain(inputs)  # the plain model sees the unsplit batch: one update per mini-batch
    plain_bn = [m for m in plain.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    pipe_bn = [m for m in pipe.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(pipe_bn) == len(plain_bn) == 1
    assert_close(pipe_bn[0].running_mean, plain_bn[0].running_mean)
    assert_close(pipe_bn[0].running_var, plain_bn[0].running_var)
    assert int(pipe_bn[0].num_batches_tracked) == int(plain_bn[0].num_batches_tracked) == 3
    plain.eval(), pipe.eval()
    inputs = torch.randn(6, 3, 5, 5)
    assert_close(pipe(inputs), plain(inputs))


def test_plain_batch_norm_in_a_pipe_counts_micro_batches():
    # The reason deferred_batch_norm exists: without it, statistics are updated per micro-batch.
    pipe = Pipe(bn_model("2d"), balance=[2, 3], devices=["cpu", "cpu"], chunks=4, checkpoint="never")
    pipe(torch.randn(12, 3, 5, 5))
    assert int(pipe[2].num_batches_tracked) == 4


def test_dropout_masks_are_replayed_exactly_when_recomputing():
    # Dropout only: output = input * mask, so d(output.sum())/d(input) = output / input.
    # If recomputation drew a different mask than the forward pass, the two would disagree.
    model = nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5), nn.Dropout(0.5), nn.Dropout(0.5))
    pipe = Pipe(model, balance=[1, 1, 1, 1], devices=["cpu"] * 4, chunks=8, checkpoint="always")
    for _ in range(5):
        inputs = (torch.rand(64, 256) + 1).requires_grad_()
        output = pipe(inputs)
        output.sum().backward()
        assert_close(inputs.grad, output.detach() / inputs.detach())
        # and each micro-batch (8 rows here) drew masks of its own, not one mask repeated
        kept = (output != 0).view(8, 8, 256)
        assert not all(torch.equal(kept[0], other) for other in kept[1:])


class FunctionalDropouts(nn.Module):
    """Draws random numbers through torch.nn.functional, where no module type gives it away."""

    def forward(self, x):
        for _ in range(20):
            x = nn.functional.dropout(x, p=0.01, training=self.training)
        return x


def test_functional_dropout_is_replayed_exactly_with_partitions_on_one_device():
    # Two partitions on the CPU share its generator. If one drew while the other ran its checkpointed
    # forward, the recomputed masks would differ from the forward ones (seen in 1 run in 5 before the
    # partitions took turns), and the gradient would not be output / input.
    pipe = Pipe(nn.Sequential(FunctionalDropouts(), FunctionalDropouts()), balance=[1, 1], devices=["cpu"] * 2,
                chunks=10, checkpoint="always")
    for _ in range(30):
        inputs = (torch.rand(10, 64) + 1).requires_grad_()
        output = pipe(inputs)
        output.sum().backward()
        assert_close(inputs.grad, output.detach() / inputs.detach())


def test_to_dtype_converts_every_partition():
    pipe = Pipe(mlp(), balance=[3, 4], devices=["cpu", "cpu"], chunks=2)
    assert pipe.to(torch.float64) is pipe
    assert {p.dtype for p in pipe.parameters()} == {torch.float64}
    assert pipe(torch.randn(4, 6, dtype=torch.float64)).dtype == torch.float64


def test_layers_are_reachable_like_a_sequential():
    model = mlp()
    layers = list(model)
    pipe = Pipe(model, balance=[3, 4], devices=["cpu", "cpu"])
    assert len(pipe) == 7 and list(pipe) == layers and pipe[4] is layers[4] and pipe[-1] is layers[-1]
    assert [len(p) for p in pipe.partitions] == [3, 4]
    assert pipe.devices == [torch.device("cpu")] * 2


def test_recomputation_leaves_plain_batch_norm_statistics_alone():
    # Without deferred_batch_norm, statistics follow micro-batches, and checkpointing must not add to that.
    pipes = {mode: Pipe(bn_model("2d"), balance=[2, 3], devices=["cpu", "cpu"], chunks=3, checkpoint=mode)
             for mode in ("always", "never")}
    inputs = torch.randn(9, 3, 5, 5)
    for pipe in pipes.values():
        pipe(inputs).sum().backward()
    always, never = pipes["always"][2], pipes["never"][2]
    assert int(always.num_batches_tracked) == int(never.num_batches_tracked) == 3
    assert_close(always.running_mean, never.running_mean)
    assert_close(always.running_var, never.running_var)


def test_parameter_names_keep_the_sequential_names():
    pipe = Pipe(mlp(), balance=[3, 4], devices=["cpu", "cpu"])
    names = [name for name, _ in pipe.named_parameters()]
    assert names[:2] == ["partitions.0.0.weight", "partitions.0.0.bias"]
    assert names[-1] == "partitions.1.6.bias"


def test_caller_autocast_and_inference_mode_reach_the_partitions():
    # Both are thread-local in PyTorch; the worker threads must run under the caller's modes.
    plain = mlp()
    pipe = Pipe(copy.deepcopy(plain), balance=[3, 4], devices=["cpu", "cpu"], chunks=2, checkpoint="always")
    inputs = torch.randn(4, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = plain(inputs), pipe(inputs)
    assert expected.dtype == got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected)
    with torch.inference_mode():
        output = pipe(inputs)
    assert output.is_inference()


@pytest.mark.gpu
def test_gpu_partitions_equal_plain_model():
    plain = mlp()
    last = torch.cuda.device_count() - 1
    pipe = Pipe(copy.deepcopy(plain), balance=[2, 3, 2], devices=[0, "cpu", f"cuda:{last}"], chunks=3)
    inputs = torch.randn(10, 6)
    expected = outputs_and_gradients(plain, inputs)
    got = outputs_and_gradients(pipe, inputs)
    assert got[0].device == torch.device("cuda", last)
    for got_part, expected_part in zip(got, expected):
        assert_close(got_part, expected_part, check_device=False)


class Logged(nn.Module):
    """Appends (micro-batch, partition) to a shared log when its forward finishes."""

    def __init__(self, log, partition, seconds):
        super().__init__()
        self.log, self.partition, self.seconds, self.calls = log, partition, seconds, 0

    def forward(self, x):
        time.sleep(self.seconds)  # run side by side, the slow first partition would finish last
        self.log.append((self.calls, self.partition))
        self.calls += 1
        return x


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_partitions_sharing_a_device_take_turns_in_order_while_checkpointing(checkpoint):
    # Each clock tick runs partition 0's micro-batch, then partition 1's, on every run: the order
    # of their random draws is then repeatable, and a checkpoint's replay cannot be disturbed.
    log = []
    model = nn.Sequential(Logged(log, 0, seconds=0.02), Logged(log, 1, seconds=0.0), Logged(log, 2, seconds=0.0))
    pipe = Pipe(model, balance=[1, 1, 1], devices=["cpu"] * 3, chunks=3, checkpoint=checkpoint)
    pipe(torch.rand(3, 1, requires_grad=True))
    ticks = [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2), (2, 1), (1, 2), (2, 2)]
    assert log == ticks


@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_cuda_partitions_under_bf16_autocast_equal_plain_model(checkpoint):
    """Every partition on the GPU, micro-batched, under bf16 autocast, with and without
    recomputation: the outputs and gradients of the same model run whole on the GPU."""
    plain = mlp().cuda()
    pipe = Pipe(copy.deepcopy(plain), balance=[3, 4], devices=[0, 0], chunks=4, checkpoint=checkpoint)
    inputs = torch.randn(16, 6, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = outputs_and_gradients(plain, inputs)
        got = outputs_and_gradients(pipe, inputs)
    assert got[0].device.type == "cuda" and got[0].dtype == torch.bfloat16
    # bf16 tolerance: a micro-batch's weight gradient is rounded to bf16 before the micro-batches
    # are added up in fp32, where the whole batch's is rounded once.
    for got_part, expected_part in zip(got, expected):
        torch.testing.assert_close(got_part, expected_part, rtol=2e-2, atol=2e-3)
