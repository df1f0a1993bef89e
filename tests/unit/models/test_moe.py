"""Qwen3, Mixtral and Qwen3-MoE: tiny random checkpoints saved by transformers compute the same LM
loss in triax (fp32, |rel| <= 1e-5); a run started from one exports back to a directory
transformers loads and scores as the original; a checkpoint whose experts, router or values do not
match its config is one line; the new config fields are bounded."""

import json

import pytest
import torch
import torch.nn.functional as F

from support.forked import launch
from support.helpers import tiny_overrides, train
from support.hf_scoring import hf_mean_loss
from support.llama_checkpoints import VOCAB
from support.moe_checkpoints import MODEL_TYPES, save_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")

BLOCK = 32


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_corpus):
    """model_type -> (save_pretrained directory with tokenizer.json, the transformers model)."""
    made = {}

    def get(model_type):
        if model_type not in made:
            directory = tmp_path_factory.mktemp(model_type)
            made[model_type] = directory, save_checkpoint(directory, model_type, tiny_corpus)
        return made[model_type]

    return get


def windows():
    return torch.randint(0, VOCAB, (4, BLOCK), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_lm_loss_equals_transformers(model_type, checkpoints):
    from triax.interop.hf.whole_model import load_hf_model

    directory, reference = checkpoints(model_type)
    ours = load_hf_model(str(directory), torch.device("cpu"))
    ids = windows()
    with torch.no_grad():
        expected = reference(ids, labels=ids).loss.item()
        logits = ours(ids)
    got = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1)).item()
    assert abs(got - expected) / expected <= 1e-5, (got, expected)


def test_grouped_matmul_equals_the_loop_over_experts():
    from triax.models import experts as moe

    counts = torch.tensor([5, 0, 9, 2])
    x = torch.randn(16, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 12, 8, dtype=torch.float64)
    looped = torch.cat([part @ weight[e].t() for e, part in enumerate(torch.split(x, counts.tolist()))])
    x32, w32 = x.detach().float(), weight.float()
    assert moe._grouped_mm_fits(x32, w32) == hasattr(F, "grouped_mm")
    assert torch.allclose(moe.grouped_linear(x32, w32, counts).double(), looped, atol=1e-5)
    assert torch.allclose(moe.grouped_linear(x, weight, counts), looped)  # float64 rows: the loop


