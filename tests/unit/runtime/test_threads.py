"""The one thread rule (triax.runtime.threads) of every command that computes: the idle cores measured now,
OMP_NUM_THREADS checked like an option, and each command taking the rule's count."""

import subprocess
import sys

import pytest
import torch

import triax.runtime.threads as threads
from triax.commands.cli import main as triax_main
from triax.testing import quiet_env

from support.helpers import tiny_overrides, train


def stat_text(busy: list[int], idle: list[int]) -> str:
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]
    lines += [f"cpu{n} {b} 0 0 {i} 0 0 0 0 0 0" for n, (b, i) in enumerate(zip(busy, idle))]
    return "\n".join(lines + ["intr 5", "procs_running 3"]) + "\n"


def test_the_idle_cores_are_those_idle_over_the_sample_not_the_load_average(tmp_path, monkeypatch):
    """Between two reads of /proc/stat cpu0 was busy throughout and cpu1 idle: one core idle,
    whatever the (lagging) load average says; a CPU outside the affinity is not counted."""
    stat = tmp_path / "stat"
    stat.write_text(stat_text([100, 100, 100], [100, 100, 100]))
    monkeypatch.setattr(threads.time, "sleep",
                        lambda seconds: stat.write_text(stat_text([120, 100, 100], [100, 120, 100])))
    assert threads.idle_cores([0, 1], path=str(stat)) == pytest.approx(1.0)
    stat.write_text(stat_text([100, 100, 100], [100, 100, 100]))
    assert threads.idle_cores([0], path=str(stat)) == pytest.approx(0.0)  # cpu0 alone: busy throughout
    assert threads.idle_cores([0], path=str(tmp_path / "absent")) is None


def test_a_real_sample_reads_this_machine():
    idle = threads.idle_cores(threads.usable_cores(), seconds=0.05)
    assert idle is None or 0.0 <= idle <= len(threads.usable_cores())


@pytest.mark.parametrize("cores,idle,processes,expected", [
    (2, 1.9, 1, 2),    # idle cores (right after an install too): all of them
    (2, 0.0, 1, 1),    # two busy processes beside it: one thread, which no busy core holds up
    (2, 0.8, 1, 1),    # one core busy: one thread
    (16, 12.4, 2, 8),  # two processes per host: each its share of the cores
    (16, 5.8, 1, 6),   # only the idle cores
    (1, 0.0, 4, 1),    # never fewer than one
])
def test_the_default_thread_count_is_the_idle_cores_share(cores, idle, processes, expected):
    choice = threads.choose_threads(processes, cores=cores, idle=idle, environment={})
    assert choice.threads == expected
    assert choice.describe() == (f"{expected} thread{'s' if expected > 1 else ''} each ({cores} cores, "
                                 f"{idle:.1f} idle; OMP_NUM_THREADS to choose)")


def test_omp_num_threads_is_the_users_choice_when_valid():
    choice = threads.choose_threads(1, cores=64, idle=0.0, environment={"OMP_NUM_THREADS": "3"})
    assert choice.threads == 3 and choice.reason == "OMP_NUM_THREADS=3"


@pytest.mark.parametrize("value", ["0", "abc", "1000000000", "-1", "2.5", "4,2"])
def test_a_bad_omp_num_threads_is_refused_like_an_option(value, monkeypatch, capsys):
    with pytest.raises(ValueError, match=f"OMP_NUM_THREADS='{value}' is not a thread count"):
        threads.choose_threads(1, environment={"OMP_NUM_THREADS": value})
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert triax_main(["eval", "runs/none"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "whole number from 1 to 4096" in error, error


def test_a_bad_omp_num_threads_is_one_line_before_torch_is_loaded(tmp_path):
    """torch's OpenMP runtime would add 'libgomp: Invalid value ...' (and carry on) if imported first."""
    done = subprocess.run([sys.executable, "-m", "triax", "generate", "runs/gpt"], cwd=tmp_path, text=True,
                          capture_output=True, env=quiet_env(OMP_NUM_THREADS="abc"), timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "libgomp" not in done.stderr, done.stderr


@pytest.fixture
def rule_says(monkeypatch):
    """No OMP_NUM_THREADS and a machine whose sample finds `idle` cores of 2; torch's count put back after."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: [0, 1])

    def say(idle: float) -> None:
        monkeypatch.setattr(threads, "idle_cores", lambda cpus: idle)
        torch.set_num_threads(2 if idle < 1 else 1)  # the other count, so the command has to set it

    yield say
    torch.set_num_threads(before)


@pytest.mark.multiprocess
def test_eval_generate_and_tokenize_compute_with_the_rules_threads(rule_says, tmp_path, tiny_corpus, capsys):
    run_dir = str(tmp_path / "run")
    train(tiny_overrides(run_dir, tiny_corpus, **{"trainer.max_steps": 2}))
    for idle, expected in ((0.3, 1), (1.9, 2)):
        rule_says(idle)
        assert triax_main(["eval", run_dir]) == 0 and torch.get_num_threads() == expected
        rule_says(idle)
        assert triax_main(["generate", run_dir, "--tokens", "3", "--prompt", "the"]) == 0
        assert torch.get_num_threads() == expected
    rule_says(0.3)
    assert triax_main(["tokenize", str(tiny_corpus), "--out", str(tmp_path / "tok"), "--vocab-size", "300"]) == 0
    import os

    assert os.environ["RAYON_NUM_THREADS"] == "1"  # the tokenizer's pool, from the same rule


def test_the_doctor_reports_and_uses_the_rules_threads(rule_says):
    from triax.commands.doctor import parse
    from triax.config import compose_config
    from triax.doctor.readiness import Doctor
    from triax.doctor.system import device_check
    from triax.runtime.place import detect_place
    from triax.train.needs import run_needs

    rule_says(0.2)
    doctor = Doctor(compose_config([]), parse([]), detect_place(), run_needs)
    assert torch.get_num_threads() == 1
    figure = device_check(doctor.device, doctor.threads).figure
    assert "1 thread each (2 cores, 0.2 idle; OMP_NUM_THREADS to choose), as `triax train` would" in figure, figure


@pytest.mark.multiprocess
def test_with_every_core_kept_busy_beside_it_the_rule_takes_one_thread():
    """Busy processes started a moment ago (the load average has not followed yet) are seen at once."""
    cores = threads.usable_cores()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in cores]
    try:
        import time

        time.sleep(1.0)  # they are running
        choice = threads.choose_threads(1, environment={})
        assert choice.threads == 1 and choice.reason.startswith(f"{len(cores)} cores, "), choice
        assert float(choice.reason.split(", ")[1].split()[0]) < 0.5, choice  # 'N cores, X idle; ...'
    finally:
        for process in busy:
            process.kill()
            process.wait()
