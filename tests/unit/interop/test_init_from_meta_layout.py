"""Llama checkpoints in Meta's layout (triax/interop/meta/weights.py): Meta's own folder (params.json +
consolidated.00.pth, triax/interop/meta/folder.py) and torchtitan's DCP folders
(triax/interop/torchtitan/checkpoint.py), read by `model.init_from`.

The folders are made here from a real transformers LlamaForCausalLM: its weights renamed to Meta's
names, wq and wk rows put back in Meta's rotary order. `meta_logits` is Meta's reference forward
pass written out (llama's model.py arithmetic: rotary embeddings by complex multiplication of
neighbouring pairs, RMSNorm, grouped-query attention, SwiGLU), so the test checks three ways: the
Meta-layout state computes transformers' logits under Meta's arithmetic (the folder is a real Meta
checkpoint, not just the inverse of triax's reader), and triax started from the folder computes
them too.
"""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from support.helpers import final_weights, tiny_overrides, token_files, train
from support.llama_checkpoints import hf_model
from triax.interop.meta.folder import CUT_DIMENSIONS, MetaFolder
from triax.interop.shared.pickled import pickled_bytes
from triax.errors import TriaxError

HEADS, KV_HEADS, DIM, LAYERS, VOCAB = 4, 2, 32, 2, 301
# Meta's FeedForward width for dim 32 with multiple_of 16 and ffn_dim_multiplier 1.3:
# int(1.3 * int(2 * 128 / 3)) = 110, rounded up to a multiple of 16.
PARAMS = {"dim": DIM, "n_layers": LAYERS, "n_heads": HEADS, "n_kv_heads": KV_HEADS, "vocab_size": VOCAB,
          "multiple_of": 16, "ffn_dim_multiplier": 1.3, "norm_eps": 1e-5, "rope_theta": 500000.0,
          "use_scaled_rope": False}
MLP = 112
META_NAMES = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
              "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
              "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
              "post_attention_layernorm": "ffn_norm"}


def reference_model():
    return hf_model("llama", hidden_size=DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                    num_hidden_layers=LAYERS, intermediate_size=MLP, rope_theta=PARAMS["rope_theta"],
                    rope_parameters={"rope_type": "default", "rope_theta": PARAMS["rope_theta"]})


