"""Context parallelism (parallel.cp) computes the same training run as one process holding the
whole sequence: the trainer's logged losses (training and validation) and its final weights, for
the llama family (rotary positions, grouped-query attention) at block 4096 and GPT-2 (learned
positions) at block 2048, with FSDP and with tensor parallelism beside it, and for packed chat
rows. A CP run's snapshot resumes on one process; bad combinations are one line before any
process group forms. Kept cheap: 2 layers 32 wide, 3 steps, one run per layout."""

import json
import os
import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from support.chat_files import arithmetic_conversations, write_chat_checkpoint, write_chat_file
from support.forked import launch
from support.helpers import assert_same_training, train
from triax.errors import ConfigError
from triax.models.decoder import Packed
from triax.parallel.context_parallel import ContextSplit, chunk_attention, chunk_attention_backward, local_chunks
from triax.parallel.mesh import Layout, check_context_parallel, resolve_layout, validate_layout
from triax.parallel.plan import ModelShape, candidate_layouts, estimate
from triax.testing import quiet_env, run_torchrun

STEPS = 3
LOSS_RTOL = 1e-5
LLAMA = {"model.arch": "llama", "model.n_head": 4, "model.n_kv_head": 2, "model.intermediate_size": 64}
GPT2 = {"model.arch": "gpt2", "model.n_head": 2}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Text enough for a validation split longer than a 4096-character block."""
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "cat", "runs"]
    path = tmp_path_factory.mktemp("cp-corpus") / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(1200)))
    return str(path)


def overrides(run_dir, corpus, arch, block, batch_size, **extra):
    values = {"model.n_layer": 2, **arch, "model.n_embd": 32, "data.path": corpus, "data.block_size": block,
              "trainer.max_steps": STEPS, "trainer.batch_size": batch_size, "trainer.eval_every": STEPS,
              "trainer.eval_batches": 1, "trainer.log_every": 1, "trainer.run_dir": str(run_dir),
              "trainer.sample_tokens": 0, "optim.warmup_steps": 2, "parallel.dp_replicate": 1, **extra}
    return [f"{key}={value}" for key, value in values.items()]


def records(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def assert_same_run(run, baseline):
    """Every logged training loss and gradient norm, the validation loss and token count, and the
    final weights agree with the baseline's."""
    ours, theirs = records(run), records(baseline)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs]
    for mine, base in zip(ours, theirs):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in base:
                assert mine[key] == pytest.approx(base[key], rel=LOSS_RTOL), (key, mine["step"])
        assert mine.get("val_tokens") == base.get("val_tokens")
    assert_same_training(run, baseline)


# ---- what runs before any process group ---------------------------------------------------------

def test_each_rank_holds_an_early_and_a_late_chunk():
    sequence = torch.arange(16)[None]
    assert local_chunks(sequence, 0, 2).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert local_chunks(sequence, 1, 2).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert local_chunks(sequence, 0, 1) is sequence


