"""Every option of Horovod 0.28's horovodrun (horovod/runner/launch.py, parse_args) is either
honoured by `triax horovodrun` or refused in one line that names it: none is accepted and
ignored. The launcher's side of the workers' output (prefixes, --output-filename files, the start
lines --start-timeout counts) is checked here on pipes, without starting a job."""

import os
import shlex
import subprocess
import sys
import types

import pytest

import triax.horovod as hvd
from support.horovod_support import REPO, child_env
from triax.commands.cli import main as cli_main
from triax.commands import horovodrun
from triax.horovod import horovodrun_options, run_function
from triax.horovod.output import JobOutput, StartWatch
from triax.launch.horovod_worker import lines, prefix, started_line
from triax.errors import TriaxError

# Horovod 0.28.1's parse_args, option by option (its first spelling), with a value where it takes one.
HOROVOD_OPTIONS = [
    "-cb", "--disable-cache", "--start-timeout=5", "--network-interfaces=lo", "--network-interface=lo",
    "--output-filename=out", "--verbose", "-p=22", "-i=key", "--fusion-threshold-mb=8", "--cycle-time-ms=2",
    "--cache-capacity=0", "--hierarchical-allreduce", "--no-hierarchical-allreduce", "--hierarchical-allgather",
    "--no-hierarchical-allgather", "--torus-allreduce", "--no-torus-allreduce", "--autotune", "--no-autotune",
    "--autotune-log-file=at.csv", "--autotune-warmup-samples=3", "--autotune-steps-per-sample=10",
    "--autotune-bayes-opt-max-samples=20", "--autotune-gaussian-process-noise=0.8", "--min-np=1",
    "--max-np=2", "--slots-per-host=1", "--elastic-timeout=60", "--reset-limit=1",
    "--blacklist-cooldown-range=1 2", "--timeline-filename=t.json", "--timeline-mark-cycles",
    "--no-timeline-mark-cycles", "--no-stall-check", "--stall-check", "--stall-check-warning-time-seconds=60",
    "--stall-check-shutdown-time-seconds=0", "--mpi-threads-disable", "--no-mpi-threads-disable",
    "--mpi-args=--map-by ppr:1:node", "--tcp", "--binding-args=--bind-to none", "--num-nccl-streams=1",
    "--thread-affinity=0", "--gloo-timeout-seconds=30", "--log-level=INFO", "--log-with-timestamp",
    "--log-without-timestamp", "-prefix-timestamp", "--log-hide-timestamp", "--no-log-hide-timestamp",
    "-H=localhost:2", "-hostfile=hosts", "--host-discovery-script=./discover.sh", "--gloo", "--mpi", "--jsrun",
]
REFUSED = {
    "--cycle-time-ms", "--cache-capacity", "--hierarchical-allreduce", "--hierarchical-allgather", "--torus-allreduce",
    "--autotune", "--autotune-log-file", "--autotune-warmup-samples", "--autotune-steps-per-sample",
    "--autotune-bayes-opt-max-samples", "--autotune-gaussian-process-noise", "--timeline-filename",
    "--timeline-mark-cycles", "--stall-check", "--stall-check-warning-time-seconds",
    "--stall-check-shutdown-time-seconds", "--mpi-threads-disable", "--no-mpi-threads-disable", "--mpi-args",
    "--binding-args", "--num-nccl-streams", "--thread-affinity", "--log-without-timestamp", "--log-hide-timestamp",
    "--mpi", "--jsrun",
}


def words(option: str) -> list[str]:
    flag, equals, value = option.partition("=")
    if not equals:
        return [flag]
    if flag == "--blacklist-cooldown-range":
        return [flag, *value.split()]
    return [f"{flag}={value}"] if flag.startswith("--") else [flag, value]


