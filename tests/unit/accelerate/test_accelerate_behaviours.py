"""The Accelerator's behaviours that Accelerate documents and its own unit tests check, each here in
triax's words: states after a reset, ACCELERATE_TORCH_DEVICE, the prepared marks, refusing a
quantized model with offloaded weights, save_model of a model whose weights offloading hooks hold,
pickling a prepared optimizer, a scheduler that skips with an overflowing optimizer, checkpoint
registration, unwrapping compiled models, trackers (start, registration, TensorBoard's folder, the
logging directory), and save_state whatever optimizers step whatever parameters."""

import copy
import os
import pickle

import pytest
import torch
from torch.utils.data import DataLoader


def test_states_after_a_reset_say_so_and_other_missing_names_do_not(fresh_state):
    from triax.accelerate import Accelerator, AcceleratorState, PartialState

    state = PartialState()
    with pytest.raises(AttributeError, match="'PartialState' object has no attribute 'nothing'") as caught:
        state.nothing
    assert "_reset_state" not in str(caught.value)
    PartialState._reset_state()
    with pytest.raises(AttributeError, match=r"`PartialState` object has no attribute `num_processes`.*"
                                             r"`PartialState._reset_state\(\)`"):
        state.num_processes
    state.nothing = "set after the reset"
    assert state.nothing == "set after the reset"

    accelerator = Accelerator(cpu=True)
    with pytest.raises(AttributeError, match="'AcceleratorState' object has no attribute 'other'"):
        accelerator.state.other
    AcceleratorState._reset_state()
    for name in ("num_processes", "process_index", "device", "distributed_type"):
        with pytest.raises(AttributeError, match=rf"`AcceleratorState` object has no attribute `{name}`.*"
                                                 r"`AcceleratorState._reset_state\(\)`"):
            getattr(accelerator, name)
    # Asked of the process state itself, as Accelerate's: these survive the reset.
    assert accelerator.is_main_process and accelerator.is_local_main_process


def test_accelerate_torch_device_names_the_device(fresh_state, monkeypatch):
    from triax.accelerate import Accelerator

    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu:64")
    assert str(Accelerator().device) == "cpu:64"


def test_what_prepare_made_is_marked_as_prepared(fresh_state):
    from triax.accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    other = [1, 2, 3]
    prepared = accelerator.prepare(model, optimizer, scheduler, DataLoader(list(range(4)), batch_size=2), other)
    assert [getattr(item, "_is_accelerate_prepared", False) for item in prepared] == [True, True, True, True, False]


def test_a_quantized_model_with_offloaded_weights_is_a_value_error(fresh_state):
    from triax.accelerate import Accelerator

    model = torch.nn.Linear(2, 2)
    model.is_loaded_in_8bit = True
    model.hf_device_map = {"": "cpu"}
    with pytest.raises(ValueError, match="CPU or disk offload"):
        Accelerator(cpu=True).prepare_model(model)


