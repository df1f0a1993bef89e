"""`triax doctor` on one process: its table, its JSON report's schema, a full snapshot disk and a
model that does not fit failing with their figures, and every bad argument refused in one line.
The multi-node checks are tests/unit/doctor/test_doctor_network.py's."""

import json
import os
import subprocess

import pytest
import torch

from triax.commands import doctor as doctor_command
from triax.doctor import network, report, storage
from triax.train.needs import run_needs
from triax.doctor.report import Check
from triax.errors import ConfigError, UsageError
from triax.runtime.place import detect_place
from triax.config import compose_config

QUICK = ["--skip", "compile", "--seconds", "0.05"]
STATUSES = {"ok", "warning", "failed", "skipped"}


def _doctor(tmp_path, *args, name="doctor.json"):
    path = tmp_path / name
    code = doctor_command.main([*QUICK, "--json", str(path), f"trainer.run_dir={tmp_path / 'run'}", *args])
    return code, json.loads(path.read_text())


def _check(content, name):
    return next(check for check in content["checks"] if check["name"] == name)


def test_report_schema_and_table(tmp_path, capsys):
    code, content = _doctor(tmp_path)
    out = capsys.readouterr().out
    assert code == 0, out
    assert content["triax_doctor"] == report.SCHEMA_VERSION
    assert content["status"] in ("ok", "warning") and content["world_size"] == 1
    assert isinstance(content["seconds"], float) and content["seconds"] > 0
    assert content["config"]["trainer"]["run_dir"] == str(tmp_path / "run")
    assert content["links"] == [] and content["nodes"][0]["ranks"] == [0]
    for check in content["checks"]:
        assert set(check) == {"name", "status", "figure", "advice", "section", "rank", "values"}
        assert check["status"] in STATUSES and check["figure"] and isinstance(check["values"], dict)
    names = [check["name"] for check in content["checks"]]
    for name in ("run", "versions", "device", "bf16", "SDPA flash", "matmul fp32", "memory",
                 "snapshot space", "snapshot write", "torch.compile", "network"):
        assert name in names, names
        assert name in out  # every check is a line of the table
    # Skipped is said, never shown as passing.
    assert _check(content, "torch.compile")["status"] == "skipped"
    assert _check(content, "network")["status"] == "skipped"
    assert _check(content, "matmul fp32")["values"]["flops"] > 0
    # The snapshot figure is triax plan's: parameters and AdamW's two moments, 12 bytes each in fp32.
    needs = run_needs(compose_config([f"trainer.run_dir={tmp_path / 'run'}"]), 1)
    assert _check(content, "snapshot space")["values"]["snapshot_bytes"] == pytest.approx(12 * needs.shape.num_params(), rel=1e-6)
    assert not os.path.exists(tmp_path / "run"), "the doctor must not create the run directory"
    assert [entry for entry in os.listdir(tmp_path) if entry.startswith(".triax-doctor")] == []


def test_bf16_run_measures_both_dtypes(tmp_path):
    code, content = _doctor(tmp_path, "trainer.precision=bf16", "--skip", "storage", "--skip", "memory")
    assert code == 0
    assert {"matmul bf16", "matmul fp32"} <= {check["name"] for check in content["checks"]}


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs, filled: where a run's snapshots would land on a full disk."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        with open(mount / "filler", "wb") as handle:
            try:
                handle.write(b"\0" * 2**20)
            except OSError:
                pass
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_snapshot_disk_fails_with_the_figure(tmp_path, small_disk, capsys):
    code, content = _doctor(tmp_path, f"trainer.snapshot_dir={small_disk / 'snapshots'}", "--skip", "system")
    out = capsys.readouterr().out
    assert code == 1 and content["status"] == "failed"
    space = _check(content, "snapshot space")
    assert space["status"] == "failed"
    assert space["values"]["free_bytes"] < space["values"]["snapshot_bytes"]
    assert space["values"]["directory"] == str(small_disk)
    assert "one snapshot needs 9.6 MiB" in space["figure"] and f"free in {small_disk}" in space["figure"]
    write = _check(content, "snapshot write")
    assert write["status"] == "failed" and "No space left on device" in write["figure"]
    assert "NOT READY" in out and "not even one snapshot fits" in out
    assert os.listdir(small_disk) == ["filler"]  # the probe is gone


