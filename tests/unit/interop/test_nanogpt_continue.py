"""A run nanoGPT began, continued by `triax train trainer.continue_from=ckpt.pt`
(triax/interop/nanogpt/run.py): the first step triax takes is the step nanoGPT would have taken
next, from the same weights, AdamW state, step count and learning rate; the run's config takes
nanoGPT's settings (the command line winning); damaged or hostile optimizer state is refused in one
line.

`nanogpt_steps` is nanoGPT's training loop written out here (train.py's arithmetic: get_lr's
warm-up and cosine, configure_optimizers' two groups, a loss divided by the accumulation steps,
clip_grad_norm_ over model.parameters(), torch's AdamW as it builds it off CUDA), over
test_nanogpt_checkpoint's model arithmetic with scaled_dot_product_attention (model.py's flash path),
so the test needs no nanoGPT checkout.
"""

import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from support.helpers import train
from support.nanogpt_checkpoints import ARGS, Payload, nanogpt_state
from triax.interop.shared.pickled import pickled_bytes

CONFIG = {"learning_rate": 1e-2, "min_lr": 1e-3, "warmup_iters": 2, "lr_decay_iters": 8, "decay_lr": True,
          "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0, "max_iters": 9, "batch_size": 2,
          "gradient_accumulation_steps": 1, "eval_interval": 50, "eval_iters": 1, "log_interval": 1,
          "dataset": "test", "dropout": 0.0, "bias": True, "block_size": ARGS["block_size"]}
STOP = 3  # nanoGPT saved its checkpoint after this many steps


def get_lr(it, c=CONFIG):
    if it < c["warmup_iters"]:
        return c["learning_rate"] * (it + 1) / (c["warmup_iters"] + 1)
    if it > c["lr_decay_iters"]:
        return c["min_lr"]
    ratio = (it - c["warmup_iters"]) / (c["lr_decay_iters"] - c["warmup_iters"])
    return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c["learning_rate"] - c["min_lr"])


def parameter_names(args):
    names = ["transformer.wte.weight", "transformer.wpe.weight"]
    for layer in range(args["n_layer"]):
        for module in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            names += [f"transformer.h.{layer}.{module}.{kind}" for kind in ("weight", "bias")]
    return names + ["transformer.ln_f.weight", "transformer.ln_f.bias"]


