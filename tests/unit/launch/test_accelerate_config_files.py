"""Every file Accelerate's own config writer produces, read by `triax launch --config_file`:
accepted with each key honoured, or refused in one line naming the key and its value.

The files are made by Accelerate itself: its questionnaire (`accelerate config`,
accelerate.commands.config.cluster.get_cluster_input) answered with its defaults for every
machine type it offers, and with FSDP (versions 1 and 2), DeepSpeed, Megatron-LM, dynamo, bf16,
fp8 and two machines chosen; and `accelerate config default` (write_basic_config).
"""

import pytest
import yaml

from triax.errors import ConfigError
from triax.launch.accelerate_config import FSDP_ENVIRONMENT, LAUNCH_KEYS
from triax.launch.config import read_config_file

cluster = pytest.importorskip("accelerate.commands.config.cluster")

MACHINES = ["NO", "MULTI_CPU", "MULTI_XPU", "MULTI_HPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA",
            "MULTI_MUSA", "MULTI_NEURON", "XLA"]  # the questionnaire's first menu, in its order
TWO = {"should be used for distributed training": "2"}  # multi-device types refuse one process
FSDP = {**TWO, "FullyShardedDataParallel": "yes", "transformer layer": "Block"}
# name: (machine type, answers to free-text questions by a piece of their text, menu choices by
# a piece of their text); everything else takes the questionnaire's default.
CASES = {**{machine.lower(): (index, TWO, {}) for index, machine in enumerate(MACHINES)},
         "fsdp_version_1": (4, FSDP, {}),
         "fsdp_version_2": (4, FSDP, {"FSDP version": 1}),
         "deepspeed": (4, {**TWO, "DeepSpeed": "yes"}, {}),
         "megatron_lm": (4, {**TWO, "Megatron": "yes"}, {}),
         "dynamo": (1, {**TWO, "dynamo": "yes"}, {}),
         "bf16": (1, TWO, {"mixed precision": 2}),
         "fp8": (4, TWO, {"mixed precision": 3}),
         "two_machines": (1, {**TWO, "different machines": "2", "IP address": "10.0.0.1", "port": "29500"}, {})}
# What triax cannot honour, by the key its one line names.
REFUSED = {"xla": "distributed_type", "deepspeed": "distributed_type", "megatron_lm": "distributed_type",
           "dynamo": "dynamo_config", "fp8": "mixed_precision"}


def write_with_accelerate(name, path, monkeypatch):
    machine, answers, menus = CASES[name]
    first = []

    def ask_field(text, convert_value=None, default=None, error_message=None):
        for piece, answer in answers.items():
            if piece.lower() in text.lower():
                return convert_value(answer) if convert_value else answer
        assert default is not None, f"the questionnaire asks {text!r} with no default: answer it in CASES"
        return default

    def ask_options(text, options=(), convert_value=None, default=0):
        choice = machine if not first else next((c for p, c in menus.items() if p.lower() in text.lower()), default)
        first.append(text)
        return convert_value(choice) if convert_value else options[choice]

    monkeypatch.setattr(cluster, "_ask_field", ask_field)
    monkeypatch.setattr(cluster, "_ask_options", ask_options)
    # DeepSpeed and an fp8 library are not installed here; the questionnaire only checks for them.
    monkeypatch.setattr(cluster, "is_deepspeed_available", lambda: True)
    monkeypatch.setattr(cluster, "is_fp8_available", lambda: True)
    monkeypatch.setattr(cluster, "is_torchao_available", lambda: True)
    cluster.get_cluster_input().to_yaml_file(str(path))


def assert_honoured(path, data):
    config, environment = read_config_file(str(path))
    for key in LAUNCH_KEYS:
        if data.get(key) is not None:
            assert getattr(config, key) == data[key], key
    kind = data["distributed_type"]
    assert config.parallel == {"NO": "none", "FSDP": "fsdp"}.get(kind, "ddp")
    for key, value in (data.get("fsdp_config") or {}).items():
        variable = FSDP_ENVIRONMENT[key if key.startswith("fsdp_") else f"fsdp_{key}"][0]
        assert environment[variable].lower() == str(value).lower(), key
    return config


@pytest.mark.parametrize("name", list(CASES))
def test_every_file_accelerates_questionnaire_writes_is_honoured_or_refused_by_key(name, tmp_path, monkeypatch):
    path = tmp_path / "default_config.yaml"
    write_with_accelerate(name, path, monkeypatch)
    data = yaml.safe_load(path.read_text())
    assert data["tpu_env"] == []  # what the questionnaire always writes, and triax once refused
    if name not in REFUSED:
        config = assert_honoured(path, data)
        assert config.num_processes == (1 if name == "no" else 2)
        return
    with pytest.raises(ConfigError) as raised:
        read_config_file(str(path))
    message, key = str(raised.value), REFUSED[name]
    value = data[key]
    assert "\n" not in message and f"{key}: " in message and (str(value) in message or repr(value) in message)


def test_accelerate_config_default_is_honoured(tmp_path):
    from accelerate.commands.config.default import write_basic_config

    path = tmp_path / "default_config.yaml"
    write_basic_config(mixed_precision="bf16", save_location=str(path))
    data = yaml.safe_load(path.read_text()) if path.suffix == ".yaml" else None
    config = assert_honoured(path, data)
    assert config.mixed_precision == "bf16"


def test_the_sagemaker_file_is_refused_by_its_compute_environment(tmp_path):
    from accelerate.commands.config.config_args import SageMakerConfig

    path = tmp_path / "sagemaker.yaml"
    SageMakerConfig(compute_environment="AMAZON_SAGEMAKER", distributed_type="DATA_PARALLEL", mixed_precision="no",
                    use_cpu=False, debug=False, ec2_instance_type="ml.p3.2xlarge",
                    iam_role_name="role").to_yaml_file(str(path))
    with pytest.raises(ConfigError, match="AMAZON_SAGEMAKER|DATA_PARALLEL") as raised:
        read_config_file(str(path))
    assert "\n" not in str(raised.value)