@pytest.mark.parametrize("option", [o for o in HOROVOD_OPTIONS if o.partition("=")[0] in REFUSED])
def test_an_option_triax_cannot_honour_is_one_line_naming_it(option, capsys):
    assert cli_main(["horovodrun", "-np", "2", *words(option), "--dry-run", "python", "train.py"]) == 2
    captured = capsys.readouterr()
    lines_ = captured.err.strip().splitlines()
    flag, equals, value = option.partition("=")
    shown = {"--log-hide-timestamp": "--log-without-timestamp"}.get(flag, flag)
    shown += f" {shlex.quote(value)}" if equals else ""  # the value given, after the option
    assert len(lines_) == 1 and lines_[0].startswith(f"triax: error: {shown}: ") and not captured.out, captured


@pytest.mark.parametrize("option", [o for o in HOROVOD_OPTIONS if o.partition("=")[0] not in REFUSED])
def test_every_other_horovod_option_is_understood(option):
    args = horovodrun_options.parse(["-np", "2", *words(option), "python", "train.py"])
    assert args.command == ["python", "train.py"]


def dry_run(capsys, *options):
    assert horovodrun.main(["-np", "2", *options, "--dry-run", "python", "train.py"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    return line.split(" /")[0]  # "[localhost] NAME=value ...", before the command


def test_options_reach_the_workers_as_horovodrun_sets_them(capsys):
    assert dry_run(capsys, "--fusion-threshold-mb", "32") == "[localhost] HOROVOD_FUSION_THRESHOLD=33554432"
    assert dry_run(capsys, "--tcp") == "[localhost] NCCL_IB_DISABLE=1"
    assert dry_run(capsys, "--network-interface", "eth0", "--network-interfaces", "eth1,eth0") == (
        "[localhost] GLOO_SOCKET_IFNAME=eth0,eth1 HOROVOD_GLOO_IFACE=eth0 NCCL_SOCKET_IFNAME=eth0,eth1")
    assert dry_run(capsys, "--log-level", "DEBUG") == "[localhost] HOROVOD_LOG_LEVEL=DEBUG TORCH_CPP_LOG_LEVEL=INFO"
    assert dry_run(capsys, "--no-autotune", "--no-stall-check", "--disable-cache", "--gloo") == "[localhost]"


def test_the_config_file_sets_options_and_the_command_line_wins(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("controller: gloo\nparams:\n  fusion_threshold_mb: 8\n  hierarchical_allreduce: false\n"
                      "library_options:\n  gloo_timeout_seconds: 45\nlogging:\n  level: error\n"
                      "stall_check:\n  enabled: false\n")
    assert dry_run(capsys, "--config-file", str(config)) == (
        "[localhost] HOROVOD_GLOO_TIMEOUT_SECONDS=45 HOROVOD_FUSION_THRESHOLD=8388608 HOROVOD_LOG_LEVEL=ERROR "
        "TORCH_CPP_LOG_LEVEL=ERROR")
    assert "HOROVOD_FUSION_THRESHOLD=1048576 " in dry_run(capsys, "--config-file", str(config),
                                                          "--fusion-threshold-mb", "1")


@pytest.mark.parametrize("text, message", [
    ("params:\n  cycle_time_ms: 5\n", "params.cycle_time_ms=5 in --config-file {}: triax has no background cycle"),
    ("stall_check:\n  enabled: true\n", "stall_check.enabled=True in --config-file {}: triax has no stall check"),
    ("controller: mpi\n", "controller='mpi' in --config-file {}: triax horovodrun runs gloo only"),
    ("params:\n  fusion_treshold_mb: 5\n", "params.fusion_treshold_mb is not one of Horovod's keys"),
    ("tuning:\n  x: 1\n", "'tuning' is not one of Horovod's sections"),
    ("params: [1, 2\n", "is not a YAML file"),
    ("library_options:\n  gloo_timeout_seconds: -1\n", "must be a positive number of seconds"),
])
def test_a_config_file_triax_cannot_honour_is_one_line(tmp_path, capsys, text, message):
    config = tmp_path / "config.yaml"
    config.write_text(text)
    assert cli_main(["horovodrun", "-np", "2", "--config-file", str(config), "--dry-run", "python", "x.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message.format(config) in err[0], err


def test_check_build_and_version(capsys):
    assert cli_main(["horovodrun", "-cb"]) == 0
    out = capsys.readouterr().out
    assert "[X] PyTorch" in out and "[ ] MPI" in out and "[X] Gloo" in out
    with pytest.raises(SystemExit) as exited:
        cli_main(["horovodrun", "--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("triax ")


def test_start_timeout_comes_from_the_option_then_horovods_variable(monkeypatch):
    parse = horovodrun_options.parse
    monkeypatch.delenv("HOROVOD_START_TIMEOUT", raising=False)
    assert horovodrun_options.start_timeout(parse(["python", "x.py"])) == 30  # Horovod's default
    monkeypatch.setenv("HOROVOD_START_TIMEOUT", "45")
    assert horovodrun_options.start_timeout(parse(["python", "x.py"])) == 45
    assert horovodrun_options.start_timeout(parse(["--start-timeout", "7", "python", "x.py"])) == 7
    monkeypatch.setenv("HOROVOD_START_TIMEOUT", "soon")
    with pytest.raises(TriaxError, match="HOROVOD_START_TIMEOUT='soon' is not a whole number"):
        horovodrun_options.start_timeout(parse(["python", "x.py"]))
    with pytest.raises(TriaxError, match="--start-timeout: 0 must be at least 1"):
        parse(["--start-timeout", "0", "python", "x.py"])


def test_lines_end_at_newlines_and_carriage_returns():
    pieces = [b"a\nb", b"c\r", b"50%\r100%\n", b"x" * 70000, b"tail"]
    got = list(lines(iter(pieces)))
    assert got[:4] == [b"a\n", b"bc\r", b"50%\r", b"100%\n"]
    assert b"".join(got[4:]) == b"x" * 70000 + b"tail" and len(got[4]) == 1 << 16


class Pipes:
    """A stand-in for a started process: its stdout and stderr are pipes we write into."""

    def __init__(self):
        out_r, self.out = os.pipe()
        err_r, self.err = os.pipe()
        self.stdout, self.stderr = os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb")

    def close(self):
        os.close(self.out)
        os.close(self.err)


def test_each_ranks_lines_go_to_its_files_and_start_lines_are_counted(tmp_path, capfd):
    output = JobOutput(str(tmp_path / "logs"), np=12)
    for rank in (3, 11):
        output.open_rank(rank)
    process = Pipes()
    output.follow(process)
    os.write(process.out, started_line(3) + prefix(3, "stdout", False) + b"loss 1\n" + started_line(11))
    os.write(process.out, prefix(11, "stdout", True) + b"step 2\r" + b"torchrun's own line\n")
    os.write(process.err, prefix(3, "stderr", False) + b"warning\n")
    process.close()
    output.close()
    assert output.started_ranks() == {3, 11}
    folder = tmp_path / "logs"
    assert sorted(p.name for p in folder.iterdir()) == ["rank.03", "rank.11"]  # padded to sort in rank order
    assert (folder / "rank.03" / "stdout").read_bytes() == b"[3]<stdout>:loss 1\n"
    assert (folder / "rank.03" / "stderr").read_bytes() == b"[3]<stderr>:warning\n"
    eleven = (folder / "rank.11" / "stdout").read_bytes()
    assert eleven.endswith(b"[11]<stdout>:step 2\r") and b"torchrun" not in eleven  # time first, then the prefix
    out, err = capfd.readouterr()
    assert "<started>" not in out and "[3]<stdout>:loss 1\n" in out and "torchrun's own line\n" in out
    assert err == "[3]<stderr>:warning\n"


def test_the_start_watch_names_the_workers_that_did_not_start(monkeypatch):
    output = types.SimpleNamespace(started_ranks=lambda: {0})
    watch = StartWatch(5, {0: "localhost", 1: "node2"}, output)
    assert watch.check({0}) and not watch.check({0, 1})
    monkeypatch.setattr("triax.horovod.output.time.monotonic", lambda: watch.began + 6)
    with pytest.raises(TriaxError, match=r"timed out after 5s waiting for the workers to start \(rank 1 on node2 "
                                         r"did not\); .* raise --start-timeout"):
        watch.check({0, 1})


class Launched(Exception):
    """Raised by the stand-in for the launcher once the command line has been checked."""


def test_hvd_run_hands_every_argument_to_horovodrun(monkeypatch):
    given = []

    parse = horovodrun_options.parse

    def parse_given(argv):
        given.append(argv)
        return parse(argv)  # refused arguments are refused as on the command line

    def launch(args, extra_env=None):
        raise Launched

    monkeypatch.setattr(run_function.horovodrun_options, "parse", parse_given)
    monkeypatch.setattr(run_function.launcher, "launch", launch)
    with pytest.raises(Launched):
        hvd.run(print, num_proc=2, disable_cache=True, output_filename="logs", start_timeout=7, use_gloo=True,
                network_interfaces=["lo", "eth0"])
    assert given[-1][:given[-1].index("--")] == [
        "-np", "2", "--start-timeout=7", "--disable-cache", "--output-filename=logs", "--gloo",
        "--network-interfaces=lo,eth0"]
    with pytest.raises(ValueError, match=r"^--mpi: triax horovodrun runs gloo only"):
        hvd.run(print, num_proc=2, use_mpi=True)
    with pytest.raises(ValueError, match=r"^--mpi-args '--map-by ppr:1:node': triax horovodrun runs gloo only"):
        hvd.run(print, num_proc=2, mpi_args="--map-by ppr:1:node")  # a value starting with '-' stays a value


WORKER_SAYS = "import os, sys; rank = os.environ['HOROVOD_RANK']; print('hello', rank); print('oops', rank, " \
              "file=sys.stderr)"


@pytest.mark.multiprocess
def test_a_job_prefixes_each_line_with_its_rank_and_writes_horovods_files(tmp_path):
    logs = tmp_path / "logs"
    done = subprocess.run([sys.executable, "-m", "triax", "horovodrun", "-np", "2", "--output-filename", str(logs),
                           sys.executable, "-c", WORKER_SAYS], env=child_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert {"[0]<stdout>:hello 0", "[1]<stdout>:hello 1"} <= set(done.stdout.splitlines()), done.stdout
    assert {"[0]<stderr>:oops 0", "[1]<stderr>:oops 1"} <= set(done.stderr.splitlines()), done.stderr
    assert sorted(p.name for p in logs.iterdir()) == ["rank.0", "rank.1"]
    assert (logs / "rank.1" / "stdout").read_text() == "[1]<stdout>:hello 1\n"
    assert (logs / "rank.1" / "stderr").read_text() == "[1]<stderr>:oops 1\n"


@pytest.mark.multiprocess
def test_workers_that_do_not_start_in_horovod_start_timeout_stop_the_job(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text("#!/bin/sh\nexec sleep 120\n")  # a host that never answers
    (bin_dir / "ssh").chmod(0o755)
    env = child_env()  # which drops HOROVOD_* variables: set ours after
    env.update(HOROVOD_START_TIMEOUT="2", PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
    done = subprocess.run([sys.executable, "-m", "triax", "horovodrun", "-np", "2", "-H", "localhost:1,node2:1",
                           sys.executable, "-c", "pass"], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert "timed out after 2s waiting for the workers to start (rank 0 on localhost, rank 1 on node2 did not)" \
        in done.stderr, done.stderr


def test_the_docs_table_names_every_horovod_option():
    page = (REPO / "docs" / "horovod.md").read_text()
    table = page[page.index("## `triax horovodrun` options"):page.index("## Coming from Horovod")]
    flags = {o.partition("=")[0] for o in HOROVOD_OPTIONS}
    missing = [f for f in flags if f"`{f}`" not in table and f"`{f} " not in table and f"/{f}`" not in table
               and not (f.startswith("--autotune-") and "`--autotune-*`" in table)]
    assert not missing, missing