def test_a_model_that_does_not_fit_fails_the_memory_check(tmp_path):
    code, content = _doctor(tmp_path, "model=gpt2-xl", "trainer.batch_size=512", "data.block_size=1024",
                            "--skip", "system", "--skip", "storage")
    memory = _check(content, "memory")
    assert code == 1 and memory["status"] == "failed"
    assert memory["values"]["needed_bytes"] > memory["values"]["total_bytes"]


def test_a_config_that_cannot_run_is_a_failed_line(tmp_path):
    code, content = _doctor(tmp_path, "parallel.tp=2", "--skip", "system")
    run = _check(content, "run")
    assert code == 1 and run["status"] == "failed" and "world size 1 is not divisible" in run["figure"]
    # What needs the run's model is said to be unchecked, not left out.
    assert _check(content, "memory")["status"] == "skipped" and _check(content, "storage")["status"] == "skipped"


def test_round_robin_meets_every_pair_once_in_disjoint_rounds():
    for count in range(2, 10):
        rounds = network.round_robin(count)
        pairs = [pair for pairs in rounds for pair in pairs]
        assert sorted(pairs) == [(a, b) for a in range(count) for b in range(a + 1, count)]
        for pairs in rounds:
            members = [node for pair in pairs for node in pair]
            assert len(members) == len(set(members))
        assert len(rounds) == count - 1 + count % 2


def test_merged_ranks_keep_the_odd_one_out():
    ok = [Check("memory", "ok", f"fine {rank}", rank=rank) for rank in range(3)]
    bad = Check("memory", "failed", "too small", "shard it", rank=3)
    merged = report.merge_ranks([[check] for check in [*ok, bad]])
    assert [(check.status, check.rank) for check in merged] == [("ok", 0), ("failed", 3)]
    merged = report.merge_ranks([[check] for check in ok])
    assert len(merged) == 1 and merged[0].rank is None and "all 3 ranks ok" in merged[0].figure
    assert report.worst([*ok, bad, Check("x", "skipped", "-")]) == "failed"
    with pytest.raises(ValueError, match="unknown check status"):
        Check("x", "fine", "-")


def test_a_node_that_sees_another_directory_is_named(tmp_path):
    needs = run_needs(compose_config([f"trainer.run_dir={tmp_path}"]), 1)
    names = ["node 0 (a 10.0.0.1)", "node 1 (b 10.0.0.2)", "node 2 (c 10.0.0.3)"]
    check = storage.shared_check(needs, [[0, 1], [0, 1], [2]], names)
    assert check.status == "failed" and check.values["blind_nodes"] == [2]
    assert "node 2 (c 10.0.0.3) does not see what node 0 (a 10.0.0.1), node 1 (b 10.0.0.2) wrote" in check.figure
    assert storage.shared_check(needs, [[0, 1, 2]] * 3, names).status == "ok"


def test_rates_are_in_bytes_and_bits():
    assert report.format_rate(6.25e6) == "6.2 MB/s (50 Mbit/s)"
    assert report.format_rate(12.5e9) == "12.50 GB/s (100.0 Gbit/s)"


# ---- hostile input ------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--sizes", "abc"], "--sizes"), (["--sizes", "0"], "--sizes"), (["--sizes", "nan"], "--sizes"),
    (["--sizes", "1,-4"], "--sizes"), (["--sizes", "1e12"], "--sizes"), (["--sizes", ""], "--sizes"),
    (["--seconds", "0"], "--seconds"), (["--seconds", "inf"], "--seconds"), (["--store-timeout", "-1"], "--store-timeout"),
    (["--link-mib", "1e9"], "--link-mib"), (["--skip", "everything"], "invalid choice"),
    (["trainer_batch"], "key=value"),
])
def test_bad_arguments_are_one_line(args, message):
    with pytest.raises(UsageError, match=message) as raised:
        doctor_command.main(args)
    assert "\n" not in str(raised.value)


def test_unknown_config_keys_are_refused():
    with pytest.raises(ConfigError, match="trainer.bach_size"):
        doctor_command.main(["trainer.bach_size=4"])


def test_the_report_never_replaces_a_file_it_did_not_write(tmp_path):
    other = tmp_path / "notes.json"
    other.write_text('{"mine": 1}')
    with pytest.raises(UsageError, match="already exists and was not written by triax"):
        doctor_command.main([*QUICK, "--json", str(other)])
    assert other.read_text() == '{"mine": 1}'
    with pytest.raises(UsageError, match="is a directory"):
        doctor_command.main([*QUICK, "--json", str(tmp_path)])
    with pytest.raises(UsageError, match="does not exist"):
        doctor_command.main([*QUICK, "--json", str(tmp_path / "missing" / "doctor.json")])
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert not report.is_doctor_report(str(fifo))  # refused at once, never blocks
    # A planted link, even to a report, is refused; with --force it is replaced, its target untouched.
    target = tmp_path / "target.json"
    target.write_text('{"triax_doctor": 1}')
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with pytest.raises(UsageError, match="already exists"):
        doctor_command.main([*QUICK, "--json", str(link)])
    code = doctor_command.main([*QUICK, "--skip", "system", "--skip", "storage", "--json", str(link), "--force",
                         f"trainer.run_dir={tmp_path / 'run'}"])
    assert code == 0 and not link.is_symlink() and target.read_text() == '{"triax_doctor": 1}'


