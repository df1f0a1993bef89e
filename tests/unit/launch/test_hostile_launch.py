"""Hostile and careless input at the launchers' doors: `triax launch` config files, FSDP options and
the FSDP_*/ACCELERATE_* variables (at the launcher and at the Accelerator's start), and `triax
horovodrun`'s config file, discovery script, --output-filename directory and timeout variables.
Every case is one line (exit code 2 on the command line, the library's exception class in
Python), with no traceback, no hang, and nothing read or written outside its place."""

import os
import sys
import time

import pytest

from triax.commands.cli import main as cli_main
from triax.errors import TriaxError

# ---- helpers ---------------------------------------------------------------------------------------


def refused(capsys, argv, *words):
    """Run `triax argv` in this process: exit code 2, one line naming `words`, no traceback."""
    capsys.readouterr()
    code = cli_main(list(argv))
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, (code, captured.out, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("triax: error:"), err
    for word in words:
        assert word in err, f"{word!r} missing from: {err}"
    return err


@pytest.fixture
def clean_environment(monkeypatch, tmp_path):
    """No FSDP_*/ACCELERATE_*/HOROVOD_* variable from the test runner's shell; no launch config."""
    for name in list(os.environ):
        if name.startswith(("FSDP_", "ACCELERATE_", "HOROVOD_")) or name == "FORK_LAUNCHED":
            monkeypatch.delenv(name)
    monkeypatch.setenv("TRIAX_CONFIG_FILE", str(tmp_path / "no-config.yaml"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('never run')\n")
    return tmp_path


# 9 levels of 9 aliases each: 9^9 (387 million) values once expanded, in under 400 bytes.
ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]\n" for previous, name in zip("abcdefgh", "bcdefghi"))
DEEP = "x: " + "[" * 3000 + "]" * 3000 + "\n"

YAML_CASES = {
    # name: (file text, words the line must name)
    "alias bomb": (ALIAS_BOMB, ["expands to more than 10000 values"]),
    "alias bomb in an Accelerate config": ("compute_environment: LOCAL_MACHINE\n" + ALIAS_BOMB,
                                           ["expands to more than 10000 values"]),
    "deep nesting": (DEEP, ["nested more than 32 levels deep"]),
    "a cycle": ("a: &a [*a]\n", ["refers to a collection that contains it"]),
    "a number as a key": ("1: 2\n", ["key 1 is not a name"]),
    "a number as an fsdp_config key": ("distributed_type: FSDP\nfsdp_config:\n  7: FULL_SHARD\n",
                                       ["key 7 under fsdp_config is not a name"]),
    "not YAML": ("a: [1, 2\n", ["is not a YAML file triax reads"]),
}


@pytest.mark.parametrize("name", list(YAML_CASES))
def test_launch_config_file_shapes_are_bounded(name, clean_environment, capsys):
    text, words = YAML_CASES[name]
    config = clean_environment / "config.yaml"
    config.write_text(text)
    refused(capsys, ["launch", "--config_file", str(config), "--dry-run", "train.py"], str(config), *words)


@pytest.mark.parametrize("name", list(YAML_CASES))
def test_horovodrun_config_file_shapes_are_bounded(name, clean_environment, capsys):
    text, words = YAML_CASES[name]
    config = clean_environment / "horovod.yaml"
    config.write_text(text)
    refused(capsys, ["horovodrun", "-np", "1", "--config-file", str(config), "--dry-run", "python", "x.py"],
            f"--config-file {config}", *words[:1])


def test_config_files_that_are_not_text_or_not_files(clean_environment, capsys):
    binary = clean_environment / "binary.yaml"
    binary.write_bytes(b"num_processes: 2\n\xff\xfe\n")
    refused(capsys, ["launch", "--config_file", str(binary), "--dry-run", "train.py"], "not UTF-8")
    refused(capsys, ["horovodrun", "-np", "1", "--config-file", str(binary), "--dry-run", "python", "x.py"],
            "not UTF-8")
    fifo = clean_environment / "fifo.yaml"
    os.mkfifo(fifo)  # nobody writes to it: a reader would wait for ever
    refused(capsys, ["launch", "--config_file", str(fifo), "--dry-run", "train.py"], "not a regular file")
    refused(capsys, ["horovodrun", "-np", "1", "--config-file", str(fifo), "--dry-run", "python", "x.py"],
            "not a regular file")
    huge = clean_environment / "huge.yaml"
    with open(huge, "wb") as handle:
        handle.truncate(2**30)  # sparse: a gigabyte claimed, nothing read
    refused(capsys, ["launch", "--config_file", str(huge), "--dry-run", "train.py"], "1073741824 bytes")


def test_an_ordinary_config_with_anchors_still_loads(clean_environment, capsys):
    config = clean_environment / "config.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_processes: 2\n"
                      "fsdp_config: &fsdp\n  fsdp_version: 2\n  fsdp_offload_params: false\n")
    assert cli_main(["launch", "--config_file", str(config), "--dry-run", "train.py"]) == 0
    command = capsys.readouterr().out
    assert "FSDP_VERSION=2" in command and "FSDP_OFFLOAD_PARAMS=false" in command


# ---- FSDP options and variables ------------------------------------------------------------------------

OPTION_CASES = {
    "--fsdp_min_num_params lots": (["--fsdp_min_num_params", "lots"], "--fsdp_min_num_params='lots'"),
    "--fsdp_version 7": (["--fsdp_version", "7"], "--fsdp_version='7'"),
    "--fsdp_sharding_strategy 99": (["--fsdp_sharding_strategy", "99"], "--fsdp_sharding_strategy='99'"),
    "--fsdp_state_dict_type": (["--fsdp_state_dict_type", "EVERYTHING"], "--fsdp_state_dict_type='EVERYTHING'"),
    "--fsdp_offload_params": (["--fsdp_offload_params", "maybe"], "--fsdp_offload_params='maybe'"),
    "--fsdp_transformer_layer_cls_to_wrap": (["--fsdp_transformer_layer_cls_to_wrap", "Block;rm -rf"],
                                             "--fsdp_transformer_layer_cls_to_wrap='Block;rm -rf'"),
}


@pytest.mark.parametrize("name", list(OPTION_CASES))
def test_fsdp_options_accelerate_cannot_take_are_refused_at_the_launcher(name, clean_environment, capsys):
    options, words = OPTION_CASES[name]
    refused(capsys, ["launch", "--use_fsdp", *options, "--dry-run", "train.py"], words, "is invalid; use")


FILE_CASES = {
    "a version in words": ("fsdp_version: two", "fsdp_config.fsdp_version='two'"),
    "a list of parameters": ("fsdp_min_num_params: [1]", "fsdp_config.fsdp_min_num_params=[1]"),
    "a bad pattern": ("fsdp_ignored_modules: '(unclosed'", "fsdp_config.fsdp_ignored_modules='(unclosed'"),
    "a mapping for a flag": ("fsdp_offload_params: {a: 1}", "fsdp_config.fsdp_offload_params={'a': 1}"),
    "an unknown strategy": ("fsdp_sharding_strategy: 99", "fsdp_config.fsdp_sharding_strategy=99"),
}


@pytest.mark.parametrize("name", list(FILE_CASES))
def test_fsdp_config_values_accelerate_cannot_take_are_refused_naming_the_key(name, clean_environment, capsys):
    line, words = FILE_CASES[name]
    config = clean_environment / "config.yaml"
    config.write_text(f"compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nfsdp_config:\n  {line}\n")
    refused(capsys, ["launch", "--config_file", str(config), "--dry-run", "train.py"], str(config), words)


VARIABLE_CASES = {
    "FSDP_VERSION": "two",
    "FSDP_SHARDING_STRATEGY": "99",
    "FSDP_MIN_NUM_PARAMS": "9" * 5000,
    "FSDP_IGNORED_MODULES": "(unclosed",
    "FSDP_STATE_DICT_TYPE": "EVERYTHING",
    "FSDP_ACTIVATION_CHECKPOINTING": "sometimes",
    "ACCELERATE_DEBUG_MODE": "maybe",
    "ACCELERATE_TORCH_DEVICE": "garbage",
    "ACCELERATE_USE_FSDP": "perhaps",
    "ACCELERATE_MIXED_PRECISION": "fp64",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "-3",
}


@pytest.mark.parametrize("variable", list(VARIABLE_CASES))
def test_bad_variables_are_refused_by_the_launcher_and_at_the_accelerators_start(variable, clean_environment,
                                                                                  capsys, monkeypatch, fresh_state):
    import triax
    from triax.accelerate._internal.fsdp_plugin import FullyShardedDataParallelPlugin
    from triax.accelerate.state import PartialState

    monkeypatch.setenv(variable, VARIABLE_CASES[variable])
    line = refused(capsys, ["launch", "--dry-run", "train.py"], f"${variable}=", "is invalid; use")
    assert len(line) < 300  # 5000 digits are not repeated back
    for start in (lambda: triax.Accelerator(cpu=True), PartialState, FullyShardedDataParallelPlugin):
        with pytest.raises(ValueError, match=rf"^\${variable}=.* is invalid; use") as caught:
            start()  # Accelerate raises ValueError for these (str_to_bool, int(), its enums' names)
        assert isinstance(caught.value, TriaxError) and "\n" not in str(caught.value)
    assert not PartialState._shared_state  # refused before the state (or a process group) was made


def test_fsdp2_reshards_by_a_truth_value(clean_environment, capsys, monkeypatch):
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "FULL_SHARD")
    refused(capsys, ["launch", "--dry-run", "train.py"], "$FSDP_RESHARD_AFTER_FORWARD='FULL_SHARD'",
            "with FSDP_VERSION=2")