class Three(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = torch.nn.Linear(3, 4)
        self.batchnorm = torch.nn.BatchNorm1d(4)
        self.linear2 = torch.nn.Linear(4, 5)

    def forward(self, x):
        return self.linear2(self.batchnorm(self.linear1(x)))


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_save_model_reads_weights_that_offloading_hooks_hold(fresh_state, tmp_path, safe_serialization):
    big_modeling = pytest.importorskip("accelerate.big_modeling")
    from triax.accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = Three().eval()
    inputs = torch.randn(3, 3)
    expected = model(inputs)
    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    first, second = tmp_path / "first", tmp_path / "second"
    accelerator.save_model(model, str(first), safe_serialization=safe_serialization)
    # Accelerate's own dispatch: the batchnorm's weights go to disk, the rest stays in memory;
    # the model's parameters of offloaded modules are then on the meta device.
    big_modeling.load_checkpoint_and_dispatch(model, str(first), offload_folder=str(tmp_path / "offload"),
                                              device_map={"linear1": "cpu", "batchnorm": "disk", "linear2": "cpu"})
    assert any(tensor.is_meta for tensor in model.state_dict().values())
    state = accelerator.get_state_dict(model)
    assert state.keys() == original.keys() and all(torch.equal(state[k], original[k]) for k in original)
    accelerator.save_model(model, str(second), safe_serialization=safe_serialization)
    fresh = Three().eval()
    big_modeling.load_checkpoint_in_model(fresh, str(second))
    torch.testing.assert_close(fresh(inputs), expected, rtol=0, atol=0)


def test_a_prepared_optimizer_pickles_and_deep_copies(fresh_state):
    from triax.accelerate import Accelerator
    from triax.accelerate.optimizer import AcceleratedOptimizer

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=0.1))
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    for copied in (pickle.loads(pickle.dumps(optimizer)), copy.deepcopy(optimizer)):
        assert isinstance(copied, AcceleratedOptimizer)
        assert copied.gradient_state.__dict__ is accelerator.gradient_state.__dict__  # the process's shared one
        assert copied.num_steps == 1 and copied.param_groups[0]["lr"] == 0.1
        saved, mine = copied.state_dict()["state"], optimizer.state_dict()["state"]
        assert all(torch.equal(saved[k]["exp_avg"], mine[k]["exp_avg"]) for k in mine)


@pytest.mark.parametrize("step_with_optimizer", [True, False])
def test_a_scheduler_does_not_step_when_the_optimizer_overflowed(fresh_state, step_with_optimizer):
    from triax.accelerate import Accelerator

    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=step_with_optimizer)
    model = torch.nn.Linear(2, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda step: 1 - step / 10)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    optimizer._is_overflow = False  # Accelerate's field: what step_was_skipped reads
    scheduler.step()
    assert scheduler.get_last_lr()[0] == 0.9 and not optimizer.step_was_skipped
    optimizer._is_overflow = True
    assert optimizer.step_was_skipped and accelerator.optimizer_step_was_skipped
    scheduler.step()
    # Stepping with the optimizer, a skipped update does not advance the schedule.
    assert scheduler.get_last_lr()[0] == (0.9 if step_with_optimizer else 0.8)


def test_register_for_checkpointing_names_every_object_it_cannot_save(fresh_state):
    from triax.accelerate import Accelerator

    model = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match=r"Item at index 0 \(Tensor\), Item at index 1 \(Tensor\) lack") as caught:
        Accelerator(cpu=True).register_for_checkpointing(torch.ones(1), torch.ones(2), model,
                                                         torch.optim.SGD(model.parameters(), lr=1))
    assert "index 2" not in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("keep_torch_compile", [True, False])
def test_unwrap_model_keeps_or_removes_torch_compile_as_accelerate(fresh_state, keep_torch_compile):
    accelerate_utils = pytest.importorskip("accelerate.utils")
    from triax.accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    ours = accelerator.unwrap_model(torch.compile(torch.nn.DataParallel(model)), keep_torch_compile=keep_torch_compile)
    theirs = accelerate_utils.extract_model_from_parallel(torch.compile(torch.nn.DataParallel(model)),
                                                          keep_torch_compile=keep_torch_compile)
    assert type(ours) is type(theirs) and getattr(ours, "_orig_mod", ours) is getattr(theirs, "_orig_mod", theirs)
    assert accelerator.unwrap_model(model) is model


# ---- trackers ---------------------------------------------------------------------------------------


def _recording_tracker(base):
    class Recording(base):
        name = "recording"
        requires_logging_directory = False

        def __init__(self, run_name="unused", **kwargs):
            super().__init__()
            self.calls, self.run_name, self.kwargs = [], run_name, kwargs

        @property
        def tracker(self):
            return self

        def start(self):
            self.calls.append("start")

        def store_init_configuration(self, values):
            self.calls.append(("config", values))

        def log(self, values, step=None, **kwargs):
            self.calls.append(("log", values, step))

        def finish(self):
            self.calls.append("finish")

    return Recording