def copy_checkpoint(source, target, change):
    """A copy of checkpoint `source` with its tensors changed by `change(dict)`."""
    from safetensors.torch import load_file, save_file

    target.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (target / name).write_bytes((source / name).read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _drop(name):
    return lambda t: t.pop(name)


def _set(name, value):
    return lambda t: t.__setitem__(name, value(t[name]))


EXPERTS = "model.layers.0.block_sparse_moe.experts"
HOSTILE = {
    "an expert missing": (_drop(f"{EXPERTS}.3.w1.weight"), "experts.3.w1.weight"),
    "an expert too many": (lambda t: t.__setitem__(f"{EXPERTS}.4.w1.weight", t[f"{EXPERTS}.0.w1.weight"].clone()),
                           "past the 4 experts"),
    "an expert of another shape": (_set(f"{EXPERTS}.2.w2.weight", lambda t: t[:, :-1].contiguous()), "experts.2.w2"),
    "a router of the wrong width": (_set("model.layers.1.block_sparse_moe.gate.weight", lambda t: t[:3].contiguous()),
                                    "gate.weight"),
    "a NaN in an expert": (_set(f"{EXPERTS}.1.w3.weight", lambda t: t.index_fill(0, torch.tensor([0]), float("nan"))),
                           "experts.1.w3.weight holds values that are not finite"),
    "expert 0 missing": (_drop(f"{EXPERTS}.0.w2.weight"), "no tensor 'model.layers.0.block_sparse_moe.experts.0.w2"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_mixtral_checkpoint_is_one_line(case, tmp_path, checkpoints):
    from triax.interop.hf.files import CheckpointError
    from triax.interop.hf.whole_model import load_hf_model

    directory, _ = checkpoints("mixtral")
    change, words = HOSTILE[case]
    damaged = copy_checkpoint(directory, tmp_path / "damaged", change)
    with pytest.raises(CheckpointError) as error:
        load_hf_model(str(damaged), torch.device("cpu"))
    assert words in str(error.value) and "\n" not in str(error.value)


def test_two_expert_counts_that_disagree_are_refused(tmp_path, checkpoints, sandbox, tiny_corpus):
    """transformers' Mixtral reads num_local_experts, Qwen3-MoE num_experts: a config.json giving both,
    unequal, is refused with both named rather than read as one of them."""
    import json

    directory, _ = checkpoints("mixtral")
    damaged = copy_checkpoint(directory, sandbox.work / "damaged", lambda tensors: None)
    config = json.loads((damaged / "config.json").read_text())
    (damaged / "config.json").write_text(json.dumps({**config, "num_experts": config["num_local_experts"] * 2}))
    sandbox.refused(["eval", str(damaged), "--text", str(tiny_corpus)], "num_experts=8", "num_local_experts=4")


@pytest.mark.parametrize("fields, words", [
    (dict(experts_per_token=5), "experts_per_token=5 is above model.num_experts=4"),
    (dict(num_experts=0), "num_experts=0 must be a positive integer"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size=0: an expert's MLP width must be positive"),
    (dict(num_experts=2**20), "num_experts=1048576 is above"),
    (dict(mlp_only_layers=[7]), "mlp_only_layers holds 7"),
    (dict(arch="mixtral", norm_topk_prob=False), "Mixtral always renormalises"),
    (dict(arch="llama"), "num_experts=4 with model.arch=llama"),
    (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef=-1.0 must be a number in"),
])
def test_expert_fields_are_bounded(fields, words):
    from triax.errors import ConfigError
    from triax.models import GPTConfig

    base = dict(vocab_size=50, block_size=16, arch="qwen3_moe", n_layer=2, n_head=2, n_embd=16, num_experts=4)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace("[", r"\[")):
        GPTConfig(**{**base, **fields})


def test_the_published_shapes_count_as_published():
    """Total and active parameters of the presets, from their shapes alone (meta device)."""
    from triax.models import GPTConfig, PRESETS, build_model, parameter_shapes

    totals = {}
    for name in ("mixtral-8x7b", "qwen3-30b-a3b", "qwen3-0.6b"):
        config = GPTConfig.from_preset(name, vocab_size=PRESETS[name]["vocab_size"], block_size=4096)
        totals[name] = sum(torch.Size(shape).numel() for shape in parameter_shapes(config).values())
    # Mixtral 8x7B: 46.7B parameters; Qwen3-30B-A3B: 30.5B; Qwen3-0.6B: 0.6B (model cards).
    assert round(totals["mixtral-8x7b"] / 1e9, 1) == 46.7
    assert round(totals["qwen3-30b-a3b"] / 1e9, 1) == 30.5
    assert round(totals["qwen3-0.6b"] / 1e9, 1) == 0.6
    with torch.device("meta"):
        model = build_model(GPTConfig.from_preset("qwen3-30b-a3b", vocab_size=151936, block_size=4096))
    assert 3.3e9 <= model.active_params() < 3.4e9  # "A3B": 3.3B activated (model card)


@pytest.mark.multiprocess
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_run_from_the_checkpoint_exports_back(model_type, tmp_path, tiny_corpus, checkpoints):
    """One step at a negligible learning rate: the export scores the validation split as the
    original does under transformers."""
    directory, _ = checkpoints(model_type)
    run_dir = tmp_path / "run"
    output = train(tiny_overrides(run_dir, tiny_corpus, **{
        "model.init_from": str(directory), "data.block_size": BLOCK, "trainer.max_steps": 1,
        "trainer.batch_size": 4, "optim.lr": 1e-12, "optim.min_lr": 0.0, "trainer.eval_every": 1,
        "trainer.eval_batches": 0, "parallel.dp_replicate": 1, "trainer.log_every": 1,
        "model.router_aux_loss_coef": 0.02 if model_type != "qwen3" else 0.0}), timeout=300)
    assert json.load(open(run_dir / "model.json"))["arch"] == model_type
    if model_type != "qwen3":  # the router's figures are logged beside the LM loss
        record = [json.loads(line) for line in open(run_dir / "metrics.jsonl")][-1]
        assert "router_loss" in record and len(record["expert_share"]) == 4
        assert record["expert_share_min"] == round(min(record["expert_share"]), 4)
        # and on the step line, under the same names
        line = next(line for line in output.stdout.splitlines() if line.startswith("step 1/1"))
        assert (f"router_loss {record['router_loss']:.4f} | expert_share_min {record['expert_share_min']:.3f}"
                in line), line
    launch(1, ["-m", "triax", "export", str(run_dir), str(tmp_path / "hf"), "--format", "hf"])
    assert json.load(open(tmp_path / "hf" / "config.json"))["model_type"] == model_type
    from tokenizers import Tokenizer

    ids = torch.tensor(Tokenizer.from_file(str(directory / "tokenizer.json")).encode(
        open(tiny_corpus, encoding="utf-8").read(), add_special_tokens=False).ids[-2000:])
    original, _ = hf_mean_loss(str(directory), ids, BLOCK)
    exported, _ = hf_mean_loss(str(tmp_path / "hf"), ids, BLOCK)
    assert abs(exported - original) / original <= 1e-5, (exported, original)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_router_losses_equal_transformers(model_type, checkpoints):
    """For one batch: the load-balancing loss equals transformers' load_balancing_loss_func over the
    model's own router logits, and LM loss + coefficient x it equals the model's loss with
    output_router_logits=True; a coefficient of 0 turns it off; the z-loss is logsumexp^2's mean."""
    import importlib

    from triax.interop.hf.whole_model import load_hf_model
    from triax.models.router_loss import expert_shares, load_balancing_loss, moe_blocks, router_loss

    directory, reference = checkpoints(model_type)
    ours = load_hf_model(str(directory), torch.device("cpu"))
    ids = windows()
    with torch.no_grad():
        out = reference(ids, labels=ids, output_router_logits=True)
        logits = ours(ids)
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    config = reference.config
    expected = modeling.load_balancing_loss_func(out.router_logits, config.num_experts if model_type == "qwen3_moe"
                                                 else config.num_local_experts, config.num_experts_per_tok)
    blocks = moe_blocks(ours)
    assert len(blocks) == len(out.router_logits)  # the dense layer of qwen3_moe has no router
    got = load_balancing_loss([b.router_logits for b in blocks], blocks[0].num_experts, blocks[0].top_k)
    assert abs(got.item() - expected.item()) <= 1e-6 * expected.item()
    coef = config.router_aux_loss_coef
    lm = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
    total = lm + router_loss(ours, coef, 0.0)
    assert abs(total.item() - out.loss.item()) / out.loss.item() <= 1e-5
    assert router_loss(ours, 0.0, 0.0) is None
    z = router_loss(ours, 0.0, 1.0).item()
    pooled = torch.cat([torch.logsumexp(b.router_logits, -1) for b in blocks])
    assert abs(z - (pooled ** 2).mean().item()) <= 1e-5 * z
    shares = expert_shares(ours)
    assert len(shares) == blocks[0].num_experts and abs(sum(shares) - 1) < 1e-6


def test_a_collapsed_router_is_named():
    from triax.models.router_loss import collapsed

    assert collapsed([0.25, 0.25, 0.25, 0.25]) == []
    assert collapsed([0.5, 0.49, 0.01, 0.0]) == [2, 3]


@pytest.mark.parametrize("arch, layout, fields, words", [
    ("mixtral", dict(tp=2, ep=2), {}, "parallel.tp=2 with parallel.ep=2 (model.arch=mixtral)"),
    ("mixtral", dict(cp=2), {}, "parallel.cp=2 with model.arch=mixtral"),
    ("mixtral", dict(tp=2, checkpointing="full"), {}, "parallel.tp=2 with parallel.activation_checkpointing=full"),
    ("qwen3_moe", dict(pp=2), dict(router_aux_loss_coef=0.01), "parallel.pp=2 with model.router_aux"),
])
def test_a_layout_that_does_not_compose_is_one_line(arch, layout, fields, words):
    from triax.errors import ConfigError
    from triax.models import GPTConfig
    from triax.parallel.experts import check_layout
    from triax.parallel.mesh import Layout

    experts = dict(num_experts=4) if arch != "qwen3" else {}
    config = GPTConfig(vocab_size=50, block_size=16, arch=arch, n_layer=2, n_head=2, n_embd=16, **experts, **fields)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        check_layout(config, Layout(**{k: v for k, v in layout.items() if k != "checkpointing"}),
                     layout.get("checkpointing", "none"))
    check_layout(config, Layout(dp_shard=2))  # FSDP composes


@pytest.mark.multiprocess
def test_the_trainer_refuses_it_before_any_group(tmp_path, tiny_corpus, checkpoints):
    directory, _ = checkpoints("mixtral")
    result = train(tiny_overrides(tmp_path / "run", tiny_corpus, **{
        "model.init_from": str(directory), "data.block_size": BLOCK, "parallel.dp_replicate": 1, "parallel.cp": 2}),
        nproc=2, check=False)
    assert result.returncode != 0 and "triax: error: parallel.cp=2 with model.arch=mixtral" in result.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [{"parallel.tp": 2}, {"parallel.dp_shard": 2}], ids=["tp2", "fsdp2"])
def test_dense_qwen3_under_tp_or_fsdp_equals_one_process(layout, tmp_path, tiny_corpus, checkpoints):
    """3 steps from the Qwen3 checkpoint: under TP x 2 each rank's per-head q/k norms see half the
    heads, and their gains' gradients are summed over the ranks; under FSDP x 2 each rank takes half
    the batch. Both equal one process (the FSDP one taking the halves as accumulated micro-batches)."""
    from support.helpers import assert_adam_close, final_weights, run_config

    directory, _ = checkpoints("qwen3")

    def run(run_dir, nproc, **settings):
        train(tiny_overrides(run_dir, tiny_corpus, **{
            "model.init_from": str(directory), "data.block_size": BLOCK, "trainer.max_steps": 3,
            "trainer.batch_size": 4, "trainer.log_every": 1, "trainer.eval_every": 3, "trainer.eval_batches": 0,
            "parallel.dp_replicate": 1, **settings}), nproc=nproc, timeout=300)
        return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]

    accumulate = 2 if "parallel.dp_shard" in layout else 1
    single = run(tmp_path / "single", 1, **{"trainer.grad_accum": accumulate})
    parallel = run(tmp_path / "parallel", 2, **layout)
    for key in ("loss", "val_loss"):
        assert [r[key] for r in parallel if key in r] == pytest.approx([r[key] for r in single if key in r], rel=1e-5)
    learning_rates = [run_config(tmp_path / "single")["optim"]["lr"]] * 3
    one = final_weights(tmp_path / "single")
    # Tensor parallelism pads the vocabulary to a multiple of tp; the padding rows hold zeros.
    ranks = {name: tensor[: one[name].shape[0]] for name, tensor in final_weights(tmp_path / "parallel").items()}
    assert_adam_close(ranks, one, learning_rates)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["fsdp2", "ep2", "ep2_in_fsdp4"])
def test_fine_tuning_under_fsdp_or_ep_equals_one_process(layout, tmp_path, tiny_corpus, checkpoints):
    """3 steps from the Mixtral checkpoint with the load-balancing loss on: FSDP x 2 (each rank
    half the batch, the experts sharded along their first dimension) or EP x 2 (each rank holding
    half the experts, tokens exchanged all-to-all) equals one process taking the
    two halves as accumulated micro-batches (the router loss is a per-micro-batch figure in both,
    as in transformers' own data-parallel training)."""
    from support.helpers import assert_adam_close, final_weights, run_config

    directory, _ = checkpoints("mixtral")

    def run(run_dir, nproc, **settings):
        train(tiny_overrides(run_dir, tiny_corpus, **{
            "model.init_from": str(directory), "data.block_size": BLOCK, "trainer.max_steps": 3,
            "trainer.batch_size": 4, "trainer.log_every": 1, "trainer.eval_every": 3, "trainer.eval_batches": 0,
            "parallel.dp_replicate": 1, "model.router_aux_loss_coef": 0.02, **settings}), nproc=nproc, timeout=300)
        return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]

    nproc = 4 if layout == "ep2_in_fsdp4" else 2  # ep2_in_fsdp4: each rank's experts FSDP-sharded over 2 more
    single = run(tmp_path / "single", 1, **{"trainer.grad_accum": nproc})
    settings = {"parallel.dp_shard": nproc, **({"parallel.ep": 2} if layout.startswith("ep2") else {})}
    sharded = run(tmp_path / "fsdp2", nproc, **settings)
    for key in ("loss", "val_loss"):
        assert [r[key] for r in sharded if key in r] == pytest.approx([r[key] for r in single if key in r], rel=1e-5)
    learning_rates = [run_config(tmp_path / "single")["optim"]["lr"]] * 3
    assert_adam_close(final_weights(tmp_path / "fsdp2"), final_weights(tmp_path / "single"), learning_rates)


