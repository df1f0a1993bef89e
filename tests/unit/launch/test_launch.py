"""triax config / launch / env, and the Accelerator's single-process helpers (no workers started)."""

import socket

import pytest
import torch
import yaml

from triax.accelerate._internal.saving import from_json, to_json
from triax.accelerate.utils.operations import slice_for_process
from triax.commands.cli import main
from triax.launch.config import LaunchConfig, load_config


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "triax" / "default_config.yaml"
    monkeypatch.setenv("TRIAX_CONFIG_FILE", str(path))
    return path


def test_config_default_writes_yaml_that_launch_reads(config_file):
    assert main(["config", "--default"]) == 0
    data = yaml.safe_load(config_file.read_text())
    assert data["num_machines"] == 1 and data["mixed_precision"] == "no"
    assert load_config(str(config_file)) == LaunchConfig(**data)


def test_config_questionnaire_reads_answers(config_file, monkeypatch):
    answers = iter(["1", "0", "2", "yes", "bf16", "", "4", ""])
    monkeypatch.setattr("builtins.input", lambda prompt: next(answers))
    assert main(["config"]) == 0
    config = load_config(str(config_file))
    assert (config.num_processes, config.main_process_port, config.use_cpu, config.mixed_precision,
            config.gradient_accumulation_steps) == (2, 0, True, "bf16", 4)


def test_config_unknown_key_is_an_error(config_file, capsys):
    main(["config", "--default"])
    config_file.write_text(config_file.read_text() + "num_gpus: 2\n")
    assert main(["launch", "--dry-run", "train.py"]) == 2
    error = capsys.readouterr().err
    assert "unknown key(s) num_gpus" in error and str(config_file) in error


def test_launch_takes_config_then_command_line(config_file, capsys):
    main(["config", "--default"])
    text = config_file.read_text().replace("mixed_precision: 'no'", "mixed_precision: bf16")
    config_file.write_text(text.replace("num_processes: 1", "num_processes: 3"))
    capsys.readouterr()
    assert main(["launch", "--dry-run", "--max-restarts", "2", "--main-process-port", "0",
                 "-m", "my.module", "--lr", "1"]) == 0
    command = capsys.readouterr().out
    assert "TRIAX_MIXED_PRECISION=bf16" in command and "--nproc-per-node=3" in command
    assert "--max-restarts=2" in command and "--master-addr=127.0.0.1" in command
    assert "--master-port=29500" not in command  # 0 picked a free port
    assert command.rstrip().endswith("--module my.module --lr 1")


def test_busy_port_is_refused_before_any_worker_starts(config_file, tmp_path, capsys):
    marker = tmp_path / "started"
    script = tmp_path / "script.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code = main(["launch", "--num-processes", "2", "--main-process-port", str(port), str(script)])
    assert code == 2
    error = capsys.readouterr().err
    assert f"port {port} is already in use" in error and "--main-process-port 0" in error
    assert not marker.exists()


def test_a_dry_run_prints_its_command_whatever_the_port_is_doing_now(config_file, capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code = main(["launch", "--num-processes", "2", "--main-process-port", str(port), "--dry-run", "x.py"])
    assert code == 0
    assert f"--master-port={port}" in capsys.readouterr().out


def test_env_reports_versions_and_config(config_file, capsys):
    main(["config", "--default"])
    capsys.readouterr()
    assert main(["env"]) == 0
    report = capsys.readouterr().out
    assert f"torch: {torch.__version__}" in report
    assert "cpu bf16 instructions:" in report and str(config_file) in report


def test_split_between_processes_covers_inputs_once():
    items = list(range(7))
    shares = [slice_for_process(items, rank, 3) for rank in range(3)]
    assert shares == [[0, 1, 2], [3, 4], [5, 6]]
    padded = [slice_for_process(torch.arange(7), rank, 3, apply_padding=True) for rank in range(3)]
    assert [len(share) for share in padded] == [3, 3, 3] and padded[2].tolist() == [5, 6, 6]


def test_state_json_round_trip_keeps_tensors_tuples_and_int_keys():
    state = {"step": 3, "pair": (1, 2.5), 7: {"t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)},
             "scalar": torch.tensor(1.5), "empty": torch.zeros(0)}
    restored = from_json(to_json(state))
    assert restored["pair"] == (1, 2.5) and restored["step"] == 3
    assert torch.equal(restored[7]["t"], state[7]["t"]) and restored[7]["t"].dtype == torch.bfloat16
    assert torch.equal(restored["scalar"], state["scalar"]) and restored["empty"].shape == (0,)


LISTENING = """\
import os
port = int(os.environ["MASTER_PORT"])
addresses = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        fields = line.split()
        address, hex_port = fields[1].rsplit(":", 1)
        if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            addresses.append(address)
if os.environ["RANK"] == "0":
    print("rendezvous store listens on", sorted(addresses))
"""


@pytest.mark.multiprocess
def test_single_machine_launch_keeps_the_rendezvous_store_on_loopback(tmp_path):
    """torchrun's TCPStore (no authentication) listens on every interface by default; on one
    machine `triax launch` makes it listen on 127.0.0.1 only."""
    import sys

    from triax.testing import quiet_env, run

    script = tmp_path / "listening.py"
    script.write_text(LISTENING)
    result = run([sys.executable, "-m", "triax", "launch", "--num-processes", "2", "--main-process-port", "0",
                  str(script)], env=quiet_env(TRIAX_CONFIG_FILE=str(tmp_path / "none.yaml")), cwd=str(tmp_path))
    assert "rendezvous store listens on ['0100007F']" in result.stdout, result.stdout  # 127.0.0.1, nothing else


@pytest.mark.multiprocess
def test_a_triax_error_in_a_job_is_printed_once(tmp_path):
    """Every rank meets the same bad key. Under `triax launch`: one line, the last, and exit code 2.
    Under plain torchrun: one line from the ranks, and torchrun's own summary shows it as the root
    cause (torchrun's exit code and traceback are its own: docs/train.md)."""
    import sys

    from triax.testing import quiet_env, run, torchrun_command

    bad = ["train", "parallel.tp=3", f"trainer.run_dir={tmp_path / 'run'}"]
    env = quiet_env(TRIAX_CONFIG_FILE=str(tmp_path / "none.yaml"))
    launched = run([sys.executable, "-m", "triax", "launch", "--num-processes", "2", "--main-process-port", "0",
                    "-m", "triax", *bad], env=env, cwd=str(tmp_path), check=False)
    output = launched.stdout + launched.stderr
    assert launched.returncode == 2
    assert output.count("triax: error:") == 1, output
    assert launched.stderr.strip().splitlines()[-1].startswith("triax: error: the world size 2 is not divisible")
    torchrun = run(torchrun_command(2, ["-m", "triax", *bad]), env=env, cwd=str(tmp_path), check=False)
    lines = (torchrun.stdout + torchrun.stderr).splitlines()
    assert torchrun.returncode != 0
    assert sum(line.startswith("triax: error:") for line in lines) == 1, lines
    root_cause = lines[next(i for i, line in enumerate(lines) if line.startswith("Root Cause")):]
    assert any("traceback : triax: error: the world size 2" in line for line in root_cause), lines[-12:]


def test_config_help_says_where_the_file_goes(capsys):
    with pytest.raises(SystemExit):
        main(["config", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: $TRIAX_CONFIG_FILE, else ~/.cache/triax/default_config.yaml)" in text and "None" not in text
