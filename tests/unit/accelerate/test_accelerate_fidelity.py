"""The Accelerator door behaves as Hugging Face Accelerate does where a drop-in needs it: its enum,
its exceptions, its reductions and their defaults, its state resets, fp16 on CPU, the loader's own
sample order, batch samplers and iterable datasets. Where Accelerate is installed its own objects
are the reference."""

import inspect
import os

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from support.forked import launch
from triax.testing import quiet_env
from support import ACCELERATE_SCRIPTS_DIR, REPO_DIR

ROOT = REPO_DIR


def test_distributed_type_has_every_member_of_accelerate():
    accelerate_utils = pytest.importorskip("accelerate.utils")
    from triax.accelerate.utils import DistributedType

    assert [m.value for m in DistributedType] == [m.value for m in accelerate_utils.DistributedType]


def test_structure_mismatch_error_is_accelerate_exception_and_value_error():
    """Where the script imported Accelerate (triax itself never does), the error raised is also
    Accelerate's class, so a script that kept Accelerate's `except` catches it."""
    operations = pytest.importorskip("accelerate.utils.operations")
    from triax.accelerate._internal.errors import distributed_operation_error
    from triax.accelerate.utils import DistributedOperationException

    error = distributed_operation_error("shapes differ")
    assert isinstance(error, (operations.DistributedOperationException)) and isinstance(error, ValueError)
    assert isinstance(error, DistributedOperationException) and str(error) == "shapes differ"
    assert type(distributed_operation_error("again")) is type(error)  # one class, made once


def test_reduce_defaults_and_reductions_follow_accelerate(fresh_state):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils import operations

    from triax.accelerate import Accelerator
    from triax.accelerate.utils import reduce

    default = inspect.signature(reduce).parameters["reduction"].default
    assert default == inspect.signature(operations.reduce).parameters["reduction"].default == "mean"
    assert (inspect.signature(Accelerator.reduce).parameters["reduction"].default
            == inspect.signature(accelerate.Accelerator.reduce).parameters["reduction"].default == "sum")
    tensor = torch.tensor([1.0, 5.0])
    for reduction in ("mean", "sum", "max", "none"):
        assert torch.equal(reduce(tensor, reduction), tensor)  # one process: every reduction is a copy
    with pytest.raises(ValueError, match="'min'"):
        reduce(tensor, "min")


def test_reset_state_keeps_process_information_and_stops_prepare(fresh_state):
    from triax.accelerate import Accelerator, AcceleratorState, GradientState, PartialState

    accelerator = Accelerator(cpu=True)
    AcceleratorState._reset_state()
    assert PartialState().is_local_main_process and accelerator.is_local_main_process
    with pytest.raises(AttributeError, match=r"AcceleratorState._reset_state\(\)"):
        accelerator.prepare(torch.nn.Linear(1, 1))
    Accelerator(cpu=True, gradient_accumulation_steps=3)
    assert GradientState().num_steps == 3  # shared, as Accelerate's
    GradientState._reset_state()
    assert GradientState().num_steps == 1
    AcceleratorState._reset_state(reset_partial_state=True)
    assert not PartialState._shared_state


def test_fp16_on_cpu_is_accepted_and_computes_in_fp32_as_accelerate(fresh_state):
    from triax.accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    assert accelerator.mixed_precision == "fp16" and accelerator.scaler is None  # as Accelerate's
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    assert model(torch.ones(1, 3)).dtype == torch.float32


def test_scheduler_steps_and_data_order_are_checked(fresh_state):
    from triax.accelerate import Accelerator

    with pytest.raises(ValueError, match="scheduler_steps='twice'"):
        Accelerator(cpu=True, scheduler_steps="twice")
    with pytest.raises(ValueError, match="data_order='random'"):
        Accelerator(cpu=True, data_order="random")


def test_shuffled_loader_draws_the_plain_dataloader_order(fresh_state):
    # One process: the prepared loader hands out what the plain DataLoader does with the same
    # generator, pass after pass (the order comes from the loader's own generator).
    from triax.accelerate import Accelerator

    def batches(loader, generator, passes=2):
        generator.manual_seed(7)
        return [batch.tolist() for _ in range(passes) for batch in loader]

    generator = torch.Generator()
    plain = batches(DataLoader(list(range(10)), batch_size=3, shuffle=True, generator=generator), generator)
    prepared = Accelerator(cpu=True).prepare(DataLoader(list(range(10)), batch_size=3, shuffle=True,
                                                        generator=generator))
    assert batches(prepared, generator) == plain
    seeded = Accelerator(cpu=True, data_order="seeded").prepare(
        DataLoader(list(range(10)), batch_size=3, shuffle=True, generator=generator))
    assert sorted(sum(batches(seeded, generator, 1), [])) == list(range(10))


def test_seedable_sampler_order_equals_accelerate(fresh_state):
    data_loader = pytest.importorskip("accelerate.data_loader")
    from triax.accelerate.utils import SeedableRandomSampler

    ours = SeedableRandomSampler(range(20), data_seed=3)
    theirs = data_loader.SeedableRandomSampler(data_source=range(20), data_seed=3)
    for _ in range(3):  # each pass moves to the next epoch
        assert list(ours) == list(theirs)


def test_batch_sampler_and_iterable_dataset_are_prepared(fresh_state):
    # One process, as Accelerate: the user's own batch sampler, and the stream batched as it is.
    from triax.accelerate.utils import DataLoaderShard, prepare_data_loader

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(7)

    sampler = BatchSampler(RandomSampler(range(10)), batch_size=4, drop_last=False)
    prepared = prepare_data_loader(DataLoader(list(range(10)), batch_sampler=sampler))
    assert isinstance(prepared, DataLoaderShard) and prepared.batch_sampler is sampler
    assert sorted(sum((b.tolist() for b in prepared), [])) == list(range(10))
    stream = prepare_data_loader(DataLoader(Stream(), batch_size=3))
    assert [b.tolist() for b in stream] == [[0, 1, 2], [3, 4, 5], [6]]


