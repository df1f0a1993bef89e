"""`triax horovodrun` hardening: hosts and numbers validated, ssh argv safe, environment values off
the command line, and one failing host stops the others."""

import subprocess
import sys
import time
import types

import pytest

from triax.commands.cli import main as cli_main
from triax.errors import TriaxError
from triax.horovod import launcher, processes
from triax.horovod.hosts import parse_hosts




@pytest.mark.parametrize("args, message", [
    (["--hostfile", "/nonexistent/hosts"], "cannot read the hostfile /nonexistent/hosts"),
    (["-H", "node1:abc"], "slots='abc' is not a whole number"),
    (["-H", "node1:-2"], "slots=-2 must be at least 1"),
    (["-H=-oProxyCommand=touch /tmp/pwned:1,node2:1"], "is not a host name"),
    (["-p", "-22", "-H", "a:1,b:1"], "-22 is not a port"),
    (["--master-port", "0"], "0 is not a port"),
    (["-np", "-1"], "-1 must be at least 1"),
])
def test_bad_arguments_fail_with_one_line_and_exit_2(args, message, capsys):
    assert cli_main(["horovodrun", *args, "--dry-run", "python", "train.py"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and not captured.out, captured


def test_hostfile_slots_are_validated(tmp_path):
    hostfile = tmp_path / "hosts"
    for content, message in [("node1 slots=abc\n", "slots='abc'"), ("node1 slots=-1\n", "slots=-1"),
                             ("-oProxyCommand=x slots=1\n", "not a host name"), ("# empty\n", "lists no hosts")]:
        hostfile.write_text(content)
        with pytest.raises(TriaxError, match=message):
            parse_hosts(None, str(hostfile), None)


def options(**overrides):
    values = dict(ssh_option=[], ssh_port=None, ssh_identity_file=None)
    values.update(overrides)
    return types.SimpleNamespace(**values)


def test_ssh_argv_puts_the_host_after_double_dash_and_keeps_values_off_it(monkeypatch):
    monkeypatch.setenv("HOROVOD_SECRET_TOKEN", "s3cret value; rm -rf /")
    monkeypatch.setenv("TRIAX_BAD NAME", "x")  # not a shell name: never forwarded
    argv, script = processes.remote_start("node2", ["python", "train.py", "--lr", "1e-3; id"],
                                           options(ssh_option=["StrictHostKeyChecking=accept-new"], ssh_port=2222))
    assert argv[:6] == ["ssh", "-o", "StrictHostKeyChecking=accept-new", "-p", "2222", "--"]
    assert argv[6] == "node2" and len(argv) == 8
    assert not any("StrictHostKeyChecking=no" in word for word in argv)
    assert not any("s3cret" in word for word in argv)
    assert "export HOROVOD_SECRET_TOKEN='s3cret value; rm -rf /'" in script
    assert "BAD NAME" not in script
    assert script.strip().endswith("exec python train.py --lr '1e-3; id'")


@pytest.mark.multiprocess
def test_the_stdin_script_runs_every_word_literally(tmp_path, monkeypatch):
    monkeypatch.setenv("HOROVOD_PROBE", "$(touch pwned) `touch pwned2` 'q\"")
    marker = tmp_path / "out.txt"
    command = [sys.executable, "-c", "import os,sys; open(sys.argv[1],'w').write(os.environ['HOROVOD_PROBE'] + '|' + sys.argv[2])",
               str(marker), "$(touch pwned3); x"]
    argv, script = processes.remote_start("node2", command, options())
    # What ssh would run on the far side, run here: the remote shell word and the stdin script.
    subprocess.run(["sh", "-c", argv[-1]], input=script.encode(), cwd=tmp_path, check=True, timeout=60)
    assert marker.read_text() == "$(touch pwned) `touch pwned2` 'q\"|$(touch pwned3); x"
    assert not any(tmp_path.glob("pwned*"))


@pytest.mark.multiprocess
def test_one_failing_host_stops_the_others(capsys):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    failing = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"], start_new_session=True)
    began = time.monotonic()
    assert launcher.supervise(["node1", "node2"], [sleeper, failing]) == 3
    assert time.monotonic() - began < 60 and sleeper.poll() is not None
    err = capsys.readouterr().err
    assert "host node2 (node 1) exited with code 3; stopping node1" in err
    assert "Horovod detected that one or more processes exited with non-zero status, thus causing the job to be " \
           "terminated. The first process to do so was: Process name: node2 Exit code: 3" in err, err
