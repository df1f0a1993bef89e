"""triax.horovod behaves as Horovod documents it, in one process (no process group): the launcher's
HOROVOD_* variables, in-flight names, the sparse allreduce's function, Horovod's optimizer
attributes and warning, the zero-gradient step of broadcast_optimizer_state, and modules that
import each other in one direction only. The two-rank behaviours (both ranks raise; join) are in
tests/support/horovod_workers/collectives.py."""

import ast
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import triax.horovod as hvd
from triax.launch import horovod_worker
from triax.horovod import launcher

from support.horovod_support import REPO, child_env, horovod  # noqa: F401  (horovod: a fixture)


def torchrun_env(rank, local_rank, node, world=6, local_world=4):
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(node)}


def test_horovodrun_gives_horovods_variables_for_uneven_hosts():
    # 4 processes on node1, 2 on node2: local rank 1 exists on both hosts, local rank 3 on one only.
    commands = dict(launcher.torchrun_commands([("node1", 4), ("node2", 2)], ["python", "train.py"], 1234, 0))
    cross = {host: next(word for word in argv if word.startswith("--cross=")) for host, argv in commands.items()}
    assert cross == {"node1": "--cross=0:2,0:2,0:1,0:1", "node2": "--cross=1:2,1:2"}
    on_node2 = horovod_worker.horovod_variables(torchrun_env(5, 1, 1, local_world=2), [(1, 2), (1, 2)], "node2")
    assert on_node2 == {"HOROVOD_RANK": "5", "HOROVOD_SIZE": "6", "HOROVOD_LOCAL_RANK": "1",
                        "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2",
                        "HOROVOD_HOSTNAME": "node2"}


def test_the_worker_gets_the_variables_before_the_command_runs():
    env = child_env(**torchrun_env(2, 0, 1, world=4, local_world=2))
    shown = subprocess.run(
        [sys.executable, "-m", "triax.launch.horovod_worker", "--hostname=nodeB", "--cross=1:2,1:2", "--",
         sys.executable, "-c", "import os; print(os.environ['HOROVOD_RANK'], os.environ['HOROVOD_CROSS_RANK'], "
                               "os.environ['HOROVOD_HOSTNAME'])"],
        env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == ["[2]<started>", "[2]<stdout>:2 1 nodeB"]


def test_a_name_in_flight_twice_is_a_value_error_on_that_rank(horovod):
    tensor = torch.ones(3)
    first = hvd.allreduce_async(tensor, name="grad")
    with pytest.raises(ValueError, match="'grad' is already in flight"):
        hvd.allreduce_async(tensor, name="grad")
    assert torch.equal(hvd.synchronize(first), tensor)
    hvd.synchronize(hvd.allreduce_async(tensor, name="grad"))  # free again once synchronized


def test_async_operations_start_in_submission_order_at_the_first_wait(horovod, monkeypatch):
    from triax.horovod import engine

    started = []
    real = engine.start_broadcast
    monkeypatch.setattr(engine, "start_broadcast",
                        lambda buffer, root, name=None: started.append(name) or real(buffer, root, name))
    a = hvd.broadcast_async(torch.ones(2), 0, name="a")
    b = hvd.broadcast_async(torch.ones(2), 0, name="b")
    assert started == []  # nothing starts until a result is asked for
    assert hvd.poll(b)
    assert started == ["a", "b"]
    hvd.synchronize(b), hvd.synchronize(a)


def test_sparse_allreduce_async_returns_a_function(horovod):
    sparse = torch.tensor([[0.0, 2.0], [3.0, 0.0]]).to_sparse()
    result = hvd.sparse_allreduce_async(sparse, name="emb", op=hvd.Sum)
    assert callable(result)
    assert torch.equal(result().to_dense(), sparse.to_dense())


def test_optimizer_has_horovods_parameter_names(horovod):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    optimizer = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1)
    optimizer = hvd.DistributedOptimizer(optimizer)
    assert optimizer._parameter_names == {
        model[0].weight: "allreduce.noname.0.0", model[0].bias: "allreduce.noname.0.1",
        model[1].weight: "allreduce.noname.1.0", model[1].bias: "allreduce.noname.1.1"}


def test_step_after_synchronize_warns_unless_skipped(horovod):
    model = torch.nn.Linear(2, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    for skip in (False, True):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if skip:
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                optimizer.step()
        messages = [str(w.message) for w in caught]
        assert messages == ([] if skip else [m for m in messages if "skip_synchronize()" in m]) and (skip or messages)
        optimizer.zero_grad()


def test_broadcast_optimizer_state_takes_horovods_zero_gradient_step(horovod, monkeypatch):
    from triax.horovod import process_sets

    monkeypatch.setattr(process_sets, "active_size", lambda: 2)  # reach the broadcast a 2-rank job runs
    sent = []
    monkeypatch.setattr("triax.horovod.broadcast_helpers.broadcast_object",
                        lambda obj, root_rank, name=None: sent.append(obj) or obj)
    monkeypatch.setattr("triax.horovod.broadcast_helpers._broadcast_tensors_", lambda tensors, root, label: None)
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([frozen, weight], lr=0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    assert frozen.grad is None and torch.equal(weight.grad, torch.zeros(2))
    assert torch.equal(weight.detach(), torch.ones(2))  # a zero gradient moved nothing
    assert sent and sent[0]["state"], "the state made by the zero step is what is broadcast"


def _imports(path: Path):
    """(module imported, at top level?) for every `from triax.horovod...` import in the file."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (node.module == "triax.horovod"
                                                              or node.module.startswith("triax.horovod.")):
            names = [node.module] if node.module != "triax.horovod" else [f"triax.horovod.{a.name}" for a in node.names]
            found += [(name, id(node) in top) for name in names]
    return found


def test_horovod_modules_import_each_other_in_one_direction_at_the_top():
    package = REPO / "triax" / "horovod"
    graph = {}
    for path in package.glob("*.py"):
        if path.name == "__init__.py":
            continue
        imports = _imports(path)
        assert all(top for _, top in imports), f"{path.name} imports triax.horovod modules inside a function"
        graph[path.stem] = {name.split(".")[2] for name, _ in imports} - {path.stem}
    done, visiting = set(), []

    def visit(module):
        assert module not in visiting, f"import circle: {' -> '.join(visiting + [module])}"
        if module in done or module not in graph:
            return
        visiting.append(module)
        for other in graph[module]:
            visit(other)
        visiting.pop()
        done.add(module)

    for module in graph:
        visit(module)


def test_sparse_as_dense_hands_sparse_gradients_back_sparse(horovod):
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    optimizer = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(embedding.parameters()), lr=0.1),
                                         sparse_as_dense=True)
    embedding(torch.tensor([[1, 2, 4]])).sum().backward()
    optimizer.step()  # SparseAdam refuses dense gradients
    assert embedding.weight.grad.is_sparse
