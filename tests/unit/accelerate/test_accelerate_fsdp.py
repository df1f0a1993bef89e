"""FSDP through Accelerate's own configuration: FullyShardedDataParallelPlugin, an `accelerate config`
file under `triax launch --config_file`, and the FSDP_* environment, mapped onto triax's FSDP2 core.

Without processes: the plugin reads the environment as Accelerate's does, a config file gives the
environment `accelerate launch` would, every option triax cannot honour is refused in one line.
With processes (a tiny transformers Llama, tests/support/accelerate_scripts/fsdp_transformer.py): 2 FSDP
processes equal 1 plain process, Accelerate's own FSDP2 gives the same bits, a run launched from
an Accelerate config file resumes bitwise, and save_state's FULL and SHARDED snapshots hold the
same tensors. (Checkpoint folders moving between Accelerate and triax: test_fsdp_folder.py.)
"""

import json
import os
import sys

import pytest
import torch

from support.fsdp_runs import LR, PLUGIN, SCRIPT, STEPS, fsdp_env, rank_records, run_fsdp_script, saved_weights
from support.helpers import assert_adam_close, assert_bitwise_equal

# Each test starts without FSDP_* / ACCELERATE_USE_FSDP (support/fsdp_runs.py).
pytestmark = pytest.mark.usefixtures("no_fsdp_environment")


# ---- the plugin, against Accelerate's -----------------------------------------------------------

def _fields(plugin) -> dict:
    """A plugin's normalised fields, comparable between triax's class and Accelerate's."""
    def plain(value):
        if hasattr(value, "__dict__") and not callable(value):
            return (type(value).__name__, sorted(vars(value).items()))
        return getattr(value, "__name__", value)

    names = ["fsdp_version", "sharding_strategy", "reshard_after_forward", "backward_prefetch",
             "mixed_precision_policy", "auto_wrap_policy", "cpu_offload", "ignored_modules", "state_dict_type",
             "state_dict_config", "optim_state_dict_config", "limit_all_gathers", "use_orig_params",
             "activation_checkpointing", "activation_checkpointing_offload", "cpu_ram_efficient_loading",
             "transformer_cls_names_to_wrap", "min_num_params"]
    return {name: plain(getattr(plugin, name)) for name in names}


ENVIRONMENTS = [
    # what `accelerate launch` sets for an FSDP2 config written by `accelerate config`
    {"FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false", "FSDP_OFFLOAD_PARAMS": "true",
     "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer,Foo",
     "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
     "FSDP_ACTIVATION_CHECKPOINTING": "true", "FSDP_USE_ORIG_PARAMS": "true", "FSDP_IGNORED_MODULES": "lm_head"},
    # FSDP1 (Accelerate's default version), size-based wrapping
    {"FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP", "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP",
     "FSDP_MIN_NUM_PARAMS": "2000", "FSDP_BACKWARD_PREFETCH": "BACKWARD_POST", "FSDP_USE_ORIG_PARAMS": "false"},
    {},
]
ARGUMENTS = [
    {"fsdp_version": 2, "mixed_precision_policy": "bf16", "cpu_offload": True, "reshard_after_forward": "false"},
    {"fsdp_version": 2, "mixed_precision_policy": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32,
                                                   "output_dtype": torch.bfloat16}, "state_dict_type": "FULL_STATE_DICT"},
    {"fsdp_version": 1, "reshard_after_forward": "SHARD_GRAD_OP", "mixed_precision_policy": "fp16"},
]


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_plugin_reads_the_fsdp_environment_as_accelerate_does(environment, monkeypatch):
    accelerate = pytest.importorskip("accelerate.utils")
    from triax.accelerate.utils import FullyShardedDataParallelPlugin

    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert _fields(FullyShardedDataParallelPlugin()) == _fields(accelerate.FullyShardedDataParallelPlugin())