def test_plan_counts_active_parameters_and_flops():
    """`triax plan` and MFU count the FLOPs of the parameters a token passes through."""
    from triax.models import GPTConfig, build_model
    from triax.parallel.plan import ModelShape, candidate_layouts

    config = GPTConfig.from_preset("mixtral-debug", vocab_size=512, block_size=128)
    shape = ModelShape.from_config(config)
    with torch.device("meta"):
        model = build_model(config)
    assert shape.num_params() == model.num_params()
    assert shape.active_params() == model.active_params() < model.num_params()
    per_expert = 3 * config.n_embd * config.moe_intermediate_size
    assert model.num_params() - model.active_params() == config.n_layer * per_expert * (8 - 2)
    assert shape.flops_per_token() == model.flops_per_token(128)
    assert all(layout.tp == 1 for layout in candidate_layouts(8, shape))
    dense = ModelShape.from_config(GPTConfig.from_preset("qwen3-debug", vocab_size=512, block_size=128))
    assert any(layout.tp == 2 for layout in candidate_layouts(8, dense))  # per-head q/k norms split by heads


@pytest.mark.multiprocess
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_lora_on_attention_exports_to_peft(model_type, tmp_path, tiny_corpus, checkpoints):
    """LoRA on q/k/v/o of a mixture of experts (the experts frozen): `--format peft` loads in
    peft.PeftModel over transformers' model with triax's logits (fp32, 1e-5)."""
    peft = pytest.importorskip("peft")
    from support.helpers import final_weights
    from triax.interop.hf.whole_model import load_hf_model
    from triax.models.lora import LoRAConfig, apply_lora

    directory, _ = checkpoints(model_type)
    run_dir = tmp_path / "run"
    train(tiny_overrides(run_dir, tiny_corpus, **{
        "model.init_from": str(directory), "data.block_size": BLOCK, "trainer.max_steps": 3, "trainer.batch_size": 4,
        "optim.lr": 1e-2, "parallel.dp_replicate": 1, "model.lora.rank": 4, "model.lora.alpha": 8,
        "model.lora.targets": "[q,k,v,o]"}), timeout=300)
    launch(1, ["-m", "triax", "export", str(run_dir), str(tmp_path / "adapter"), "--format", "peft"])
    weights = final_weights(run_dir)
    ours = load_hf_model(str(directory), torch.device("cpu"))
    apply_lora(ours, LoRAConfig(rank=4, alpha=8, targets=["q", "k", "v", "o"]))
    with torch.no_grad():
        for name, parameter in ours.named_parameters():
            if name in weights:
                parameter.data = weights[name].clone()
    base = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    reference = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    ids = windows()
    with torch.no_grad():
        triax_logits, peft_logits = ours(ids), reference(ids).logits
        plain = load_hf_model(str(directory), torch.device("cpu"))(ids)
    torch.testing.assert_close(triax_logits, peft_logits, atol=1e-5, rtol=1e-5)
    assert (triax_logits - plain).abs().max() > 1e-3  # the adapters changed the model