def _tracker_bases():
    from triax.accelerate.tracking import GeneralTracker

    bases = [GeneralTracker]
    try:
        from accelerate.tracking import GeneralTracker as AccelerateTracker
    except ImportError:
        return bases
    return bases + [AccelerateTracker]


@pytest.mark.parametrize("base", _tracker_bases(), ids=lambda base: base.__module__)
def test_a_tracker_object_is_started_before_it_is_used(fresh_state, base):
    from triax.accelerate import Accelerator

    tracker = _recording_tracker(base)()
    accelerator = Accelerator(cpu=True, log_with=tracker)
    accelerator.init_trackers("run", config={"lr": 0.1}, init_kwargs=None)
    accelerator.log({"loss": 1.0}, step=3, log_kwargs=None)
    accelerator.end_training()
    assert tracker.calls == ["start", ("config", {"lr": 0.1}), ("log", {"loss": 1.0}, 3), "finish"]


@pytest.mark.parametrize("registry", ["triax", "accelerate"])
def test_registered_tracker_classes_are_made_by_name(fresh_state, tmp_path, registry):
    from triax.accelerate import Accelerator
    from triax.accelerate import tracking

    module = tracking if registry == "triax" else pytest.importorskip("accelerate.tracking")
    before = dict(module.LOGGER_TYPE_TO_CLASS)
    Recording = _recording_tracker(module.GeneralTracker)
    try:
        module.register_tracker_class(Recording)
        accelerator = Accelerator(cpu=True, log_with="recording")
        accelerator.init_trackers("project", init_kwargs={"recording": {"tag": 1}})
        tracker = accelerator.get_tracker("recording")
        assert isinstance(tracker, Recording) and tracker.run_name == "project" and tracker.kwargs == {"tag": 1}
        assert tracker.calls == ["start"]
        Recording.requires_logging_directory = True
        with pytest.raises(ValueError, match="Logging with `recording` requires a `logging_dir`"):
            Accelerator(cpu=True, log_with="recording")
    finally:
        module.LOGGER_TYPE_TO_CLASS.clear()
        module.LOGGER_TYPE_TO_CLASS.update(before)


def test_register_tracker_class_refuses_what_is_not_a_tracker_and_warns_on_a_second_one():
    from triax.accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, register_tracker_class

    class Nameless(GeneralTracker):
        requires_logging_directory = False

    class NoFlag(GeneralTracker):
        name = "no_flag"

    for bad in (dict, Nameless, NoFlag):
        with pytest.raises(ValueError):
            register_tracker_class(bad)
    before = dict(LOGGER_TYPE_TO_CLASS)
    try:
        class Shadow(GeneralTracker):
            name = "tensorboard"
            requires_logging_directory = False

        with pytest.warns(UserWarning, match="'tensorboard' was registered already"):
            register_tracker_class(Shadow)
    finally:
        LOGGER_TYPE_TO_CLASS.clear()
        LOGGER_TYPE_TO_CLASS.update(before)
    with pytest.raises(NotImplementedError, match="lacks `name`"):
        GeneralTracker()


def test_tensorboard_needs_a_logging_dir_as_accelerate(fresh_state):
    from triax.accelerate import Accelerator

    with pytest.raises(ValueError, match="Logging with `tensorboard` requires a `logging_dir`"):
        Accelerator(cpu=True, log_with="tensorboard")