@pytest.mark.parametrize("arguments", ARGUMENTS)
def test_plugin_normalises_its_arguments_as_accelerate_does(arguments):
    accelerate = pytest.importorskip("accelerate.utils")
    from triax.accelerate.utils import FullyShardedDataParallelPlugin

    ours, theirs = FullyShardedDataParallelPlugin(**arguments), accelerate.FullyShardedDataParallelPlugin(**arguments)
    assert _fields(ours) == _fields(theirs)
    ours.set_state_dict_type("FULL_STATE_DICT")
    theirs.set_state_dict_type("FULL_STATE_DICT")
    assert _fields(ours) == _fields(theirs)


def test_accelerator_mixed_precision_gives_accelerates_fsdp_policy():
    accelerate = pytest.importorskip("accelerate.utils")
    from triax.accelerate._internal.fsdp import default_mixed_precision_policy

    for name in ("bf16", "fp16"):
        plugin = accelerate.FullyShardedDataParallelPlugin(fsdp_version=2)
        plugin.set_mixed_precision(name)  # what Accelerate's state does for Accelerator(mixed_precision=name)
        assert default_mixed_precision_policy(name) == plugin.mixed_precision_policy


def test_accelerator_without_a_plugin_builds_one_from_the_fsdp_environment(monkeypatch, capsys):
    from triax.accelerate import Accelerator
    from triax.commands.launch import main as launch

    for name, value in {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP",
                        "FSDP_MIN_NUM_PARAMS": "1000", "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"}.items():
        monkeypatch.setenv(name, value)
    accelerator = Accelerator()
    plugin = accelerator.state.fsdp_plugin
    assert accelerator.parallel == "fsdp" and accelerator.is_fsdp2 is False  # one process: nothing to shard
    assert (plugin.fsdp_version, plugin.state_dict_type.name, plugin.min_num_params) == (2, "FULL_STATE_DICT", 1000)
    assert plugin.auto_wrap_policy.__name__ == "size_based_auto_wrap_policy"
    # triax launch hands that environment on, with the FSDP layout, as accelerate launch does.
    monkeypatch.setenv("TRIAX_CONFIG_FILE", "/nonexistent/config.yaml")
    assert launch(["--num_processes", "2", "--main_process_port", "0", "--dry-run", "demo.py"]) == 0
    assert "TRIAX_PARALLEL=fsdp" in capsys.readouterr().out


# ---- refused in one line ----------------------------------------------------------------------

REFUSED = [
    ({"sharding_strategy": "NO_SHARD"}, NotImplementedError, "NO_SHARD"),
    ({"sharding_strategy": "HYBRID_SHARD"}, NotImplementedError, "HYBRID_SHARD"),
    ({"fsdp_version": 2, "state_dict_type": "LOCAL_STATE_DICT"}, ValueError, "LOCAL_STATE_DICT"),
    ({"fsdp_version": 1, "state_dict_type": "LOCAL_STATE_DICT"}, ValueError, "LOCAL_STATE_DICT"),
    ({"fsdp_version": 3}, ValueError, "fsdp_version"),
    ({"fsdp_version": 2, "activation_checkpointing": True}, ValueError, "activation_checkpointing"),
    ({"fsdp_version": 2, "activation_checkpointing_offload": True}, ValueError, "activation_checkpointing_offload"),
    ({"fsdp_version": 2, "auto_wrap_policy": "layer_wrap"}, ValueError, "auto wrap policy"),
    ({"fsdp_version": 2, "reshard_after_forward": "FULL_SHARD"}, ValueError, "reshard_after_forward"),
    ({"fsdp_version": 2, "cpu_offload": "yes"}, ValueError, "cpu_offload"),
    ({"fsdp_version": 2, "state_dict_type": "WHOLE"}, ValueError, "state_dict_type"),
]


@pytest.mark.parametrize("arguments, error, names", REFUSED)
def test_options_triax_cannot_honour_are_refused_in_one_line(arguments, error, names):
    from triax.accelerate import Accelerator
    from triax.accelerate.utils import FullyShardedDataParallelPlugin
    from triax.errors import TriaxError

    with pytest.raises(error) as caught:
        Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(**arguments))
    message = str(caught.value)
    assert isinstance(caught.value, TriaxError) and names in message and "\n" not in message, message