def test_lora_on_the_experts_is_one_line():
    from triax.errors import ConfigError
    from triax.models import GPTConfig, build_model
    from triax.models.lora import LoRAConfig, apply_lora

    with torch.device("meta"):
        model = build_model(GPTConfig.from_preset("mixtral-debug", vocab_size=64, block_size=16))
    with pytest.raises(ConfigError, match="no mlp.gate_proj"):
        apply_lora(model, LoRAConfig(rank=4, targets=["all-linear"]))


@pytest.mark.multiprocess
def test_snapshots_are_layout_free_under_ep(tmp_path, tiny_corpus, checkpoints):
    """A snapshot saved at step 2 by EP x 2 resumes on one process, and one saved by one process
    resumes under EP x 2: both land on the uninterrupted single process's step 3."""
    import shutil

    from support.helpers import assert_adam_close, final_weights, run_config

    directory, _ = checkpoints("mixtral")
    single = {"trainer.grad_accum": 2}
    ep2 = {"parallel.dp_shard": 2, "parallel.ep": 2}

    def run(run_dir, settings, nproc):
        return train(tiny_overrides(run_dir, tiny_corpus, **{
            "model.init_from": str(directory), "data.block_size": BLOCK, "trainer.max_steps": 3,
            "trainer.batch_size": 4, "trainer.save_every": 2, "parallel.dp_replicate": 1,
            "model.router_aux_loss_coef": 0.02, **settings}), nproc=nproc, timeout=300)

    run(tmp_path / "single", single, 1)
    started = run(tmp_path / "ep", ep2, 2)
    assert "x 2 processes (dp_shard=2, ep=2)" in started.stdout + started.stderr  # the start line names ep
    learning_rates = [run_config(tmp_path / "single")["optim"]["lr"]] * 3
    for first, settings, nproc in (("ep", single, 1), ("single", ep2, 2)):
        resumed = tmp_path / f"{first}_resumed"
        shutil.copytree(tmp_path / first, resumed)
        shutil.rmtree(resumed / "snapshots" / "step_00000003")
        result = run(resumed, settings, nproc)
        assert "resuming from" in result.stdout + result.stderr
        assert_adam_close(final_weights(resumed), final_weights(tmp_path / "single"), learning_rates)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_greedy_generation_equals_transformers(model_type, checkpoints):
    """generate (with its key/value cache) writes transformers' greedy continuation."""
    from triax.interop.hf.whole_model import load_hf_model

    directory, reference = checkpoints(model_type)
    ours = load_hf_model(str(directory), torch.device("cpu"))
    prompt = windows()[:2, :8]
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, 12, greedy=True), expected)


