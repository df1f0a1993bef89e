"""Mixtures of experts under tensor parallelism: the attention split by heads, the routed MLP
computed whole on every rank (its parameters replicated DTensors). 3 steps under TP x 2 equal one
process: the loss (the router's load-balancing loss in it), the gradients' norm and the weights;
the expert-selection bias of DeepSeek-V3 moves as in one process."""

import json

import pytest

from support.helpers import assert_adam_close, final_weights, run_config, tiny_overrides, train
from support.moe_checkpoints import save_checkpoint

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")

BLOCK = 32
STEPS = {"data.block_size": BLOCK, "trainer.max_steps": 3, "trainer.batch_size": 4, "trainer.log_every": 1,
         "trainer.eval_every": 3, "trainer.eval_batches": 0, "parallel.dp_replicate": 1}


def run(run_dir, corpus, nproc, presets, **settings):
    train([*presets, *tiny_overrides(run_dir, corpus, **{**STEPS, **settings})], nproc=nproc, timeout=300)
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def assert_tp2_equals_one_process(tmp_path, corpus, *presets, **settings):
    single = run(tmp_path / "single", corpus, 1, presets, **settings)
    parallel = run(tmp_path / "tp2", corpus, 2, presets, **settings, **{"parallel.tp": 2})
    for key in ("loss", "val_loss", "grad_norm"):  # the replicated experts' gradients counted once
        assert [r[key] for r in parallel if key in r] == pytest.approx([r[key] for r in single if key in r], rel=1e-5)
    learning_rates = [run_config(tmp_path / "single")["optim"]["lr"]] * 3
    one = final_weights(tmp_path / "single")
    # Tensor parallelism pads the vocabulary to a multiple of tp; the padding rows hold zeros.
    ranks = {name: tensor[: one[name].shape[0]] for name, tensor in final_weights(tmp_path / "tp2").items()}
    assert_adam_close(ranks, one, learning_rates)
    return one, ranks


@pytest.mark.multiprocess
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_moe_under_tp_equals_one_process(model_type, tmp_path, tiny_corpus):
    """From a tiny checkpoint (Qwen3-MoE's with a dense layer between two routed ones), the
    load-balancing and z losses on."""
    directory = tmp_path / model_type
    save_checkpoint(directory, model_type, tiny_corpus)
    assert_tp2_equals_one_process(tmp_path, tiny_corpus, **{
        "model.init_from": str(directory), "model.router_aux_loss_coef": 0.02, "model.router_z_loss_coef": 0.001})


@pytest.mark.multiprocess
def test_deepseek_v3_under_tp_equals_one_process(tmp_path, tiny_corpus):
    """DeepSeek-V3 from scratch (a dense layer, then a routed one with a shared expert; latent
    attention split by heads), the selection bias updated after every step: each rank's loads are
    the whole batch's, counted on every rank alike (the update's sign does not change when every
    load is doubled), so the bias moves as in one process."""
    one, ranks = assert_tp2_equals_one_process(tmp_path, tiny_corpus, "model=deepseek-v3-debug",
                                               **{"model.router_bias_update_rate": 0.01})
    biases = [name for name in one if name.endswith("expert_bias")]
    assert biases and all(one[name].abs().sum() > 0 for name in biases)
    assert all(ranks[name].equal(one[name]) for name in biases)


@pytest.mark.multiprocess
def test_gpt_oss_under_tp_equals_one_process(tmp_path, tiny_corpus):
    """gpt-oss from scratch: each rank's attention holds half the heads and their sinks (with the
    q/k/v/o biases and a sliding-window layer); the biased router and the clamped experts whole."""
    one, _ = assert_tp2_equals_one_process(tmp_path, tiny_corpus, "model=gpt-oss-debug",
                                           **{"model.n_kv_head": 2, "model.head_dim": 8})
    assert any(name.endswith("attn.sinks") for name in one) and any(name.endswith("q_proj.bias") for name in one)


def test_plan_counts_a_routed_mlp_whole_under_tp():
    """`triax plan`: under tp=2 a routed layer's shared expert and experts are whole on every rank;
    a dense layer's MLP and the attention are halved."""
    from triax.models.llama.parallel import TP_SPLIT_DIMS
    from triax.parallel.plan import local_numel

    def numel(name, shape):
        return local_numel(name, shape, tp=2, dp_shard=1, split_dims=TP_SPLIT_DIMS)

    assert numel("layers.1.mlp.shared_expert.up_proj.weight", (64, 32)) == 64 * 32
    assert numel("layers.1.mlp.experts.up_proj", (8, 64, 32)) == 8 * 64 * 32
    assert numel("layers.0.mlp.up_proj.weight", (64, 32)) == 32 * 32
    assert numel("layers.1.attn.q_proj.weight", (64, 32)) == 32 * 32


@pytest.mark.multiprocess
def test_qwen3_moe_under_fsdp_and_tp_equals_one_process(tmp_path, tiny_corpus):
    """FSDP x 2 over TP x 2 (4 processes): the routed MLP's replicated parameters sharded by FSDP
    over the data-parallel ranks; equal to one process taking the two halves as micro-batches."""
    directory = tmp_path / "qwen3_moe"
    save_checkpoint(directory, "qwen3_moe", tiny_corpus)
    settings = {"model.init_from": str(directory), "model.router_aux_loss_coef": 0.02}
    single = run(tmp_path / "single", tiny_corpus, 1, (), **settings, **{"trainer.grad_accum": 2})
    parallel = run(tmp_path / "2d", tiny_corpus, 4, (), **settings, **{"parallel.tp": 2, "parallel.dp_shard": 2})
    assert [r["loss"] for r in parallel if "loss" in r] == pytest.approx([r["loss"] for r in single if "loss" in r],
                                                                          rel=1e-5)
    learning_rates = [run_config(tmp_path / "single")["optim"]["lr"]] * 3
    one = final_weights(tmp_path / "single")
    ranks = {name: tensor[: one[name].shape[0]] for name, tensor in final_weights(tmp_path / "2d").items()}
    assert_adam_close(ranks, one, learning_rates)
