"""Accelerator.save_state / load_state in Accelerate's folder layout (triax/accelerate/_internal/accelerate_folder.py):
what is written, what is read back, and hostile or damaged folders refused in one line before
anything changes. The runs crossing between Accelerate and triax bitwise are in
test_accelerate_same_numbers.py."""

import copy
import os

import pytest
import torch

from support.accelerator_checkpoints import Counter, prepared
from triax.accelerate import Accelerator
from triax.checkpoint import SnapshotCorruptError
from triax.interop.shared.pickled import pickled_bytes

pytestmark = pytest.mark.usefixtures("fresh_state")


class Tied(torch.nn.Module):
    """A head that shares the embedding's weight, as GPT-2's does."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens):
        return self.head(self.embedding(tokens))


def train_step(model, optimizer, scheduler, accelerator):
    inputs = torch.tensor([0, 1, 2]) if isinstance(accelerator.unwrap_model(model), Tied) else torch.randn(4, 3)
    accelerator.backward(model(inputs).square().mean())
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_save_state_writes_accelerates_files_and_load_state_restores_every_one(tmp_path, safe_serialization):
    accelerator, model, optimizer, scheduler, counter, _ = prepared(Tied())
    train_step(model, optimizer, scheduler, accelerator)
    counter.count = 7
    folder = accelerator.save_state(str(tmp_path / "step_1"), safe_serialization=safe_serialization)
    weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    assert sorted(os.listdir(folder)) == sorted([weights, "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
                                                 "custom_checkpoint_0.pkl", "triax_manifest.json"])
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer_state, scheduler_state = copy.deepcopy(optimizer.state_dict()), scheduler.state_dict()
    draw = torch.rand(3)

    train_step(model, optimizer, scheduler, accelerator)
    counter.count = 0
    accelerator.load_state(folder)
    assert all(model.state_dict()[name].equal(tensor) for name, tensor in expected.items())
    assert model.head.weight is model.embedding.weight  # still tied after loading one copy
    assert scheduler.state_dict() == scheduler_state and counter.count == 7
    assert optimizer.state_dict()["state"][0]["exp_avg"].equal(optimizer_state["state"][0]["exp_avg"])
    assert torch.rand(3).equal(draw)  # the random states as they were at save time


def hostile_pickle(marker):
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    return pickled_bytes({"state": Payload()})


@pytest.mark.parametrize("name", ["optimizer.bin", "scheduler.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl",
                                  "pytorch_model.bin"])
def test_a_pickle_calling_os_system_is_refused_in_one_line_and_never_runs(tmp_path, name):
    accelerator, model, optimizer, scheduler, counter, _ = prepared()
    folder = accelerator.save_state(str(tmp_path / "ckpt"), safe_serialization=name != "pytorch_model.bin")
    os.remove(os.path.join(folder, "triax_manifest.json"))  # as Accelerate writes it: no manifest
    marker = tmp_path / "ran"
    with open(os.path.join(folder, name), "wb") as handle:
        handle.write(hostile_pickle(marker))
    before = model.weight.detach().clone()
    with pytest.raises(SnapshotCorruptError) as raised:
        accelerator.load_state(folder)
    message = str(raised.value)
    assert "\n" not in message and name in message and "system" in message and "weights-only" in message
    assert not marker.exists() and model.weight.equal(before)


def test_a_file_changed_after_the_manifest_was_written_is_refused(tmp_path):
    accelerator, model, optimizer, scheduler, counter, _ = prepared()
    folder = accelerator.save_state(str(tmp_path / "ckpt"))
    with open(os.path.join(folder, "scheduler.bin"), "wb") as handle:
        handle.write(pickled_bytes({**scheduler.state_dict(), "last_epoch": 3}))
    with pytest.raises(SnapshotCorruptError, match="scheduler.bin does not match the sha256"):
        accelerator.load_state(folder)


@pytest.mark.parametrize("replace", ["symlink", "fifo", "directory"])
def test_a_link_fifo_or_directory_in_place_of_a_file_is_refused(tmp_path, replace):
    accelerator, model, optimizer, scheduler, counter, _ = prepared()
    folder = accelerator.save_state(str(tmp_path / "ckpt"))
    target = os.path.join(folder, "optimizer.bin")
    os.rename(target, tmp_path / "elsewhere.bin")
    {"symlink": lambda: os.symlink(tmp_path / "elsewhere.bin", target), "fifo": lambda: os.mkfifo(target),
     "directory": lambda: os.mkdir(target)}[replace]()
    with pytest.raises(OSError, match="optimizer.bin"):
        accelerator.load_state(folder)


@pytest.mark.parametrize("edit", [
    lambda state: state.update(last_epoch="abc"),
    lambda state: state.update(base_lrs=[float("nan")]),
    lambda state: state.update(base_lrs=[float("inf")]),
])
def test_numbers_out_of_range_in_a_scheduler_file_are_refused_before_anything_loads(tmp_path, edit):
    accelerator, model, optimizer, scheduler, counter, _ = prepared()
    folder = accelerator.save_state(str(tmp_path / "ckpt"))
    os.remove(os.path.join(folder, "triax_manifest.json"))
    state = scheduler.state_dict()
    edit(state)
    with open(os.path.join(folder, "scheduler.bin"), "wb") as handle:
        handle.write(pickled_bytes(state))
    optimizer.param_groups[0]["lr"] = 0.5
    with pytest.raises((SnapshotCorruptError, ValueError)):
        accelerator.load_state(folder)
    assert optimizer.param_groups[0]["lr"] == 0.5  # nothing was loaded


def test_a_stateful_dataloader_position_beyond_its_epoch_is_refused(tmp_path):
    """A saved StatefulDataLoader position is fast-forwarded through on the next pass: a count
    larger than the epoch (2**40 batches) would keep the run busy for ever, so it is refused."""
    pytest.importorskip("torchdata.stateful_dataloader")
    accelerator, model, optimizer, scheduler, counter, loader = prepared(stateful=True)
    next(iter(loader))
    folder = accelerator.save_state(str(tmp_path / "ckpt"))
    assert os.path.isfile(os.path.join(folder, "dl_state_dict.bin"))
    os.remove(os.path.join(folder, "triax_manifest.json"))
    state = loader.state_dict()
    state["_sampler_iter_yielded"] = 2**40
    with open(os.path.join(folder, "dl_state_dict.bin"), "wb") as handle:
        handle.write(pickled_bytes(state))
    with pytest.raises(SnapshotCorruptError, match="1099511627776"):
        accelerator.load_state(folder)


def test_registered_objects_must_match_the_custom_checkpoints(tmp_path):
    accelerator, model, optimizer, scheduler, counter, _ = prepared()
    folder = accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator.register_for_checkpointing(Counter())
    with pytest.raises(RuntimeError, match="1 custom_checkpoint_<i>.pkl files but 2 objects"):
        accelerator.load_state(folder)


def test_a_model_of_another_shape_is_refused_in_one_line(tmp_path):
    accelerator, model, optimizer, scheduler, counter, _ = prepared()
    folder = accelerator.save_state(str(tmp_path / "ckpt"))
    from safetensors.torch import save_file

    os.remove(os.path.join(folder, "triax_manifest.json"))
    save_file({"weight": torch.zeros(4, 3), "bias": torch.zeros(2)}, os.path.join(folder, "model.safetensors"))
    with pytest.raises(ValueError, match=r"weight has shape \(4, 3\) but the prepared model's is \(2, 3\)"):
        accelerator.load_state(folder)


def test_automatic_naming_keeps_total_limit_folders_and_loads_the_newest(tmp_path):
    from triax.accelerate import ProjectConfiguration

    accelerator = Accelerator(project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2))
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    for value in range(3):
        with torch.no_grad():
            model.weight.fill_(value)
        accelerator.save_state()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]
    with torch.no_grad():
        model.weight.fill_(9)
    accelerator.load_state()
    assert model.weight.eq(2).all()


def test_several_models_and_optimizers_take_accelerates_numbered_names(tmp_path):
    accelerator = Accelerator()
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 3)
    prepared = accelerator.prepare(first, second, torch.optim.SGD(first.parameters(), lr=0.1),
                                   torch.optim.Adam(second.parameters(), lr=0.1))
    folder = accelerator.save_state(str(tmp_path / "ckpt"), safe_serialization=False)
    assert sorted(os.listdir(folder)) == ["optimizer.bin", "optimizer_1.bin", "pytorch_model.bin",
                                          "pytorch_model_1.bin", "random_states_0.pkl", "triax_manifest.json"]
    expected = [model.weight.detach().clone() for model in prepared[:2]]
    with torch.no_grad():
        for model in prepared[:2]:
            model.weight.zero_()
    accelerator.load_state(folder)
    assert all(model.weight.equal(weight) for model, weight in zip(prepared[:2], expected))