@pytest.mark.parametrize("normalise", [True, False])
def test_a_shared_expert_block_equals_transformers_qwen2_moe(normalise):
    """With a gated shared expert, the routed MLP computes transformers' Qwen2MoeSparseMoeBlock
    (the same weights copied in), forward and gradients."""
    from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    from triax.models import GPTConfig
    from triax.models.moe import MoE

    torch.manual_seed(0)
    theirs = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(hidden_size=32, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                                   norm_topk_prob=normalise))
    for parameter in theirs.parameters():
        torch.nn.init.normal_(parameter, std=0.1)
    ours = MoE(GPTConfig(vocab_size=50, block_size=16, arch="qwen3_moe", n_layer=1, n_head=2, n_embd=32,
                         num_experts=4, experts_per_token=2, moe_intermediate_size=16, norm_topk_prob=normalise,
                         shared_expert_intermediate_size=24, shared_expert_gate=True))
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        ours.experts.gate_proj.copy_(theirs.experts.gate_up_proj[:, :16])
        ours.experts.up_proj.copy_(theirs.experts.gate_up_proj[:, 16:])
        ours.experts.down_proj.copy_(theirs.experts.down_proj)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.shared_expert, name).weight.copy_(getattr(theirs.shared_expert, name).weight)
        ours.shared_expert_gate.weight.copy_(theirs.shared_expert_gate.weight)
    x = torch.randn(2, 8, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    torch.testing.assert_close(ours(x), theirs(x2), atol=1e-6, rtol=1e-5)
    ours(x).square().sum().backward()
    theirs(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.shared_expert_gate.weight.grad, theirs.shared_expert_gate.weight.grad,
                               atol=1e-5, rtol=1e-5)


def test_a_shared_expert_trains_and_is_not_exported_as_transformers_mixtral(tmp_path):
    from triax.models import GPTConfig, build_model
    from triax.interop.hf.export import ExportError, check_mappable

    config = GPTConfig.from_preset("mixtral-debug", vocab_size=64, block_size=16, shared_expert_intermediate_size=64)
    model = build_model(config, seed=0)
    assert model.layers["0"].mlp.shared_expert.up_proj.weight.std() > 0.01  # initialised
    ids = torch.randint(0, 64, (2, 16))
    F.cross_entropy(model(ids).view(-1, 64), ids.view(-1)).backward()
    assert model.layers["0"].mlp.shared_expert.down_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ExportError, match="shared_expert_intermediate_size=64 has no equivalent"):
        check_mappable(config)