def forward_loss(p, args, x, y):
    C, H = args["n_embd"], args["n_head"]

    def norm(t, prefix):
        return F.layer_norm(t, (C,), p[prefix + "weight"], p[prefix + "bias"], 1e-5)

    B, T = x.shape
    h = p["transformer.wte.weight"][x] + p["transformer.wpe.weight"][:T]
    for layer in range(args["n_layer"]):
        q = f"transformer.h.{layer}."
        qkv = F.linear(norm(h, q + "ln_1."), p[q + "attn.c_attn.weight"], p[q + "attn.c_attn.bias"])
        qq, kk, vv = (t.view(B, T, H, C // H).transpose(1, 2) for t in qkv.split(C, dim=2))
        a = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        h = h + F.linear(a, p[q + "attn.c_proj.weight"], p[q + "attn.c_proj.bias"])
        m = F.gelu(F.linear(norm(h, q + "ln_2."), p[q + "mlp.c_fc.weight"], p[q + "mlp.c_fc.bias"]))
        h = h + F.linear(m, p[q + "mlp.c_proj.weight"], p[q + "mlp.c_proj.bias"])
    logits = F.linear(norm(h, "transformer.ln_f."), p["transformer.wte.weight"])
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1)


def nanogpt_steps(state, optimizer_state, first, count, x, y, args=ARGS, c=CONFIG):
    """Take `count` of nanoGPT's steps, numbered from `first`, on the batch (x, y); returns (the
    parameters, the optimizer, the loss of each step)."""
    names = parameter_names(args)
    params = {name: state[name].clone().requires_grad_() for name in names}
    decay = [params[n] for n in names if params[n].dim() >= 2]
    nodecay = [params[n] for n in names if params[n].dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": c["weight_decay"]},
                                   {"params": nodecay, "weight_decay": 0.0}],
                                  lr=c["learning_rate"], betas=(c["beta1"], c["beta2"]))
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    losses = []
    for it in range(first, first + count):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it, c)
        loss = forward_loss(params, args, x, y) / c["gradient_accumulation_steps"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), c["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return params, optimizer, losses


@pytest.fixture
def started(tmp_path):
    """nanoGPT's run stopped after STOP steps (its ckpt.pt), the data it trained on (two samples:
    every batch holds both), and what nanoGPT's own next step gives (loss, weights)."""
    args = dict(ARGS, bias=True, dropout=0.0)
    tokens = np.random.default_rng(3).integers(0, args["vocab_size"], args["block_size"] + 2).astype(np.uint16)
    data = tmp_path / "data"
    data.mkdir()
    tokens.tofile(data / "train.bin")
    tokens.tofile(data / "val.bin")
    (data / "meta.json").write_text(json.dumps({"vocab_size": args["vocab_size"], "dtype": "uint16"}))
    windows = torch.from_numpy(tokens.astype(np.int64)).unfold(0, args["block_size"] + 1, 1)
    x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # as get_batch stacks them
    state = nanogpt_state(args, seed=1)
    params, optimizer, _ = nanogpt_steps(state, None, 0, STOP, x, y)
    model = {name: value.detach().clone() for name, value in params.items()}
    model["lm_head.weight"] = model["transformer.wte.weight"]
    checkpoint = {"model": model, "optimizer": optimizer.state_dict(), "model_args": args, "iter_num": STOP,
                  "best_val_loss": torch.tensor(1.25), "config": dict(CONFIG)}
    out = tmp_path / "out"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(pickled_bytes(checkpoint))
    after, _, losses = nanogpt_steps(model, optimizer.state_dict(), STOP, 1, x, y)
    return {"out": out, "data": data, "checkpoint": checkpoint, "loss": losses[0],
            "weights": {name: value.detach() for name, value in after.items()}}


def continue_overrides(run_dir, started, *extra):
    return [f"trainer.continue_from={started['out']}", "data.task=tokens", f"data.path={started['data']}",
            f"trainer.run_dir={run_dir}", "trainer.sample_tokens=0", "optim.fused=false", *extra]


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc, layout", [(1, []), (2, ["parallel.dp_shard=2", "trainer.batch_size=1"])],
                         ids=["one-process", "fsdp-two-processes"])
def test_the_first_step_triax_takes_is_nanogpts_next_step(tmp_path, started, nproc, layout):
    """nanoGPT's next step on its batch of two samples; with FSDP, each of two processes takes one
    of them and holds half of every weight and moment."""
    from triax.commands.export import main as export_main

    run_dir = tmp_path / "run"
    result = train(continue_overrides(run_dir, started, f"trainer.max_steps={STOP + 1}", *layout), nproc=nproc)
    assert f"continuing nanoGPT's run {started['out']} at step {STOP}/{STOP + 1}" in result.stdout
    assert f"best val_loss 1.2500 (step {STOP})" in result.stdout  # nanoGPT's best_val_loss, still the best
    record = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line][-1]
    assert record["step"] == STOP + 1
    assert record["lr"] == pytest.approx(get_lr(STOP + 1), rel=1e-12)  # logged after the step: the next one's
    assert record["loss"] == pytest.approx(started["loss"], rel=1e-6)
    assert export_main([str(run_dir), str(tmp_path / "export"), "--format", "nanogpt"]) == 0
    exported = torch.load(tmp_path / "export" / "ckpt.pt", map_location="cpu", weights_only=True)
    assert exported["iter_num"] == STOP + 1
    if nproc == 1:  # a later start resumes from the run's own snapshot, not from nanoGPT's again
        again = train(continue_overrides(run_dir, started, f"trainer.max_steps={STOP + 2}"))
        assert f"from {run_dir / 'snapshots' / 'step_00000004'}" in again.stdout and "continuing" not in again.stdout
    key_bias = torch.arange(3 * ARGS["n_embd"]) // ARGS["n_embd"] == 1  # c_attn's rows of the key's bias
    for name, expected in started["weights"].items():
        got, before = exported["model"][name], started["checkpoint"]["model"][name]
        if name.endswith("attn.c_attn.bias"):
            # The key's bias has no true gradient (softmax ignores a shift shared by every key): its
            # computed gradient is round-off, which AdamW turns into a step of up to about lr.
            assert (got[key_bias] - expected[key_bias]).abs().max() <= 2 * get_lr(STOP)
            got, expected, before = got[~key_bias], expected[~key_bias], before[~key_bias]
        # The same arithmetic but for how q, k and v are cut (one fused matmul in nanoGPT, three in
        # triax), which reorders a few sums: fp32 round-off (a few 1e-9 here), while the step moved
        # the weights by about lr = 1e-2.
        difference = (got - expected).abs().max()
        assert difference <= 2e-7, (name, difference)
        assert difference <= (expected - before).abs().max() / 1e4, (name, difference)


