"""The single-process pieces of triax.parallel: checkpointing, compile, the pipeline cut, the plan."""

import pytest
import torch
import torch.nn.functional as F

from triax.models import GPT, GPTConfig
from triax.parallel.activation_checkpoint import apply_activation_checkpointing
from triax.parallel.mesh import Layout
from triax.parallel.pipeline_parallel import build_stage_modules, split_layers
from triax.parallel.plan import ModelShape, estimate, local_parameter_count, plan

CONFIG = GPTConfig(vocab_size=28, block_size=16, n_layer=4, n_head=2, n_embd=32)


def loss_and_grads(model, x, y):
    model.zero_grad()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_changes_memory_not_results(mode):
    torch.manual_seed(0)
    plain = GPT(CONFIG)
    checkpointed = GPT(CONFIG)
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(checkpointed, mode)
    # Names are unchanged, so snapshots of checkpointed models load anywhere.
    assert list(dict(checkpointed.named_parameters())) == list(dict(plain.named_parameters()))
    x = torch.randint(0, 28, (4, 16))
    y = torch.randint(0, 28, (4, 16))
    loss_a, grads_a = loss_and_grads(plain, x, y)
    loss_b, grads_b = loss_and_grads(checkpointed, x, y)
    torch.testing.assert_close(loss_a, loss_b)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], msg=name)


def test_split_layers_even_and_balanced():
    assert split_layers(4, 2) == [[0, 1], [2, 3]]
    assert split_layers(5, 3) == [[0, 1], [2, 3], [4]]
    assert split_layers(4, 3) == [[0], [1, 2], [3]]  # the extra layer goes to the middle
    assert split_layers(4, 2, [3, 1]) == [[0, 1, 2], [3]]


def test_stages_keep_global_names_and_compose_to_the_model():
    # Each stage is built on its own (no copy of the whole model) from the same seed: together they
    # hold exactly the full model's parameters, with its names and its initial values.
    model = GPT(CONFIG, seed=7)
    x = torch.randint(0, 28, (2, 16))
    expected = model(x)
    stages = [module for rank in range(2) for _, module in build_stage_modules(CONFIG, rank, 2, "1f1b", seed=7)]
    assert set(stages[0].state_dict()) | set(stages[1].state_dict()) == set(model.state_dict())
    assert "layers.3.mlp.up_proj.weight" in stages[1].state_dict()
    assert stages[0].lm_head is None and stages[1].tok_emb is None
    torch.testing.assert_close(stages[1](stages[0](x)), expected, rtol=0, atol=0)
    # Cut from an existing model, the stages hold copies of its weights.
    torch.manual_seed(0)
    other = GPT(CONFIG)
    cut = [module for rank in range(2) for _, module in build_stage_modules(other, rank, 2, "1f1b")]
    torch.testing.assert_close(cut[1](cut[0](x)), other(x), rtol=0, atol=0)


def test_interleaved_ranks_hold_two_looped_stages():
    with torch.device("meta"):
        held = build_stage_modules(CONFIG, 0, 2, "interleaved_1f1b")
    assert [stage_id for stage_id, _ in held] == [0, 2]
    assert list(held[1][1].layers.keys()) == ["2"]
    assert all(p.is_meta for _, stage in held for p in stage.parameters())


def test_plan_counts_a_pipeline_stage_exactly():
    model = GPT(CONFIG)
    shape = ModelShape(4, 2, 32, 28, 16)
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    for rank in range(2):
        with torch.device("meta"):
            (_, stage), = build_stage_modules(CONFIG, rank, 2, "1f1b")
        counted = local_parameter_count(shape, Layout(pp=2), "1f1b", stage=rank)
        assert counted == sum(p.numel() for p in stage.parameters())


