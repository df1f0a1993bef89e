"""triax.accelerate against Hugging Face Accelerate's documented behaviour: imports, configuration
objects, sharding, accumulation, no_sync, join, triggers, ordering, checkpoint naming, hooks, and
failures that every process must raise together. The 2-process checks run in one launch per
implementation (tests/support/accelerate_scripts/surface.py); where Accelerate is installed the same
script also runs on it and the records must match."""

import base64
import datetime
import hashlib
import json
import os
import sys

import pytest
import torch

from support.forked import launch
from triax.testing import quiet_env
from support import ACCELERATE_SCRIPTS_DIR, REPO_DIR

ROOT = REPO_DIR
SURFACE = os.path.join(ACCELERATE_SCRIPTS_DIR, "surface.py")


def run_surface(out, impl, *extra):
    os.makedirs(out, exist_ok=True)
    launch(2, [SURFACE, "--impl", impl, "--out", str(out), *extra], env=quiet_env(PYTHONPATH=ROOT), timeout=420)
    return [json.load(open(os.path.join(out, f"rank_{rank}.json"))) for rank in (0, 1)]


@pytest.fixture(scope="module")
def triax_records(tmp_path_factory):
    out = tmp_path_factory.mktemp("surface_triax")
    return out, run_surface(out, "triax", "--hostile")


@pytest.mark.multiprocess
def test_surface_matches_accelerate_documented_behaviour(triax_records):
    _, (zero, one) = triax_records
    assert zero["process"] == [0, 2, True, False] and one["process"] == [1, 2, False, True]
    assert zero["distributed_type"] == ["MULTI_CPU", True, True]
    # 10 samples, 2 per process: the last global batch is padded from the start, and
    # gather_for_metrics drops the padding again, so every sample is counted once.
    assert zero["even"]["mine"] == [[0, 1], [4, 5], [8, 9]] and one["even"]["mine"] == [[2, 3], [6, 7], [0, 1]]
    for record in (zero, one):
        assert record["even"]["gathered"] == list(range(10)) == record["split"]["gathered"]
        assert record["even"]["ends"] == [False, False, True]
    # split_batches: batch_size 4 is the global batch, each process takes half.
    assert zero["split"]["mine"] == zero["even"]["mine"] and zero["split"]["len"] == 3
    # even_batches=False: 9 samples; process 1 gets one batch fewer.
    assert zero["uneven"] == {"len": 3, "mine": [[0, 1], [4, 5], [8]]}
    assert one["uneven"] == {"len": 2, "mine": [[2, 3], [6, 7]]}
    for record in (zero, one):
        # 5 batches, accumulation 2: sync on micro-steps 2 and 4, and on the last batch only when
        # sync_with_dataloader (the default); gradients agree across processes exactly then.
        assert record["accumulate"]["syncs"] == [False, True, False, True, True]
        assert record["accumulate"]["stepped"] == record["accumulate"]["syncs"] == record["accumulate"]["grads_equal"]
        assert record["accumulate_no_dataloader_sync"]["syncs"] == [False, True, False, True, False]
        assert record["accumulate_no_dataloader_sync"]["grads_equal"] == [False, True, False, True, False]
        # sync_each_batch: gradients are reduced on every micro-step, the optimizer still waits.
        assert record["accumulate_sync_each_batch"]["grads_equal"] == [True] * 5
        assert record["accumulate_sync_each_batch"]["stepped"] == [False, True, False, True, True]
        # As Accelerate: with split_batches=False a prepared scheduler steps once per process for
        # each real optimizer step (3 and 2 of them here, 2 processes), so a schedule written for
        # one process ends at the same sample count; scheduler_steps="per_update" steps once.
        assert record["accumulate"]["scheduler_steps"] == 3 * 2
        assert record["accumulate_no_dataloader_sync"]["scheduler_steps"] == 2 * 2
        assert record["triax_scheduler_per_update"] == 3
        assert record["no_sync"] == {"equal_after_no_sync": False, "equal_after_trigger": True}
        assert record["ddp_kwargs"] == [True, False]
        assert record["trigger_fired_at"] == 2 and record["trigger_after_reset"] is False
        assert record["order"] == ["0", "1"]
        checkpoints = record["checkpoints"]
        assert checkpoints["dirs"] == ["checkpoint_2", "checkpoint_3"]  # total_limit=2
        assert checkpoints["hooks"] == [["save", 1, 1, f"checkpoint_{i}"] for i in range(3)] + [["load", 1, "checkpoint_3"]]
        assert checkpoints["restored"] and checkpoints["iteration"] == 4
    # join_uneven_inputs(even_batches=False): 3 batches of 2 over 2 processes are 2 and 1, and
    # nobody hangs; after the block the loader pads again (2 batches each).
    assert (zero["join"], one["join"]) == ({"batches": 2, "len_after": 2}, {"batches": 1, "len_after": 2})
    assert zero["decorators"] == ["main", None, None, "local"] and one["decorators"] == [None, "last", "one", None]


