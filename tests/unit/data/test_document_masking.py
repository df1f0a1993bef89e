"""Documents that never see each other (data.packing with data.task=tokens): a packed window on a
tiny Llama loaded from transformers computes, to round-off, what transformers computes for each
document alone; it does not without the mask. Document starts come from a Megatron index or an
end-of-text token; a format with neither is refused with one line."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from triax.config import compose_config
from triax.data.targets import IGNORE_INDEX
from triax.data.sources import open_source
from triax.interop.hf.whole_model import load_hf_model
from triax.train.data import build_data
from triax.errors import ConfigError

from support.helpers import tiny_overrides
from support.llama_checkpoints import VOCAB, save_checkpoint
from support.token_formats import write_megatron, write_shard

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")

LENGTHS = (7, 12, 9)  # three documents, one window of 27 inputs over all of them
CP_LENGTHS = (7, 12, 10)  # 28 inputs: a multiple of 2 x cp = 4, as context parallelism cuts a window
EOT = 0

# fp32: the two implementations differ in summation order only, a few units of round-off (2^-24)
# per logit, summed over ~27 targets of losses ~6: far below 1e-5 relative. A document that sees
# another's tokens changes its losses by about the attention weights it gives them (percents).
RELATIVE = 1e-5


def documents(seed=0, lengths=LENGTHS):
    rng = np.random.default_rng(seed)
    return [np.concatenate([[EOT], rng.integers(1, VOCAB, length - 1)]) for length in lengths]


def summed_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).double(), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum").item()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(a tiny transformers Llama's checkpoint directory, the transformers model)."""
    directory = tmp_path_factory.mktemp("llama")
    return directory, save_checkpoint(directory, "llama")


@pytest.fixture(scope="module")
def models(checkpoint):
    directory, reference = checkpoint
    return reference, load_hf_model(str(directory), torch.device("cpu")).eval()


def alone(reference, lengths=LENGTHS):
    """Each document's summed loss, computed by transformers on the document by itself."""
    total = 0.0
    with torch.no_grad():
        for document in documents(lengths=lengths):
            ids = torch.from_numpy(document).long()[None]
            total += summed_loss(reference(ids).logits[:, :-1], ids[:, 1:])
    return total


@pytest.mark.parametrize("where", ["megatron_index", "end_of_text"])
def test_a_packed_window_equals_each_document_alone_in_transformers(tmp_path, models, where):
    reference, ours = models
    if where == "megatron_index":
        path = write_megatron(tmp_path / "docs", documents())
        source = open_source(str(path), str(path), sum(LENGTHS) - 1, VOCAB, None, 0.9)
    else:
        path = write_shard(tmp_path / "docs_000001.bin", np.concatenate(documents()))
        source = open_source(str(path), str(path), sum(LENGTHS) - 1, VOCAB, None, 0.9, eot_token=EOT)
    window = source.train
    assert len(window) == 1
    window.packing, window.score_document_starts = True, False
    x, y = window.batch(torch.tensor([0]))
    assert int((y == IGNORE_INDEX).sum()) == len(LENGTHS) - 1  # each next document's first token
    with torch.no_grad():
        packed = summed_loss(ours(x, documents=window.document_ids(torch.tensor([0]))), y)
        unmasked = summed_loss(ours(x), y)
    expected = alone(reference)
    assert abs(packed - expected) <= RELATIVE * abs(expected)
    assert abs(unmasked - expected) > 100 * RELATIVE * abs(expected)


@pytest.mark.multiprocess
def test_under_context_parallelism_a_packed_window_still_equals_each_document_alone(tmp_path, checkpoint):
    """The same window cut over 2 context-parallel ranks (each holds two of its four chunks and
    attends with its rows of the whole window's mask): the ranks' losses add up to transformers'
    for each document alone, and differ without the mask."""
    import json
    import os

    from support import SUPPORT_DIR
    from support.forked import launch

    directory, reference = checkpoint
    path = write_megatron(tmp_path / "docs", documents(lengths=CP_LENGTHS))
    window = open_source(str(path), str(path), sum(CP_LENGTHS) - 1, VOCAB, None, 0.9).train
    window.packing, window.score_document_starts = True, False
    x, y = window.batch(torch.tensor([0]))
    np.savez(tmp_path / "window.npz", x=x.numpy(), y=y.numpy(), documents=window.document_ids(torch.tensor([0])).numpy())
    probe = os.path.join(SUPPORT_DIR, "document_cp_probe.py")
    result = launch(2, [probe, str(directory), str(tmp_path / "window.npz")], timeout=240)
    losses = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("PROBE "))[6:])
    expected = alone(reference, CP_LENGTHS)
    assert abs(losses["packed"] - expected) <= RELATIVE * abs(expected), (losses, expected)
    assert abs(losses["unmasked"] - expected) > 100 * RELATIVE * abs(expected), (losses, expected)