def test_sigmoid_scores_with_a_bias_choose_by_the_bias_and_weigh_without_it():
    from triax.models.moe import route

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    weights, experts = route(logits, 2, normalise=False, scoring="sigmoid", bias=bias)
    assert experts.tolist() == [[3, 0]]  # the bias lifted expert 3 into the top 2
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[-1.0, 2.0]])))
    weights, _ = route(logits, 2, normalise=True, scoring="sigmoid", bias=bias)
    assert abs(weights.sum().item() - 1) < 1e-6


def test_the_bias_moves_toward_an_even_load():
    from triax.models import GPTConfig
    from triax.models.moe import MoE, update_expert_bias

    block = MoE(GPTConfig(vocab_size=50, block_size=16, arch="qwen3_moe", n_layer=1, n_head=2, n_embd=16,
                          num_experts=4, router_scoring="sigmoid", router_bias_update_rate=0.01))
    block.step_load = torch.tensor([10.0, 0.0, 5.0, 5.0])
    update_expert_bias(block, 0.01)
    torch.testing.assert_close(block.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    assert block.step_load is None


@pytest.mark.multiprocess
def test_aux_free_balancing_under_fsdp_equals_one_process(tmp_path, tiny_corpus):
    """DeepSeek-V3's sigmoid scores and per-expert bias, from scratch: the biases (summed loads over
    ranks) and weights of FSDP x 2 equal one process's with accumulated micro-batches, and moved."""
    from support.helpers import assert_adam_close, final_weights, run_config

    def run(run_dir, nproc, **settings):
        train(["model=qwen3-moe-debug", *tiny_overrides(run_dir, tiny_corpus, **{
            "trainer.max_steps": 3, "trainer.batch_size": 4, "parallel.dp_replicate": 1,
            "model.router_scoring": "sigmoid", "model.router_bias_update_rate": 0.01, **settings})], nproc=nproc,
            timeout=300)
        return final_weights(run_dir)

    single = run(tmp_path / "single", 1, **{"trainer.grad_accum": 2})
    sharded = run(tmp_path / "fsdp2", 2, **{"parallel.dp_shard": 2})
    biases = [name for name in single if name.endswith("expert_bias")]
    assert biases and all(single[name].abs().sum() > 0 for name in biases)
    for name in biases:
        assert torch.equal(single[name], sharded[name]), name
    learning_rates = [run_config(tmp_path / "single")["optim"]["lr"]] * 3
    assert_adam_close(sharded, single, learning_rates)


@pytest.mark.multiprocess
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recomputed_activations_leave_the_bias_update_as_it_was(tmp_path, tiny_corpus, recompute):
    """Activation checkpointing runs each block's forward again in the backward, routing the same
    tokens again: the biases move as without it (bitwise) and the weights end the same."""
    from support.helpers import final_weights

    def run(run_dir, **settings):
        train(["model=qwen3-moe-debug", *tiny_overrides(run_dir, tiny_corpus, **{
            "trainer.max_steps": 3, "trainer.batch_size": 4, "trainer.grad_accum": 2, "parallel.dp_replicate": 1,
            "model.router_scoring": "sigmoid", "model.router_bias_update_rate": 0.01, **settings})], timeout=300)
        return final_weights(run_dir)

    plain = run(tmp_path / "plain")
    recomputed = run(tmp_path / recompute, **{"parallel.activation_checkpointing": recompute})
    biases = [name for name in plain if name.endswith("expert_bias")]
    assert biases and all(plain[name].abs().sum() > 0 for name in biases)
    for name in plain:
        if name in biases:
            assert torch.equal(plain[name], recomputed[name]), name
        else:  # the same arithmetic recomputed: equal up to the order the backward sums in
            torch.testing.assert_close(recomputed[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.multiprocess
def test_a_30_step_fine_tune_under_ep_ends_where_one_process_does(tmp_path, tiny_corpus, checkpoints):
    """30 steps from the Mixtral checkpoint, load-balancing loss on: EP x 2 ends with one process's
    weights (grad_accum 2: the same micro-batches), and the validation loss falls."""
    from support.helpers import assert_adam_close, final_weights, run_config

    directory, _ = checkpoints("mixtral")

    def run(run_dir, nproc, **settings):
        train(tiny_overrides(run_dir, tiny_corpus, **{
            "model.init_from": str(directory), "data.block_size": BLOCK, "trainer.max_steps": 30,
            "trainer.batch_size": 4, "trainer.log_every": 10, "trainer.eval_every": 10, "trainer.eval_batches": 0,
            "optim.lr": 3e-3, "optim.warmup_steps": 3, "parallel.dp_replicate": 1,
            "model.router_aux_loss_coef": 0.02, **settings}), nproc=nproc, timeout=600)
        return [r["val_loss"] for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "val_loss" in r]

    single = run(tmp_path / "single", 1, **{"trainer.grad_accum": 2})
    ep = run(tmp_path / "ep", 2, **{"parallel.dp_shard": 2, "parallel.ep": 2})
    assert ep == pytest.approx(single, rel=1e-5)
    assert single[-1] < single[0] - 0.1, single
    learning_rates = [run_config(tmp_path / "single")["optim"]["lr"]] * 30
    assert_adam_close(final_weights(tmp_path / "ep"), final_weights(tmp_path / "single"), learning_rates)


@pytest.mark.multiprocess
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_chat_data_with_lora_on_the_attention_learns_the_answers(model_type, tmp_path):
    """Chat data as for the Llama family: a checkpoint of the family with a chat template, LoRA on
    the attention, the answer-only loss; after training the validation loss is below the base's."""
    from support.chat_files import arithmetic_conversations, write_chat_checkpoint, write_chat_file

    base = tmp_path / "base"
    write_chat_checkpoint(base, model_type)
    chat = write_chat_file(tmp_path / "chat.jsonl", arithmetic_conversations(48, seed=1))
    run_dir = tmp_path / "run"
    train([f"{key}={value}" for key, value in {
        "model.init_from": base, "data.task": "chat", "data.path": chat, "data.block_size": 64,
        "model.lora.rank": 4, "model.lora.alpha": 8, "model.lora.targets": "[q,v]", "trainer.max_steps": 8,
        "trainer.batch_size": 4, "trainer.eval_every": 8, "trainer.log_every": 1, "trainer.sample_tokens": 0,
        "trainer.run_dir": run_dir, "optim.lr": 3e-2, "optim.warmup_steps": 0, "parallel.dp_replicate": 1}.items()],
        timeout=300)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    first = [record["loss"] for record in records if "loss" in record][0]  # the base's: B starts at zero
    losses = [record["val_loss"] for record in records if "val_loss" in record]
    assert losses and losses[-1] < first - 0.1, (first, losses)
