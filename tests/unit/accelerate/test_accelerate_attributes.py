"""The objects a script holds answer every attribute Accelerate's do, with Accelerate's answers.

tests/unit/accelerate/test_accelerate_names.py holds the modules' names against the installed Accelerate; this
holds the attributes of the four objects scripts read (`Accelerator`, `AcceleratorState`,
`GradientState`, `PartialState`), so `accelerator.state.deepspeed_plugin is None`, a common check
in training scripts, works as it does on Accelerate. One process, the default Accelerator on CPU.
"""

import enum

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

# Attributes whose values are objects of each library's own classes (compared by other tests) or
# settings triax chooses differently on purpose (docs/accelerate.md).
NOT_COMPARED = {
    "state", "gradient_state", "scaler", "dataloader_config", "project_configuration", "trackers",
    "dynamo_plugin",  # Accelerate's TorchDynamoPlugin; triax's is a record with the same fields (below)
    "place",
}
PLAIN = (type(None), bool, int, float, str, dict, list, tuple, torch.device, enum.Enum)


def public_attributes(obj) -> dict:
    """name -> ("value", v) or ("raises", exception class) for each public attribute."""
    found = {}
    for name in dir(obj):
        if name.startswith("_"):
            continue
        try:
            found[name] = ("value", getattr(obj, name))
        except Exception as error:  # noqa: BLE001 - what a script reading it would get
            found[name] = ("raises", type(error))
    return found


def the_four(module_accelerator, state_module):
    accelerator = module_accelerator(cpu=True)
    return {"Accelerator": accelerator, "AcceleratorState": accelerator.state,
            "GradientState": accelerator.gradient_state, "PartialState": state_module.PartialState()}


@pytest.fixture(scope="module")
def both():
    import accelerate.state as accelerate_state

    import triax.accelerate as triax_accelerate
    import triax.accelerate.state as triax_state

    def reset():
        for module in (accelerate_state, triax_state):
            module.AcceleratorState._reset_state(reset_partial_state=True)
            module.GradientState._reset_state()

    reset()
    theirs = {kind: public_attributes(obj) for kind, obj in the_four(accelerate.Accelerator, accelerate_state).items()}
    reset()
    objects = the_four(triax_accelerate.Accelerator, triax_state)
    ours = {kind: public_attributes(obj) for kind, obj in objects.items()}
    yield theirs, ours, objects
    reset()


@pytest.mark.parametrize("kind", ["Accelerator", "AcceleratorState", "GradientState", "PartialState"])
def test_every_attribute_of_accelerates_object_is_there(kind, both):
    theirs, ours, _ = both
    missing = sorted(set(theirs[kind]) - set(ours[kind]))
    assert not missing, f"triax's {kind} lacks Accelerate's {missing}"


@pytest.mark.parametrize("kind", ["Accelerator", "AcceleratorState", "GradientState", "PartialState"])
def test_each_attribute_answers_as_accelerates(kind, both):
    theirs, ours, _ = both
    differ = []
    for name, (how, value) in theirs[kind].items():
        if name in NOT_COMPARED or name not in ours[kind]:
            continue
        our_how, our_value = ours[kind][name]
        if how == "raises":
            # The same built-in class a script would catch (triax's errors subclass it).
            builtin = next(base for base in value.__mro__ if base.__module__ == "builtins")
            if our_how != "raises" or not issubclass(our_value, builtin):
                differ.append(f"{name}: Accelerate raises {value.__name__}, triax gives {our_how} {our_value!r}")
        elif callable(value) and not isinstance(value, PLAIN):
            if not callable(our_value):
                differ.append(f"{name}: Accelerate's is callable, triax's is {our_value!r}")
        elif isinstance(value, PLAIN) and (our_how != "value" or our_value != value):
            differ.append(f"{name}: Accelerate {value!r}, triax {our_how} {our_value!r}")
    assert not differ, f"{kind}: " + "; ".join(differ)


def test_the_features_triax_leaves_out_read_as_off(both):
    *_, objects = both
    accelerator, state = objects["Accelerator"], objects["AcceleratorState"]
    from triax.accelerate.utils import DynamoBackend

    assert state.deepspeed_plugin is None and accelerator.deepspeed_plugin is None
    assert state.dynamo_plugin.backend == DynamoBackend.NO
    assert (accelerator.fp8_backend, accelerator.torch_device_mesh, accelerator.parallelism_config) == ("NO", None, None)
    with pytest.raises(ValueError, match="DeepSpeed is not enabled"):
        state.get_deepspeed_plugin("default")
    with pytest.raises(NotImplementedError, match="torch.profiler"):
        accelerator.profile()
    with accelerator.maybe_context_parallel():
        pass


def test_kwargs_handlers_and_the_step_counter_are_kept_as_accelerate_keeps_them(fresh_state):
    from triax.accelerate import Accelerator
    from triax.accelerate.utils import DistributedDataParallelKwargs, GradScalerKwargs

    ddp = DistributedDataParallelKwargs(find_unused_parameters=True)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, kwargs_handlers=[ddp, GradScalerKwargs()])
    assert accelerator.ddp_handler is ddp and accelerator.init_handler is None
    assert accelerator.gradient_state.plugin_kwargs == {"num_steps": 2}
    model = torch.nn.Linear(2, 1)
    loader = torch.utils.data.DataLoader(torch.zeros(6, 2), batch_size=2)
    model, loader = accelerator.prepare(model, loader)
    steps = []
    for _ in range(2):
        for batch in loader:
            with accelerator.accumulate(model):
                steps.append((accelerator.step, accelerator.sync_gradients))
    # Accelerate's counter: +1 per block, back to 0 on a dataloader's last batch (which syncs).
    assert steps == [(1, False), (2, True), (0, True)] * 2


def scheduler_after_accumulation(accelerator_class):
    accelerator = accelerator_class(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loader = torch.utils.data.DataLoader(torch.ones(8, 2), batch_size=2)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(batch).sum())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return scheduler.scheduler.state_dict(), accelerator.gradient_state.adjust_scheduler


def test_a_scheduler_under_accumulation_saves_what_accelerates_saves(fresh_state):
    """Accelerate reads adjust_scheduler from the plugin's changed fields (default False), so its
    scheduler's _step_count, which save_state writes, counts updates only."""
    import accelerate.state as accelerate_state

    from triax.accelerate import Accelerator

    theirs = scheduler_after_accumulation(accelerate.Accelerator)
    accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerate_state.GradientState._reset_state()
    ours = scheduler_after_accumulation(Accelerator)
    assert ours[0]["_step_count"] == theirs[0]["_step_count"] and ours == theirs
