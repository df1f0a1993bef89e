"""The rules written once: config documentation from the dataclasses, the debug section, model
presets, the restart count and the launch -> Accelerator settings. No processes are started."""

import dataclasses

import pytest

from triax.errors import ConfigError, TriaxError
from triax.launch import settings
from triax.launch.config import LaunchConfig
from triax.models.config import PRESETS
from triax.runtime.rendezvous import restart_count
from triax.config import TrainConfig, compose_config, describe_keys, field_docs


def sections():
    return [(section.name, section.default_factory) for section in dataclasses.fields(TrainConfig)]


def test_every_config_field_has_a_docstring():
    for name, schema in sections():
        docs = field_docs(schema)
        missing = [item.name for item in dataclasses.fields(schema) if not docs.get(item.name)]
        assert not missing, f"{name}: fields without a docstring under them: {missing}"
    assert not [item.name for item in dataclasses.fields(LaunchConfig) if not field_docs(LaunchConfig).get(item.name)]


def test_help_lists_every_key_with_default_and_docstring():
    text = describe_keys()
    for name, schema in sections():
        docs = field_docs(schema)
        for item in dataclasses.fields(schema):
            line = next((line for line in text.splitlines() if line.startswith(f"  {name}.{item.name}=")), None)
            assert line is not None, f"{name}.{item.name} missing from --help"
            assert docs[item.name].split()[0] in line
    assert "  trainer.max_steps=500 " in text and "  data.path=null " in text
    assert "  optim.betas=[0.9,0.95] " in text
    debug_title = next(line for line in text.splitlines() if line.startswith("debug:"))
    assert "fault injection" in debug_title.lower()


def test_debug_section_is_typed_and_checked():
    config = compose_config(["debug.preempt_at_step=3", "debug.sample_log=/tmp/x"])
    assert config.debug.preempt_at_step == 3 and config.debug.sample_log == "/tmp/x"
    assert compose_config([]).debug.preempt_at_step is None
    with pytest.raises(ConfigError, match="debug.preempt_at_step"):
        compose_config(["debug.preempt_at_step=0"])
    with pytest.raises(ConfigError):
        compose_config(["debug.preempt_at_step=soon"])


def test_model_presets_come_from_one_table():
    from hydra.core.config_store import ConfigStore

    model = compose_config(["model=gpt2"]).model
    assert (model.name, model.n_layer, model.n_head, model.n_embd) == ("gpt2", 12, 12, 768)
    assert {key: getattr(model, key) for key in PRESETS["gpt2"]} == PRESETS["gpt2"]
    llama = compose_config(["model=llama-debug"]).model
    assert (llama.arch, llama.n_kv_head) == ("llama", 2)
    group = ConfigStore.instance().list("model")
    assert sorted(group) == sorted(f"{name}.yaml" for name in PRESETS)
    with pytest.raises(ConfigError, match="unknown model preset"):
        compose_config(["model=gpt5"])


def test_restart_count():
    assert restart_count({}) == 0
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "3"}) == 3
    with pytest.raises(TriaxError, match="TORCHELASTIC_RESTART_COUNT"):
        restart_count({"TORCHELASTIC_RESTART_COUNT": "x"})


def test_launch_settings_reach_the_accelerator(monkeypatch):
    config = LaunchConfig(mixed_precision="bf16", parallel="none", use_cpu=True, gradient_accumulation_steps=3)
    env = settings.to_environment(config)
    assert set(env) == set(settings.ENVIRONMENT.values())
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    from triax import Accelerator

    accelerator = Accelerator()
    assert accelerator.precision.name == "bf16"
    assert accelerator.parallel == "none"
    assert accelerator.device.type == "cpu"
    assert accelerator.gradient_accumulation_steps == 3
    # An argument wins over what the launcher set.
    assert Accelerator(mixed_precision="no", gradient_accumulation_steps=1).precision.name == "fp32"


def test_min_lr_follows_lr_unless_set():
    """A fine-tuning rate below the old fixed floor (1e-4) must not trip it: unset, optim.min_lr is
    optim.lr / 10 (nanoGPT's rule); set, it is checked against optim.lr."""
    from triax.config import final_lr

    assert final_lr(compose_config(["optim.lr=3e-5"]).optim) == pytest.approx(3e-6)
    assert final_lr(compose_config([]).optim) == pytest.approx(1e-4)  # the default run is unchanged
    assert final_lr(compose_config(["optim.lr=3e-5", "optim.min_lr=0"]).optim) == 0
    with pytest.raises(ConfigError, match=r"optim.min_lr=0.001 is invalid; use 0 <= min_lr <= optim.lr"):
        compose_config(["optim.lr=3e-5", "optim.min_lr=1e-3"])


@pytest.mark.parametrize("override, expected", [
    ("trainer.max_steps=five", "trainer.max_steps=five is not an integer; give an integer or null (default 500)"),
    ("optim.lr=abc", "optim.lr=abc is not a number; give a number (default 0.001)"),
    ("trainer.resume=maybe", "trainer.resume=maybe is not true or false; give true or false (default true)"),
    ("trainer.loggers=jsonl", "trainer.loggers is a list; write it in brackets (default "
                              "trainer.loggers=[tensorboard,jsonl])"),
])
def test_a_wrong_type_names_the_key_the_value_and_the_type_expected(override, expected):
    with pytest.raises(ConfigError) as error:
        compose_config([override])
    assert str(error.value) == expected


def test_a_derived_count_is_named_as_what_it_follows():
    """parallel.pp_microbatches unset is 2 x pp: the error names the keys the user did set."""
    from triax.parallel.mesh import Layout, validate_layout

    with pytest.raises(ConfigError) as error:
        validate_layout(Layout(pp=2), n_layer=4, n_head=4, block_size=16, batch_size=3)
    assert str(error.value).startswith("4 pipeline micro-batches (parallel.pp_microbatches unset: 2 x "
                                       "parallel.pp=2) do not divide trainer.batch_size=3")
    assert "; set parallel.pp_microbatches=3 or make trainer.batch_size a multiple of 4" in str(error.value)
    with pytest.raises(ConfigError, match="set parallel.pp_microbatches to one of 2, 3, 6 or"):
        validate_layout(Layout(pp=2), n_layer=4, n_head=4, block_size=16, batch_size=6, pp_microbatches=4)
    with pytest.raises(ConfigError, match=r"^parallel.pp_microbatches=2 does not divide trainer.batch_size=3"):
        validate_layout(Layout(pp=2), n_layer=4, n_head=4, block_size=16, batch_size=3, pp_microbatches=2)
