"""Sharded construction: a model is built on the meta device, laid out, and only each rank's
shards are allocated and initialised, with initial weights equal to the single-process model's.

Also the padded vocabulary of tensor parallelism (it must not change the model) and FSDP's CPU
offload (it must not change the result)."""

import json
import os
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from support.helpers import assert_adam_close, assert_same_training, final_weights, run_config, train
from triax.errors import ConfigError
from triax.models import GPT, GPTConfig
from triax.models import init as weight_init
from triax.parallel.mesh import Layout, validate_layout
from support.forked import launch
from support import SUPPORT_DIR

STEPS = 3
VOCAB = 29  # characters in the test corpus
# As in test_parallel_layouts: k_proj.bias's true gradient is zero, so its Adam updates act on
# round-off; one wrong step would move a weight by ~lr = 1e-3.


# ---- the initialisation rule, in one process -------------------------------------------------

def test_any_slice_equals_the_full_tensor_and_draws_only_its_blocks(monkeypatch):
    shape = (700, 4096)  # 256 rows per block: blocks [0,256) [256,512) [512,700)
    full = torch.empty(shape)
    assert weight_init.fill_normal(full, (0, 0), shape, 3, "w", 0.02) == full.numel()
    drawn_blocks = []
    real_seed = weight_init.block_seed
    monkeypatch.setattr(weight_init, "block_seed", lambda *a: drawn_blocks.append(a[2]) or real_seed(*a))
    # A row range inside one block, and a box that also cuts columns (tensor parallelism's Shard(1)).
    for rows, cols in (((300, 400), (0, 4096)), ((200, 600), (1024, 2048)), ((512, 700), (0, 4096))):
        drawn_blocks.clear()
        box = torch.empty(rows[1] - rows[0], cols[1] - cols[0])
        weight_init.fill_normal(box, (rows[0], cols[0]), shape, 3, "w", 0.02)
        assert torch.equal(box, full[rows[0]:rows[1], cols[0]:cols[1]])
        assert drawn_blocks == list(range(rows[0] // 256, (rows[1] - 1) // 256 + 1))
    assert 0.019 < full.std().item() < 0.021


def tiny(**extra):
    return GPTConfig(vocab_size=27, block_size=8, n_layer=2, n_head=2, n_embd=16, **extra)


def same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_weights_are_a_function_of_the_seed():
    assert same_state(GPT(tiny(), seed=1).state_dict(), GPT(tiny(), seed=1).state_dict())
    assert not torch.equal(GPT(tiny(), seed=1).lm_head.weight, GPT(tiny(), seed=2).lm_head.weight)
    # Without a seed, torch's global generator decides it, as for any torch module.
    torch.manual_seed(0)
    first = GPT(tiny()).state_dict()
    torch.manual_seed(0)
    assert same_state(first, GPT(tiny()).state_dict())


@pytest.mark.parametrize("tie", [False, True])
def test_meta_construction_then_materialising_equals_direct_construction(tie):
    with torch.device("meta"):
        model = GPT(tiny(tie_embeddings=tie))
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights(seed=5)
    assert (model.lm_head.weight is model.tok_emb.weight) == tie
    assert same_state(model.state_dict(), GPT(tiny(tie_embeddings=tie), seed=5).state_dict())


def test_a_padded_vocabulary_changes_nothing_but_adds_inert_rows():
    plain, padded = GPT(tiny(), seed=4), GPT(tiny(padded_vocab_size=30), seed=4)
    # The real rows are the unpadded model's; the padding rows are zero.
    assert torch.equal(padded.tok_emb.weight[:27], plain.tok_emb.weight)
    assert torch.equal(padded.lm_head.weight[:27], plain.lm_head.weight)
    assert not padded.tok_emb.weight[27:].any() and not padded.lm_head.weight[27:].any()
    x, y = torch.randint(0, 27, (3, 8)), torch.randint(0, 27, (3, 8))
    logits_plain, logits_padded = plain(x), padded(x)
    torch.testing.assert_close(logits_padded[..., :27], logits_plain, rtol=0, atol=0)
    # Padding logits take no probability, so the loss and every real gradient are the unpadded ones.
    loss_plain = F.cross_entropy(logits_plain.flatten(0, 1), y.flatten())
    loss_padded = F.cross_entropy(logits_padded.flatten(0, 1), y.flatten())
    torch.testing.assert_close(loss_padded, loss_plain)
    loss_plain.backward()
    loss_padded.backward()
    torch.testing.assert_close(padded.lm_head.weight.grad[:27], plain.lm_head.weight.grad)
    assert not padded.lm_head.weight.grad[27:].any()
    # Sampling never draws a padding id, even with no vocab_limit.
    assert padded.generate(torch.zeros(8, 1, dtype=torch.long), 16).max() < 27


def test_cpu_offload_needs_fsdp_sharding():
    shape = {"n_layer": 2, "n_head": 2, "block_size": 8, "batch_size": 4}
    validate_layout(Layout(dp_shard=2), cpu_offload=True, **shape)
    for layout in (Layout(), Layout(dp_replicate=2), Layout(tp=2)):
        with pytest.raises(ConfigError, match=r"parallel.cpu_offload=true needs FSDP sharding.*dp_shard"):
            validate_layout(layout, cpu_offload=True, **shape)


# ---- real processes --------------------------------------------------------------------------

def write_corpus(path):
    # An odd number of distinct characters (29): tensor parallelism over 2 pads the vocabulary.
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "cat", "runs", "wiz!"]
    text = "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(600))
    assert len(set(text)) == VOCAB
    path.write_text(text)
    return str(path)


def overrides(run_dir, corpus, batch_size, **extra):
    values = {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 32, "data.path": corpus,
              "data.block_size": 16, "trainer.max_steps": STEPS, "trainer.batch_size": batch_size,
              "trainer.eval_every": 0, "trainer.log_every": STEPS, "trainer.run_dir": str(run_dir),
              "trainer.sample_tokens": 0, "optim.warmup_steps": 2, "parallel.dp_replicate": 1}
    values.update(extra)
    return [f"{key}={value}" for key, value in values.items()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data") / "corpus.txt")


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, corpus):
    run_dir = tmp_path_factory.mktemp("single")
    train(overrides(run_dir, corpus, 8))
    return run_dir


def export(run_dir):
    out = os.path.join(run_dir, "export.safetensors")
    launch(1, ["-m", "triax", "export", str(run_dir), out])
    return load_file(out)


@pytest.mark.multiprocess
def test_no_rank_builds_the_whole_model(tmp_path, corpus):
    # Pipeline x FSDP on 4 processes: every GPT a rank builds is a meta-device module holding only
    # its own stage; afterwards each rank holds half its stage (FSDP x 2), all of it allocated.
    args = overrides(tmp_path, corpus, 4, **{"model.n_layer": 4, "parallel.pp": 2, "parallel.dp_shard": 2,
                                               "parallel.pp_microbatches": 2})
    report_dir = tmp_path / "reports"
    report_dir.mkdir()
    launch(4, [os.path.join(SUPPORT_DIR, "construction_probe.py"), str(report_dir), *args],
           timeout=300)
    reports = [json.loads(path.read_text()) for path in report_dir.iterdir()]
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3]
    for report in reports:
        # the trainer's own and triax plan's (the memory check) are meta descriptions
        stages = [b for b in report["built"] if b["by"] not in ("trainer.py", "plan.py")]
        assert stages and all(b["meta"] for b in report["built"])
        first = report["pp_rank"] == 0
        assert stages == [{"by": "pipeline_parallel.py", "layers": [0, 1] if first else [2, 3],
                           "embeddings": first, "head": not first, "meta": True}]
        assert report["all_materialized"]
        # Its stage is about half of the model, and FSDP x 2 keeps about half of that.
        assert report["local_values"] <= 0.3 * report["total_values"]
    assert sum(r["local_values"] for r in reports) == report["total_values"]


