"""Skip connections (triax.pipe.skip, FairScale's fairscale.nn.pipe.skip) through Pipe equal the same
layers run as a plain nn.Sequential: outputs and gradients, with every checkpoint mode, and the
stashed tensors are let go as soon as nothing can need them."""

import copy
import functools
import gc
import importlib.util
import re
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from triax.errors import TriaxError
from triax.pipe import Pipe, is_checkpointing, is_recomputing
from triax.pipe.skip import Namespace, pop, skippable, stash, verify_skippables
from support import REPO_DIR

# Micro-batches run in other threads with their own intra-op thread counts and smaller matrices,
# so sums may be rounded in another order than in the plain model: float32 rounding, nothing more.
assert_close = functools.partial(torch.testing.assert_close, rtol=1e-4, atol=1e-5)


@skippable(stash=["skip"])
class Down(nn.Module):
    """Stashes its input for the matching Up, returns a transformed copy."""

    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, input):
        yield stash("skip", input)
        return torch.tanh(self.linear(input))


@skippable(pop=["skip"])
class Up(nn.Module):
    """Adds the tensor the matching Down stashed, multiplied in so its gradient depends on both."""

    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, input):
        skip = yield pop("skip")
        return self.linear(input) + skip * input


def unet() -> nn.Sequential:
    """A U-Net-shaped stack: two nested skips, the outer one isolated in its own namespace."""
    torch.manual_seed(0)
    outer = Namespace()
    return nn.Sequential(nn.Linear(5, 8), Down(8).isolate(outer), Down(8), nn.Linear(8, 8), Up(8),
                         Up(8).isolate(outer), nn.Linear(8, 3))


def outputs_and_gradients(model, inputs):
    inputs = inputs.detach().clone().requires_grad_()
    output = model(inputs)
    (output.square().sum() + output.sum()).backward()
    return [output.detach(), inputs.grad, *[p.grad.clone() for p in model.parameters()]]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("balance", [[7], [2, 3, 2], [1, 2, 2, 2], [3, 4]])
def test_skips_across_partitions_equal_the_plain_model(balance, checkpoint):
    plain = unet()
    pipe = Pipe(copy.deepcopy(plain), balance=balance, devices=["cpu"] * len(balance), chunks=3,
                checkpoint=checkpoint)
    inputs = torch.randn(7, 5)  # 7 does not divide by 3: uneven micro-batches too
    expected, got = outputs_and_gradients(plain, inputs), outputs_and_gradients(pipe, inputs)
    assert len(got) == len(expected)
    for got_part, expected_part in zip(got, expected):
        assert_close(got_part, expected_part)


