"""Token sources read as other tools write them: Megatron-LM's indexed datasets (written here by
megatron-core itself when it is installed, else by the documented layout) and llm.c / modded-nanogpt
shards train exactly as the same tokens in nanoGPT's layout; the documents are counted as the
.idx records them."""

import json

import numpy as np
import pytest
import torch

from triax.config import compose_config
from triax.data.megatron import IndexedDataset
from triax.data.sources import open_source
from triax.train.trainer import Trainer

from support.helpers import tiny_overrides
from support.token_formats import split_documents, write_megatron, write_shard

VOCAB = 61


def stream(count, seed):
    rng = np.random.default_rng(seed)
    ids = np.tile(np.random.default_rng(0).integers(0, VOCAB, 97), count // 97 + 1)[:count]
    noise = rng.random(count) < 0.05
    ids[noise] = rng.integers(0, VOCAB, noise.sum())
    return ids.astype(np.uint16)


TRAIN, VAL = stream(3000, 1), stream(500, 2)


def megatron_core_write(prefix, documents):
    """The dataset as megatron-core's IndexedDatasetBuilder writes it."""
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    builder = indexed.IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for document in documents:
        builder.add_item(torch.from_numpy(document.astype(np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def nanogpt_dir(tmp_path):
    directory = tmp_path / "nanogpt"
    directory.mkdir()
    TRAIN.tofile(directory / "train.bin")
    VAL.tofile(directory / "val.bin")
    return str(directory)


def run_metrics(run_dir, path, **extra):
    values = {"data.task": "tokens", "data.vocab_size": VOCAB, "trainer.max_steps": 6, "trainer.eval_every": 3,
              "trainer.eval_batches": 0, **extra}
    Trainer(compose_config(tiny_overrides(run_dir, path, **values))).fit()
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_megatron_core_dataset_counts_its_documents_and_trains_as_nanogpt_files(tmp_path):
    documents = split_documents(TRAIN, seed=3)
    prefix = megatron_core_write(tmp_path / "train_text_document", documents)
    val_prefix = megatron_core_write(tmp_path / "val_text_document", split_documents(VAL, seed=4))
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset

    ours = IndexedDataset(str(prefix))
    assert ours.document_count == len(MegatronDataset(str(prefix)).document_indices) - 1 == len(documents)
    assert np.array_equal(ours.stream.windows(np.array([0]), len(TRAIN))[0], TRAIN)
    expected = run_metrics(tmp_path / "nanogpt_run", nanogpt_dir(tmp_path))
    got = run_metrics(tmp_path / "megatron_run", str(prefix), **{"data.val_path": str(val_prefix)})
    assert [record.get("val_loss") for record in got] == [record.get("val_loss") for record in expected]
    assert [record.get("loss") for record in got] == [record.get("loss") for record in expected]
    assert any("val_loss" in record for record in got)


def test_shards_by_glob_train_as_nanogpt_files(tmp_path):
    # Three training shards of uneven sizes (windows cross from one into the next) and one val shard.
    (tmp_path / "fineweb").mkdir()
    for number, (begin, end) in enumerate([(0, 1000), (1000, 1100), (1100, len(TRAIN))], start=1):
        write_shard(tmp_path / "fineweb" / f"fineweb_train_{number:06d}.bin", TRAIN[begin:end])
    write_shard(tmp_path / "fineweb" / "fineweb_val_000000.bin", VAL)
    expected = run_metrics(tmp_path / "nanogpt_run", nanogpt_dir(tmp_path))
    got = run_metrics(tmp_path / "shards_run", str(tmp_path / "fineweb" / "fineweb_train_*.bin"),
                      **{"data.val_path": str(tmp_path / "fineweb" / "fineweb_val_*.bin")})
    assert [(record.get("loss"), record.get("val_loss")) for record in got] == \
        [(record.get("loss"), record.get("val_loss")) for record in expected]


def test_without_val_path_the_tail_validates_cut_at_a_document_start(tmp_path):
    documents = split_documents(TRAIN, seed=5)
    prefix = write_megatron(tmp_path / "corpus", documents)
    source = open_source(str(prefix), None, 16, VOCAB, None, 0.9)
    starts = np.cumsum([0] + [len(document) for document in documents])
    cut = source.train.tokens.num_tokens
    assert cut in starts and cut >= 0.9 * len(TRAIN)
    assert cut + source.val.tokens.num_tokens == len(TRAIN)
    assert source.format == "megatron"
    # The prefix's .bin or .idx names the same dataset.
    assert open_source(f"{prefix}.idx", None, 16, VOCAB, None, 0.9).train.tokens.num_tokens == cut