@pytest.mark.multiprocess
def test_failures_are_raised_on_every_process(triax_records):
    _, records = triax_records
    for rank, record in enumerate(records):
        failures = record["failures"]
        for case in ("gather_trailing", "gather_dtype", "gather_keys", "reduce_shape"):
            kind, is_value_error, _, message = failures[case].split("|", 3)
            assert kind == "DistributedOperationException" and is_value_error == "True", (rank, case, failures[case])
            assert "different data on different processes" in message
        assert "[*, 3]" in failures["gather_trailing"] and "[*, 4]" in failures["gather_trailing"]
        assert "['a', 'c']" in failures["gather_keys"]
        assert failures["gather_first_dim_ok"] == "ok" and failures["still_in_step"] == "ok"
        assert "|True|" in failures["save_model"].replace("|False|True|", "|True|")
    zero, one = (record["failures"] for record in records)
    assert zero["main_process_first"].startswith("OSError") and "download failed" in zero["main_process_first"]
    assert one["main_process_first"].startswith("AcceleratorRuntimeError") and "rank 0 failed" in one["main_process_first"]
    assert "Not a directory" in zero["save_model"] or "NotADirectory" in zero["save_model"]
    assert one["save_model"].startswith("AcceleratorRuntimeError") and "rank 0 failed" in one["save_model"]
    # Process 1's RNG file was damaged: it reports the corruption, process 0 stops with it.
    # (a SnapshotCorruptError: its file no longer matches the manifest).
    assert one["load_state_one_rank"].startswith("PickledFileError") and "random_states_1" in one["load_state_one_rank"]
    # The reader agrees before loading: the other rank raises that the checkpoint failed there.
    assert zero["load_state_one_rank"].startswith("AcceleratorRuntimeError") and "rank 1 failed" in zero["load_state_one_rank"]


@pytest.mark.multiprocess
def test_same_records_and_weights_as_hf_accelerate(triax_records, tmp_path):
    pytest.importorskip("accelerate")
    triax_out, triax = triax_records
    accelerate = run_surface(tmp_path / "hf", "accelerate")
    for ours, theirs in zip(triax, accelerate):
        for key, value in theirs.items():
            if key == "join":
                # Accelerate 1.15 documents that join_uneven_inputs(even_batches=False) overrides
                # the prepared dataloaders, but on this setup its loader still pads (2 batches on
                # both processes); triax follows the documentation (checked above).
                continue
            assert ours[key] == value, key
    ours = json.load(open(triax_out / "weights.json"))
    theirs = json.load(open(tmp_path / "hf" / "weights.json"))
    assert ours.keys() == theirs.keys()
    for name in ours:  # same arithmetic in the same order: equal to the bit
        assert torch.equal(torch.tensor(ours[name]), torch.tensor(theirs[name])), name


# ---- one process ------------------------------------------------------------------------------------


def test_imports_mirror_accelerate():
    from triax.accelerate import Accelerator, PartialState, notebook_launcher  # noqa: F401
    from triax.accelerate.utils import (  # noqa: F401
        DataLoaderConfiguration,
        DistributedDataParallelKwargs,
        DistributedType,
        GradientAccumulationPlugin,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ProjectConfiguration,
        broadcast_object_list,
        find_executable_batch_size,
        gather_object,
        set_seed,
        skip_first_batches,
    )

    assert DistributedType.MULTI_GPU == "MULTI_GPU" and json.dumps(DistributedType.NO) == '"NO"'
    assert DistributedDataParallelKwargs(find_unused_parameters=True).to_kwargs() == {"find_unused_parameters": True}


