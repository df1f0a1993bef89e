"""triax.accelerate.utils' helpers against accelerate.utils': the same inputs give the same outputs
(nested data, environment, versions, probes, constants), and the behaviours Accelerate documents
for the rest (out-of-memory messages, nested tensors, kernel warning, shared tensors, unwrapping)."""

import collections
import logging
import os
import pickle
from unittest import mock

import pytest
import torch

from triax.accelerate import utils as ours

theirs = pytest.importorskip("accelerate.utils", reason="Accelerate is in the test extras")

Pair = collections.namedtuple("Pair", "a b")


def same(a, b) -> bool:
    """Equal values, containers of the same types, tensors equal in dtype and values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, collections.abc.Mapping):
        return list(a.keys()) == list(b.keys()) and all(same(a[k], b[k]) for k in a.keys())
    return a == b


NESTED = [
    torch.arange(6).reshape(3, 2),
    (torch.ones(2, dtype=torch.float16), [torch.zeros(2, 1, dtype=torch.bfloat16), 1], "x"),
    {"a": torch.ones(4, 2), "b": [torch.arange(4), {"c": torch.tensor(2.5)}], "n": None},
    Pair(a=torch.ones(2, 3), b=[torch.ones(2), 3]),
    collections.UserDict({"ids": torch.arange(3), "mask": torch.ones(3, dtype=torch.bool)}),
    collections.OrderedDict(x=torch.ones(1, dtype=torch.float64)),
]


@pytest.mark.parametrize("data", NESTED, ids=[f"nested{i}" for i in range(len(NESTED))])
def test_nested_helpers_equal_accelerates(data):
    double = lambda tensor: tensor * 2  # noqa: E731
    assert same(ours.recursively_apply(double, data), theirs.recursively_apply(double, data))
    assert same(ours.send_to_device(data, "cpu"), theirs.send_to_device(data, "cpu"))
    assert same(ours.listify(data), theirs.listify(data))
    assert same(ours.convert_to_fp32(data), theirs.convert_to_fp32(data))
    assert ours.find_device(data) == theirs.find_device(data)
    assert ours.ignorant_find_batch_size(data) == theirs.ignorant_find_batch_size(data)
    if _concatenable(data):
        assert same(ours.concatenate([data, data]), theirs.concatenate([data, data]))


def _concatenable(data) -> bool:
    flat = []
    theirs.recursively_apply(lambda tensor: flat.append(tensor), data, test_type=lambda x: True)
    return all(isinstance(item, torch.Tensor) and item.dim() for item in flat)


def test_nested_helpers_edge_cases_equal_accelerates():
    with pytest.raises(TypeError) as mine:
        ours.recursively_apply(torch.tensor, (torch.tensor(1), 1), error_on_other_type=True)
    with pytest.raises(TypeError) as original:
        theirs.recursively_apply(torch.tensor, (torch.tensor(1), 1), error_on_other_type=True)
    assert str(mine.value) == str(original.value)
    batch = {"keep": torch.ones(2), "also": [torch.ones(1)]}
    assert same(ours.send_to_device(batch, "cpu", skip_keys="keep"), theirs.send_to_device(batch, "cpu",
                                                                                          skip_keys="keep"))
    for bad in ([], {}, "text"):
        assert ours.ignorant_find_batch_size(bad) is theirs.ignorant_find_batch_size(bad) is None
    assert same(ours.concatenate([5]), theirs.concatenate([5]))
    for value in (Pair(1, 2), (1, 2), "hey", object()):
        assert ours.is_namedtuple(value) == theirs.is_namedtuple(value)
    assert same(ours.honor_type(Pair(0, 0), iter([3, 4])), theirs.honor_type(Pair(0, 0), iter([3, 4])))
    assert ours.find_device([1, "a"]) is None


def _fp32_wrapped(module):
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    model._original_forward = model.forward
    model.forward = module.convert_outputs_to_fp32(model.forward)
    return model


def test_outputs_to_fp32_and_unwrapping_equal_accelerates():
    for module in (ours, theirs):
        model = _fp32_wrapped(module)
        assert model(torch.ones(1, 2, dtype=torch.bfloat16)).dtype == torch.float32
        with pytest.raises((pickle.PicklingError, AttributeError)):  # the fp32 forward is not picklable
            pickle.dumps(model)
        pickle.dumps(module.extract_model_from_parallel(model, keep_fp32_wrapper=False))
    # triax's gives the model its own forward back (Accelerate's leaves one that takes the model
    # twice: calling it is a TypeError there).
    model = _fp32_wrapped(ours)
    assert ours.extract_model_from_parallel(model, keep_fp32_wrapper=False) is model and "forward" not in vars(model)
    assert model(torch.ones(1, 2, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("keep_torch_compile", [True, False])
def test_extract_model_from_parallel_equals_accelerates(keep_torch_compile):
    model = torch.nn.Linear(2, 2)
    results = []
    for module in (ours, theirs):
        compiled = torch.compile(torch.nn.DataParallel(model))
        results.append(module.extract_model_from_parallel(compiled, keep_torch_compile=keep_torch_compile))
    if keep_torch_compile:
        assert all(ours.is_compiled_module(result) and result._orig_mod is model for result in results)
    else:
        assert results[0] is results[1] is model
    assert ours.has_compiled_regions(torch.nn.Sequential(torch.compile(torch.nn.Linear(1, 1))))
    assert not ours.has_compiled_regions(torch.nn.Sequential(torch.nn.Linear(1, 1)))


def test_environment_helpers_equal_accelerates(monkeypatch):
    for text in ("y", "Yes", "TRUE", "on", "1", "n", "No", "false", "OFF", "0"):
        assert ours.str_to_bool(text) == theirs.str_to_bool(text)
        assert ours.str_to_bool(text, to_bool=True) is theirs.str_to_bool(text, to_bool=True)
    with pytest.raises(ValueError):
        ours.str_to_bool("maybe")
    monkeypatch.setenv("TRIAX_TEST_FLAG", "yes")
    monkeypatch.setenv("TRIAX_TEST_COUNT", "-1")
    monkeypatch.setenv("TRIAX_TEST_OTHER", "7")
    for module in (ours, theirs):
        assert module.parse_flag_from_env("TRIAX_TEST_FLAG") and not module.parse_flag_from_env("TRIAX_TEST_UNSET")
        assert module.parse_choice_from_env("TRIAX_TEST_UNSET", "fp16") == "fp16"
        assert module.get_int_from_env(["TRIAX_TEST_COUNT", "TRIAX_TEST_OTHER"], 3) == 7
        assert module.get_int_from_env(["TRIAX_TEST_UNSET"], 3) == 3


@pytest.mark.parametrize("helper", ["patch_environment", "clear_environment"])
def test_environment_is_restored_even_after_an_error(helper):
    key = next(name for name in os.environ if name.isupper())
    before = dict(os.environ)
    with pytest.raises(RuntimeError):
        if helper == "patch_environment":
            with ours.patch_environment(**{key: "patched", "triax_new_key": 1}):
                assert os.environ[key] == "patched" and os.environ["TRIAX_NEW_KEY"] == "1"
                with ours.patch_environment(triax_new_key=2):
                    assert os.environ["TRIAX_NEW_KEY"] == "2"
                assert os.environ["TRIAX_NEW_KEY"] == "1"
                raise RuntimeError("inside")
        else:
            with ours.clear_environment():
                assert not os.environ
                os.environ["TRIAX_SET_INSIDE"] = "1"
                raise RuntimeError("inside")
    assert dict(os.environ) == before


def test_small_helpers_equal_accelerates():
    assert ours.compare_versions("torch", ">=", "1.0") == theirs.compare_versions("torch", ">=", "1.0")
    for operation in ("<", "<=", "==", "!=", ">=", ">"):
        assert ours.is_torch_version(operation, "2.5") == theirs.is_torch_version(operation, "2.5")
    for obj in (ours.listify, torch.nn.Linear, torch.nn.Linear(1, 1), 3):
        assert ours.get_pretty_name(obj) == theirs.get_pretty_name(obj)
    assert ours.merge_dicts({"a": {"b": 1}, "c": 2}, {"a": {"d": 3}}) == theirs.merge_dicts(
        {"a": {"b": 1}, "c": 2}, {"a": {"d": 3}})
    for size in (10, 2048, 5 * 1024**3, 3.5 * 1024**4):
        assert ours.convert_bytes(size) == theirs.convert_bytes(size)
    model = torch.nn.Sequential(torch.nn.Linear(1, 1))
    assert ours.recursive_getattr(model, "0.weight") is theirs.recursive_getattr(model, "0.weight")


def test_probes_and_constants_equal_accelerates():
    from triax.accelerate.utils import imports

    # Probes triax answers differently on purpose (it runs none of those features) are documented
    # in triax.accelerate._internal.surface.DIFFERS; every other one answers as Accelerate's here.
    from triax.accelerate._internal.surface import DIFFERS

    on_purpose = set(DIFFERS["accelerate.utils"])
    for name in imports.PROBES:
        if name not in on_purpose:
            assert getattr(ours, name)() == bool(getattr(theirs, name)()), name  # some of theirs give None
    for name in ours.__all__:
        if name.isupper():
            assert getattr(ours, name) == getattr(theirs, name) or name in on_purpose, name


@pytest.mark.parametrize("message", ["CUDA out of memory. Tried to allocate 2 GiB", "XPU out of memory.",
                                     "CPU out of memory.", "MPS backend out of memory (MPS allocated: 1 GB)",
                                     "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear",
                                     "[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried",
                                     "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed", "shapes do not match"])
def test_out_of_memory_messages_of_every_device_equal_accelerates(message):
    from accelerate.utils.memory import should_reduce_batch_size

    error = RuntimeError(message)
    assert ours.should_reduce_batch_size(error) == should_reduce_batch_size(error)
    tried = []

    @ours.find_executable_batch_size(starting_batch_size=16)
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > 12:
            raise RuntimeError(message)
        return batch_size

    if ours.should_reduce_batch_size(error):
        assert train() == 12 and tried == [16, 14, 12]
    else:
        with pytest.raises(RuntimeError, match="shapes"):
            train()


def test_pad_across_processes_leaves_nested_tensors_and_missing_dims(fresh_state):
    nested = torch.nested.nested_tensor([torch.ones(3), torch.ones(1)])
    with pytest.warns(ours.CannotPadNestedTensorWarning):
        assert ours.pad_across_processes(nested) is nested
    tensor = torch.randn(4, 3, 5)
    assert ours.pad_across_processes(tensor, dim=-1).shape == (4, 3, 5)
    assert ours.pad_across_processes(tensor, dim=-4) is tensor


def test_check_os_kernel_warns_without_any_state(fresh_state, caplog):
    with mock.patch("platform.uname", return_value=mock.Mock(release="5.4.0-35-generic", system="Linux")):
        with caplog.at_level(logging.WARNING):
            ours.check_os_kernel()
    assert len(caplog.records) == 1 and "5.4.0" in caplog.records[0].getMessage() and "5.5.0" in caplog.text
    caplog.clear()
    for release, system in (("5.15.0-35-generic", "Linux"), ("5.4.0", "Darwin")):
        with mock.patch("platform.uname", return_value=mock.Mock(release=release, system=system)):
            ours.check_os_kernel()
    assert not caplog.records


def test_save_writes_tied_weights_once_and_load_reads_them(fresh_state, tmp_path, caplog):
    from safetensors.torch import load_file

    model = torch.nn.Module()
    model.a = torch.nn.Linear(4, 4)
    model.b = model.a
    path = str(tmp_path / "model.safetensors")
    with caplog.at_level(logging.WARNING):
        ours.save(model.state_dict(), path, safe_serialization=True)
    assert len(caplog.records) == 1 and "Removed shared tensor" in caplog.text
    saved = load_file(path)
    assert sorted(saved) == ["a.bias", "a.weight"] and torch.equal(saved["a.weight"], model.a.weight)
    ours.save({"step": 3, "weight": model.a.weight.detach()}, str(tmp_path / "state.pt"))
    assert ours.load(str(tmp_path / "state.pt"))["step"] == 3


def test_device_backend_helpers_equal_accelerates():
    """Accelerate 1.16's backend helpers answer alike on this machine, and for every device type."""
    assert ours.get_torch_accelerator_backend() == theirs.get_torch_accelerator_backend()
    assert (ours.get_torch_accelerator_backend(check_available=False)
            == theirs.get_torch_accelerator_backend(check_available=False))
    for device_type in (None, "cpu", "cuda", "xpu", "npu", "hpu", "mlu", "musa", "sdaa", "neuron", "mps"):
        assert ours.get_distributed_backend(device_type) == theirs.get_distributed_backend(device_type), device_type
    for device in ("npu", 0, 3, "cpu", "cuda:1", torch.device("cpu")):
        assert ours.normalize_device(device) == theirs.normalize_device(device), device


def test_free_memory_is_asked_of_the_device_module():
    """get_accelerator_free_memory asks the module it is handed (torch.cuda's mem_get_info and alike)."""
    class Device:
        @staticmethod
        def mem_get_info(index):
            return (1000 + index, 4000)

    assert ours.get_accelerator_free_memory(Device, 2) == theirs.get_accelerator_free_memory(Device, 2) == 1002
