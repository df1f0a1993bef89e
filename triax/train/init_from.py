"""`model.init_from`: start training from existing weights instead of a random initialisation:
a transformers GPT-2 directory (what `save_pretrained` writes, or a snapshot directory in the
Hugging Face cache; nothing is downloaded) or another triax run (its newest good snapshot).

The checkpoint fixes the architecture (layers, heads, width, context, vocabulary, biases, tied
embeddings) and the text codec: a GPT-2 directory's tokenizer.json, a run's tokenizer.json or
character vocabulary, which then encodes `data.task=char` text. Weights are read only where this
rank holds them (transformers' safetensors by lazy slices; a triax snapshot through the
layout-independent loader), after the model is built in its layout and before any step.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from triax import checkpoint
from triax.data.tokenizer import BPETokenizer
from triax.errors import ConfigError
from triax.models import hf_gpt2
from triax.train.commands import open_run


@dataclass
class InitSource:
    path: str
    kind: str  # "transformers" | "run"
    architecture: dict  # GPTConfig fields the checkpoint fixes
    codec: object | None  # encodes text for the run: a BPETokenizer or a character Vocabulary
    saved_rows: int | None = None  # a run's embedding rows (its tensor-parallel padding must be kept)
    snapshot: str | None = None


def resolve(path: str) -> InitSource:
    if not os.path.isdir(path):
        raise ConfigError(f"model.init_from={path!r} is not a directory; give a transformers GPT-2 directory "
                          "(save_pretrained output or a Hugging Face cache snapshot) or a triax run directory")
    if os.path.isfile(os.path.join(path, "model.json")):


        reader, model_config, vocab = open_run(path)
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            vocab.source_path = os.path.join(path, "tokenizer.json")  # the new run keeps a copy
        values = asdict(model_config)
        architecture = {key: values[key] for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd",
                                                     "bias", "tie_embeddings", "gelu")}
        return InitSource(path, "run", architecture, vocab, model_config.vocab_rows, reader.snapshot)

    if not hf_gpt2.is_hf_gpt2(path):
        raise ConfigError(f"model.init_from={path!r} has neither model.json (a triax run) nor config.json "
                          "(a transformers GPT-2)")
    architecture = hf_gpt2.architecture(hf_gpt2.read_hf_config(path))
    hf_gpt2.HFWeights(path)  # a directory without safetensors weights fails here, before any process group
    codec = None
    tokenizer = hf_gpt2.tokenizer_file(path)
    if tokenizer is not None:

        codec = BPETokenizer.from_file(tokenizer)
        codec.source_path = tokenizer
    return InitSource(path, "transformers", architecture, codec)


def check_fits(source: InitSource, data_vocab_size: int, block_size: int) -> None:
    """The data must fit the checkpoint's vocabulary and context."""
    arch = source.architecture
    if data_vocab_size > arch["vocab_size"]:
        raise ConfigError(f"the data has token ids up to {data_vocab_size - 1} but model.init_from={source.path!r} "
                          f"has a vocabulary of {arch['vocab_size']}; use data tokenized with its tokenizer")
    if block_size > arch["block_size"]:
        raise ConfigError(f"data.block_size={block_size} is longer than model.init_from's context of "
                          f"{arch['block_size']} positions; use data.block_size <= {arch['block_size']}")


def load_weights(source: InitSource, model, model_config, stored_name) -> None:
    """Overwrite this rank's part of the freshly built model with the checkpoint's values."""
    if source.kind == "run":

        checkpoint.load_snapshot(source.snapshot, model, None, restore_rng=False, stored_name=stored_name)
        return

    hf_gpt2.copy_into(model, hf_gpt2.HFWeights(source.path), model_config.n_embd, model_config.vocab_size,
                      stored_name)