@pytest.mark.parametrize("port", ["abc", "0", "70000", "-5"])
def test_a_bad_master_port_is_a_failed_store_line(monkeypatch, port):
    monkeypatch.setenv("MASTER_PORT", port)
    store, check = network.reach_store(detect_place({"RANK": "1", "WORLD_SIZE": "2"}), 1.0)
    assert store is None and check.status == "failed" and "MASTER_PORT" in check.figure


# ---- trainer.preflight=true ---------------------------------------------------------------------

def test_preflight_stops_a_run_whose_snapshot_disk_is_full(tmp_path, small_disk, tiny_corpus, capsys):
    from support.helpers import tiny_overrides
    from triax.train import Trainer

    overrides = tiny_overrides(tmp_path / "run", tiny_corpus, **{"trainer.preflight": "true",
                                                                 "trainer.snapshot_dir": small_disk / "snapshots"})
    with pytest.raises(ConfigError, match="trainer.preflight: a check the run needs failed"):
        Trainer(compose_config(overrides))
    out = capsys.readouterr().out
    assert "snapshot space" in out and "not even one snapshot fits" in out
    content = json.loads((tmp_path / "run" / "doctor.json").read_text())
    assert _check(content, "snapshot space")["status"] == "failed"
    assert "metrics.jsonl" not in os.listdir(tmp_path / "run")  # stopped before the run began


@pytest.mark.multiprocess
def test_preflight_runs_on_the_runs_own_processes(tmp_path, tiny_corpus):
    from support.helpers import tiny_overrides, train

    result = train(tiny_overrides(tmp_path / "run", tiny_corpus, **{"trainer.preflight": "true",
                                                                     "trainer.max_steps": 2}), nproc=2)
    content = json.loads((tmp_path / "run" / "doctor.json").read_text())
    assert content["world_size"] == 2 and content["status"] in ("ok", "warning")
    names = {check["name"] for check in content["checks"]}
    assert {"all-reduce 1.0 MiB", "all-gather 1.0 MiB", "stragglers", "snapshot space", "memory"} <= names
    assert "torch.compile" in names and _check(content, "torch.compile")["status"] == "skipped"
    assert "snapshot space" in result.stdout


def test_the_slow_node_is_named_from_its_pairs():
    nodes = [network.Node(index, f"host{index}", f"10.0.0.{index + 1}", [index]) for index in range(4)]
    fast, slow = 100e6, 5e6
    links = [{"nodes": [a, b], "busbw": slow if 3 in (a, b) else fast}
             for pairs in network.round_robin(4) for a, b in pairs]
    checks = {check.name: check for check in network.link_checks(nodes, links)}
    slowest = checks["slowest link"]
    assert slowest.status == "warning" and slowest.values["node"] == 3 and "host3 10.0.0.4" in slowest.figure
    assert slowest.values["busbw"] == slow and slowest.values["median_busbw"] == fast
    assert [checks[f"link {a}-3"].status for a in range(3)] == ["warning"] * 3
    assert checks["link 0-1"].status == "ok"
    # Within 20% of the median is no finding.
    even = [{**link, "busbw": fast * (0.85 if 3 in link["nodes"] else 1)} for link in links]
    assert {check.status for check in network.link_checks(nodes, even)} == {"ok"}
    assert network.link_checks(nodes[:1], [])[0].status == "skipped"


def test_a_rank_more_than_20_percent_slower_than_the_median_is_a_straggler():
    assert network.stragglers([100.0, 100.0, 100.0, 80.0]) == (100.0, [3])  # 1.25x the median's time
    assert network.stragglers([100.0, 100.0, 100.0, 85.0]) == (100.0, [])  # 1.18x: within 20%