# (variable, value): Accelerate's own FullyShardedDataParallelPlugin decides which are accepted.
SPELLINGS = [
    ("FSDP_VERSION", "2"), ("FSDP_VERSION", "two"),
    ("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP"), ("FSDP_SHARDING_STRATEGY", "hybrid_shard_zero2"),
    ("FSDP_SHARDING_STRATEGY", "2"), ("FSDP_SHARDING_STRATEGY", "99"), ("FSDP_SHARDING_STRATEGY", "FULL"),
    ("FSDP_OFFLOAD_PARAMS", "True"), ("FSDP_OFFLOAD_PARAMS", "off"), ("FSDP_OFFLOAD_PARAMS", "maybe"),
    ("FSDP_STATE_DICT_TYPE", "sharded_state_dict"), ("FSDP_STATE_DICT_TYPE", "EVERYTHING"),
    ("FSDP_BACKWARD_PREFETCH", "BACKWARD_POST"), ("FSDP_BACKWARD_PREFETCH", "sideways"),
    ("FSDP_AUTO_WRAP_POLICY", "size_based_wrap"), ("FSDP_AUTO_WRAP_POLICY", "any"),
    ("FSDP_USE_ORIG_PARAMS", "yes"), ("FSDP_USE_ORIG_PARAMS", "sometimes"),
    ("FSDP_ACTIVATION_CHECKPOINTING", "false"), ("FSDP_ACTIVATION_CHECKPOINTING", "nah"),
]