def test_tensorboard_writes_where_accelerate_writes(fresh_state, tmp_path):
    pytest.importorskip("tensorboard")
    accelerate_tracking = pytest.importorskip("accelerate.tracking")
    from accelerate.state import PartialState as AcceleratePartialState
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from triax.accelerate import Accelerator

    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path / "ours"))
    accelerator.init_trackers("run")
    AcceleratePartialState(cpu=True)  # Accelerate's tracker asks its own state who is main
    theirs = accelerate_tracking.TensorBoardTracker("run", str(tmp_path / "theirs"))
    theirs.start()
    trackers = [accelerator, theirs]
    for step, values in enumerate([{"loss": 0.5, "tensor": torch.tensor(1.0), "note": "text"},
                                   {"loss": 0.25, "pair": {"a": 1.0, "b": 2.0}}]):
        for tracker in trackers:
            tracker.log(values, step=step)
    accelerator.end_training()
    theirs.finish()
    results = []
    for side in ("ours", "theirs"):
        files = sorted(os.path.relpath(os.path.join(folder, name), tmp_path / side)
                       for folder, _, names in os.walk(tmp_path / side) for name in names)
        assert all(path.startswith(f"run{os.sep}") for path in files)  # <logging_dir>/<run>/, as Accelerate
        scalars = {}
        for folder in sorted({os.path.dirname(tmp_path / side / path) for path in files}):
            events = EventAccumulator(folder)
            events.Reload()
            relative = os.path.relpath(folder, tmp_path / side).split(os.sep)[1:]
            for tag in events.Tags()["scalars"]:
                scalars["/".join(relative + [tag])] = [(e.step, e.value) for e in events.Scalars(tag)]
        results.append(scalars)
    assert results[0] == results[1] and results[0]["loss"] == [(0, 0.5), (1, 0.25)]


# ---- save_state whatever the optimizers step --------------------------------------------------------


def _one_optimizer_over_two_models():
    first, second = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
    return [first, second, torch.optim.Adam([*first.parameters(), *second.parameters()], lr=0.1)]


def _two_optimizers_over_one_model():
    model = torch.nn.Linear(3, 2)
    return [model, torch.optim.Adam([model.weight], lr=0.1), torch.optim.SGD([model.bias], lr=0.1, momentum=0.9)]


def _an_optimizer_over_parameters_of_no_model():
    model = torch.nn.Linear(3, 2)
    scale = torch.nn.Parameter(torch.ones(2))
    return [model, torch.optim.Adam(model.parameters(), lr=0.1), torch.optim.Adam([scale], lr=0.1), scale]


@pytest.mark.parametrize("build", [_one_optimizer_over_two_models, _two_optimizers_over_one_model,
                                   _an_optimizer_over_parameters_of_no_model])
def test_save_state_takes_any_optimizer_layout_and_resumes_exactly(fresh_state, tmp_path, build):
    """Train 2 steps, save, train 2 more; a fresh run that loads the save and trains 2 more ends
    with the same parameters and optimizer states, bit for bit."""
    from triax.accelerate import Accelerator, AcceleratorState, GradientState

    def run(load_from=None, save_to=None):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        torch.manual_seed(0)
        objects = build()
        extra = [item for item in objects if isinstance(item, torch.nn.Parameter)]
        accelerator = Accelerator(cpu=True)
        prepared = accelerator.prepare(*[item for item in objects if item not in extra])
        models = [item for item in prepared if isinstance(item, torch.nn.Module)]
        optimizers = [item for item in prepared if isinstance(item, torch.optim.Optimizer)]
        if load_from:
            accelerator.load_state(load_from)
        for step in range(2 if load_from else 4):
            if step == 2 and save_to:
                accelerator.save_state(save_to)
            output = torch.ones(4, 3)
            for model in models:
                output = model(output)
            loss = output.pow(2).sum() + sum(parameter.pow(3).sum() for parameter in extra)
            accelerator.backward(loss)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        parameters = [p.detach().clone() for model in models for p in model.parameters()] + [
            p.detach().clone() for p in extra]
        states = [optimizer.state_dict()["state"] for optimizer in optimizers]
        return parameters, states

    straight = run(save_to=str(tmp_path / "checkpoint"))
    resumed = run(load_from=str(tmp_path / "checkpoint"))
    for mine, other in zip(straight[0], resumed[0]):
        assert torch.equal(mine, other)
    for mine, other in zip(straight[1], resumed[1]):
        assert mine.keys() == other.keys()
        for key in mine:
            assert all(torch.equal(torch.as_tensor(mine[key][name]), torch.as_tensor(other[key][name]))
                       for name in mine[key])