def test_document_numbers_follow_the_index_in_both_splits(tmp_path):
    many = [np.arange(length) % VOCAB for length in (5, 9, 4, 8, 6, 7)]
    path = write_megatron(tmp_path / "docs", many)
    source = open_source(str(path), None, 6, VOCAB, None, 0.6)
    cut = source.train.tokens.num_tokens
    assert cut == 5 + 9 + 4 + 8  # the first document start at or after 60% of the 39 tokens
    val_numbers = source.val.documents.numbers(np.arange(13)[None], None)[0]
    assert val_numbers.tolist() == [1] * 6 + [2] * 7  # documents of 6 and 7 tokens


def test_packing_trains_and_a_source_without_document_starts_is_refused(tmp_path):
    write_shard(tmp_path / "docs_000001.bin", np.tile(np.concatenate(documents()), 20))
    base = {"data.task": "tokens", "data.vocab_size": VOCAB, "data.packing": "true",
            "data.val_path": str(tmp_path / "docs_*.bin")}
    with pytest.raises(ConfigError, match="set data.eot_token"):
        build_data(compose_config(tiny_overrides(tmp_path / "run", str(tmp_path / "docs_*.bin"), **base)).data)
    data = build_data(compose_config(tiny_overrides(tmp_path / "run", str(tmp_path / "docs_*.bin"), **{
        **base, "data.eot_token": EOT})).data)
    assert data.train.packing and data.val.packing
    numbers = data.train.document_ids(torch.tensor([0, 3]))
    assert numbers.shape == (2, 16) and numbers[0].tolist() == [1] * 7 + [2] * 9


@pytest.mark.multiprocess
def test_context_parallel_packed_documents_train_as_one_process(tmp_path):
    """parallel.cp=2 cuts each window over two ranks; the documents stay masked across the cut:
    the same losses (training and validation) and weights as one process holding whole windows."""
    import json

    from support.helpers import assert_same_training, train
    from triax.train.trainer import Trainer

    rng = np.random.default_rng(1)
    many = [np.concatenate([[EOT], rng.integers(1, VOCAB, int(length))]) for length in rng.integers(5, 40, 60)]
    write_megatron(tmp_path / "docs", many)
    values = {"data.task": "tokens", "data.vocab_size": VOCAB, "data.packing": "true",
              "data.score_document_starts": "false", "data.block_size": 32, "model.arch": "llama",
              "model.n_head": 4, "model.n_kv_head": 2, "model.intermediate_size": 64, "model.dropout": 0.0,
              "trainer.max_steps": 3, "trainer.batch_size": 2, "trainer.eval_every": 3, "trainer.eval_batches": 2,
              "trainer.log_every": 1, "parallel.dp_replicate": 1}
    train(tiny_overrides(tmp_path / "cp", str(tmp_path / "docs"), **values, **{"parallel.cp": 2}), nproc=2)
    Trainer(compose_config(tiny_overrides(tmp_path / "one", str(tmp_path / "docs"), **values))).fit()
    ours, theirs = ([json.loads(line) for line in open(tmp_path / run / "metrics.jsonl")] for run in ("cp", "one"))
    for mine, base in zip(ours, theirs):
        for key in ("loss", "val_loss"):
            if key in base:
                assert mine[key] == pytest.approx(base[key], rel=1e-5), (key, mine["step"])
    assert any("val_loss" in record for record in ours)
    assert_same_training(tmp_path / "cp", tmp_path / "one")
    # The trainer did mask: without packing the same windows give other losses (by more than the
    # tolerance that called the two layouts equal; a model at its initialisation attends almost
    # uniformly, so the masked keys move the loss by about 1e-4 here).
    Trainer(compose_config(tiny_overrides(tmp_path / "unmasked", str(tmp_path / "docs"), **{
        **values, "data.packing": "false"}))).fit()
    unmasked = json.loads(open(tmp_path / "unmasked" / "metrics.jsonl").readline())
    assert unmasked["loss"] != pytest.approx(theirs[0]["loss"], rel=1e-5)


@pytest.mark.multiprocess
def test_two_data_parallel_processes_equal_one_when_document_starts_are_not_scored(tmp_path):
    """Without the documents' first targets each row scores its own number of tokens: the step's
    loss is then the mean over every scored token of the step, on all ranks together (as chat's),
    so 2 processes of 4 windows compute the gradient of 1 process of 8."""
    from support.helpers import assert_same_training, train

    rng = np.random.default_rng(2)
    write_megatron(tmp_path / "docs", [rng.integers(0, VOCAB, int(length)) for length in rng.integers(3, 30, 80)])
    values = {"data.task": "tokens", "data.vocab_size": VOCAB, "data.packing": "true",
              "data.score_document_starts": "false", "model.dropout": 0.0, "model.bias": "false",
              "trainer.max_steps": 4}
    train(tiny_overrides(tmp_path / "two", str(tmp_path / "docs"), **values, **{"trainer.batch_size": 4}), nproc=2)
    train(tiny_overrides(tmp_path / "one", str(tmp_path / "docs"), **values, **{"trainer.batch_size": 8}))
    assert_same_training(tmp_path / "two", tmp_path / "one")