@pytest.mark.parametrize("variable, value", SPELLINGS)
def test_the_launcher_accepts_what_accelerates_plugin_accepts(variable, value, clean_environment, monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin as AcceleratePlugin

    from triax.launch.variables import check_environment

    monkeypatch.setenv(variable, value)
    try:
        AcceleratePlugin()
        accelerate_accepts = True
    except (ValueError, KeyError):  # Accelerate's own failures for a bad spelling
        accelerate_accepts = False
    try:
        check_environment(os.environ)
        triax_accepts = True
    except ValueError:
        triax_accepts = False
    assert triax_accepts == accelerate_accepts


# ---- triax horovodrun --------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_horovodrun_help(flag, capsys):
    with pytest.raises(SystemExit) as exited:
        cli_main(["horovodrun", flag])
    out = capsys.readouterr().out
    assert exited.value.code == 0
    assert out.startswith("usage: triax horovodrun") and "--host-discovery-script" in out


TIMEOUT_CASES = {
    "HOROVOD_ELASTIC_TIMEOUT=1e15": ("HOROVOD_ELASTIC_TIMEOUT", "1e15", "not a whole number of seconds"),
    "HOROVOD_ELASTIC_TIMEOUT=-5": ("HOROVOD_ELASTIC_TIMEOUT", "-5", "not a whole number of seconds"),
    "HOROVOD_ELASTIC_TIMEOUT=10^15": ("HOROVOD_ELASTIC_TIMEOUT", str(10**15), "from 1 to 604800"),
    "HOROVOD_GLOO_TIMEOUT_SECONDS=nan": ("HOROVOD_GLOO_TIMEOUT_SECONDS", "nan", "positive number of seconds"),
    "HOROVOD_GLOO_TIMEOUT_SECONDS=1e15": ("HOROVOD_GLOO_TIMEOUT_SECONDS", "1e15", "at most 604800"),
    "HOROVOD_START_TIMEOUT=0": ("HOROVOD_START_TIMEOUT", "0", "not a whole number of seconds"),
}


@pytest.mark.parametrize("name, elastic", [(name, elastic) for name in TIMEOUT_CASES for elastic in (False, True)
                                           if elastic or "ELASTIC" not in name])  # a fixed job never reads it
def test_horovod_timeout_variables_are_checked_before_anything_starts(name, elastic, clean_environment, capsys,
                                                                       monkeypatch):
    variable, value, words = TIMEOUT_CASES[name]
    monkeypatch.setenv(variable, value)
    job = ["--min-np", "1", "-H", "a:1,b:1"] if elastic else []
    refused(capsys, ["horovodrun", "-np", "2", *job, "--dry-run", "python", "x.py"], f"${variable}=", words)


def test_horovod_timeout_options_are_bounded(capsys):
    for option in ("--elastic-timeout", "--start-timeout"):
        refused(capsys, ["horovodrun", "-np", "2", "--min-np", "1", "-H", "a:1,b:1", option, str(10**15),
                         "--dry-run", "python", "x.py"], option, "must be at most 604800")
    refused(capsys, ["horovodrun", "-np", "2", "--gloo-timeout-seconds", "inf", "--dry-run", "python", "x.py"],
            "--gloo-timeout-seconds")


def test_process_counts_are_bounded_before_one_object_per_slot_is_made(capsys):
    refused(capsys, ["horovodrun", "-np", "100000000", "--dry-run", "python", "x.py"], "-np 100000000",
            "65536 processes")
    refused(capsys, ["horovodrun", "-np", "2", "-H", "a:100000000", "--dry-run", "python", "x.py"],
            "slots=100000000", "65536 processes")
    refused(capsys, ["horovodrun", "-np", "2", "-H", ",".join(f"h{i}:60000" for i in range(3)), "--dry-run",
                     "python", "x.py"], "180000 slots in all")


def discovery_script(folder, body: str) -> str:
    script = folder / "discover.sh"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return str(script)


DISCOVERY_CASES = {
    # name: (script body, words)
    "non-UTF-8 bytes": ("printf 'localhost:1\\n\\377\\376:1\\n'\n", ["not UTF-8 text (byte 12)"]),
    "output without end": ("yes localhost:1\n", ["printed more than 4194304 bytes"]),
    "errors without end": ("yes oops >&2\n", ["printed more than 4194304 bytes"]),
    "a hundred million slots": ("echo localhost:100000000\n", ["slots=100000000", "65536 processes"]),
    "many hosts' slots in all": ("for i in 1 2 3; do echo h$i:60000; done\n", ["180000 slots in all"]),
    "a terminal escape": ("printf 'host\\033]0;pwned\\007\\n'\n", ["\\x1b"]),
}


@pytest.mark.parametrize("name", list(DISCOVERY_CASES))
@pytest.mark.parametrize("max_np", [None, "2"])
def test_discovery_script_output_is_bounded_and_decoded_strictly(name, max_np, clean_environment, capsys):
    body, words = DISCOVERY_CASES[name]
    script = discovery_script(clean_environment, body)
    limit = ["--max-np", max_np] if max_np else []
    refused(capsys, ["horovodrun", "-np", "1", *limit, "--host-discovery-script", script, "--dry-run",
                     "python", "x.py"], "host discovery script", *words)


def test_a_hanging_discovery_script_and_what_it_started_are_stopped(clean_environment, monkeypatch):
    from triax.horovod.elastic import discovery

    child = clean_environment / "child.pid"
    script = discovery_script(clean_environment, f"sleep 600 &\necho $! > {child}\necho localhost:1\nsleep 600\n")
    monkeypatch.setattr(discovery, "DISCOVERY_TIMEOUT_S", 1)
    with pytest.raises(discovery.DiscoveryError, match="did not answer in 1s"):
        discovery.DiscoveryScript(script, None).find()
    assert gone(int(child.read_text()))  # the script's own child was stopped with it
    failing = discovery_script(clean_environment, "echo 'no hosts \\033[2J' >&2\nexit 4\n")
    with pytest.raises(discovery.DiscoveryError, match=r"exited with code 4: no hosts \\x1b\[2J$"):
        discovery.DiscoveryScript(failing, None).find()


def gone(pid: int, wait_s: float = 30.0) -> bool:
    """Whether process `pid` ended (absent, or a zombie its new parent has yet to reap)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                if handle.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def output_job(folder):
    from triax.horovod.output import JobOutput

    return JobOutput(str(folder / "out"), 2)


@pytest.mark.parametrize("plant", ["link to a file", "linked rank directory", "fifo", "hard link"])
def test_output_filename_never_writes_through_what_was_planted(plant, clean_environment, capsys):
    victim = clean_environment / "victim.txt"
    victim.write_text("precious\n")
    elsewhere = clean_environment / "elsewhere"
    elsewhere.mkdir()
    rank = clean_environment / "out" / "rank.0"
    if plant == "linked rank directory":
        rank.parent.mkdir()
        rank.symlink_to(elsewhere)
    else:
        rank.mkdir(parents=True)
        if plant == "link to a file":
            (rank / "stdout").symlink_to(victim)
        elif plant == "fifo":
            os.mkfifo(rank / "stdout")  # no reader: a plain open for writing would wait for ever
        else:
            os.link(victim, rank / "stdout")
    words = {"link to a file": "is a symlink", "linked rank directory": "is a symlink",
             "fifo": "not a regular file", "hard link": "other hard links"}[plant]
    refused(capsys, ["horovodrun", "-np", "1", "--output-filename", str(clean_environment / "out"),
                     sys.executable, "-c", "print('never run')"], "--output-filename", words)
    assert victim.read_text() == "precious\n" and os.listdir(elsewhere) == []


def test_output_files_are_emptied_at_the_start_and_appended_to_later(clean_environment):
    output = output_job(clean_environment)
    stdout = clean_environment / "out" / "rank.0" / "stdout"
    stdout.parent.mkdir(parents=True)
    stdout.write_text("an earlier job\n")
    output.open_rank(0)
    output.files[(0, "stdout")].write(b"[0]<stdout>:first\n")
    output.open_rank(0, append=True)  # an elastic worker started later with rank 0
    output.files[(0, "stdout")].write(b"[0]<stdout>:second\n")
    output.close()
    assert stdout.read_text() == "[0]<stdout>:first\n[0]<stdout>:second\n"


@pytest.mark.parametrize("option", ["--num-processes", "--num-machines"])
def test_launch_process_counts_are_bounded(option, clean_environment, capsys):
    refused(capsys, ["launch", option, "100000000", "--dry-run", "train.py"], "=100000000 is invalid", "1 .. 65536")
    config = clean_environment / "config.yaml"
    config.write_text(f"{option[2:].replace('-', '_')}: 100000000\n")
    refused(capsys, ["launch", "--config_file", str(config), "--dry-run", "train.py"], "=100000000 is invalid")


@pytest.mark.parametrize("value", ["nan", "1e15", "-5", "abc"])
def test_hvd_init_checks_the_gloo_timeout_at_its_start(value, clean_environment, monkeypatch):
    import triax.horovod as hvd

    monkeypatch.setenv("HOROVOD_GLOO_TIMEOUT_SECONDS", value)
    with pytest.raises(ValueError, match=r"^HOROVOD_GLOO_TIMEOUT_SECONDS=.* must be a positive number of seconds"):
        hvd.init()  # one process: no group is made, the variable is checked all the same
    assert not hvd.is_initialized()