def test_plan_memory_shrinks_with_sharding_and_ranks_fastest_first():
    shape = ModelShape(12, 12, 768, 50257, 1024)
    one = estimate(shape, Layout(), batch_size=8)
    sharded = estimate(shape, Layout(dp_shard=4), batch_size=8)
    assert sharded.params_gb == pytest.approx(one.params_gb / 4, rel=0.01)
    assert sharded.optimizer_gb == pytest.approx(2 * sharded.params_gb)
    selective = estimate(shape, Layout(), batch_size=8, checkpointing="selective")
    full = estimate(shape, Layout(), batch_size=8, checkpointing="full")
    assert full.activations_gb < selective.activations_gb < one.activations_gb
    assert full.step_s > selective.step_s > one.step_s  # recomputation costs time
    results = plan(shape, 8, 16.0, 32)
    assert results and [r.step_s for r in results] == sorted(r.step_s for r in results)
    assert all(r.total_gb <= 16.0 for r in results)
    assert plan(shape, 1, 0.5, 32) == []


def test_plan_searches_expert_parallel_layouts_for_a_mixture_of_experts():
    """EP borrows the fully-sharded ranks: the same rows of experts per rank as FSDP alone, fewer
    gathered in flight, and the all-to-all's time added to the step."""
    from triax.parallel.plan import candidate_layouts, expert_exchange_seconds

    mixtral = ModelShape.from_config(GPTConfig.from_preset("mixtral-8x7b", vocab_size=32000, block_size=1024))
    layouts = candidate_layouts(16, mixtral)
    assert {layout.ep for layout in layouts} == {1, 2, 4, 8}  # the divisors of its 8 experts
    assert all(layout == Layout(dp_shard=16, ep=layout.ep) for layout in layouts if layout.ep > 1)
    # cp refused for experts (experts.py); tp runs but is not searched (plan.py: not in its estimates)
    assert not any(layout.tp > 1 or layout.cp > 1 for layout in layouts)
    assert {layout.ep for layout in candidate_layouts(16, ModelShape(12, 12, 768, 50257, 1024))} == {1}
    fsdp, ep = (estimate(mixtral, Layout(dp_shard=16, ep=ep), batch_size=2, precision="bf16-pure") for ep in (1, 8))
    experts = 8 * 3 * 14336 * 4096  # one block's routed experts
    # FSDP alone: 8 experts over 16 ranks leave rank 0 a whole one of every layer; under EP x 8 each
    # rank's one expert is cut along its width over the other 2 (expert_shard_placement): 1/16 each.
    dense = mixtral.num_params() - 32 * experts
    assert local_parameter_count(mixtral, Layout(dp_shard=16)) == pytest.approx(dense / 16 + 32 * experts / 8,
                                                                                rel=1e-4)
    assert local_parameter_count(mixtral, Layout(dp_shard=16, ep=8)) == pytest.approx(mixtral.num_params() / 16,
                                                                                      rel=1e-4)
    assert ep.activations_gb == fsdp.activations_gb
    # gathered in flight: 2 blocks x (2 + 4) bytes a value, a block's experts 1/8 of them under EP x 8
    assert (fsdp.gathered_gb - ep.gathered_gb) * 1024**3 == pytest.approx(2 * 6 * experts * 7 / 8, rel=1e-9)
    # 4 exchanges x 32 layers x 2 routed copies of 2 x 1024 tokens x 4096 values x 2 bytes, 7/8 of them sent
    exchange = 4 * 32 * 2 * 2048 * 4096 * 2 * 7 / 8 / 100e9
    assert expert_exchange_seconds(mixtral, Layout(dp_shard=16, ep=8), 2048, 2, "none", 100.0) == \
        pytest.approx(exchange, rel=1e-12)
    best = plan(mixtral, 16, 80.0, 32)  # bf16: FSDP over the 16 alone does not fit, EP does and comes first
    assert best and best[0].layout.ep > 1 and Layout(dp_shard=16) not in [e.layout for e in best]