def meta_order(weight, heads):
    """transformers' rows of one projection -> Meta's: value i of a head's first half and value i
    of its second half become neighbours 2i and 2i + 1."""
    head_dim = weight.shape[0] // heads
    first, second = weight.view(heads, 2, head_dim // 2, -1).unbind(1)
    return torch.stack((first, second), dim=2).reshape(weight.shape)


def meta_state(model):
    """LlamaForCausalLM's weights as Meta's consolidated.00.pth holds them."""
    state = {"tok_embeddings.weight": model.model.embed_tokens.weight, "norm.weight": model.model.norm.weight,
             "output.weight": model.lm_head.weight}
    for name, tensor in model.model.layers.state_dict().items():
        number, module, kind = name.split(".", 1)[0], name.split(".", 1)[1].rsplit(".", 1)[0], name.rsplit(".", 1)[1]
        if module == "self_attn.q_proj":
            tensor = meta_order(tensor, HEADS)
        elif module == "self_attn.k_proj":
            tensor = meta_order(tensor, KV_HEADS)
        state[f"layers.{number}.{META_NAMES[module]}.{kind}"] = tensor
    return {name: tensor.detach().clone() for name, tensor in state.items()}


def meta_logits(state, ids, params=PARAMS):
    """Meta's Llama forward pass (its model.py) over a consolidated state dict."""
    dim, heads, kv_heads = params["dim"], params["n_heads"], params["n_kv_heads"]
    head_dim, eps = dim // heads, params["norm_eps"]
    T = ids.shape[1]
    freqs = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    freqs_cis = torch.polar(torch.ones(T, head_dim // 2), torch.outer(torch.arange(T).float(), freqs))

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rotary(x):
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs_cis[None, :, None, :]).flatten(3)

    x = state["tok_embeddings.weight"][ids]
    for layer in range(params["n_layers"]):
        p = f"layers.{layer}."
        h = norm(x, state[p + "attention_norm.weight"])
        q = rotary(F.linear(h, state[p + "attention.wq.weight"]).view(*ids.shape, heads, head_dim))
        k = rotary(F.linear(h, state[p + "attention.wk.weight"]).view(*ids.shape, kv_heads, head_dim))
        v = F.linear(h, state[p + "attention.wv.weight"]).view(*ids.shape, kv_heads, head_dim)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=2) for t in (k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(x.shape)
        x = x + F.linear(attended, state[p + "attention.wo.weight"])
        h = norm(x, state[p + "ffn_norm.weight"])
        x = x + F.linear(F.silu(F.linear(h, state[p + "feed_forward.w1.weight"]))
                         * F.linear(h, state[p + "feed_forward.w3.weight"]), state[p + "feed_forward.w2.weight"])
    return F.linear(norm(x, state["norm.weight"]), state["output.weight"])


def write_meta_folder(directory, state, params=PARAMS):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "params.json").write_text(json.dumps(params))
    torch.save(state, directory / "consolidated.00.pth")
    (directory / "tokenizer.model").write_bytes(b"not read by triax")
    return directory


def write_torchtitan_folder(directory, state, prefixed=True):
    """What torchtitan's CheckpointManager saves at a step: the model's tensors (flattened under
    `model.` in older versions, at the top level in newer ones) beside other state."""
    import torch.distributed.checkpoint as dcp

    folder = directory / "step-10"
    model = {"model": state} if prefixed else dict(state)
    other = {"lr_scheduler": {"last_epoch": torch.tensor(10)},
             "optimizer": {f"state.{name}.exp_avg": torch.zeros_like(tensor) for name, tensor in state.items()}}
    dcp.save({**model, **other}, checkpoint_id=str(folder), no_dist=True)
    return directory


def triax_model_from(path, **model_keys):
    from triax.models import GPTConfig, build_model
    from triax.train import init_from
    from triax.config import ModelConfig

    source = init_from.resolve(str(path), ModelConfig(**model_keys))
    config = GPTConfig(**source.architecture)
    model = build_model(config)
    init_from.load_weights(source, model, config, lambda name: name)
    return model.eval()


IDS = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def reference():
    model = reference_model()
    with torch.no_grad():
        logits = model(IDS).logits
        state = meta_state(model)
        # float32, two layers, values of order 1: another order of the same sums differs by ~1e-6
        assert torch.allclose(meta_logits(state, IDS), logits, atol=1e-5, rtol=1e-5)  # a true Meta checkpoint
    return state, logits


def test_meta_mlp_width_is_metas_rounding():
    from triax.interop.meta.weights import mlp_width

    # Published shapes: Llama 2 7B (multiple_of 256) and Llama 3 8B (multiple_of 1024, multiplier 1.3).
    assert mlp_width(4096, 256, None) == 11008
    assert mlp_width(4096, 1024, 1.3) == 14336
    assert mlp_width(DIM, 16, 1.3) == MLP


def test_llama_3_1_params_json_is_transformers_llama3_rope_scaling():
    from triax.interop.meta.weights import architecture_from_params

    # Llama 3.1 8B's params.json, as Meta publishes it.
    params = {"dim": 4096, "ffn_dim_multiplier": 1.3, "multiple_of": 1024, "n_heads": 32, "n_kv_heads": 8,
              "n_layers": 32, "norm_eps": 1e-05, "rope_theta": 500000.0, "use_scaled_rope": True, "vocab_size": 128256}
    fields = architecture_from_params(params, "params.json", None)
    # What transformers' converter writes in config.json for it: rope_type llama3, factor 8,
    # low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192.
    # Llama 3.2 1B's params.json says use_scaled_rope but not its factor of 32: the run's model.rope_factor.
    assert architecture_from_params(params, "params.json", None, rope_factor=32.0)["rope_factor"] == 32.0
    assert architecture_from_params({**params, "rope_scaling_factor": 16}, "p", None, 32.0)["rope_factor"] == 16.0
    assert {key: fields[key] for key in ("rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                                         "rope_original_context", "intermediate_size", "n_kv_head", "head_dim")} == {
        "rope_scaling": "llama3", "rope_factor": 8.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
        "rope_original_context": 8192, "intermediate_size": 14336, "n_kv_head": 8, "head_dim": 128}


def test_any_box_of_rows_is_served_in_triaxs_rotary_order(reference):
    """A rank's rows may start and end inside a head (FSDP cuts rows evenly, whatever the heads):
    each box is the same rows of the whole tensor in triax's order."""
    from triax.interop.meta.weights import MetaWeights

    state, _ = reference
    stored = Tensors(state)
    weights = MetaWeights(stored, DIM // HEADS)
    name = "layers.1.attention.wq.weight"
    whole = weights.slice(name, (slice(0, DIM), slice(0, DIM)))
    assert torch.equal(whole, reference_model().model.layers[1].self_attn.q_proj.weight.detach())
    for rows, columns in [((3, 13), (0, DIM)), ((7, 8), (5, 9)), ((9, 32), (30, 32))]:
        assert torch.equal(weights.slice(name, (slice(*rows), slice(*columns))), whole[slice(*rows), slice(*columns)])
    assert stored.largest_read <= 2 * DIM // HEADS * DIM  # whole heads around the rows, not the tensor


class Tensors:
    """A state dict read by box, as the folders' readers serve it; records the largest read."""

    def __init__(self, state):
        self.state, self.largest_read = state, 0

    def entries(self):
        return {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in self.state.items()}

    def read(self, name, box):
        if box[0] != (0, self.state[name].shape[0]):
            self.largest_read = max(self.largest_read, math.prod(stop - start for start, stop in box))
        return self.state[name][tuple(slice(*part) for part in box)]


def test_a_meta_folder_computes_transformers_logits_in_triax(tmp_path, reference):
    state, logits = reference
    model = triax_model_from(write_meta_folder(tmp_path / "Llama", state))
    assert model.config.intermediate_size == MLP and model.config.n_kv_head == KV_HEADS
    with torch.no_grad():
        assert torch.allclose(model(IDS), logits, atol=1e-5, rtol=1e-5)


def test_a_meta_folder_without_output_ties_the_head_to_the_embedding(tmp_path, reference):
    """Llama 3.2's small models store no output.weight: the head is the embedding."""
    state = {name: tensor for name, tensor in reference[0].items() if name != "output.weight"}
    model = triax_model_from(write_meta_folder(tmp_path / "Llama", state))
    assert model.config.tie_embeddings and model.lm_head.weight is model.tok_emb.weight
    with torch.no_grad():
        expected = meta_logits({**state, "output.weight": state["tok_embeddings.weight"]}, IDS)
        assert torch.allclose(model(IDS), expected, atol=1e-5, rtol=1e-5)


def model_parallel_parts(state, parts, embedding_cut):
    """Meta's N files of a model-parallel checkpoint: each projection cut as fairscale's parallel
    layers hold it (column-parallel by rows, row-parallel by columns), norms whole in every file,
    the embedding by columns (Llama 2) or rows (Llama 3)."""
    files = [{} for _ in range(parts)]
    for name, tensor in state.items():
        kind = name.split(".", 2)[-1] if name.startswith("layers.") else name
        cut = embedding_cut if kind == "tok_embeddings.weight" else CUT_DIMENSIONS[kind]
        for number in range(parts):
            files[number][name] = tensor.clone() if cut is None else tensor.chunk(parts, cut)[number].clone()
    return files


@pytest.mark.parametrize("embedding_cut", [1, 0], ids=["llama2", "llama3"])
def test_a_model_parallel_meta_folder_is_its_parts_end_to_end(tmp_path, reference, embedding_cut):
    state, logits = reference
    # 2 files: 2 query heads and 1 key/value head each. The vocabulary (301) does not split in 2:
    # a Llama 3-style embedding is cut unevenly, as torch.chunk cuts it.
    folder = write_meta_folder(tmp_path / "Llama", {})
    for number, part in enumerate(model_parallel_parts(state, 2, embedding_cut)):
        torch.save(part, folder / f"consolidated.{number:02d}.pth")
    model = triax_model_from(folder)
    with torch.no_grad():
        assert torch.allclose(model(IDS), logits, atol=1e-5, rtol=1e-5)
    # A rank's box may lie across two files, or inside one.
    read = MetaFolder(str(folder))
    for name, rows, columns in [("tok_embeddings.weight", (100, 200), (10, 20)), ("tok_embeddings.weight", (0, 9), (0, 4)),
                                ("layers.0.attention.wo.weight", (0, 32), (12, 20)),
                                ("layers.1.feed_forward.w1.weight", (50, 60), (0, DIM))]:
        assert torch.equal(read.read(name, (rows, columns)), state[name][slice(*rows), slice(*columns)]), name


@pytest.mark.parametrize("prefixed, described", [(True, "by the run"), (False, "by the run"), (True, "by params.json")],
                         ids=["model-prefix", "flat", "params.json"])
def test_a_torchtitan_folder_computes_transformers_logits_in_triax(tmp_path, reference, prefixed, described):
    state, logits = reference
    root = write_torchtitan_folder(tmp_path / "checkpoint", state, prefixed)
    write_torchtitan_folder(tmp_path / "checkpoint" / "older", {"tok_embeddings.weight": torch.zeros(1, 1)})
    (tmp_path / "checkpoint" / "older" / "step-10").rename(tmp_path / "checkpoint" / "step-9")
    # torchtitan's checkpoint folder (its newest step-N is read, step-10 over step-9); the heads
    # and rotary base come from the run's keys, or from Meta's params.json beside the steps.
    keys = dict(n_kv_head=KV_HEADS, rope_theta=PARAMS["rope_theta"])
    if described == "by params.json":
        (root / "params.json").write_text(json.dumps(PARAMS))
        keys = {}
    model = triax_model_from(root, **keys)
    assert model.config.n_head == HEADS and model.config.intermediate_size == MLP
    with torch.no_grad():
        assert torch.allclose(model(IDS), logits, atol=1e-5, rtol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind, layout", [("meta", "parallel.dp_shard=2"), ("torchtitan", "parallel.tp=2"),
                                          ("torchtitan", "parallel.pp=2")])
def test_two_processes_start_from_each_rank_s_slices(tmp_path, reference, kind, layout):
    """2 processes (FSDP shards, tensor-parallel heads, or pipeline stages holding different
    layers) start from the same weights one process does: after one step at a negligible learning
    rate (AdamW moves a weight by about lr), the run's weights are the checkpoint's."""
    state, _ = reference
    if kind == "meta":
        source = write_meta_folder(tmp_path / "Llama", state)
        keys = {}
    else:
        source = write_torchtitan_folder(tmp_path / "checkpoint", state)
        keys = {"model.arch": "llama", "model.n_kv_head": KV_HEADS, "model.rope_theta": PARAMS["rope_theta"]}
    data = token_files(tmp_path / "data", VOCAB)
    overrides = tiny_overrides(tmp_path / "run", str(data), **{
        "data.task": "tokens", "data.vocab_size": VOCAB, "model.init_from": str(source), **keys,
        "trainer.max_steps": 1, "optim.lr": 1e-12, "optim.min_lr": 0.0, "optim.warmup_steps": 0, "model.dropout": 0.0,
        "trainer.save_every": 1})
    overrides = [item for item in overrides if not item.startswith(("model.n_layer", "model.n_head", "model.n_embd"))]
    train([*overrides, layout], nproc=2)
    expected = triax_model_from(source, n_kv_head=KV_HEADS, rope_theta=PARAMS["rope_theta"]).state_dict()
    saved = final_weights(tmp_path / "run", [*overrides, layout])
    for name, tensor in expected.items():
        assert torch.allclose(saved[name][: tensor.shape[0]], tensor, rtol=0, atol=1e-9), name


class Payload:
    """A pickle that runs a command when unpickled by anything but a restricted reader."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _outside(directory, name, content=b"{}"):
    """`name` in `directory` made a link to a file outside it."""
    outside = directory.parent / f"outside-{name}"
    outside.write_bytes(content)
    target = directory / name
    target.unlink(missing_ok=True)
    target.symlink_to(outside)


def _fifo(directory, name):
    (directory / name).unlink(missing_ok=True)
    os.mkfifo(directory / name)


def _params(directory, **changes):
    (directory / "params.json").write_text(json.dumps({**PARAMS, **changes}))


META_DAMAGE = {
    "os.system pickle": (lambda d, m: (d / "consolidated.00.pth").write_bytes(pickled_bytes({"x": Payload(m)})),
                         "needs posix.system to be unpickled"),
    "missing params.json": (lambda d, m: (d / "params.json").unlink(), "params.json does not exist"),
    "wrong shapes": (lambda d, m: _params(d, dim=64), "has shape [301, 32], but"),
    "huge layer count": (lambda d, m: _params(d, n_layers=10**12), "n_layers=1000000000000 is outside 1..1024"),
    "huge width": (lambda d, m: _params(d, dim=2**40), "dim=1099511627776 is outside"),
    "a setting triax lacks": (lambda d, m: _params(d, moe_args={"num_experts": 16}), "moe_args="),
    "params.json of another type": (lambda d, m: _params(d, n_heads="4"), "n_heads='4' is not the int"),
    "params.json not UTF-8": (lambda d, m: (d / "params.json").write_bytes(b'{"dim": "\xff\xfe"}'),
                              "UnicodeDecodeError"),
    "params.json nested deep": (lambda d, m: (d / "params.json").write_text("[" * 100000 + "]" * 100000),
                                "RecursionError"),
    "params.json too large": (lambda d, m: (d / "params.json").write_bytes(b" " * (16 * 2**20 + 1)),
                              "more than the 16777216"),
    "an infinite number": (lambda d, m: (d / "params.json").write_text(json.dumps(PARAMS).replace("500000.0", "Infinity")),
                           "Infinity is not a number triax accepts"),
    "a layer too many": (lambda d, m: _params(d, n_layers=1), "holds layers.1.attention.wk.weight and 8 more"),
    "a damaged second file": (lambda d, m: (d / "consolidated.01.pth").write_bytes(b""), "is not a torch.save archive"),
    "a missing part": (lambda d, m: torch.save({}, d / "consolidated.02.pth"), "numbered [0, 2]"),
    "parts of another model": (lambda d, m: torch.save({"x": torch.ones(1)}, d / "consolidated.01.pth"),
                               "holds other tensors than consolidated.00.pth"),
    "weights linked outside": (lambda d, m: _outside(d, "consolidated.00.pth"), "outside the checkpoint directory"),
    "params.json linked outside": (lambda d, m: _outside(d, "params.json"), "outside the checkpoint directory"),
    "params.json a FIFO": (lambda d, m: _fifo(d, "params.json"), "is not a regular file"),
    "weights a FIFO": (lambda d, m: _fifo(d, "consolidated.00.pth"), "is not a regular file"),
    "not a pickle": (lambda d, m: (d / "consolidated.00.pth").write_bytes(b"junk" * 10), "is not a torch.save archive"),
}


@pytest.mark.parametrize("damage", list(META_DAMAGE))
def test_a_hostile_or_damaged_meta_folder_is_refused_in_one_line(tmp_path, reference, damage):
    from triax.train import init_from
    from triax.config import ModelConfig

    folder = write_meta_folder(tmp_path / "Llama", reference[0])
    marker = tmp_path / "ran"
    change, message = META_DAMAGE[damage]
    change(folder, marker)
    with pytest.raises(TriaxError) as raised:
        init_from.resolve(str(folder), ModelConfig())
    assert message in str(raised.value) and "\n" not in str(raised.value), str(raised.value)
    assert not marker.exists()


def _metadata(folder, change):
    """Rewrite a DCP folder's .metadata after `change(metadata)` (the test's own file: plain pickle)."""
    import pickle

    path = folder / "step-10" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))


def _first_record(metadata):
    return next(record for index, record in metadata.storage_data.items() if index.fqn.endswith("wq.weight"))


TORCHTITAN_DAMAGE = {
    "os.system pickle": (lambda d, m: (d / "step-10" / ".metadata").write_bytes(__import__("pickle").dumps(Payload(m))),
                         "needs posix.system to be unpickled"),
    "a file outside the folder": (lambda d, m: _metadata(d, lambda md: setattr(_first_record(md), "relative_path",
                                                                                "../outside.distcp")),
                                  "is stored in '../outside.distcp', not a file of the folder itself"),
    "bytes past the file's end": (lambda d, m: _metadata(d, lambda md: setattr(_first_record(md), "length", 2**40)),
                                  "are not within __0_0.distcp"),
    "a chunk outside the tensor": (lambda d, m: _metadata(d, lambda md: setattr(
        md.state_dict_metadata["model.norm.weight"].chunks[0], "sizes", torch.Size([10**6]))), "has a chunk outside"),
    "data linked outside": (lambda d, m: _outside(d / "step-10", "__0_0.distcp"), "outside the checkpoint directory"),
    "metadata a FIFO": (lambda d, m: _fifo(d / "step-10", ".metadata"), "is not a regular file"),
    "a step linked outside": (lambda d, m: ((d / "step-10").rename(d.parent / "elsewhere"),
                                            (d / "step-10").symlink_to(d.parent / "elsewhere")), "step-10 is a link to"),
    "chunks that miss values": (lambda d, m: _metadata(d, lambda md: setattr(
        md.state_dict_metadata["model.norm.weight"].chunks[0], "sizes", torch.Size([DIM - 1]))),
                                "chunks do not hold its 32 values"),
    "no head count": (None, "give model.arch=llama model.n_kv_head=N"),
    "a head count that does not fit": (3, "model.n_kv_head=3 does not fit"),
}


@pytest.mark.parametrize("damage", list(TORCHTITAN_DAMAGE))
def test_a_hostile_or_damaged_torchtitan_folder_is_refused_in_one_line(tmp_path, reference, damage):
    from triax.train import init_from
    from triax.config import ModelConfig

    root = write_torchtitan_folder(tmp_path / "checkpoint", reference[0])
    marker = tmp_path / "ran"
    change, message = TORCHTITAN_DAMAGE[damage]
    heads = KV_HEADS
    if callable(change):
        change(root, marker)
    else:
        heads = change
    with pytest.raises(TriaxError) as raised:
        init_from.resolve(str(root), ModelConfig(arch="llama", n_kv_head=heads))
    assert message in str(raised.value) and "\n" not in str(raised.value), str(raised.value)
    assert not marker.exists()


def test_torchtitan_bytes_damaged_after_the_check_are_one_line_when_read(tmp_path, reference):
    from triax.models import GPTConfig, build_model
    from triax.train import init_from
    from triax.config import ModelConfig

    root = write_torchtitan_folder(tmp_path / "checkpoint", reference[0])
    source = init_from.resolve(str(root), ModelConfig(arch="llama", n_kv_head=KV_HEADS))
    data = root / "step-10" / "__0_0.distcp"
    data.write_bytes(b"\0" * data.stat().st_size)  # same size, no torch.save record left
    config = GPTConfig(**source.architecture)
    with pytest.raises(TriaxError) as raised:
        init_from.load_weights(source, build_model(config), config, lambda name: name)
    assert "cannot read model." in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["hostile pickle", "text without tokenizer.json"])
def test_triax_train_refuses_with_exit_2_in_one_line(tmp_path, reference, case):
    import subprocess
    import sys

    folder = write_meta_folder(tmp_path / "Llama", reference[0])
    marker = tmp_path / "ran"
    data = ["data.task=tokens", f"data.path={token_files(tmp_path / 'data', VOCAB)}", f"data.vocab_size={VOCAB}"]
    message = "needs posix.system"
    if case == "hostile pickle":
        (folder / "consolidated.00.pth").write_bytes(pickled_bytes({"x": Payload(marker)}))
    else:  # Meta's tokenizer.model is not read: text needs the model's tokenizer.json
        data, message = [], "has no tokenizer.json, so text cannot be encoded for it"
    result = subprocess.run([sys.executable, "-m", "triax", "train", *data, f"model.init_from={folder}",
                             f"trainer.run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=240)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not marker.exists()
