"""Every parallel layout computes the same training run as one process.

Same seed, data and global batch: the training and validation loss after K steps and the final (exported) parameters of
DDP, FSDP2, HSDP, tensor parallel, pipeline parallel (each schedule) and their mixes must equal the
single-process run's to fp32 round-off, for the GPT and for the llama family (grouped-query
attention, rotary positions, SwiGLU; its rows also switch on activation checkpointing, CPU offload
and torch.compile, which must not change the result either). Checkpoints written in one layout
resume in another. Kept cheap: a 4-layer, 32-wide model, 3 steps, a global batch of 8 that every
degree divides.
"""

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from support.forked import launch
from support.helpers import assert_bitwise_equal, assert_same_training, final_weights, train
from triax import checkpoint
from triax.testing import quiet_env
from support import SUPPORT_DIR

# Every test here starts processes (torchrun, launchers, scripts).
pytestmark = pytest.mark.multiprocess

STEPS = 3
GLOBAL_BATCH = 8
# Losses after a few steps: the weights agree to helpers.adam_tolerance (~3e-6 here), which moves
# a loss of ~3 by far less than this.
LOSS_RTOL = 1e-5


# model.* keys of each architecture under test: 4 query heads on 2 key/value heads for the llama
# family, so tensor parallelism over 2 splits both.
ARCHITECTURES = {"gpt2": {"model.n_head": 2},
                 "llama": {"model.arch": "llama", "model.n_head": 4, "model.n_kv_head": 2, "model.intermediate_size": 64}}


def overrides(run_dir, corpus, batch_size, arch="gpt2", **extra):
    values = {"model.n_layer": 4, **ARCHITECTURES[arch], "model.n_embd": 32, "data.path": corpus,
              "data.block_size": 16, "trainer.max_steps": STEPS, "trainer.batch_size": batch_size,
              "trainer.eval_every": STEPS, "trainer.eval_batches": 1, "trainer.log_every": STEPS,
              "trainer.run_dir": str(run_dir),
              "trainer.sample_tokens": 0, "optim.warmup_steps": 2, "parallel.dp_replicate": 1}
    values.update(extra)
    return [f"{key}={value}" for key, value in values.items()]


def final_loss(run_dir, key="loss"):
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return next(r[key] for r in records if r["step"] == STEPS)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory, tiny_corpus):
    """arch -> the single-process run (trained on first use)."""
    runs = {}

    def baseline(arch):
        if arch not in runs:
            runs[arch] = tmp_path_factory.mktemp(f"single_{arch}")
            train(overrides(runs[arch], tiny_corpus, GLOBAL_BATCH, arch, **{"trainer.save_every": 1}))
        return runs[arch]

    return baseline


@pytest.fixture(scope="module")
def baseline(baselines):
    return baselines("gpt2")