def test_the_run_takes_nanogpts_settings_and_the_command_line_wins(started):
    from triax.config import compose_config

    config = compose_config([f"trainer.continue_from={started['out']}", "trainer.eval_every=7"])
    assert (config.optim.lr, config.optim.min_lr, config.optim.warmup_steps, config.optim.decay_steps) == (1e-2, 1e-3, 2, 8)
    assert (config.optim.schedule, config.optim.decay, list(config.optim.betas)) == ("nanogpt", "matrices", [0.9, 0.95])
    assert config.trainer.max_steps == CONFIG["max_iters"] + 1  # train.py also takes the step numbered max_iters
    assert (config.trainer.batch_size, config.trainer.grad_clip, config.trainer.eval_every) == (2, 1.0, 7)
    assert (config.data.block_size, config.data.vocab_size, config.model.dropout) == (ARGS["block_size"], ARGS["vocab_size"], 0.0)


def test_the_schedule_is_nanogpts_get_lr():
    from triax.train.optim import warmup_cosine

    for step in range(12):
        assert warmup_cosine(step, 8, 2, 1e-2, 1e-3, "nanogpt") == pytest.approx(get_lr(step), rel=1e-15)
    assert warmup_cosine(5, 8, 2, 1e-2, 1e-3, "constant") == 1e-2


def damaged(started, change):
    checkpoint = dict(started["checkpoint"])
    change(checkpoint)
    (started["out"] / "ckpt.pt").write_bytes(pickled_bytes(checkpoint))


def first_group_short(checkpoint):
    groups = [dict(group) for group in checkpoint["optimizer"]["param_groups"]]
    groups[0]["params"] = groups[0]["params"][1:]
    checkpoint["optimizer"] = {"state": checkpoint["optimizer"]["state"], "param_groups": groups}


def moment_of_another_shape(checkpoint):
    state = {index: dict(entry) for index, entry in checkpoint["optimizer"]["state"].items()}
    state[0]["exp_avg"] = torch.zeros(3)
    checkpoint["optimizer"] = {"state": state, "param_groups": checkpoint["optimizer"]["param_groups"]}


def steps_that_differ(checkpoint):
    state = {index: dict(entry) for index, entry in checkpoint["optimizer"]["state"].items()}
    state[5]["step"] = torch.tensor(99.0)
    checkpoint["optimizer"] = {"state": state, "param_groups": checkpoint["optimizer"]["param_groups"]}


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("optimizer"), "holds no AdamW state"),
    (first_group_short, "parameter groups hold [9, 18] parameters, not the [10, 18]"),
    (moment_of_another_shape, "exp_avg of transformer.wte.weight is not a floating tensor"),
    (steps_that_differ, "different step counts"),
    (lambda c: c.update(config=dict(CONFIG, learning_rate="fast")), "learning_rate='fast'"),
    (lambda c: c.update(config=dict(CONFIG, warmup_iters=-4)), "warmup_iters=-4"),
    (lambda c: c.update(config=dict(CONFIG, beta2=1.5)), "beta2=1.5"),
    (lambda c: c.update(config=dict(CONFIG, max_iters=float("nan"))), "max_iters=nan"),
    (lambda c: c.update(config=dict(CONFIG, max_iters=10**30)), "max_iters=1000000000000000000000000000000"),
    (lambda c: c.update(config=dict(CONFIG, batch_size=True)), "batch_size=True"),
    (lambda c: c.update(config=dict(CONFIG, decay_lr="yes")), "decay_lr='yes'"),
])
def test_a_damaged_checkpoint_is_refused_in_one_line(tmp_path, started, change, message):
    from triax.errors import ConfigError
    from triax.train import Trainer, compose_config

    damaged(started, change)
    with pytest.raises((ConfigError, ValueError)) as raised:
        Trainer(compose_config(continue_overrides(tmp_path / "run", started)))
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert not (tmp_path / "run").exists()


