"""The Accelerator conducts components (triax/accelerate/_internal/: preparation, gradient_sync,
state_saving, experiment_tracking, gathering): what a script sees stays as it was on one class.
The attributes it reads are the components' own, and setting one reaches the component; a subclass's
prepare_<kind> is the one prepare uses. One process, on CPU."""

from types import SimpleNamespace

import torch

from triax.accelerate import Accelerator
from triax.accelerate._internal.gathering import gather_for_metrics


def test_the_attributes_scripts_set_reach_the_components(fresh_state):
    accelerator = Accelerator(cpu=True)
    accelerator.device_placement = False
    accelerator.step = 5
    assert accelerator._preparation.device_placement is False and accelerator._gradient_sync.step == 5
    with accelerator.accumulate():
        pass
    assert accelerator.step == 6
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared_model, prepared_optimizer = accelerator.prepare(model, optimizer)
    assert accelerator._models == [prepared_model] and accelerator._optimizers == [prepared_optimizer]
    assert accelerator.trackers == [] and accelerator.project_configuration.iteration == 0
    accelerator.free_memory()
    assert accelerator._models == [] and accelerator._optimizers == []


def test_prepare_uses_a_subclass_s_own_prepare_model(fresh_state):
    seen = []

    class Recording(Accelerator):
        def prepare_model(self, model, device_placement=None, evaluation_mode=False):
            seen.append(model)
            return super().prepare_model(model, device_placement, evaluation_mode)

    model = torch.nn.Linear(2, 2)
    Recording(cpu=True).prepare(model)
    assert seen == [model]


def test_gather_for_metrics_keeps_only_the_last_batch_s_real_samples():
    last_batch = SimpleNamespace(end_of_dataloader=True, remainder=2)
    assert gather_for_metrics(torch.arange(4), False, last_batch).tolist() == [0, 1]
    assert gather_for_metrics(["a", "b", "c"], True, last_batch) == ["a", "b"]
    inside = SimpleNamespace(end_of_dataloader=False, remainder=2)
    assert gather_for_metrics(torch.arange(4), False, inside).tolist() == [0, 1, 2, 3]