def test_chunk_attention_equals_causal_attention_and_its_gradients():
    """Each rank's two query chunks over the whole sequence's keys (grouped-query heads), without a
    mask: the outputs and the query gradients are the rows of one causal attention's, and the key
    and value gradients summed over the ranks (what the backward's reduction does) are its."""
    torch.manual_seed(0)
    batch, heads, kv_heads, seq, size, degree = 2, 4, 2, 64, 8, 2
    q, k, v = (torch.randn(batch, n, seq, size, requires_grad=True) for n in (heads, kv_heads, kv_heads))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grad = torch.randn_like(whole)
    expected = torch.autograd.grad(whole, (q, k, v), grad)
    chunk, key_grads = seq // (2 * degree), [torch.zeros_like(k), torch.zeros_like(v)]
    for rank in range(degree):
        rows, starts = local_chunks(q.detach(), rank, degree, dim=2), (rank * chunk, (2 * degree - 1 - rank) * chunk)
        out, lse = chunk_attention(rows, k.detach(), v.detach(), starts)
        torch.testing.assert_close(out, local_chunks(whole, rank, degree, dim=2), rtol=0, atol=1e-6)
        dq, dk, dv = chunk_attention_backward(local_chunks(grad, rank, degree, dim=2), rows, k.detach(), v.detach(),
                                              out, lse, starts)
        torch.testing.assert_close(dq, local_chunks(expected[0], rank, degree, dim=2), rtol=0, atol=1e-5)
        key_grads[0] += dk
        key_grads[1] += dv
    torch.testing.assert_close(key_grads[0], expected[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(key_grads[1], expected[2], rtol=0, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_each_chunk_sees_what_it_sees_in_the_whole_sequence(packed):
    """The masks and positions of the masked attention path (packed rows, dropout, other devices)
    are the rows of one process's: causal, and within each example for packed rows."""
    seq, degree = 16, 2
    documents = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16]) if packed else None
    whole = (Packed.of(documents).mask if packed else torch.ones(seq, seq, dtype=torch.bool).tril())
    positions = Packed.of(documents).positions if packed else torch.arange(seq)
    for rank in range(degree):
        view = ContextSplit(None, degree, rank).slice(seq // degree, documents, torch.device("cpu"))
        chunk = seq // (2 * degree)
        for chunk_id, mask in zip((rank, 2 * degree - 1 - rank), view.masks()):
            rows = whole[..., chunk_id * chunk:(chunk_id + 1) * chunk, :(chunk_id + 1) * chunk]
            assert torch.equal(mask.expand_as(rows), rows)
            # No key past the chunk's end is ever seen: cutting the keys there loses nothing.
            assert not whole[..., chunk_id * chunk:(chunk_id + 1) * chunk, (chunk_id + 1) * chunk:].any()
        assert torch.equal(view.positions, local_chunks(positions, rank, degree, dim=positions.dim() - 1))


def test_cp_counts_in_the_layout():
    layout = resolve_layout(1, 2, 2, 1, 8, cp=2)
    assert layout == Layout(dp_shard=2, tp=2, cp=2) and layout.reducing == 4 and layout.dp == 2
    assert layout.coordinates(2) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 1, "tp": 0}
    assert resolve_layout(-1, 1, 1, 1, 4, cp=2).dp_replicate == 2


@pytest.mark.parametrize("layout, block, compile, message", [
    (Layout(cp=2), 18, False, r"parallel.cp=2 needs the sequence length \(data.block_size=18\) to be a multiple of "
                              r"2 x cp = 4"),
    (Layout(cp=2, pp=2), 16, False, r"parallel.cp=2 does not run with parallel.pp=2"),
    (Layout(cp=2), 16, True, r"parallel.compile=true does not run with parallel.cp=2"),
    (Layout(cp=2, tp=8), 24, False, r"parallel.tp=8 does not divide each context-parallel rank's 12 tokens"),
])
def test_bad_combinations_are_one_line(layout, block, compile, message):
    with pytest.raises(ConfigError, match=message) as raised:
        check_context_parallel(layout, block, compile)
    assert "\n" not in str(raised.value)
    if not compile:  # validate_layout (triax plan's check too) refuses the same
        with pytest.raises(ConfigError, match=message):
            validate_layout(layout, n_layer=4, n_head=8, block_size=block, batch_size=8)


def test_plan_counts_cp():
    """Per rank, context parallelism divides the activations by cp (plus the gathered keys and
    values) and FSDP over dp_shard x cp divides the weights; plan offers cp layouts where the
    sequence cuts and only pp=1 ones."""
    shape = ModelShape(8, 4, 128, 64, 16384, arch="llama", n_kv_head=2, intermediate_size=512)
    one, two = (estimate(shape, Layout(cp=cp, dp_replicate=1), batch_size=1, precision="fp32") for cp in (1, 2))
    assert two.activations_gb < 0.6 * one.activations_gb
    assert two.params_gb == pytest.approx(one.params_gb / 2, rel=0.01) and two.gathered_gb > 0
    layouts = candidate_layouts(8, shape)
    assert {layout.cp for layout in layouts} == {1, 2, 4, 8}
    assert all(layout.pp == 1 for layout in layouts if layout.cp > 1)
    odd = ModelShape(8, 4, 128, 64, 1000, arch="llama", n_kv_head=2, intermediate_size=512)
    assert {layout.cp for layout in candidate_layouts(8, odd)} == {1, 2, 4}  # 1000 tokens: no 16 chunks


@pytest.mark.parametrize("options, words", [
    # named as the user gave them: options, not the config keys
    (["--seq", "1000", "--cp", "8"], ["--cp 8 needs the sequence length (--seq 1000)", "2 x cp = 16",
                                      "change --seq or --cp"]),
    (["--cp", "3"], ["--cp 3 does not divide --world 8"]),
])
def test_plan_refuses_a_cp_that_cannot_run(options, words, capsys):
    from triax.commands.cli import main as triax_main

    code = triax_main(["plan", "--world", "8", "--memory-gb", "80", "--model", "llama3-8b", *options])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("triax: error:"), (code, err)
    assert all(word in err for word in words), err


@pytest.mark.multiprocess
def test_the_cli_refuses_before_the_process_group(tmp_path):
    result = run_torchrun(2, ["-m", "triax", "train", "parallel.cp=2", "parallel.dp_replicate=1", "data.block_size=18",
                              f"trainer.run_dir={tmp_path / 'run'}", "trainer.max_steps=1"], timeout=120, check=False)
    assert result.returncode != 0
    printed = [line for line in result.stderr.splitlines() if line.startswith("triax: error: parallel.cp=2")]
    assert len(printed) == 1 and "multiple of 2 x cp = 4" in printed[0], result.stderr[-2000:]
    assert not (tmp_path / "run").exists()


# ---- equivalence with one process ---------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_single(tmp_path_factory, corpus):
    run_dir = tmp_path_factory.mktemp("cp-llama-single")
    train(overrides(run_dir, corpus, LLAMA, 4096, 2), timeout=400)
    return run_dir


@pytest.mark.multiprocess
def test_llama_at_4096_cp2_equals_one_process_and_resumes_on_one(tmp_path, corpus, llama_single):
    run = tmp_path / "cp2"
    train(overrides(run, corpus, LLAMA, 4096, 2, **{"parallel.cp": 2, "trainer.save_every": 1}), nproc=2, timeout=400)
    assert_same_run(run, llama_single)
    # The snapshot of step 2 is layout-free: one process resumes it and ends where the baseline did.
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "snapshots" / f"step_{STEPS:08d}")
    os.remove(resumed / "metrics.jsonl")
    result = train(overrides(resumed, corpus, LLAMA, 4096, 2, **{"trainer.resume": "true"}), env=quiet_env())
    assert "resuming from" in result.stdout + result.stderr
    assert records(resumed)[-1]["loss"] == pytest.approx(records(llama_single)[-1]["loss"], rel=LOSS_RTOL)
    assert_same_training(resumed, llama_single)
    # `triax eval` of the CP run scores its validation split as it scores the one-process run's.
    scores = [json.loads(launch(1, ["-m", "triax", "eval", str(directory), "--json"]).stdout)
              for directory in (run, llama_single)]
    assert scores[0]["loss"] == pytest.approx(scores[1]["loss"], rel=LOSS_RTOL)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, settings, batch_size", [
    ("fsdp2_cp2", {"parallel.dp_shard": 2, "parallel.cp": 2}, 1),
    ("tp2_cp2", {"parallel.tp": 2, "parallel.cp": 2}, 2),
])
def test_cp2_with_fsdp_or_tp_equals_one_process(name, settings, batch_size, tmp_path, corpus, llama_single):
    train(overrides(tmp_path, corpus, LLAMA, 4096, batch_size, **settings), nproc=4, timeout=400)
    assert_same_run(tmp_path, llama_single)


