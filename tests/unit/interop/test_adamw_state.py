"""triax/interop/shared/adamw_state.py: torch's AdamW state_dict, numbered as another tool listed its
parameters, read back by parameter name; every entry checked before anything is loaded.

The state read here is torch's own: an AdamW stepped a few times over a small model, saved with
`optimizer.state_dict()` as nanoGPT's train.py and the transformers Trainer save it."""

from __future__ import annotations

import math

import pytest
import torch

from triax.interop.shared.adamw_state import MOMENTS, moments
from triax.interop.shared.pickled import PickledFileError

WHERE = "ckpt.pt"


def stepped_adamw(steps: int = 3) -> tuple[torch.nn.Module, torch.optim.AdamW, list[str]]:
    """(model, its AdamW after `steps` steps, the parameter names in the order the optimizer lists them)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2, bias=False))
    names = [name for name, _ in model.named_parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
    return model, optimizer, names


def shapes_of(model: torch.nn.Module):
    shapes = {name: tuple(parameter.shape) for name, parameter in model.named_parameters()}
    return shapes.get


def test_torch_adamw_state_is_read_by_parameter_name_with_its_step():
    model, optimizer, names = stepped_adamw(steps=3)
    saved = optimizer.state_dict()["state"]
    named, step = moments(saved, names, shapes_of(model), WHERE)
    assert step == 3.0
    assert list(named) == names
    parameters = dict(model.named_parameters())
    for name in names:
        assert set(named[name]) == set(MOMENTS)
        for key in MOMENTS:
            # The very tensors torch's optimizer holds for that parameter: nothing copied or reordered.
            assert torch.equal(named[name][key], optimizer.state[parameters[name]][key])


def test_moments_loaded_into_a_fresh_adamw_continue_exactly_as_the_original():
    """Equivalence: the moments read by name, put into a new AdamW over a copy of the model, make
    the next step equal the original optimizer's next step."""
    model, optimizer, names = stepped_adamw(steps=2)
    named, step = moments(optimizer.state_dict()["state"], names, shapes_of(model), WHERE)
    copy = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2, bias=False))
    copy.load_state_dict(model.state_dict())
    fresh = torch.optim.AdamW(copy.parameters(), lr=1e-2)
    for name, parameter in copy.named_parameters():
        fresh.state[parameter] = {"step": torch.tensor(step), **{key: named[name][key].clone() for key in MOMENTS}}
    batch = torch.randn(5, 4)
    for module, adamw in ((model, optimizer), (copy, fresh)):
        adamw.zero_grad()
        module(batch).square().sum().backward()
        adamw.step()
    for (name, ours), (_, theirs) in zip(copy.named_parameters(), model.named_parameters()):
        assert torch.equal(ours, theirs), name


def test_a_plain_number_step_count_is_accepted_as_older_torch_saved_it():
    model, optimizer, names = stepped_adamw(steps=1)
    saved = optimizer.state_dict()["state"]
    for entry in saved.values():
        entry["step"] = 1  # torch < 1.12 kept the step count as an int
    _, step = moments(saved, names, shapes_of(model), WHERE)
    assert step == 1.0 and isinstance(step, float)


def test_a_parameter_without_state_is_refused_naming_it():
    model, optimizer, names = stepped_adamw(steps=1)
    saved = optimizer.state_dict()["state"]
    del saved[2]
    with pytest.raises(PickledFileError, match=rf"ckpt.pt: its optimizer has no state for parameter 2 \({names[2]}\); "
                                               "a checkpoint saved before the first step"):
        moments(saved, names, shapes_of(model), WHERE)


def test_an_optimizer_saved_before_its_first_step_is_refused():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(PickledFileError, match="no state for parameter 0 .weight."):
        moments(optimizer.state_dict()["state"], ["weight", "bias"], shapes_of(model), WHERE)