def test_accelerates_own_plugin_is_read_and_refused_alike():
    accelerate = pytest.importorskip("accelerate.utils")
    from torch.distributed.fsdp import MixedPrecision

    from triax.accelerate import Accelerator

    with pytest.raises(NotImplementedError, match="HYBRID_SHARD_ZERO2"):
        Accelerator(fsdp_plugin=accelerate.FullyShardedDataParallelPlugin(sharding_strategy="HYBRID_SHARD_ZERO2"))
    keep = accelerate.FullyShardedDataParallelPlugin(mixed_precision_policy=MixedPrecision(keep_low_precision_grads=True))
    with pytest.raises(NotImplementedError, match="keep_low_precision_grads"):
        Accelerator(fsdp_plugin=keep)
    with pytest.raises(TypeError, match="FullyShardedDataParallelPlugin"):
        Accelerator(fsdp_plugin={"fsdp_version": 2})


def test_fsdp1_runs_as_fsdp2_with_one_warning_naming_what_is_not_applied():
    from triax.accelerate import Accelerator
    from triax.accelerate.utils import FullyShardedDataParallelPlugin

    with pytest.warns(UserWarning) as caught:
        accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
            fsdp_version=1, sharding_strategy="SHARD_GRAD_OP", backward_prefetch="BACKWARD_POST", limit_all_gathers=False))
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and all("\n" not in m for m in messages), messages
    assert "fsdp_version=1" in messages[0] and "backward_prefetch=BACKWARD_POST" in messages[0]
    assert "limit_all_gathers=False" in messages[1]
    assert accelerator._fsdp.reshard_after_forward is False  # SHARD_GRAD_OP, as `accelerate to-fsdp2` maps it
    assert accelerator.state.fsdp_plugin.state_dict_type.name == "FULL_STATE_DICT"  # FSDP1's default