def moe_overrides(run_dir, corpus, batch_size, num_experts, **extra):
    return overrides(run_dir, corpus, batch_size, **{"model.arch": "mixtral", "model.num_experts": num_experts,
                                                     "model.experts_per_token": 2, "model.intermediate_size": 48,
                                                     "model.router_aux_loss_coef": 0.02, **extra})


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc, num_experts", [(2, 4), (4, 2)], ids=["experts_rows", "experts_width"])
def test_plan_counts_what_each_rank_holds_under_expert_parallelism(nproc, num_experts, tmp_path, corpus):
    """A mixture of experts under EP x 2 inside FSDP x nproc: each rank holds its share of every
    layer's experts (4 experts over 2 ranks: 2 whole ones; 2 experts over 4 ranks: half of one,
    FSDP cutting its width) and of the rest, exactly what triax plan counts for it."""
    args = moe_overrides(tmp_path, corpus, 4, num_experts, **{"parallel.dp_shard": nproc, "parallel.ep": 2})
    report_dir = tmp_path / "reports"
    report_dir.mkdir()
    launch(nproc, [os.path.join(SUPPORT_DIR, "construction_probe.py"), str(report_dir), *args], timeout=300)
    reports = [json.loads(path.read_text()) for path in report_dir.iterdir()]
    assert len(reports) == nproc and all(r["all_materialized"] for r in reports)
    assert max(r["local_values"] for r in reports) == reports[0]["planned_values"]


