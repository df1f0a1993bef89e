"""The elastic pieces one by one, in this process: Horovod's placement of ranks, the discovery
script's output, host order and the blacklist, the command line's checks, ElasticSampler and
TorchState's handlers (Horovod's own semantics, from its test_torch_elastic.py and its sources)."""

import copy
import random

import pytest
import torch
from torch.utils.data import DataLoader

from support.horovod_support import horovod  # noqa: F401  (fixture)
from triax.commands.cli import main as cli_main
from triax.horovod.elastic import protocol
from triax.horovod.elastic.discovery import DiscoveryError, DiscoveryScript, HostManager
from triax.horovod.slots import SlotInfo, assign


def test_ranks_fill_hosts_in_order_and_cross_ranks_join_equal_local_ranks():
    infos = assign([("a", 2), ("b", 1), ("c", 2)])
    assert [(i.hostname, i.rank, i.local_rank, i.local_size) for i in infos] == [
        ("a", 0, 0, 2), ("a", 1, 1, 2), ("b", 2, 0, 1), ("c", 3, 0, 2), ("c", 4, 1, 2)]
    # local rank 0 lives on a, b, c; local rank 1 on a and c only
    assert [(i.cross_rank, i.cross_size) for i in infos] == [(0, 3), (0, 2), (1, 3), (2, 3), (1, 2)]
    assert all(i.size == 5 for i in infos)
    capped = assign([("a", 2), ("b", 2)], max_np=3)
    assert [(i.hostname, i.local_rank, i.size) for i in capped] == [("a", 0, 3), ("a", 1, 3), ("b", 0, 3)]
    slot = capped[2]
    assert SlotInfo.decode("b", slot.encode()) == slot
    assert slot.environment()["HOROVOD_CROSS_SIZE"] == "2" and slot.environment()["HOROVOD_HOSTNAME"] == "b"


def test_discovery_script_lines():
    script = DiscoveryScript("unused", default_slots=4)
    assert script.parse("node1:2\n\nnode2\n  node3:0 \n") == {"node1": 2, "node2": 4, "node3": 0}
    assert script.parse("") == {}  # nothing available is an answer
    with pytest.raises(DiscoveryError, match="without slots"):
        DiscoveryScript("unused", default_slots=None).parse("node1\n")
    with pytest.raises(Exception, match="is not a host name"):
        script.parse("-oProxyCommand=x:1\n")
    with pytest.raises(Exception, match="slots='many'"):
        script.parse("node1:many\n")


def test_discovery_script_is_run_and_checked(tmp_path):
    good = tmp_path / "hosts.sh"
    good.write_text("#!/bin/sh\necho node1:2\necho node2:1\n")
    good.chmod(0o755)
    script = DiscoveryScript(str(good), None)
    script.check()
    assert script.find() == {"node1": 2, "node2": 1}
    failing = tmp_path / "fail.sh"
    failing.write_text("#!/bin/sh\necho boom >&2\nexit 3\n")
    failing.chmod(0o755)
    with pytest.raises(DiscoveryError, match="exited with code 3: boom"):
        DiscoveryScript(str(failing), None).check()
    plain = tmp_path / "plain.sh"
    plain.write_text("echo node1:1\n")
    with pytest.raises(DiscoveryError, match="is not executable"):
        DiscoveryScript(str(plain), None).check()
    with pytest.raises(DiscoveryError, match="does not exist"):
        DiscoveryScript(str(tmp_path / "missing.sh"), None).check()


def test_hosts_keep_their_order_and_changes_are_flagged():
    hosts = HostManager()
    assert hosts.update({"a": 1, "b": 2}, now=0) == protocol.ADDED
    assert hosts.update({"a": 1, "b": 2}, now=1) == protocol.NO_UPDATE
    assert hosts.update({"c": 1, "b": 1, "a": 1}, now=2) == protocol.ADDED | protocol.REMOVED
    assert hosts.available() == [("a", 1), ("b", 1), ("c", 1)]  # oldest first: rank 0 stays on a
    assert hosts.update({"c": 1, "b": 1}, now=3) == protocol.REMOVED
    assert hosts.update({"a": 1, "c": 1, "b": 1}, now=4) == protocol.ADDED
    assert [host for host, _ in hosts.available()] == ["b", "c", "a"]  # a came back: it is the newest