def test_the_memory_check_names_what_decides_the_larger_part():
    """One line before anything is allocated: the context and batch when activations dominate, the
    model when its weights, gradients and AdamW state do; nothing when the estimate fits."""
    from triax.errors import ConfigError
    from triax.models.config import PRESETS
    from triax.parallel.mesh import Layout
    from triax.parallel.plan import check_memory

    micro = ModelShape(**PRESETS["gpt-micro"], vocab_size=161, block_size=100_000)
    with pytest.raises(ConfigError, match=r"^data.block_size=100000 with trainer.batch_size=32 needs [\d.]+ GiB of "
                                          r"activations per process.*but this host has 24.0 GiB; lower data.block_size"):
        check_memory(micro, Layout(), 24.0, "this host", batch_size=32, precision="fp32")
    xl = ModelShape(**PRESETS["gpt2-xl"], vocab_size=50257, block_size=64)
    with pytest.raises(ConfigError, match=r"^the model \([\d,]+M parameters: model.n_layer=48, model.n_embd=1600\) "
                                          r"needs [\d.]+ GiB for its weights"):
        check_memory(xl, Layout(), 8.0, "this host", batch_size=1, precision="fp32")
    check_memory(ModelShape(**PRESETS["gpt-micro"], vocab_size=161, block_size=64), Layout(), 1.0, "this host",
                 batch_size=32, precision="fp32")
    tied = ModelShape(**PRESETS["gpt2"], vocab_size=50257, block_size=1024, tie_embeddings=True)
    assert ModelShape(**PRESETS["gpt2"], vocab_size=50257, block_size=1024).num_params() - tied.num_params() == 50257 * 768


def test_plan_counts_a_chunk_of_the_logits_above_the_limit():
    """Where a micro-batch's whole fp32 logits pass parallel.max_logits_mb the loss holds one
    chunk's logits, softmax and gradient (3 x 4 bytes a logit of floor(limit / 4V) positions: at
    most three times the limit), whatever the micro-batch; where they fit, and under pipeline
    parallelism (whose loss takes the whole logits), 16 bytes a logit of the micro-batch, as before.
    `triax plan` takes the limit a GPU run leaves unset, a quarter of --memory-gb."""
    from triax.parallel.plan import loss_bytes

    qwen = ModelShape(2, 2, 64, 151936, 1024)  # the logits dominate
    vocabulary, limit = 151936, 256.0
    chunk = int(limit * 2**20) // (vocabulary * 4)  # 441 positions
    assert loss_bytes(4 * 1024, vocabulary, 1, limit) == 12 * chunk * vocabulary <= 3 * limit * 2**20
    assert loss_bytes(4 * 1024, vocabulary, 2, limit) == 12 * chunk * vocabulary / 2  # each rank's columns
    assert loss_bytes(4 * 1024, vocabulary, 1, 0.0) == 16 * 4 * 1024 * vocabulary  # no limit: the whole
    assert loss_bytes(chunk, vocabulary, 1, limit) == 16 * chunk * vocabulary  # they fit: the whole
    whole, chunked = ({batch: estimate(qwen, Layout(), batch_size=batch, precision="fp32", max_logits_mb=mb)
                       for batch in (4, 8)} for mb in (0.0, limit))
    layers_gb = {batch: whole[batch].activations_gb - 16 * batch * 1024 * vocabulary / 2**30 for batch in (4, 8)}
    for batch in (4, 8):  # everything but the loss's term is the same
        assert chunked[batch].activations_gb == pytest.approx(layers_gb[batch] + 12 * chunk * vocabulary / 2**30)
    assert whole[8].activations_gb - whole[4].activations_gb > 9.0  # the whole logits grow with the batch
    assert chunked[8].activations_gb - chunked[4].activations_gb == pytest.approx(layers_gb[8] - layers_gb[4])
    assert chunked[4].total_gb < 2.0 < whole[4].total_gb
    pipelined = [estimate(qwen, Layout(pp=2), batch_size=4, microbatches=2, max_logits_mb=mb) for mb in (0.0, limit)]
    assert pipelined[0] == pipelined[1]
    # triax plan on one 8 GiB device: a quarter of it, 2,048 MB, chunks a micro-batch of 8 x 1,024.
    (planned,) = plan(qwen, 1, 8.0, 8)
    assert planned == estimate(qwen, Layout(), batch_size=8, max_logits_mb=2048.0)
    assert planned.activations_gb < estimate(qwen, Layout(), batch_size=8).activations_gb