def test_a_pickle_that_runs_code_is_refused(tmp_path, started):
    from triax.config import compose_config

    marker = tmp_path / "ran"
    damaged(started, lambda c: c.update(optimizer=Payload(marker)))
    with pytest.raises(ValueError, match="weights-only") as raised:
        compose_config([f"trainer.continue_from={started['out']}"])
    assert "\n" not in str(raised.value) and not marker.exists()


def test_continue_from_names_nanogpts_checkpoint_alone(tmp_path, started):
    from triax.errors import ConfigError
    from triax.config import compose_config

    with pytest.raises(ConfigError, match="both name a checkpoint"):
        compose_config([f"trainer.continue_from={started['out']}", f"model.init_from={started['out']}"])
    with pytest.raises(ConfigError, match="is not nanoGPT's ckpt.pt"):
        compose_config([f"trainer.continue_from={tmp_path}"])
    with pytest.raises(ConfigError, match="optim.schedule"):
        compose_config(["optim.schedule=exponential"])


@pytest.mark.multiprocess
def test_a_triax_run_exported_continues_on_nanogpt_and_back_on_triax(tmp_path, started):
    """triax -> nanoGPT: `export --format nanogpt` writes the optimizer and settings nanoGPT's
    train.py resumes from (its AdamW loads the state), and nanoGPT's next step equals triax's own
    next step of the run; continuing the export on triax is that step too."""
    from triax.commands.export import main as export_main

    # A directory of its own: tmp_path/out holds nanoGPT's own ckpt.pt, which an export never replaces.
    run_dir = tmp_path / "triax-run"
    common = [f"data.path={started['data']}", "data.task=tokens", "data.block_size=16", "model.n_layer=2",
              "model.n_head=2", "model.n_embd=16", "model.gelu=exact", "model.tie_embeddings=true",
              "model.dropout=0.0", "optim.lr=1e-2", "optim.min_lr=1e-3", "optim.warmup_steps=2",
              "optim.decay_steps=8", "optim.schedule=nanogpt", "optim.decay=matrices", "optim.fused=false",
              "trainer.batch_size=2", "trainer.eval_every=0", "trainer.log_every=1", "trainer.sample_tokens=0"]
    train([*common, f"trainer.run_dir={run_dir}", f"trainer.max_steps={STOP}"])
    assert export_main([str(run_dir), str(tmp_path / "exported"), "--format", "nanogpt"]) == 0
    exported = torch.load(tmp_path / "exported" / "ckpt.pt", map_location="cpu", weights_only=True)
    config = exported["config"]
    assert {key: config[key] for key in ("learning_rate", "min_lr", "warmup_iters", "lr_decay_iters", "batch_size",
                                         "max_iters", "beta1", "beta2", "decay_lr")} == {
        "learning_rate": 1e-2, "min_lr": 1e-3, "warmup_iters": 2, "lr_decay_iters": 8, "batch_size": 2,
        "max_iters": STOP - 1, "beta1": 0.9, "beta2": 0.95, "decay_lr": True}
    tokens = torch.from_numpy(np.fromfile(started["data"] / "train.bin", dtype=np.uint16).astype(np.int64))
    windows = tokens.unfold(0, ARGS["block_size"] + 1, 1)
    x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    on_nanogpt, _, _ = nanogpt_steps(exported["model"], exported["optimizer"], STOP, 1, x, y)

    train([*common, f"trainer.run_dir={run_dir}", f"trainer.max_steps={STOP + 1}"])  # triax's own next step
    continued = tmp_path / "continued"
    train([f"trainer.continue_from={tmp_path / 'exported'}", f"data.path={started['data']}", "data.task=tokens",
           f"trainer.run_dir={continued}", f"trainer.max_steps={STOP + 1}", "optim.fused=false",
           "trainer.sample_tokens=0"])
    for name, run in (("own", run_dir), ("continued", continued)):
        assert export_main([str(run), str(tmp_path / name), "--format", "nanogpt"]) == 0
    own = torch.load(tmp_path / "own" / "ckpt.pt", map_location="cpu", weights_only=True)["model"]
    again = torch.load(tmp_path / "continued" / "ckpt.pt", map_location="cpu", weights_only=True)["model"]
    key_bias = torch.arange(3 * ARGS["n_embd"]) // ARGS["n_embd"] == 1
    for name, expected in on_nanogpt.items():
        expected, before = expected.detach(), exported["model"][name]
        # (The continued run starts a new data order: its batch holds the two samples in either
        # order, which only reorders the loss's sum.)
        for got in (own[name], again[name]):
            if name.endswith("attn.c_attn.bias"):  # the key's bias: see the first test
                assert (got[key_bias] - expected[key_bias]).abs().max() <= 2 * get_lr(STOP)
                got = got[~key_bias]
            kept = ~key_bias if name.endswith("attn.c_attn.bias") else slice(None)
            difference = (got - expected[kept]).abs().max()
            assert difference <= 2e-7 and difference <= (expected[kept] - before[kept]).abs().max() / 1e4, (name, difference)