@pytest.mark.multiprocess
def test_gpt2_at_2048_cp2_equals_one_process(tmp_path, corpus):
    single, cp2 = tmp_path / "single", tmp_path / "cp2"
    train(overrides(single, corpus, GPT2, 2048, 2), timeout=400)
    train(overrides(cp2, corpus, GPT2, 2048, 2, **{"parallel.cp": 2}), nproc=2, timeout=400)
    assert_same_run(cp2, single)


@pytest.mark.multiprocess
def test_packed_chat_rows_under_cp2_equal_one_process(tmp_path):
    """Several conversations per row, each attending only to itself and positioned from 0, cut
    over two ranks: the loss over the answers and the weights are one process's."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")
    base = tmp_path / "base"
    write_chat_checkpoint(base)
    chat = write_chat_file(tmp_path / "chat.jsonl", arithmetic_conversations(48, seed=1))
    values = {"model.init_from": base, "data.task": "chat", "data.path": chat, "data.block_size": 128,
              "data.packing": "true", "trainer.max_steps": STEPS, "trainer.batch_size": 2,
              "trainer.eval_every": STEPS, "trainer.log_every": 1, "trainer.sample_tokens": 0,
              "optim.lr": 1e-3, "optim.warmup_steps": 0, "parallel.dp_replicate": 1}
    runs = {}
    for name, nproc, extra in (("single", 1, {}), ("cp2", 2, {"parallel.cp": 2})):
        runs[name] = tmp_path / name
        args = {**values, **extra, "trainer.run_dir": runs[name]}
        train([f"{key}={value}" for key, value in args.items()], nproc=nproc, timeout=400)
    assert_same_run(runs["cp2"], runs["single"])
