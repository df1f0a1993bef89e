"""DeepSeek-V3 under the layouts a mixture of experts composes with: 3 steps from a tiny checkpoint
saved by transformers under FSDP x 2 (the experts sharded along their first dimension) or EP x 2
(each rank holding half the experts, tokens exchanged all-to-all) equal one process taking the
halves as accumulated micro-batches; the published shapes count as published."""

import json

import pytest
import torch

from support.deepseek_checkpoints import save_checkpoint

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")

BLOCK = 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_corpus):
    from support.llama_checkpoints import train_tokenizer

    directory = tmp_path_factory.mktemp("deepseek_v3")
    save_checkpoint(directory)
    train_tokenizer(tiny_corpus, directory / "tokenizer.json")
    return directory


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["fsdp2", "ep2"])
def test_fine_tuning_under_fsdp_or_ep_equals_one_process(layout, tmp_path, tiny_corpus, checkpoint):
    from support.helpers import assert_adam_close, final_weights, run_config, tiny_overrides, train

    def run(run_dir, nproc, **settings):
        train(tiny_overrides(run_dir, tiny_corpus, **{
            "model.init_from": str(checkpoint), "data.block_size": BLOCK, "trainer.max_steps": 3,
            "trainer.batch_size": 4, "trainer.log_every": 1, "trainer.eval_every": 3, "trainer.eval_batches": 0,
            "parallel.dp_replicate": 1, **settings}), nproc=nproc, timeout=300)
        return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]

    single = run(tmp_path / "single", 1, **{"trainer.grad_accum": 2})
    settings = {"parallel.dp_shard": 2, **({"parallel.ep": 2} if layout == "ep2" else {})}
    sharded = run(tmp_path / "sharded", 2, **settings)
    for key in ("loss", "val_loss"):
        assert [r[key] for r in sharded if key in r] == pytest.approx([r[key] for r in single if key in r], rel=1e-5)
    learning_rates = [run_config(tmp_path / "single")["optim"]["lr"]] * 3
    one = final_weights(tmp_path / "single")
    assert any("expert_bias" in name for name in one)  # the correction bias is part of the snapshot
    assert_adam_close(final_weights(tmp_path / "sharded"), one, learning_rates)


def test_the_published_shapes_count_as_published():
    """Total and active parameters of the presets from their shapes alone (meta device):
    DeepSeek-V3 671B with 37B activated (its paper, the next-token model without the 14B of its
    multi-token prediction module); Moonlight-16B-A3B 16B with 3B activated (its model card)."""
    from triax.models import GPTConfig, PRESETS, build_model
    from triax.parallel.plan import ModelShape

    counts = {}
    for name in ("deepseek-v3", "moonlight-16b-a3b"):
        config = GPTConfig.from_preset(name, vocab_size=PRESETS[name]["vocab_size"], block_size=4096)
        with torch.device("meta"):
            model = build_model(config)
        shape = ModelShape.from_config(config)
        assert shape.num_params() == model.num_params() and shape.active_params() == model.active_params()
        counts[name] = model.num_params() / 1e9, model.active_params() / 1e9
    assert round(counts["deepseek-v3"][0]) == 671 and 37 <= counts["deepseek-v3"][1] < 38
    assert round(counts["moonlight-16b-a3b"][0]) == 16 and 2.9 <= counts["moonlight-16b-a3b"][1] < 3.0


def test_plan_reports_the_preset(capsys):
    from triax.commands.cli import main

    main(["plan", "--model", "deepseek-v3", "--world", "256", "--memory-gb", "80"])
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("deepseek-v3: 671026.4M parameters (37552.3M active per token)"), first


LATENT = {"model.arch": "deepseek_v3", "model.kv_lora_rank": 16, "model.qk_nope_head_dim": 8,
          "model.qk_rope_head_dim": 4, "model.v_head_dim": 6}