@pytest.mark.parametrize("arguments, names", [
    ({"deepspeed_plugin": object()}, "fsdp"),
    ({"megatron_lm_plugin": object()}, "tp"),
    ({"mixed_precision": "fp8"}, "bf16"),
    ({"parallelism_config": object()}, "triax train"),
])
def test_unsupported_features_fail_at_construction_naming_the_alternative(arguments, names):
    from triax.accelerate import Accelerator
    from triax.errors import TriaxError

    with pytest.raises(NotImplementedError) as caught:
        Accelerator(**arguments)
    assert isinstance(caught.value, TriaxError) and names in str(caught.value)


def test_configuration_objects_and_bad_values():
    from triax.accelerate import Accelerator
    from triax.accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True, even_batches=False),
                              gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3,
                                                                                      sync_with_dataloader=False),
                              project_config=ProjectConfiguration(project_dir="/nowhere/p", total_limit=2))
    assert accelerator.split_batches and not accelerator.even_batches
    assert accelerator.gradient_accumulation_steps == 3 and not accelerator.gradient_state.sync_with_dataloader
    assert accelerator.project_dir == accelerator.logging_dir == "/nowhere/p"
    assert accelerator.state.distributed_type == "NO" and accelerator.state.num_processes == 1
    with pytest.raises(ValueError, match="not both"):
        Accelerator(gradient_accumulation_steps=2, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    with pytest.raises(ValueError, match="total_limit"):
        Accelerator(project_config=ProjectConfiguration(project_dir="/p", total_limit=0))
    with pytest.raises(TypeError, match="DataLoaderConfiguration"):
        Accelerator(dataloader_config=42)
    dispatching = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    from torch.utils.data import DataLoader

    assert type(dispatching.prepare(DataLoader(list(range(4))))).__name__ == "DataLoaderDispatcher"


def test_accelerate_launch_environment_is_read(monkeypatch):
    from triax.accelerate import Accelerator

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "3")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    accelerator = Accelerator()
    assert (accelerator.parallel, accelerator.gradient_accumulation_steps, accelerator.mixed_precision) == ("fsdp", 3, "bf16")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(NotImplementedError, match="DeepSpeed"):
        Accelerator()


def test_accelerate_own_configuration_objects_are_accepted():
    accelerate_utils = pytest.importorskip("accelerate.utils")
    from triax.accelerate import Accelerator

    accelerator = Accelerator(
        dataloader_config=accelerate_utils.DataLoaderConfiguration(even_batches=False),
        gradient_accumulation_plugin=accelerate_utils.GradientAccumulationPlugin(num_steps=4, adjust_scheduler=False),
        project_config=accelerate_utils.ProjectConfiguration(project_dir="/p", automatic_checkpoint_naming=True),
        kwargs_handlers=[accelerate_utils.DistributedDataParallelKwargs(find_unused_parameters=True),
                         accelerate_utils.InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=30))])
    assert not accelerator.even_batches and accelerator.gradient_accumulation_steps == 4
    assert accelerator.project_configuration.automatic_checkpoint_naming
    assert accelerator._ddp_options == {"find_unused_parameters": True}
    assert accelerator.distributed_type == accelerate_utils.DistributedType.NO


def test_prepare_twice_returns_the_same_objects(tmp_path):
    from torch.utils.data import DataLoader

    from triax.accelerate import Accelerator

    accelerator = Accelerator(project_dir=str(tmp_path))
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    loader = DataLoader(list(range(4)), batch_size=2)
    prepared = accelerator.prepare(model, optimizer, loader)
    again = accelerator.prepare(model, optimizer, loader)
    assert all(a is b for a, b in zip(prepared[:2], again[:2])) and accelerator.prepare(prepared[0]) is prepared[0]
    assert len(accelerator._models) == len(accelerator._optimizers) == 1
    # As Accelerate: a DataLoader prepared twice is two loaders; a prepared one is returned as it is.
    assert again[2] is not prepared[2] and accelerator.prepare(prepared[2]) is prepared[2]
    assert len(accelerator._dataloaders) == 2
    accelerator.save_state()