@pytest.mark.parametrize("key", MOMENTS)
@pytest.mark.parametrize("bad", [torch.zeros(2, 2), torch.zeros(3, dtype=torch.int64), "zeros", None],
                         ids=["wrong shape", "integer", "string", "missing"])
def test_a_moment_that_is_not_a_floating_tensor_of_the_parameters_shape_is_refused(key, bad):
    model, optimizer, names = stepped_adamw(steps=1)
    saved = optimizer.state_dict()["state"]
    index = names.index("0.bias")  # shape (3,)
    if bad is None:
        del saved[index][key]
    else:
        saved[index][key] = bad
    with pytest.raises(PickledFileError, match=rf"ckpt.pt: its optimizer's {key} of 0.bias is not a floating tensor "
                                               r"of the parameter's shape \[3\]"):
        moments(saved, names, shapes_of(model), WHERE)


def test_a_parameter_the_model_does_not_have_is_refused_with_an_empty_shape():
    model, optimizer, names = stepped_adamw(steps=1)
    with pytest.raises(PickledFileError, match=r"exp_avg of extra is not a floating tensor of the parameter's shape \[\]"):
        moments(optimizer.state_dict()["state"], names[:-1] + ["extra"], shapes_of(model), WHERE)


@pytest.mark.parametrize("step, shown", [(torch.tensor(0.0), "0.0"), (-1, "-1"), (math.nan, "nan"),
                                         (math.inf, "inf"), (True, "True"), ("3", "'3'"),
                                         (torch.tensor([1.0, 2.0]), "tensor"), (2**48 + 1, str(2**48 + 1))])
def test_a_step_count_outside_one_to_the_maximum_is_refused(step, shown):
    model, optimizer, names = stepped_adamw(steps=1)
    saved = optimizer.state_dict()["state"]
    saved[1]["step"] = step
    with pytest.raises(PickledFileError, match=rf"its optimizer's step count for {names[1]} is "):
        moments(saved, names, shapes_of(model), WHERE)
    try:
        moments(saved, names, shapes_of(model), WHERE)
    except PickledFileError as error:
        assert shown in str(error) and str(error).endswith(f"not in 1..{2**48}")


def test_the_largest_step_allowed_is_the_callers():
    model, optimizer, names = stepped_adamw(steps=2)
    saved = optimizer.state_dict()["state"]
    assert moments(saved, names, shapes_of(model), WHERE, max_step=2)[1] == 2.0
    with pytest.raises(PickledFileError, match=r"is 2.0, not in 1..1$"):
        moments(saved, names, shapes_of(model), WHERE, max_step=1)


def test_parameters_with_different_step_counts_are_refused():
    model, optimizer, names = stepped_adamw(steps=2)
    saved = optimizer.state_dict()["state"]
    saved[0]["step"] = torch.tensor(5.0)
    with pytest.raises(PickledFileError, match=r"ckpt.pt: its optimizer's parameters have different step counts "
                                               r"\[2.0, 5.0\]"):
        moments(saved, names, shapes_of(model), WHERE)


def test_a_damaged_entry_is_refused_before_any_later_entry_is_read():
    """Everything is checked before anything is loaded: the first bad entry names the file and the parameter."""
    model, optimizer, names = stepped_adamw(steps=1)
    saved = optimizer.state_dict()["state"]
    saved[0] = "not a dict"
    saved[1]["exp_avg"] = None
    with pytest.raises(PickledFileError, match=rf"no state for parameter 0 \({names[0]}\)"):
        moments(saved, names, shapes_of(model), WHERE)


def test_refusals_are_the_snapshot_errors_callers_catch():
    from triax.checkpoint.errors import SnapshotCorruptError

    model, optimizer, names = stepped_adamw(steps=1)
    with pytest.raises(SnapshotCorruptError):
        moments({}, names, shapes_of(model), WHERE)
    with pytest.raises(ValueError):
        moments({}, names, shapes_of(model), WHERE)