# name: (processes, per-data-parallel-rank batch, parallel.* settings)
LAYOUTS = {
    "ddp2": (2, 4, {"parallel.dp_replicate": 2}),
    "fsdp2": (2, 4, {"parallel.dp_shard": 2}),
    "tp2": (2, 8, {"parallel.tp": 2}),
    "pp2_gpipe": (2, 8, {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"}),
    "pp2_1f1b": (2, 8, {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}),
    "pp2_interleaved": (2, 8, {"parallel.pp": 2, "parallel.pp_schedule": "interleaved_1f1b"}),
    "pp2_zero_bubble": (2, 8, {"parallel.pp": 2, "parallel.pp_schedule": "zero_bubble"}),
    "fsdp2_tp2": (4, 4, {"parallel.dp_shard": 2, "parallel.tp": 2}),
    "pp2_dp2": (4, 4, {"parallel.pp": 2, "parallel.dp_replicate": 2, "parallel.pp_microbatches": 2}),
    "hsdp2x2": (4, 2, {"parallel.dp_replicate": 2, "parallel.dp_shard": 2}),
}
# The llama family in every layout, with the single-process techniques layered on some of them
# (recomputation and offloading change where values live, never the values).
LLAMA_EXTRAS = {"fsdp2": {"parallel.activation_checkpointing": "selective"},
                "tp2": {"parallel.activation_checkpointing": "full"},
                "hsdp2x2": {"parallel.cpu_offload": "true"}}
CASES = [("gpt2", name) for name in LAYOUTS] + [("llama", name) for name in LAYOUTS] + [("llama", "compiled")]


@pytest.mark.parametrize("arch,name", CASES, ids=[f"{arch}-{name}" for arch, name in CASES])
def test_layout_equals_single_process(arch, name, tmp_path, tiny_corpus, baselines):
    baseline = baselines(arch)
    if name == "compiled":  # torch.compile per block, in one process: compiling takes ~30 s a process
        nproc, batch_size, settings = 1, GLOBAL_BATCH, {"parallel.compile": "true"}
    else:
        nproc, batch_size, settings = LAYOUTS[name]
        settings = {**settings, **(LLAMA_EXTRAS.get(name, {}) if arch == "llama" else {})}
    assert batch_size * nproc // _model_parallel(settings) == GLOBAL_BATCH
    train(overrides(tmp_path, tiny_corpus, batch_size, arch, **settings), nproc=nproc, timeout=400)
    assert final_loss(tmp_path) == pytest.approx(final_loss(baseline), rel=LOSS_RTOL)
    # Evaluation too (through the pipeline schedule, or with vocabulary-sharded logits).
    assert final_loss(tmp_path, "val_loss") == pytest.approx(final_loss(baseline, "val_loss"), rel=LOSS_RTOL)
    assert_same_training(tmp_path, baseline)
    if name in ("pp2_1f1b", "fsdp2", "tp2"):
        # `triax export` streams the sharded snapshot into one plain file: exactly the weights
        # that were saved (vocabulary padding dropped), and so equal to the baseline.
        out = tmp_path / "export.safetensors"
        launch(1, ["-m", "triax", "export", str(tmp_path), str(out)])
        exported, saved = load_file(str(out)), final_weights(tmp_path)
        assert exported.keys() == saved.keys()
        assert_bitwise_equal(exported, {key: saved[key][: exported[key].shape[0]] for key in exported})


def _model_parallel(settings):
    return settings.get("parallel.tp", 1) * settings.get("parallel.pp", 1)


def test_training_moves_the_weights(baseline):
    # Guards the comparisons above against comparing two untouched initialisations.
    first = checkpoint.read_model_tensors(str(baseline / "snapshots" / "step_00000001"))
    assert not torch.allclose(first["lm_head.weight"], final_weights(baseline)["lm_head.weight"])


def read_sample_ids(prefix, world):
    """{step: sorted global sample ids every rank of a run consumed at that step}."""
    steps = {}
    for rank in range(world):
        for line in open(f"{prefix}.rank{rank}"):
            number, _, *ids = map(int, line.split())
            steps.setdefault(number, set()).update(ids)
    return {number: sorted(ids) for number, ids in steps.items()}


def test_snapshot_resumes_in_another_layout(tmp_path, tiny_corpus, baseline):
    """Saved at step 2 by FSDP x TP (4 processes, each writing only its shards), resumed for step 3
    as a 2-stage pipeline, as one process and as FSDP x 4: each continued run lands where the
    uninterrupted single process did, takes exactly the next global batch, and no FSDP x 4 rank
    reads the whole snapshot to resume."""
    from triax.data import GlobalSampler
    from triax.config import compose_config
    from triax.train.data import build_data

    first = tmp_path / "fsdp_tp"
    launch(4, ["-m", "triax", "train", *overrides(first, tiny_corpus, 4, **{
        "parallel.dp_shard": 2, "parallel.tp": 2, "trainer.save_every": 2}),
        f"debug.sample_log={tmp_path / 'first'}"], timeout=300)
    snapshot = first / "snapshots" / "step_00000002"
    shards = json.load(open(snapshot / "shards.json"))
    assert len(shards["files"]) == 4  # every rank wrote its own shards
    total_bytes = sum(chunk["bytes"] for entry in shards["tensors"].values() for chunk in entry["chunks"])
    shutil.rmtree(first / "snapshots" / f"step_{STEPS:08d}")
    config = compose_config(overrides(first, tiny_corpus, 8))
    order = GlobalSampler(len(build_data(config.data).train), seed=config.trainer.seed).epoch_order(0).tolist()
    consumed = read_sample_ids(tmp_path / "first", 4)
    assert [consumed[1], consumed[2]] == [sorted(order[:8]), sorted(order[8:16])]
    for name, nproc, batch, settings in (("pp", 2, 8, {"parallel.pp": 2}), ("single", 1, 8, {}),
                                         ("fsdp4", 4, 2, {"parallel.dp_shard": 4})):
        resumed = tmp_path / name
        shutil.copytree(first, resumed)
        os.remove(resumed / "metrics.jsonl")
        args = [*overrides(resumed, tiny_corpus, batch, **settings), f"debug.sample_log={tmp_path / f'{name}_samples'}"]
        env = quiet_env()
        if name == "fsdp4":
            result = launch(4, [os.path.join(SUPPORT_DIR, "snapshot_probe.py"), *args], env=env,
                            timeout=300)
            # Ranks print concurrently: lines may interleave, so pick each report out by its braces.
            reports = [json.loads(found) for found in re.findall(r"PROBE (\{[^{}]*\})", result.stdout)]
            assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3] and all(r["step"] == 2 for r in reports)
            # Each rank read only the chunks overlapping its own shards, never the whole state.
            assert all(0 < r["bytes_read"] < total_bytes for r in reports), (reports, total_bytes)
            print(f"fsdp4 resume: bytes read per rank {[r['bytes_read'] for r in reports]} of {total_bytes}")
        else:
            result = train(args, nproc=nproc, env=env)
        assert "resuming from" in result.stdout + result.stderr
        assert read_sample_ids(tmp_path / f"{name}_samples", nproc)[3] == sorted(order[16:24])
        assert final_loss(resumed) == pytest.approx(final_loss(baseline), rel=LOSS_RTOL)
        assert_same_training(resumed, baseline)


def test_fsdp_shards_parameters_and_optimizer_state_as_planned(tmp_path, tiny_corpus):
    args = overrides(tmp_path, tiny_corpus, 4, **{"parallel.dp_shard": 2, "trainer.save_every": 0})
    result = launch(2, [os.path.join(SUPPORT_DIR, "parallel_probe.py"), *args], timeout=240)
    reports = [json.loads(line.split("PROBE ", 1)[1]) for line in result.stdout.splitlines() if "PROBE " in line]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    total = reports[0]["total_params"]
    # Each rank holds about half of every tensor (FSDP2 splits dim 0, so odd rows round up on rank 0)...
    assert sum(r["local_params"] for r in reports) == total
    for report in reports:
        assert abs(report["local_params"] - total / 2) <= 0.02 * total
        # ...and AdamW's two moment buffers follow the same shards.
        assert report["local_optimizer"] == 2 * report["local_params"]
    # The plan's parameter formula is the most loaded rank (rank 0) exactly.
    rank0 = next(r for r in reports if r["rank"] == 0)
    assert rank0["planned_params"] == rank0["local_params"]