def _rewrite_state(snapshot, edit):
    """Edit state.json and keep the manifest consistent, as a hostile writer would."""
    path = os.path.join(snapshot, "state.json")
    document = json.load(open(path))
    edit(document["accelerator"])
    data = json.dumps(document).replace('"DEEP"', "[" * 100000 + "]" * 100000).encode()
    open(path, "wb").write(data)
    manifest_path = os.path.join(snapshot, "manifest.json")
    manifest = json.load(open(manifest_path))
    manifest["files"]["state.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    json.dump(manifest, open(manifest_path, "w"))


def _scaler_tensor(state, value):
    state["custom"] = [value]


@pytest.mark.parametrize("edit", [
    lambda s: _scaler_tensor(s, {"__tensor__": "", "dtype": "load", "shape": [1]}),
    lambda s: _scaler_tensor(s, {"__tensor__": "", "dtype": "float32", "shape": [10**9, 10**6]}),
    lambda s: _scaler_tensor(s, {"__tensor__": base64.b64encode(b"1234").decode(), "dtype": "float32", "shape": [2]}),
    lambda s: _scaler_tensor(s, {"__items__": 5}),
    lambda s: s.update(num_models="abc"),
    lambda s: s.pop("dataloaders"),
    lambda s: s.update(dataloaders=[5]),
    lambda s: _scaler_tensor(s, "DEEP"),
    lambda s: s.update(dataloaders=[{"_num_yielded": 10**40}]),
])
def test_hostile_state_json_is_one_clear_error(tmp_path, edit):
    from torch.utils.data import DataLoader

    from triax.accelerate import Accelerator
    from triax.accelerate._internal import saving
    from triax.checkpoint import SnapshotCorruptError

    class Counter:
        def __init__(self):
            self.value = torch.zeros(1)

        def state_dict(self):
            return {"value": self.value}

        def load_state_dict(self, state):
            self.value = state["value"]

    accelerator = Accelerator()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer, _ = accelerator.prepare(model, optimizer, DataLoader(list(range(4)), batch_size=2))
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    # A triax snapshot, as triax's older versions wrote save_state (every time, and under FSDP
    # until it wrote Accelerate's FSDP layout): load_state still reads them, through this
    # validating reader.
    snapshot = saving.save_state(accelerator._state_saving.checkpointed, str(tmp_path), 0, [0])
    _rewrite_state(snapshot, edit)
    with pytest.raises((SnapshotCorruptError, ValueError)) as caught:
        accelerator.load_state(str(tmp_path))
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400
    assert torch.equal(counter.value, torch.zeros(1))  # nothing was applied


def test_find_executable_batch_size_reduces_on_out_of_memory():
    from triax.accelerate.utils import find_executable_batch_size

    tried = []

    @find_executable_batch_size(starting_batch_size=10)
    def train(batch_size, scale):
        tried.append(batch_size)
        if batch_size > 7:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")
        return batch_size * scale

    assert train(2) == 14 and tried == [10, 9, 8, 7]
    with pytest.raises(TypeError):
        train(8, 2)


@pytest.mark.multiprocess
def test_notebook_launcher_runs_processes_with_the_process_group_timeout(tmp_path):
    script = tmp_path / "notebook.py"
    script.write_text(f"""
import datetime, json, sys, torch, torch.distributed as dist
from triax.accelerate import Accelerator, notebook_launcher
from triax.accelerate.utils import InitProcessGroupKwargs

def train(out):
    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=77))])
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    total = accelerator.reduce(torch.ones(1)).item()
    with open(f"{{out}}/{{accelerator.process_index}}.json", "w") as handle:
        json.dump([accelerator.num_processes, total, backend.options._timeout.total_seconds()], handle)

def fails():
    raise ValueError("boom")

notebook_launcher(train, ({str(tmp_path)!r},), num_processes=2)
try:
    notebook_launcher(fails, num_processes=2)
except RuntimeError as error:
    print("raised:", error)
""")
    from triax.testing import run

    result = run([sys.executable, str(script)], env=quiet_env(PYTHONPATH=ROOT), timeout=240)
    for rank in (0, 1):
        assert json.load(open(tmp_path / f"{rank}.json")) == [2, 2.0, 77.0]
    assert "raised:" in result.stdout and "boom" in result.stdout


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_goes_through_triax_parallel_and_matches_torch(norm_type):
    from triax.accelerate import Accelerator

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)))
    reference = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    reference.load_state_dict(model.state_dict())
    inputs = torch.randn(4, 5)
    for net in (model, reference):
        net(inputs).pow(2).sum().backward()
    ours = accelerator.clip_grad_norm_(model.parameters(), 0.1, norm_type=norm_type)
    theirs = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1, norm_type=norm_type)
    # Same formula; the order of the additions may differ (groups, then their sum): a few ulps.
    torch.testing.assert_close(ours, theirs, rtol=8 * torch.finfo(torch.float32).eps, atol=0)
    for mine, other in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, other.grad, rtol=8 * torch.finfo(torch.float32).eps, atol=0)