def test_each_weight_decay_rule_groups_the_parameters_it_names():
    from triax.models import GPTConfig, build_model
    from triax.train.optim import split_decay_parameters

    model = build_model(GPTConfig(vocab_size=67, block_size=16, n_layer=1, n_head=2, n_embd=16, tie_embeddings=True))
    names = {id(p): n for n, p in model.named_parameters()}

    def decayed(rule):
        return sorted(names[id(p)] for p in split_decay_parameters(model, rule)[0])

    matrices = sorted(n for n, p in model.named_parameters() if p.dim() >= 2)
    assert decayed("matrices") == matrices and "pos_emb.weight" in matrices and "tok_emb.weight" in matrices
    assert decayed("linear") == [n for n in matrices if n != "pos_emb.weight"]  # the tied table as the head
    assert decayed("all") == sorted(names.values())


@pytest.mark.parametrize("option, extra", [("trainer.continue_from", []), ("model.init_from", []),
                                           ("model.init_from", ["trainer.preflight=true"])])
def test_a_run_opens_the_checkpoint_once(tmp_path, started, monkeypatch, option, extra):
    """`triax train`: ckpt.pt is read whole once a run, continue_from's for the config's settings
    (then its weights, AdamW state and notes come from that same reading), init_from's by the trainer
    (and the preflight's sizes come from that reading too)."""
    from triax.commands.train import main
    from triax.interop import formats

    opened, open_checkpoint = [], formats.open_checkpoint
    monkeypatch.setattr(formats, "open_checkpoint", lambda path: opened.append(path) or open_checkpoint(path))
    overrides = continue_overrides(tmp_path / "run", started, f"trainer.max_steps={STOP + 1}",
                                   f"data.block_size={ARGS['block_size']}", *extra)
    assert main([f"{option}={started['out']}", *overrides[1:]]) == 0
    assert opened == [str(started["out"])]


def test_the_trainer_leaves_the_config_it_is_given_as_it_was(tmp_path, started, monkeypatch):
    """The run resolves its own copy (triax.train.resolve): the checkpoint's architecture, the batch
    lowered to the data, the paths made absolute; the caller's config is not edited."""
    import copy

    from triax.train import Trainer, compose_config

    monkeypatch.chdir(tmp_path)
    config = compose_config(["trainer.continue_from=out", "data.task=tokens", "data.path=data", "trainer.run_dir=run",
                             "trainer.sample_tokens=0", "optim.fused=false", "trainer.batch_size=64",
                             f"trainer.max_steps={STOP + 1}"])
    given = copy.deepcopy(config)
    trainer = Trainer(config)
    trainer.fit()
    assert config == given
    resolved = trainer.config
    assert resolved.trainer.batch_size == 2 and resolved.data.path == str(tmp_path / "data")
    assert resolved.model.n_layer == ARGS["n_layer"] and resolved.model.n_embd == ARGS["n_embd"]