@pytest.mark.multiprocess
def test_two_processes_follow_accelerate(tmp_path):
    """2 processes: the shuffled order is the one-process order, batch samplers and streams are
    shared out batch by batch, reduce takes the max, RNG states are synchronised, and a shape
    mismatch is Accelerate's exception (tests/support/accelerate_scripts/fidelity.py)."""
    script = os.path.join(ACCELERATE_SCRIPTS_DIR, "fidelity.py")
    launch(2, [script, str(tmp_path)], env=quiet_env(PYTHONPATH=ROOT), timeout=300)
    for rank in (0, 1):
        assert (tmp_path / f"ok_{rank}").read_text() == "ok"


def test_a_dataloader_in_the_middle_of_a_pass_does_not_outlive_its_owner(fresh_state):
    """The GradientState (shared for the whole process) knows the dataloader being iterated only
    by a weak reference: dropping the object that holds the Accelerator, the loader and a paused
    pass frees all three at once, without waiting for the garbage collector."""
    import gc
    import weakref

    from triax.accelerate import Accelerator

    class Owner:
        def __init__(self):
            self.accelerator = Accelerator()
            self.loader = self.accelerator.prepare(DataLoader(list(range(16)), batch_size=4))
            self.batches = iter(self.loader)

    owner = Owner()
    assert next(owner.batches).tolist() == [0, 1, 2, 3]
    assert owner.accelerator.gradient_state.active_dataloader is owner.loader
    references = [weakref.ref(owner.accelerator), weakref.ref(owner.loader)]
    gc.disable()
    try:
        del owner
        assert [reference() for reference in references] == [None, None]
    finally:
        gc.enable()


def test_a_stateful_dataloader_resumes_where_it_was_saved(fresh_state, tmp_path):
    """use_stateful_dataloader=True: the loader is a torchdata StatefulDataLoader whose position
    save_state keeps; after load_state its next pass continues after the batch last handed out
    (it reads one batch ahead, which must not count). Without it nothing of the data is saved."""
    pytest.importorskip("torchdata.stateful_dataloader")
    from torchdata.stateful_dataloader import StatefulDataLoader

    from triax.accelerate import Accelerator, DataLoaderConfiguration

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    loader = accelerator.prepare(DataLoader(list(range(10)), batch_size=2))
    assert isinstance(loader, StatefulDataLoader)
    batches = iter(loader)
    for _ in range(2):
        next(batches)
    accelerator.save_state(str(tmp_path / "state"))
    rest = [batch.tolist() for batch in batches]
    assert rest == [[4, 5], [6, 7], [8, 9]]
    accelerator.load_state(str(tmp_path / "state"))
    assert [batch.tolist() for batch in loader] == rest
    assert [batch.tolist() for batch in loader][:1] == [[0, 1]]  # the pass after that is a whole one


def test_accelerate_helpers_kept_by_the_script_see_triax_accelerator(fresh_state, recwarn):
    """A script that switched only its Accelerator to triax's may keep Accelerate's own helpers;
    they ask Accelerate's AcceleratorState, which triax's Accelerator sets up for the same job."""
    accelerate_state = pytest.importorskip("accelerate.state")
    from accelerate.utils import gather
    from triax.accelerate import Accelerator
    from triax.accelerate.state import AcceleratorState

    accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(ValueError, match="initialize your accelerator"):
        accelerate_state.AcceleratorState()  # Accelerate's own rule without any Accelerator
    accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)  # its half-made state
    accelerator = Accelerator(mixed_precision="bf16")
    theirs = accelerate_state.AcceleratorState()
    assert (theirs.num_processes, theirs.process_index, theirs.mixed_precision) == (1, 0, "bf16")
    assert theirs.device == accelerator.device
    assert torch.equal(gather(torch.arange(3)), torch.arange(3))
    # A reset of triax's state resets Accelerate's, so the next Accelerator may choose again.
    AcceleratorState._reset_state()
    Accelerator(mixed_precision="no")
    assert accelerate_state.AcceleratorState().mixed_precision == "no"
    assert not [w for w in recwarn if "helpers will not see" in str(w.message)]


def test_a_resumed_loader_keeps_its_batch_metadata_and_settings_as_accelerate(fresh_state):
    """skip_first_batches (Accelerate 1.16): the loader it makes counts the global batch, the remainder and
    drop_last as the loader it resumes, and keeps its non-blocking copies and its mesh."""
    theirs = pytest.importorskip("accelerate.data_loader")
    from triax.accelerate import data_loader as ours

    for drop_last in (False, True):
        resumed = []
        for library in (ours, theirs):
            loader = library.prepare_data_loader(DataLoader(range(10), batch_size=2, drop_last=drop_last),
                                                 num_processes=2, process_index=0)
            loader = library.skip_first_batches(loader, num_batches=1)
            batches = [batch.tolist() for batch in loader]
            resumed.append((loader.total_batch_size, batches, loader.remainder, loader._drop_last))
        assert resumed[0] == resumed[1], drop_last
    for name in ("DataLoaderShard", "DataLoaderDispatcher"):
        loader = getattr(ours, name)(list(range(16)), batch_size=4, _drop_last=True, _non_blocking=True)
        loader = ours.skip_first_batches(loader, num_batches=1)
        assert (loader._drop_last, loader._non_blocking, loader.torch_device_mesh) == (True, True, None), name