def test_wrap_policies_choose_accelerates_units():
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.dirname(SCRIPT))
    from fsdp_transformer import tiny_llama

    from triax.accelerate._internal.fsdp import read_plugin, wrapped_modules
    from triax.accelerate.utils import FullyShardedDataParallelPlugin

    model = tiny_llama()
    names = {id(module): name for name, module in model.named_modules()}

    def units(**arguments):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **arguments)
        return [names[id(module)] for module in wrapped_modules(read_plugin(plugin), model)]

    layers = ["model.layers.0", "model.layers.1"]
    assert units(auto_wrap_policy="transformer_based_wrap") == layers  # the model's _no_split_modules
    assert units(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaMLP"]) == [
        "model.layers.0.mlp", "model.layers.1.mlp"]
    # Accelerate's size rule counts every parameter below a module, so the ModuleList and the
    # base model (each over 8000) become units too, around the layers.
    assert units(auto_wrap_policy="size_based_wrap", min_num_params=8000) == [*layers, "model.layers", "model"]
    assert units(auto_wrap_policy="size_based_wrap", min_num_params=0) == []  # Accelerate: 0 is no wrap
    assert units() == []  # NO_WRAP
    # Any other callable is asked as FSDP1 asks it (nonwrapped_numel: what no unit below took).
    assert units(auto_wrap_policy=lambda module, recurse, nonwrapped_numel: nonwrapped_numel > 8000) == layers
    with pytest.raises(ValueError, match="Could not find the transformer layer class GPT2Block"):
        units(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"])


# ---- an `accelerate config` file ----------------------------------------------------------------

def write_accelerate_config(path, fsdp_config, **fields):
    """The file `accelerate config` writes, by its own ClusterConfig class."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import ComputeEnvironment, DistributedType

    values = dict(compute_environment=ComputeEnvironment.LOCAL_MACHINE, distributed_type=DistributedType.FSDP,
                  mixed_precision="no", use_cpu=True, debug=False, num_processes=2, fsdp_config=fsdp_config)
    values.update(fields)
    ClusterConfig(**values).to_yaml_file(str(path))
    return str(path)


FSDP_CONFIGS = [
    {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_reshard_after_forward": False,
     "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "fsdp_state_dict_type": "FULL_STATE_DICT",
     "fsdp_offload_params": True, "fsdp_cpu_ram_efficient_loading": True, "fsdp_activation_checkpointing": True},
    {"fsdp_version": 1, "fsdp_reshard_after_forward": "SHARD_GRAD_OP", "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
     "fsdp_min_num_params": 2000, "fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_use_orig_params": True,
     "fsdp_cpu_ram_efficient_loading": False, "fsdp_sync_module_states": False},
    {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"},  # accelerate launch adds the fsdp_ prefix
]


@pytest.mark.parametrize("fsdp_config", FSDP_CONFIGS)
def test_accelerate_config_file_gives_the_environment_accelerate_launch_gives(fsdp_config, tmp_path):
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    from triax.launch.config import read_config_file

    path = write_accelerate_config(tmp_path / "fsdp.yaml", fsdp_config, mixed_precision="bf16")
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", path, "x.py"]))
    theirs = {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith(("FSDP_", "ACCELERATE_USE_FSDP"))}
    config, ours = read_config_file(path)
    assert ours == theirs
    assert (config.parallel, config.num_processes, config.use_cpu, config.mixed_precision) == ("fsdp", 2, True, "bf16")


# ---- `accelerate launch --use_fsdp --fsdp_*` flags ----------------------------------------------

def accelerate_launch_environment(argv):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args([*argv, "x.py"]))
    return {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith(("FSDP_", "ACCELERATE_USE_FSDP"))}


def triax_launch_environment(argv):
    from triax.commands.launch import build_parser
    from triax.launch.launcher import resolve_config

    config, environment = resolve_config(build_parser().parse_args([*argv, "x.py"]))
    return config, environment


FSDP_FLAGS = [
    ["--use_fsdp"],
    ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
     "--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer", "--fsdp_reshard_after_forward", "False",
     "--fsdp_state_dict_type", "FULL_STATE_DICT", "--fsdp_offload_params", "True",
     "--fsdp_activation_checkpointing", "True"],
    ["--use_fsdp", "--fsdp_version", "1", "--fsdp_sharding_strategy", "SHARD_GRAD_OP",
     "--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP", "--fsdp_min_num_params", "2000",
     "--fsdp_backward_prefetch", "BACKWARD_PRE", "--fsdp_cpu_ram_efficient_loading", "false",
     "--fsdp_sync_module_states", "false", "--fsdp_forward_prefetch", "true", "--fsdp_use_orig_params", "false"],
]


@pytest.mark.parametrize("flags", FSDP_FLAGS)
def test_fsdp_flags_give_the_environment_accelerate_launch_gives(flags, tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    monkeypatch.setenv("TRIAX_CONFIG_FILE", str(tmp_path / "none.yaml"))  # no saved `triax config`
    monkeypatch.setattr("accelerate.commands.launch.default_config_file", str(tmp_path / "none.yaml"))  # nor Accelerate's
    config, ours = triax_launch_environment(["--num_processes", "2", "--cpu", *flags])
    assert ours == accelerate_launch_environment(["--num_processes", "2", *flags])
    assert config.parallel == "fsdp"


def test_fsdp_flags_win_over_the_config_file_as_in_accelerate_launch(tmp_path):
    pytest.importorskip("accelerate")
    path = write_accelerate_config(tmp_path / "fsdp.yaml", {"fsdp_version": 2, "fsdp_min_num_params": 1000,
                                                             "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"})
    flags = ["--config_file", path, "--fsdp_min_num_params", "5000", "--fsdp_state_dict_type", "FULL_STATE_DICT"]
    _, ours = triax_launch_environment(flags)
    theirs = accelerate_launch_environment(flags)
    assert ours == theirs
    assert (ours["FSDP_MIN_NUM_PARAMS"], ours["FSDP_VERSION"]) == ("5000", "2")


@pytest.mark.parametrize("flags, names", [
    (["--fsdp_version", "2"], "--use_fsdp"),
    (["--use_fsdp", "--parallel", "ddp"], "--parallel is ddp"),
    (["--use_fsdp", "--fsdp_cpu_ram_efficient_loading", "true", "--fsdp_sync_module_states", "false"],
     "fsdp_sync_module_states"),
])
def test_fsdp_flags_that_cannot_work_are_refused_in_one_line(flags, names, tmp_path, monkeypatch):
    from triax.errors import TriaxError

    monkeypatch.setenv("TRIAX_CONFIG_FILE", str(tmp_path / "none.yaml"))
    with pytest.raises(TriaxError) as caught:
        triax_launch_environment(["--num_processes", "2", "--cpu", *flags])
    assert names in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("fields, names", [
    ({"distributed_type": "DEEPSPEED"}, "DEEPSPEED"),
    ({"fsdp_config": {"fsdp_version": 2, "fsdp_cpu_ram_efficient_loading": True,
                      "fsdp_sync_module_states": False}}, "fsdp_sync_module_states"),
    ({"fsdp_config": {"fsdp_verison": 2}}, "fsdp_verison"),
    ({"mixed_precision": "fp8"}, "fp8"),
    ({"downcast_bf16": True}, "downcast_bf16"),
    ({"dynamo_config": {"dynamo_backend": "INDUCTOR"}}, "dynamo_config"),
])
def test_accelerate_config_keys_triax_cannot_honour_are_refused_in_one_line(fields, names, tmp_path):
    import yaml

    from triax.errors import ConfigError
    from triax.launch.config import read_config_file

    data = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_processes": 2,
            "mixed_precision": "no", "use_cpu": True, "fsdp_config": {"fsdp_version": 2}}
    data.update(fields)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as caught:
        read_config_file(str(tmp_path / "c.yaml"))
    assert names in str(caught.value) and "\n" not in str(caught.value)


# ---- with processes ----------------------------------------------------------------------------

def _saved_tensors(folder):
    """An Accelerate FSDP checkpoint's model and optimizer tensors, whole, by name, whichever of
    its layouts it has: the two torch.save files (FULL_STATE_DICT) or the two DCP folders
    (SHARDED_STATE_DICT, read back by torch's own converter, as a user of Accelerate would)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def flat(prefix, value):
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flat(f"{prefix}{key}.", item).items()}
        return {prefix[:-1]: value} if isinstance(value, torch.Tensor) else {}

    tensors = {}
    for kind, whole, sharded in (("model", "pytorch_model_fsdp.bin", "pytorch_model_fsdp_0"),
                                 ("optimizer", "optimizer.bin", "optimizer_0")):
        if os.path.exists(os.path.join(folder, whole)):
            state = torch.load(os.path.join(folder, whole), weights_only=True)
        else:
            dcp_to_torch_save(os.path.join(folder, sharded), os.path.join(folder, f"{kind}.whole"))
            state = torch.load(os.path.join(folder, f"{kind}.whole"), weights_only=True)[kind]
            os.remove(os.path.join(folder, f"{kind}.whole"))
        tensors.update(flat(kind + ".", state if kind == "model" else state["state"]))
    return tensors


@pytest.mark.multiprocess
def test_ignored_modules_sync_module_states_and_forward_prefetch_are_honoured(tmp_path):
    sys.path.insert(0, os.path.dirname(SCRIPT))
    from fsdp_options import model_for

    options = {"fsdp_version": 2, "auto_wrap_policy": "size_based_wrap", "min_num_params": 200,
               "ignored_modules": "4", "sync_module_states": True, "forward_prefetch": True}
    from support import forked

    forked.launch(2, [os.path.join(os.path.dirname(SCRIPT), "fsdp_options.py"), "--out", str(tmp_path / "out"),
                      "--plugin", json.dumps(options)], env=fsdp_env(tmp_path), timeout=300)
    reference = {name: tensor.tolist() for name, tensor in model_for(seed=0).state_dict().items()}
    for rank in (0, 1):
        record = json.load(open(tmp_path / "out" / f"rank_{rank}.json"))
        assert record["units"] == ["", "0", "2"]  # the Linears over 200 parameters, and the root
        assert record["sharded"] == ["0.bias", "0.weight", "2.bias", "2.weight"]  # "4" is ignored
        assert record["prefetched"] == {"": 0, "0": 1, "2": 0}
        # Each process built its own weights; sync_module_states gave every one process 0's.
        assert record["weights"] == reference


@pytest.mark.multiprocess
def test_two_fsdp_processes_equal_one_process_and_save_model_writes_the_whole_model(runs):
    from transformers import LlamaForCausalLM

    sys.path.insert(0, os.path.dirname(SCRIPT))
    from fsdp_transformer import tiny_llama

    one, fsdp = saved_weights(runs / "one"), saved_weights(runs / "fsdp")
    assert_adam_close(fsdp, one, [LR] * STEPS)
    for record in rank_records(runs / "fsdp"):
        # Each decoder layer, the input embedding, the final norm with the (tied) head, and the root.
        assert record["units"] == ["", "model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm",
                                   "lm_head"]
        assert record["local_elements"] < record["elements"] and record["steps"] == STEPS
    assert sum(r["local_elements"] for r in rank_records(runs / "fsdp")) == rank_records(runs / "fsdp")[0]["elements"]
    # save_model's file loads into a fresh unsharded model, strictly.
    model = tiny_llama()
    assert isinstance(model, LlamaForCausalLM)
    model.load_state_dict(fsdp, strict=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.multiprocess
def test_accelerates_own_fsdp2_gives_the_same_bits(runs):
    pytest.importorskip("accelerate")
    run_fsdp_script(runs, 2, "--out", str(runs / "accelerate"), "--plugin", json.dumps(PLUGIN), "--door", "accelerate")
    assert_bitwise_equal(saved_weights(runs / "accelerate"), saved_weights(runs / "fsdp"))


@pytest.mark.multiprocess
def test_triax_launch_runs_an_accelerate_fsdp_config_and_resumes_bitwise(runs, tmp_path):
    pytest.importorskip("accelerate")
    from triax.testing import run

    path = write_accelerate_config(tmp_path / "fsdp.yaml", FSDP_CONFIGS[0], main_process_port=0)
    launch = [sys.executable, "-m", "triax", "launch", "--config_file", path, SCRIPT, "--others-on-meta"]
    run(launch + ["--out", str(tmp_path / "full"), "--save-at", "3", "--save", str(tmp_path / "ckpt")],
        env=fsdp_env(tmp_path), timeout=300)
    # The file's FULL_STATE_DICT: process 0 gathered everything and wrote it alone (Accelerate's
    # pytorch_model_fsdp.bin and optimizer.bin), the same tensors (optimizer state included) the
    # sharded save of the same step holds.
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["custom_checkpoint_0.pkl", "optimizer.bin", "pytorch_model_fsdp.bin",
                                                    "random_states_0.pkl", "random_states_1.pkl", "triax_manifest.json"]
    assert_bitwise_equal(_saved_tensors(tmp_path / "ckpt"), _saved_tensors(runs / "sharded"))
    # Offload, no resharding after forward, activation checkpointing: the same arithmetic.
    assert_bitwise_equal(saved_weights(tmp_path / "full"), saved_weights(runs / "fsdp"))
    run(launch + ["--out", str(tmp_path / "resumed"), "--resume", str(tmp_path / "ckpt")], env=fsdp_env(tmp_path),
        timeout=300)
    assert_bitwise_equal(saved_weights(tmp_path / "resumed"), saved_weights(tmp_path / "full"))
    full, resumed = rank_records(tmp_path / "full"), rank_records(tmp_path / "resumed")
    for before, after in zip(full, resumed):
        assert after["losses"] == before["losses"][3:] and after["steps"] == STEPS
        assert after["units"] == before["units"] and "model.layers.0" in after["units"]
