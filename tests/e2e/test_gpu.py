"""What only a CUDA GPU can check: mixed precision against fp32, a snapshot resumed bitwise with the
CUDA generator's state, the Accelerator's fp16/bf16 against Hugging Face Accelerate's, the Horovod
door on CUDA tensors. Each skips where no GPU is visible (conftest.py); `triax doctor --gpu-suite` runs
them all on a GPU, with the throughput benchmark, in one command. (Pipe on CUDA devices:
test_pipe_equivalence.py.)"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from support.helpers import tiny_overrides
from triax.config import compose_config
from triax.train.trainer import Trainer
from support import REPO_DIR

pytestmark = pytest.mark.gpu
ROOT = REPO_DIR
# The checkout first, then whatever the caller's path held (packages installed beside it).
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


def cuda_run(run_dir, corpus, **extra):
    values = {"trainer.device": "cuda", "model.n_layer": 2, "model.n_head": 2, "model.n_embd": 64,
              "data.block_size": 32, "trainer.batch_size": 16, "trainer.save_every": 0, **extra}
    trainer = Trainer(compose_config(tiny_overrides(run_dir, corpus, **values)))
    trainer.fit()
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        losses = {record["step"]: record["loss"] for record in map(json.loads, handle) if "loss" in record}
    return trainer, losses


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_tracks_fp32_over_50_steps(tmp_path, tiny_corpus, precision):
    steps = {"trainer.max_steps": 50, "trainer.log_every": 10}
    _, reference = cuda_run(str(tmp_path / "fp32"), tiny_corpus, **steps)
    trainer, losses = cuda_run(str(tmp_path / precision), tiny_corpus, **steps, **{"trainer.precision": precision})
    assert trainer.scaler.is_enabled() == (precision == "fp16")  # loss scaling for fp16 alone
    if precision == "fp16":
        scale = trainer.scaler.get_scale()
        assert 1.0 <= scale <= 2.0 ** 24, scale
    assert sorted(losses) == sorted(reference) == [10, 20, 30, 40, 50]
    assert losses[50] < 0.8 * losses[10]  # it learns
    for step, loss in losses.items():  # and follows fp32: 16-bit round-off, not another trajectory
        assert abs(loss - reference[step]) <= 0.05 * reference[step], (step, loss, reference[step])


def test_snapshot_on_gpu_resumes_bitwise_with_the_cuda_generator(tmp_path, tiny_corpus):
    """Dropout draws from the CUDA generator: a run stopped at step 4 and resumed must draw the same
    masks as one that never stopped, so the final weights are equal bit for bit."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    settings = {"model.dropout": 0.1, "trainer.max_steps": 8, "optim.warmup_steps": 2}
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        # The math kernel: flash attention's backward may add in another order from run to run.
        with sdpa_kernel([SDPBackend.MATH]):
            straight, _ = cuda_run(str(tmp_path / "straight"), tiny_corpus, **settings)
            # Stopped after step 4 as by a preemption: a snapshot, then the same command again.
            cuda_run(str(tmp_path / "resumed"), tiny_corpus, **{**settings, "debug.preempt_at_step": 4})
            resumed, _ = cuda_run(str(tmp_path / "resumed"), tiny_corpus, **settings)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    # Without the CUDA generator's state the resumed half would draw its masks from a fresh seed.
    assert resumed.step == straight.step == 8
    for (name, a), (_, b) in zip(straight.raw_model.state_dict().items(), resumed.raw_model.state_dict().items()):
        assert a.device.type == "cuda"
        assert torch.equal(a, b), name


def accelerator_script(path):
    path.write_text(textwrap.dedent("""
        import sys
        import torch
        library, precision, out = sys.argv[1:4]
        if library == "triax":
            from triax import Accelerator
        else:
            from accelerate import Accelerator
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        accelerator = Accelerator(mixed_precision=precision)
        model, optimizer = accelerator.prepare(model, optimizer)
        assert accelerator.device.type == "cuda", accelerator.device
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(32, 64, generator=generator).to(accelerator.device)
        y = torch.randint(0, 8, (32,), generator=generator).to(accelerator.device)
        losses = []
        for _ in range(20):  # one batch again and again: the loss must fall
            output = model(x)
            assert output.dtype == torch.float32, output.dtype  # outputs come back in fp32
            loss = torch.nn.functional.cross_entropy(output, y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        weights = {k: v.cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        torch.save({"losses": losses, "weights": weights,
                    "scaler": accelerator.scaler is not None}, out)
    """))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_accelerator_mixed_precision_equals_accelerate_on_cuda(tmp_path, precision):
    pytest.importorskip("accelerate")
    script = tmp_path / "script.py"
    accelerator_script(script)
    results = {}
    for library in ("triax", "accelerate"):
        out = tmp_path / f"{library}.pt"
        subprocess.run([sys.executable, str(script), library, precision, str(out)], check=True, timeout=300,
                       env=ENV)
        results[library] = torch.load(out)
    ours, theirs = results["triax"], results["accelerate"]
    assert ours["scaler"] == theirs["scaler"] == (precision == "fp16")
    assert ours["losses"] == theirs["losses"]
    assert ours["losses"][-1] < ours["losses"][0]
    for name, tensor in theirs["weights"].items():
        assert torch.equal(ours["weights"][name], tensor), name


HOROVOD_SCRIPT = textwrap.dedent("""
    import torch
    import triax.horovod as hvd

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    assert hvd.nccl_built() and hvd.size() == 1
    total = hvd.allreduce(torch.arange(4.0, device="cuda"), op=hvd.Sum)
    assert total.device.type == "cuda" and total.tolist() == [0.0, 1.0, 2.0, 3.0], total
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).cuda()
    plain = torch.nn.Linear(16, 4).cuda()
    plain.load_state_dict(model.state_dict())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    reference = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(8, 16, device="cuda")
        for net, opt in ((model, optimizer), (plain, reference)):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    hvd.shutdown()
    print("horovod on cuda: ok")
""")


def test_horovod_door_on_cuda_tensors(tmp_path):
    """A Horovod script on one GPU under `triax horovodrun -np 1`: collectives and the distributed
    optimizer on CUDA tensors. (One rank needs no process group; NCCL between ranks needs a GPU per
    rank, which this test does not have.)"""
    script = tmp_path / "train.py"
    script.write_text(HOROVOD_SCRIPT)
    result = subprocess.run([sys.executable, "-m", "triax", "horovodrun", "-np", "1", sys.executable, str(script)],
                            capture_output=True, text=True, timeout=300, env=ENV)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "horovod on cuda: ok" in result.stdout + result.stderr