@pytest.mark.multiprocess
def test_experts_cut_along_their_width_train_and_resume_as_one_process(tmp_path, corpus):
    """2 experts under EP x 2 inside FSDP x 4: each rank holds half of one expert's width. 3 steps
    equal one process taking the four ranks' batches as accumulated micro-batches, and so do runs
    resumed from step 2 across the two layouts, both ways."""
    import shutil

    single = {"trainer.grad_accum": 4, "trainer.save_every": 2}
    ep = {"parallel.dp_shard": 4, "parallel.ep": 2, "trainer.save_every": 2}
    train(moe_overrides(tmp_path / "single", corpus, 2, 2, **single))
    train(moe_overrides(tmp_path / "ep", corpus, 2, 2, **ep), nproc=4)
    for first, settings, nproc in (("single", ep, 4), ("ep", single, 1)):
        shutil.copytree(tmp_path / first, tmp_path / f"{first}_resumed")
        shutil.rmtree(tmp_path / f"{first}_resumed" / "snapshots" / f"step_{STEPS:08d}")
        result = train(moe_overrides(tmp_path / f"{first}_resumed", corpus, 2, 2, **settings), nproc=nproc)
        assert "resuming from" in result.stdout + result.stderr
    config = run_config(tmp_path / "single")
    for run in ("ep", "single_resumed", "ep_resumed"):
        assert_adam_close(final_weights(tmp_path / run), final_weights(tmp_path / "single"),
                          [config["optim"]["lr"]] * config["trainer"]["max_steps"])


@pytest.mark.multiprocess
def test_tensor_parallel_with_a_padded_vocabulary_equals_one_process(tmp_path, corpus, baseline):
    train(overrides(tmp_path, corpus, 8, **{"parallel.tp": 2}), nproc=2)
    assert final_weights(tmp_path)["tok_emb.weight"].shape[0] == VOCAB + 1  # padded to a multiple of tp
    exported = export(tmp_path)
    # `triax export` drops the padding: the file has the model's true shape, and equals one process.
    assert exported["tok_emb.weight"].shape[0] == exported["lm_head.weight"].shape[0] == VOCAB
    config = run_config(baseline)
    assert_adam_close(exported, export(baseline), [config["optim"]["lr"]] * config["trainer"]["max_steps"])


@pytest.mark.multiprocess
def test_cpu_offload_equals_one_process(tmp_path, corpus, baseline):
    # On a CPU-only machine the "device" is the host already, so this proves the offloaded code
    # path (FSDP's CPUOffloadPolicy, the optimizer on host shards) computes the same run; the memory
    # it saves on a GPU is measured by benchmarks/memory_scaling.py.
    train(overrides(tmp_path, corpus, 4, **{"parallel.dp_shard": 2, "parallel.cpu_offload": "true"}), nproc=2)
    assert_same_training(tmp_path, baseline)