@pytest.mark.multiprocess
@pytest.mark.parametrize("queries", [{"model.q_lora_rank": 24}, {}], ids=["query_latent", "no_query_latent"])
def test_latent_attention_under_tp_equals_one_process(queries, tmp_path, tiny_corpus):
    """3 steps of a dense latent-attention model (its MLPs SwiGLU) from one seed: under TP x 2 each
    rank holds half the heads and computes the latents whole; the loss and the weights equal one
    process's (the latents' weights, replicated, summed their gradients over the ranks)."""
    from support.helpers import assert_adam_close, final_weights, run_config, tiny_overrides, train

    def run(run_dir, nproc, **settings):
        train(tiny_overrides(run_dir, tiny_corpus, **{
            **LATENT, **queries, "model.n_head": 4, "trainer.max_steps": 3, "trainer.batch_size": 4,
            "trainer.log_every": 1, "trainer.eval_every": 3, "trainer.eval_batches": 0, "parallel.dp_replicate": 1,
            **settings}), nproc=nproc, timeout=300)
        return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]

    single = run(tmp_path / "single", 1)
    parallel = run(tmp_path / "tp2", 2, **{"parallel.tp": 2})
    for key in ("loss", "val_loss", "grad_norm"):  # the gradients' norm: the replicated latents' summed once
        assert [r[key] for r in parallel if key in r] == pytest.approx([r[key] for r in single if key in r], rel=1e-5)
    learning_rates = [run_config(tmp_path / "single")["optim"]["lr"]] * 3
    one = final_weights(tmp_path / "single")
    assert any("kv_a_proj_with_mqa" in name for name in one)
    ranks = {name: tensor[: one[name].shape[0]] for name, tensor in final_weights(tmp_path / "tp2").items()}
    assert_adam_close(ranks, one, learning_rates)


@pytest.mark.multiprocess
def test_fine_tuning_under_pp_equals_one_process(tmp_path, tiny_corpus, checkpoint):
    """3 steps from the checkpoint with its 3 layers over 2 pipeline stages (the dense layer and a
    routed one on the first): the losses and the weights equal one process's."""
    from support.helpers import assert_adam_close, final_weights, run_config, tiny_overrides, train

    def run(run_dir, nproc, **settings):
        train(tiny_overrides(run_dir, tiny_corpus, **{
            "model.init_from": str(checkpoint), "data.block_size": BLOCK, "trainer.max_steps": 3,
            "trainer.batch_size": 4, "trainer.log_every": 1, "trainer.eval_every": 3, "trainer.eval_batches": 0,
            "parallel.dp_replicate": 1, **settings}), nproc=nproc, timeout=300)
        return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]

    single = run(tmp_path / "single", 1)
    staged = run(tmp_path / "pp2", 2, **{"parallel.pp": 2})
    for key in ("loss", "val_loss"):
        assert [r[key] for r in staged if key in r] == pytest.approx([r[key] for r in single if key in r], rel=1e-5)
    learning_rates = [run_config(tmp_path / "single")["optim"]["lr"]] * 3
    assert_adam_close(final_weights(tmp_path / "pp2"), final_weights(tmp_path / "single"), learning_rates)


def test_plan_counts_latent_attention_s_activations():
    """`triax plan`'s activation widths of a block are latent attention's (not GPT-2's 17 h): for
    DeepSeek-V3, 6h + the latents + every head's queries, keys, values and outputs + the SwiGLUs of
    a token's 8 experts and the shared one + the router's 256 scores."""
    from triax.models import GPTConfig
    from triax.parallel.plan import ModelShape, layer_widths

    config = GPTConfig.from_preset("deepseek-v3", vocab_size=129280, block_size=4096)
    expected = (6 * 7168 + 2 * 1536 + 2 * 512 + 64 + 2 * 128 * 192 + 2 * 128 * 128
                + 4 * 8 * 2048 + 4 * 2048 + 256)
    assert layer_widths(ModelShape.from_config(config)) == expected != 17 * 7168
