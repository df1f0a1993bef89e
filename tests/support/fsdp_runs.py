"""The FSDP runs of a tiny transformers Llama (accelerate_scripts/fsdp_transformer.py) that
tests/unit/accelerate/test_accelerate_fsdp.py and test_fsdp_folder.py share: one plain process and
2 FSDP processes saving Accelerate's sharded checkpoint folder, run once for the whole session
(the `runs` fixture, registered for every test by tests/conftest.py)."""

import json
import os

import pytest

from support import ACCELERATE_SCRIPTS_DIR, REPO_DIR

ROOT = REPO_DIR
SCRIPT = os.path.join(ACCELERATE_SCRIPTS_DIR, "fsdp_transformer.py")
STEPS, LR = 6, 3e-3  # the script's defaults
WRAP = {"fsdp_version": 2, "auto_wrap_policy": "transformer_based_wrap",
        "transformer_cls_names_to_wrap": ["LlamaDecoderLayer"]}


@pytest.fixture
def no_fsdp_environment(monkeypatch):
    """Each test starts without FSDP_* / ACCELERATE_USE_FSDP, and whatever it (or an Accelerator
    given a plugin, as Accelerate's does) sets is undone afterwards."""
    for name in [n for n in os.environ if n.startswith("FSDP_")]:
        monkeypatch.delenv(name)
    for name in ("FSDP_CPU_RAM_EFFICIENT_LOADING", "ACCELERATE_USE_FSDP"):
        monkeypatch.setenv(name, "")  # so that monkeypatch remembers to remove them again
        monkeypatch.delenv(name)


def fsdp_env(tmp_path):
    from triax.testing import quiet_env

    return quiet_env(PYTHONPATH=ROOT, TRIAX_CONFIG_FILE=str(tmp_path / "no-config.yaml"))


def run_fsdp_script(tmp_path, nproc, *args):
    from support import forked

    forked.launch(nproc, [SCRIPT, *args], env=fsdp_env(tmp_path), timeout=300)


def saved_weights(out):
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "model", "model.safetensors"))


def rank_records(out):
    return [json.load(open(os.path.join(out, f"rank_{rank}.json"))) for rank in (0, 1)]


def folder_listing(folder):
    return sorted(os.path.relpath(os.path.join(where, name), folder)
                  for where, _, names in os.walk(folder) for name in names if name != "triax_manifest.json")


PLUGIN = dict(WRAP, state_dict_type="SHARDED_STATE_DICT", activation_checkpointing=True,
              cpu_ram_efficient_loading=True)


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """One plain process (the reference), and 2 FSDP processes through the plugin, saving its
    state (SHARDED_STATE_DICT) after 3 of the 6 steps. Process 1 builds its model on the meta
    device (no weights): with cpu_ram_efficient_loading every shard gets process 0's weights."""
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("fsdp")
    run_fsdp_script(tmp, 1, "--out", str(tmp / "one"))
    run_fsdp_script(tmp, 2, "--out", str(tmp / "fsdp"), "--plugin", json.dumps(PLUGIN), "--save-at", "3",
            "--save", str(tmp / "sharded"), "--others-on-meta")
    return tmp