@skippable(stash=["features"])
class StashFeatures(nn.Module):
    """Takes (token ids, features): the integer tensor comes first, as in a model fed token ids."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, pair):
        ids, features = pair
        features = self.linear(features)
        yield stash("features", features)
        return ids, torch.relu(features)


@skippable(pop=["features"])
class PopFeatures(nn.Module):
    def forward(self, pair):
        ids, features = pair
        stashed = yield pop("features")
        return features * stashed + ids.unsqueeze(1).float()


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_tuple_led_by_an_integer_tensor_carries_the_skip_gradient(checkpoint):
    # Autograd drops anything tied into an integer tensor; the stashed tensor's gradient must still
    # reach the layer that made it.
    torch.manual_seed(0)
    plain = nn.Sequential(StashFeatures(), PopFeatures())
    pipe = Pipe(copy.deepcopy(plain), balance=[1, 1], devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint)
    ids, features = torch.arange(4), torch.randn(4, 4)
    for model in (plain, pipe):
        model(tuple([ids, features])).sum().backward()
    for got, expected in zip(pipe.parameters(), plain.parameters()):
        assert_close(got.grad, expected.grad)


stashed_refs: list = []


@skippable(stash=["kept"])
class StashFresh(nn.Module):
    """Stashes a tensor nothing else refers to, and remembers its memory by weak reference only (the
    storage: detached views of a tensor are other Python objects on the same memory)."""

    def forward(self, input):
        fresh = input * 2
        stashed_refs.append(weakref.ref(fresh.untyped_storage()))
        yield stash("kept", fresh)
        return input + 1


@skippable(pop=["kept"])
class PopAdd(nn.Module):
    def forward(self, input):
        kept = yield pop("kept")
        return input + kept  # an addition saves neither operand for backward


def alive() -> int:
    gc.collect()
    return sum(ref() is not None for ref in stashed_refs)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_stashed_tensor_is_let_go_after_its_last_use(checkpoint):
    stashed_refs.clear()
    pipe = Pipe(nn.Sequential(StashFresh(), nn.Linear(3, 3), PopAdd()), balance=[1, 2], devices=["cpu", "cpu"],
                chunks=2, checkpoint=checkpoint)
    output = pipe(torch.randn(4, 3))
    assert len(stashed_refs) == 2  # one per micro-batch
    # Without checkpointing the pop was the last use. With it, the pop partition's recomputation
    # will need the tensor again, so its portal keeps it until then.
    assert alive() == (2 if checkpoint == "always" else 0)
    output.sum().backward()
    # Recomputing the stash partition stashed new tensors; none of them outlives the backward pass.
    assert len(stashed_refs) == (4 if checkpoint == "always" else 2)
    assert alive() == 0


def test_flags_tell_a_layer_how_it_runs():
    seen = []

    class Spy(nn.Module):
        def forward(self, input):
            seen.append((is_checkpointing(), is_recomputing()))
            return input

    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), Spy()), balance=[2], devices=["cpu"], chunks=2,
                checkpoint="except_last")
    pipe(torch.randn(4, 2)).sum().backward()
    # micro-batch 0 checkpointed then recomputed; micro-batch 1 (the last) run plainly
    assert sorted(seen) == sorted([(True, False), (False, False), (False, True)])
    assert (is_checkpointing(), is_recomputing()) == (False, False)


@skippable(stash=["a"])
class StashA(nn.Module):
    def forward(self, input):
        yield stash("a", input)
        return input


@skippable(pop=["a"])
class PopA(nn.Module):
    def forward(self, input):
        a = yield pop("a")
        return input + a


@pytest.mark.parametrize("layers, message", [
    ([StashA], "no module declared 'a' as poppable but stashed"),
    ([PopA], "'0' declared 'a' as poppable but it was not stashed"),
    ([StashA, StashA, PopA], "'1' redeclared 'a' as stashable but not isolated by namespace"),
    ([StashA, PopA, PopA], "'2' redeclared 'a' as poppable but not isolated by namespace"),
])
def test_pipe_refuses_unmatched_skips_before_anything_runs(layers, message):
    module = nn.Sequential(*[layer() for layer in layers])
    for check in (verify_skippables, lambda m: Pipe(m, balance=[len(m)], devices=["cpu"])):
        with pytest.raises(TypeError, match=message) as caught:
            check(module)
        assert isinstance(caught.value, TriaxError)


def test_isolated_pairs_may_share_a_name():
    first, second = Namespace(), Namespace()
    verify_skippables(nn.Sequential(StashA().isolate(first), StashA().isolate(second), PopA().isolate(second),
                                    PopA().isolate(first)))


def test_broken_declarations_fail_at_run_time_with_runtime_error():
    @skippable(stash=["declared"])
    class StashesOther(nn.Module):
        def forward(self, input):
            yield stash("other", input)
            return input

    @skippable(stash=["declared"])
    class StashesNothing(nn.Module):
        def forward(self, input):
            return input

    for layer, message in [(StashesOther(), "'other' has not been declared as stashable"),
                           (StashesNothing(), "'declared' must be stashed but have not"),
                           (PopA(), "'a' has not been stashed")]:
        with pytest.raises(RuntimeError, match=message) as caught:
            layer(torch.zeros(1))
        assert isinstance(caught.value, TriaxError)


def test_skippable_layers_work_without_a_pipe_and_keep_their_module():
    model = nn.Sequential(StashA(), nn.Identity(), PopA())
    assert_close(model(torch.ones(2)), torch.full((2,), 2.0))
    assert type(model[0]).__name__ == "StashA" and isinstance(model[0].module, nn.Module)
    assert repr(model[0]) == "@skippable(StashA())"
    assert copy.copy(Namespace()) != Namespace()


@pytest.mark.parametrize("stashed", [5, "text", [torch.ones(1)]])
def test_a_non_tensor_crossing_partitions_is_one_type_error_and_within_one_it_is_handed_over(stashed):
    """FairScale fails with "'int' object has no attribute 'device'" when a portal meets a
    non-tensor; inside one partition (or without a Pipe) the value is handed over as it is."""
    @skippable(stash=["skip"])
    class StashValue(nn.Module):
        def forward(self, input):
            yield stash("skip", stashed)
            return input

    @skippable(pop=["skip"])
    class PopValue(nn.Module):
        def forward(self, input):
            assert (yield pop("skip")) is stashed
            return input * 2

    layers = nn.Sequential(StashValue(), PopValue())
    with pytest.raises(TypeError, match=r"stash\('skip', ...\) was given a .* value, not a tensor") as caught:
        Pipe(layers, balance=[1, 1], devices=["cpu", "cpu"], chunks=2)(torch.ones(4, 2))
    assert isinstance(caught.value, TriaxError) and "\n" not in str(caught.value)
    assert_close(Pipe(layers, balance=[2], devices=["cpu"], chunks=2)(torch.ones(4, 2)), torch.full((4, 2), 2.0))
    assert_close(layers(torch.ones(4, 2)), torch.full((4, 2), 2.0))


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a GPU")
def test_a_skip_crossing_devices_lands_on_the_pop_partitions_device():
    plain = unet()
    # the inner skip goes from the GPU to the CPU, the outer one from one GPU partition to another
    pipe = Pipe(copy.deepcopy(plain), balance=[1, 2, 2, 2], devices=["cpu", "cuda:0", "cpu", "cuda:0"], chunks=3,
                checkpoint="except_last")
    inputs = torch.randn(7, 5)
    expected = outputs_and_gradients(plain, inputs)
    got = [tensor.cpu() for tensor in outputs_and_gradients(pipe, inputs)]
    for got_part, expected_part in zip(got, expected):
        assert_close(got_part, expected_part)


def test_the_example_unet_matches_its_plain_model_and_learns(capsys):
    path = Path(REPO_DIR) / "examples" / "pipe_skip_unet.py"
    spec = importlib.util.spec_from_file_location("pipe_skip_unet", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--steps", "4"]) == 0
    printed = capsys.readouterr().out
    difference = float(re.search(r"largest difference (\S+)", printed).group(1))
    assert difference < 1e-5  # float32 rounding of a 7-layer net with outputs of order 1
    losses = [float(value) for value in re.findall(r"loss (\d+\.\d+)", printed)]
    assert len(losses) == 4 and losses[-1] < losses[0]
