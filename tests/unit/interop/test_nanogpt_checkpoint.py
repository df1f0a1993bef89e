"""nanoGPT's ckpt.pt (triax/interop/nanogpt/checkpoint.py): `triax train model.init_from=ckpt.pt` starts
from its weights and computes nanoGPT's logits; `triax export --format nanogpt` writes a ckpt.pt
that loads with torch's weights-only loader (as nanoGPT's sample.py loads it) and computes the
same logits; hostile or malformed files are refused in one line.

`nanogpt_logits` is nanoGPT's forward pass written out here (model.py's arithmetic: learned
positions, pre-LayerNorm blocks, one fused c_attn Linear, causal softmax attention, exact GELU,
the head tied to the token embedding), so the test needs no nanoGPT checkout.
"""

import math
import os

import pytest
import torch
import torch.nn.functional as F

from support.helpers import tiny_overrides, token_files, train
from support.nanogpt_checkpoints import ARGS, Payload, nanogpt_state
from triax.checkpoint import SnapshotCorruptError
from triax.interop.shared.pickled import pickled_bytes

def nanogpt_logits(state, args, ids):
    C, H = args["n_embd"], args["n_head"]
    get = state.get

    def norm(x, prefix):
        return F.layer_norm(x, (C,), state[prefix + "weight"], get(prefix + "bias"), 1e-5)

    T = ids.shape[1]
    x = state["transformer.wte.weight"][ids] + state["transformer.wpe.weight"][:T]
    for layer in range(args["n_layer"]):
        p = f"transformer.h.{layer}."
        fused = F.linear(norm(x, p + "ln_1."), state[p + "attn.c_attn.weight"], get(p + "attn.c_attn.bias"))
        q, k, v = fused.split(C, 2)
        q, k, v = (t.view(*t.shape[:2], H, C // H).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(x.shape)
        x = x + F.linear(attended, state[p + "attn.c_proj.weight"], get(p + "attn.c_proj.bias"))
        hidden = F.gelu(F.linear(norm(x, p + "ln_2."), state[p + "mlp.c_fc.weight"], get(p + "mlp.c_fc.bias")))
        x = x + F.linear(hidden, state[p + "mlp.c_proj.weight"], get(p + "mlp.c_proj.bias"))
    return F.linear(norm(x, "transformer.ln_f."), state["lm_head.weight"])


def write_ckpt(path, args=ARGS, compiled=False, **extra):
    state = nanogpt_state(args)
    model = {("_orig_mod." + name if compiled else name): tensor for name, tensor in state.items()}
    checkpoint = {"model": model, "optimizer": {"state": {}, "param_groups": []}, "model_args": dict(args),
                  "iter_num": 250, "best_val_loss": torch.tensor(1.25), "config": {"dataset": "shakespeare_char"}}
    checkpoint.update(extra)
    path.write_bytes(pickled_bytes(checkpoint))
    return state


def triax_model_from(path):
    from triax.models import GPTConfig, build_model
    from triax.train import init_from

    source = init_from.resolve(str(path))
    config = GPTConfig(**source.architecture)
    model = build_model(config)
    init_from.load_weights(source, model, config, lambda name: name)
    return model.eval()


@pytest.mark.parametrize("bias, compiled", [(True, False), (False, True)])
def test_a_nanogpt_checkpoint_computes_nanogpts_logits_in_triax(tmp_path, bias, compiled):
    args = dict(ARGS, bias=bias)
    state = write_ckpt(tmp_path / "ckpt.pt", args, compiled=compiled)
    model = triax_model_from(tmp_path)  # nanoGPT's out_dir, holding ckpt.pt
    ids = torch.randint(0, args["vocab_size"], (3, args["block_size"]), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # float32, two layers, values of order 1: a different order of the same sums differs by ~1e-6
        assert torch.allclose(model(ids), nanogpt_logits(state, args, ids), atol=1e-5, rtol=1e-5)
    assert model.lm_head.weight is model.tok_emb.weight


@pytest.mark.multiprocess
def test_triax_train_starts_from_ckpt_pt_and_exports_a_ckpt_pt_nanogpt_loads(tmp_path):
    from triax.commands.export import main as export_main

    state = write_ckpt(tmp_path / "ckpt.pt")
    data = token_files(tmp_path / "data", ARGS["vocab_size"])
    run_dir = tmp_path / "run"
    # One step at a negligible learning rate: the weights stay the checkpoint's.
    overrides = tiny_overrides(run_dir, str(data), **{
        "data.task": "tokens", "data.vocab_size": ARGS["vocab_size"], "model.init_from": str(tmp_path / "ckpt.pt"),
        "trainer.max_steps": 1, "optim.lr": 1e-12, "optim.min_lr": 0.0, "model.dropout": 0.0})
    train(overrides)
    assert export_main([str(run_dir), str(tmp_path / "out"), "--format", "nanogpt"]) == 0
    exported = torch.load(tmp_path / "out" / "ckpt.pt", map_location="cpu", weights_only=True)  # as sample.py
    assert exported["model_args"] == {**{k: ARGS[k] for k in ARGS if k != "dropout"}, "dropout": 0.0}
    assert exported["iter_num"] == 1
    assert exported["model"].keys() == state.keys()
    ids = torch.randint(0, ARGS["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(nanogpt_logits(exported["model"], ARGS, ids), nanogpt_logits(state, ARGS, ids),
                              atol=1e-5, rtol=1e-5)
    again = triax_model_from(tmp_path / "out")  # and triax reads its own export
    with torch.no_grad():
        assert torch.allclose(again(ids), nanogpt_logits(state, ARGS, ids), atol=1e-5, rtol=1e-5)


def test_export_refuses_a_model_nanogpt_cannot_compute():
    from triax.errors import UsageError
    from triax.interop.nanogpt.export import check_expressible

    check_expressible({"arch": "gpt2", "gelu": "exact", "tie_embeddings": True, "norm_eps": 1e-5, "n_embd": 8,
                       "intermediate_size": None})
    with pytest.raises(UsageError, match=r"model.gelu='tanh' is not what nanoGPT's GPT computes"):
        check_expressible({"arch": "gpt2", "gelu": "tanh", "tie_embeddings": True, "norm_eps": 1e-5, "n_embd": 8})


@pytest.mark.parametrize("damage, message", [
    (lambda path, marker: path.write_bytes(pickled_bytes({"model": Payload(marker)})), "weights-only"),
    (lambda path, marker: path.write_bytes(b"not a pickle at all"), "not a readable torch.save file"),
    (lambda path, marker: path.write_bytes(pickled_bytes([1, 2])), "lacks the 'model' and 'model_args'"),
    (lambda path, marker: write_ckpt(path, model_args=dict(ARGS, n_embd=2**40)), "n_embd=1099511627776"),
    (lambda path, marker: write_ckpt(path, model_args=dict(ARGS, n_head=3)), "not divisible by n_head=3"),
    (lambda path, marker: write_ckpt(path, iter_num="soon"), "iter_num='soon'"),
    (lambda path, marker: (path.unlink(missing_ok=True), os.symlink(os.devnull, path)), "symlink"),
])
def test_a_hostile_or_malformed_ckpt_pt_is_refused_in_one_line(tmp_path, damage, message):
    from triax.train import init_from

    marker = tmp_path / "ran"
    damage(tmp_path / "ckpt.pt", marker)
    with pytest.raises((SnapshotCorruptError, OSError)) as raised:
        init_from.resolve(str(tmp_path / "ckpt.pt"))
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert not marker.exists()