def test_snapshot_places_that_are_not_directories(tmp_path):
    plain = tmp_path / "a-file"
    plain.write_text("x")
    code, content = _doctor(tmp_path, f"trainer.snapshot_dir={plain}", "--skip", "system", "--skip", "memory")
    assert code == 1 and "is not a directory" in _check(content, "snapshot space")["figure"]
    code, content = _doctor(tmp_path, "trainer.snapshot_dir=memory://snapshots", "--skip", "system",
                            "--skip", "memory", name="remote.json")
    assert code == 0
    assert [_check(content, name)["status"] for name in ("snapshot space", "snapshot write")] == ["skipped", "skipped"]


@pytest.mark.parametrize("payload", [b"", b"\xff\xfe", b"[1, 2]", b'{"host": 7}', b'{"host": "' + b"h" * 10000 + b'"}'])
def test_a_malformed_arrival_record_is_read_as_unknown(payload):
    record = network._arrival(payload)
    assert set(record) == {"host", "address"} and all(isinstance(v, str) and len(v) <= 256 for v in record.values())


def test_the_memory_estimate_counts_the_logits_the_run_keeps(tmp_path):
    """A 151,936-token vocabulary, 8 x 4,096 positions: the whole fp32 logits alone are 18.5 GiB, but the
    loss computes them in chunks under parallel.max_logits_mb (unset: 256 MB on a CPU), and the
    doctor's estimate is of that run; max_logits_mb=0 (no limit) counts the whole."""
    from triax.doctor.needs import ModelSizes, needs_of
    from triax.objectives.chunked_logits import logits_limit_mb
    from triax.parallel.plan import loss_bytes

    def activations(*overrides, device=None):
        config = compose_config([f"trainer.run_dir={tmp_path}", "trainer.batch_size=8", "model.n_layer=2",
                                 "model.n_head=4", "model.n_embd=256", *overrides])
        sizes = ModelSizes(151936, 4096, config.model, 4096)
        limit = logits_limit_mb(config.parallel.max_logits_mb, device or torch.device("cpu"))
        return needs_of(config, 1, sizes, limit).per_device.activations_gb * 2**30

    whole, chunked = activations("parallel.max_logits_mb=0"), activations()
    positions = 8 * 4096
    assert whole - chunked == pytest.approx(loss_bytes(positions, 151936, 1, 0) - loss_bytes(positions, 151936, 1, 256))
    assert whole - chunked > 18 * 2**30
    assert activations("parallel.max_logits_mb=64") < chunked  # a smaller limit, smaller chunks


def test_run_needs_applies_the_runs_logits_limit(tmp_path, monkeypatch):
    """run_needs hands the doctor's estimate the limit the run applies on its device."""
    from triax.objectives.logits_budget import CPU_LOGITS_MB

    seen = []
    monkeypatch.setattr("triax.train.needs.needs_of", lambda config, world, sizes, limit: seen.append(limit))
    config = compose_config([f"trainer.run_dir={tmp_path}"])
    run_needs(config, 1)
    config.parallel.max_logits_mb = 32.0
    run_needs(config, 1, device=torch.device("cpu"))
    assert seen == [CPU_LOGITS_MB, 32.0]


def test_a_gpu_run_counts_what_it_keeps_in_host_memory(tmp_path):
    from triax.doctor.system import host_bytes_per_gpu_process

    config = compose_config([f"trainer.run_dir={tmp_path}"])
    needs = run_needs(config, 1)
    states = needs.per_device.params_gb + needs.per_device.optimizer_gb
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")  # devices by name: no GPU needed
    # async_save (unset: on with CUDA) stages parameters and AdamW's moments on the host.
    assert host_bytes_per_gpu_process(needs, config.trainer, gpu, False) == int(states * 2**30)
    assert host_bytes_per_gpu_process(needs, config.trainer, cpu, False) == 0
    config.trainer.async_save = False
    offloaded = states + needs.per_device.grads_gb
    assert host_bytes_per_gpu_process(needs, config.trainer, gpu, True) == int(offloaded * 2**30)


def test_a_check_that_raises_is_a_failed_line(tmp_path, monkeypatch):
    from triax.doctor import system

    def broken(*args):
        raise RuntimeError("CUDA driver initialization failed\ndetails")

    monkeypatch.setattr(system, "device_check", broken)
    monkeypatch.delenv("TRIAX_DEBUG", raising=False)
    code, content = _doctor(tmp_path, "--skip", "storage")
    device = _check(content, "device")
    assert code == 1 and device["status"] == "failed"
    assert device["figure"] == "the check itself failed: RuntimeError: CUDA driver initialization failed"
    assert _check(content, "matmul fp32")["status"] == "ok"  # the others still ran
