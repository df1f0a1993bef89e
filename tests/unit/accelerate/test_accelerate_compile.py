"""Accelerator(dynamo_backend=...) / dynamo_plugin compile each prepared model last, as Accelerate 1.16
does, and train to the same numbers as the script compiling the model itself; parameters a prepare
replaces (a move under torch.__future__'s overwrite flag) are followed by the optimizer, with
Accelerate's private helpers for it (_get_named_parameters, _remap_optimizer_parameters)."""

import types

import pytest
import torch

from triax.errors import TriaxError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, backward) -> list[float]:
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        inputs = torch.randn(5, 4, generator=generator)
        loss = model(inputs).pow(2).mean()
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_dynamo_backend_compiles_the_prepared_model_and_trains_as_compiling_it_by_hand(fresh_state):
    from triax.accelerate import Accelerator
    from triax.accelerate.utils import DynamoBackend, is_compiled_module

    accelerator = Accelerator(dynamo_backend="eager")
    assert accelerator.state.dynamo_plugin.backend == DynamoBackend.EAGER
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert is_compiled_module(model)
    ours = _train(model, optimizer, accelerator.backward)

    by_hand = _model()
    by_hand_optimizer = torch.optim.SGD(by_hand.parameters(), lr=0.1)
    theirs = _train(torch.compile(by_hand, backend="eager"), by_hand_optimizer, torch.Tensor.backward)
    assert ours == theirs
    for mine, reference in zip(accelerator.unwrap_model(model).parameters(), by_hand.parameters()):
        assert torch.equal(mine, reference)


def test_a_model_compiled_by_the_script_is_not_compiled_again(fresh_state):
    from triax.accelerate import Accelerator

    compiled = torch.compile(_model(), backend="eager")
    assert Accelerator(dynamo_backend="eager").prepare(compiled) is compiled


def test_the_dynamo_environment_of_accelerate_launch_is_read(fresh_state, monkeypatch):
    from triax.accelerate import Accelerator
    from triax.accelerate.utils import is_compiled_module

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "EAGER")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "true")
    accelerator = Accelerator()
    assert (accelerator.state.dynamo_plugin.backend, accelerator.state.dynamo_plugin.fullgraph) == ("EAGER", True)
    assert is_compiled_module(accelerator.prepare(_model()))


def test_accelerates_own_plugin_is_taken_field_by_field(fresh_state):
    accelerate_utils = pytest.importorskip("accelerate.utils")
    from triax.accelerate import Accelerator

    plugin = accelerate_utils.TorchDynamoPlugin(backend="eager", mode="reduce-overhead", dynamic=False)
    state = Accelerator(dynamo_plugin=plugin).state.dynamo_plugin
    assert (state.backend, state.mode, state.dynamic, state.fullgraph) == ("EAGER", "reduce-overhead", False, False)


@pytest.mark.parametrize("arguments, error, words", [
    ({"dynamo_backend": "eager", "dynamo_plugin": types.SimpleNamespace(backend="eager")}, ValueError, "both"),
    ({"dynamo_backend": "warp-drive"}, ValueError, "'warp-drive'"),
    ({"dynamo_plugin": types.SimpleNamespace(backend="inductor", use_regional_compilation=True)},
     NotImplementedError, "use_regional_compilation"),
])
def test_bad_compile_settings_are_one_line_errors(fresh_state, arguments, error, words):
    from triax.accelerate import Accelerator

    with pytest.raises(error) as caught:
        Accelerator(**arguments)
    assert isinstance(caught.value, TriaxError) and words in str(caught.value) and "\n" not in str(caught.value)


def test_parameters_a_move_replaces_are_followed_by_the_optimizer(fresh_state, monkeypatch):
    from triax.accelerate import Accelerator

    monkeypatch.setattr(torch.__future__, "_overwrite_module_params_on_conversion", True)
    accelerator = Accelerator()
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    old_parameter = model.weight
    old_named = accelerator._get_named_parameters(model)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert model.weight is not old_parameter and old_named == {"weight": old_parameter}
    assert optimizer.param_groups[0]["params"][0] is model.weight  # prepare followed the move itself
    accelerator._remap_optimizer_parameters(old_named, model, optimizer)  # and again is harmless
    before = model.weight.detach().clone()
    accelerator.backward(model(torch.ones(2, 2)).sum())
    optimizer.step()
    torch.testing.assert_close(model.weight, before - 0.2)
    named_storage = accelerator._get_named_parameters(model, torch.nn.Linear(1, 1), drop_refs=True)
    assert sorted(named_storage) == ["0.weight", "1.bias", "1.weight"]
    assert named_storage["0.weight"][1] == model.weight.data_ptr()