def test_a_blacklisted_host_stays_out_or_returns_after_its_cooldown():
    forever = HostManager()
    forever.update({"a": 1, "b": 1}, now=0)
    forever.blacklist("b", now=0)
    assert forever.available() == [("a", 1)] and forever.available_slots() == 1
    assert forever.update({"a": 1, "b": 1}, now=10_000) == protocol.NO_UPDATE
    assert forever.available() == [("a", 1)]

    cooling = HostManager(cooldown_range=(10, 15))
    cooling.update({"a": 1, "b": 1}, now=0)
    cooling.blacklist("b", now=0)  # 10 * 2 + up to 10, kept within [10, 15]: back at 15
    assert cooling.update({"a": 1, "b": 1}, now=14.9) == protocol.NO_UPDATE
    assert cooling.update({"a": 1, "b": 1}, now=15) == protocol.ADDED
    assert cooling.available() == [("a", 1), ("b", 1)] and not cooling.is_blacklisted("b")


@pytest.mark.parametrize("args, message", [
    (["--min-np", "3", "-np", "2"], "--min-np 3 is more than -np 2"),
    (["-np", "3", "--min-np", "1", "--max-np", "2"], "--max-np 2 is less than -np 3"),
    (["-np", "2", "--max-np", "4"], "--max-np applies to elastic jobs only"),
    (["-np", "2", "--slots-per-host", "2"], "--slots-per-host applies to elastic jobs only"),
    (["-np", "2", "--min-np", "1"], "needs at least 2 hosts"),
    (["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "20", "10", "-H", "a:1,b:1"],
     "need 1 <= MIN_S <= MAX_S <= 3600"),
    (["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "0", "10", "-H", "a:1,b:1"], "MIN_S"),
    (["-np", "2", "--host-discovery-script", "/nonexistent/hosts.sh"], "/nonexistent/hosts.sh does not exist"),
    (["-np", "2", "--host-discovery-script", "no-such-command-here"], "is not a command on PATH"),
    (["-np", "2", "--host-discovery-script", "true", "-H", "a:1"], "not both"),
    (["-np", "2", "--min-np", "x"], "'x' is not a whole number"),
    (["-np", "2", "--reset-limit", "-1", "--min-np", "1"], "-1 must be at least 0"),
    (["-np", "2", "--elastic-timeout", "0", "--min-np", "1"], "0 must be at least 1"),
])
def test_elastic_options_are_checked_before_anything_starts(args, message, capsys):
    assert cli_main(["horovodrun", *args, "python", "train.py"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and not captured.out, captured


def test_elastic_dry_run_prints_each_worker_with_horovods_variables(tmp_path, capsys):
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho nodeA:2\necho nodeB:2\n")
    script.chmod(0o755)
    assert cli_main(["horovodrun", "-np", "2", "--max-np", "3", "--host-discovery-script", str(script),
                     "--dry-run", "python", "train.py"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3  # as many as --max-np allows
    assert lines[2].startswith("[nodeB] HOROVOD_HOSTNAME=nodeB HOROVOD_RANK=2 HOROVOD_SIZE=3 HOROVOD_LOCAL_RANK=0")
    assert lines[2].endswith("HOROVOD_CROSS_RANK=1 HOROVOD_CROSS_SIZE=2 python train.py")


class Numbers(torch.utils.data.Dataset):
    def __init__(self, count):
        self.count = count

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        return index


def test_elastic_sampler_follows_horovods_order_and_record_batch(horovod):
    dataset = Numbers(16)
    sampler = horovod.elastic.ElasticSampler(dataset, shuffle=True, seed=5)
    order = list(range(16))
    random.Random(5).shuffle(order)  # Horovod's order: Python's shuffle, seeded with seed + epoch
    assert list(sampler) == order and len(sampler) == 16
    sampler.record_batch(0, 4)
    sampler.record_batch(1, 4)
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 8}
    sampler.reset()
    assert list(sampler) == order[8:]  # what is left of the epoch
    sampler.set_epoch(1)
    again = list(range(16))
    random.Random(6).shuffle(again)
    assert list(sampler) == again and sampler.processed_num == 0
    assert list(horovod.elastic.ElasticSampler(dataset, shuffle=False)) == list(range(16))


def test_elastic_sampler_in_torch_state_commit_restore_sync(horovod):
    # Horovod's test_elastic_sampler, in words: a partial epoch is committed, later progress is
    # undone by restore, and the loader then yields only what is left.
    dataset = Numbers(16)
    sampler = horovod.elastic.ElasticSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    state = horovod.elastic.TorchState(sampler=sampler, epoch=0)
    state.sync()
    sampler.set_epoch(2)
    for batch_idx in range(3):
        sampler.record_batch(batch_idx, 2)
    committed = copy.copy(sampler.processed_num)
    state.commit()
    sampler.record_batch(3, 2)
    sampler.record_batch(4, 2)
    state.restore()
    assert sampler.processed_num == committed == 6 and sampler.epoch == 2
    state.sync()
    batches = list(loader)
    assert sum(len(batch) for batch in batches) == 10 and len(batches) == 5
    seen = [int(i) for batch in batches for i in batch]
    order = list(range(16))
    random.Random(0 + 2).shuffle(order)  # seed 0, epoch 2
    assert seen == order[6:]  # the committed six are not processed again


def test_torch_state_keeps_every_model_and_optimizer_it_is_given(horovod):
    torch.manual_seed(0)
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(list(first.parameters()) + list(second.parameters()), lr=0.1, momentum=0.9)
    state = horovod.elastic.TorchState(first, optimizer, head=second, step=0)
    before = {k: v.clone() for k, v in second.state_dict().items()}
    with torch.no_grad():
        second.weight.add_(1.0)
    state.step = 5
    state.restore()  # the second model is kept by its handler too, as in Horovod
    assert torch.equal(second.weight, before["weight"]) and state.step == 0
    replacement = torch.nn.Linear(3, 1)
    state.head = replacement  # a new value for a handled name is what is kept from now on
    with torch.no_grad():
        replacement.weight.zero_()
    state.restore()
    assert state.head is replacement and not torch.equal(replacement.weight, torch.zeros(1, 3))


# ---- the driver's decisions, Horovod's rules, without processes ------------------------------
class FakeStore:
    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value

    def check(self, keys):
        return all(key in self.values for key in keys)

    def add(self, key, amount):
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]


class FakeProcess:
    pid = 0

    def poll(self):
        return None


def driver_with(hosts, *, reset_limit=None, min_np=1, max_np=None):
    from triax.horovod.elastic import driver as elastic_driver
    from triax.horovod.elastic.discovery import FixedHosts

    settings = elastic_driver.ElasticSettings(command=["python", "train.py"], np=min_np, min_np=min_np,
                                              max_np=max_np, discovery=FixedHosts(hosts), reset_limit=reset_limit,
                                              cooldown_range=None, elastic_timeout=5, ssh=None)
    job = elastic_driver._Driver(settings, store=FakeStore(), hosts=HostManager())
    job.hosts.update(dict(hosts), now=0)
    job.assignment = assign(job.hosts.available(), max_np)
    started = []
    job.start_worker = lambda slot: started.append(slot)
    for number, slot in enumerate(job.assignment):
        job.workers[f"w{number}"] = elastic_driver._Worker(f"w{number}", slot, FakeProcess())
    return job, started


HOROVOD_FAILURE = "Horovod detected that one or more processes exited with non-zero status"  # its tests match this


def test_driver_ends_the_job_when_a_worker_succeeds_or_every_worker_failed(capsys):
    job, _ = driver_with([("a", 1), ("b", 1)])
    job.workers["w0"].exit_code, job.workers["w1"].exit_code = 0, 0
    assert job.decide() == 0
    job, _ = driver_with([("a", 1), ("b", 1)])
    job.workers["w0"].exit_code, job.workers["w1"].ready = 0, True
    assert job.decide() == 0  # one success ends the job (the waiting worker is stopped)
    assert HOROVOD_FAILURE not in capsys.readouterr().err
    job, _ = driver_with([("a", 1), ("b", 1)])
    job.workers["w0"].exit_code, job.workers["w1"].exit_code = 3, 4
    job.workers["w0"].failed_at, job.workers["w1"].failed_at = 2.0, 1.0  # b's worker failed first
    assert job.decide() == 4
    err = capsys.readouterr().err
    assert f"{HOROVOD_FAILURE}, thus causing the job to be terminated. The first process to do so was: " \
           "Process name: b[0] Exit code: 4" in err, err
    job, _ = driver_with([("a", 1), ("b", 1)])
    job.workers["w0"].exit_code, job.workers["w1"].exit_code = 0, 5  # a success, and a failure
    assert job.decide() == 5 and "Process name: b[0] Exit code: 5" in capsys.readouterr().err


def test_driver_blacklists_a_failed_workers_host_and_hands_out_the_next_round():
    job, started = driver_with([("a", 2), ("b", 1)])
    job.workers["w0"].ready = job.workers["w1"].ready = True
    job.workers["w2"].exit_code = -9  # b's worker was killed
    assert job.decide() is None and job.hosts.is_blacklisted("b")
    assert job.round == 1 and job.resets == 1 and not started
    assert job.store.values[protocol.assignment_key(1, "w0")].startswith("0,2,0,2,0,1;")
    assert job.store.values[protocol.assignment_key(1, "w1")].startswith("1,2,1,2,0,1;")
    assert set(job.workers) == {"w0", "w1"}


def test_driver_stops_after_the_reset_limit_and_when_every_host_is_blacklisted(capsys):
    job, _ = driver_with([("a", 1), ("b", 1)], reset_limit=0)
    job.workers["w0"].ready, job.workers["w1"].exit_code = True, 1
    assert job.decide() == 1
    assert "number of resets during elastic job exceeded limit: 0" in capsys.readouterr().err
    job, _ = driver_with([("a", 2)])
    job.workers["w0"].ready, job.workers["w1"].exit_code = True, 1
    assert job.decide() == 1  # a's worker failed: a is blacklisted, and a was the only host
    err = capsys.readouterr().err
    assert "every host of the job is blacklisted" in err and f"{HOROVOD_FAILURE}" in err, err
    assert "Process name: a[1] Exit code: 1" in err, err


def test_driver_removes_and_adds_slots_as_the_hosts_change():
    job, started = driver_with([("a", 1), ("b", 1)], max_np=3)
    job.hosts.update({"a": 1}, now=1)  # b left: its worker is told it was removed
    job.workers["w0"].ready = job.workers["w1"].ready = True
    assert job.decide() is None
    assert job.store.values[protocol.assignment_key(1, "w1")] == protocol.REMOVED_ANSWER
    assert job.store.values[protocol.assignment_key(1, "w0")].startswith("0,1,0,1,0,1;")
    job.hosts.update({"a": 1, "c": 3}, now=2)  # c joins with 3 slots: 2 more fit under --max-np 3
    job.workers["w0"].ready = True
    assert job.decide() is None
    assert [(slot.hostname, slot.local_rank, slot.rank) for slot in started] == [("c", 0, 1), ("c", 1, 2)]
