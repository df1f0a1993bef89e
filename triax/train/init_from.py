"""`model.init_from`: start training from existing weights instead of a random initialisation:
a transformers directory of model_type gpt2, llama, qwen2 or mistral (what `save_pretrained`
writes, or a snapshot directory in the Hugging Face cache; nothing is downloaded) or another triax
run (its newest good snapshot).

The checkpoint fixes the architecture (every model.* key but dropout) and the text codec: the
directory's tokenizer.json, a run's tokenizer.json or character vocabulary, which then encodes
`data.task=char` text. Weights are read only where this rank holds them (transformers' safetensors
by lazy slices; a triax snapshot through the layout-independent loader), after the model is built
in its layout and before any step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from triax import checkpoint
from triax.data.tokenizer import BPETokenizer
from triax.errors import ConfigError
from triax.models import hf
from triax.models.config import architecture_fields
from triax.models.decoder import vocabulary_rows
from triax.train.commands import open_run


@dataclass
class InitSource:
    path: str
    kind: str  # "transformers" | "run"
    architecture: dict  # GPTConfig fields the checkpoint fixes
    codec: object | None  # encodes text for the run: a BPETokenizer or a character Vocabulary
    snapshot: str | None = None
    context_reason: str = ""  # why the context is what it is, when not the checkpoint's max positions


def resolve(path: str) -> InitSource:
    if not os.path.isdir(path):
        raise ConfigError(f"model.init_from={path!r} is not a directory; give a transformers directory "
                          "(save_pretrained output or a Hugging Face cache snapshot) or a triax run directory")
    if os.path.isfile(os.path.join(path, "model.json")):
        reader, model_config, vocab = open_run(path)
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            vocab.source_path = os.path.join(path, "tokenizer.json")  # the new run keeps a copy
        return InitSource(path, "run", architecture_fields(model_config), vocab, reader.snapshot)

    if not hf.is_hf_directory(path):
        raise ConfigError(f"model.init_from={path!r} has neither model.json (a triax run) nor config.json "
                          "(a transformers checkpoint)")
    architecture = hf.architecture(path)
    hf.HFWeights(path)  # a directory without safetensors weights fails here, before any process group
    codec = None
    tokenizer = hf.tokenizer_file(path)
    if tokenizer is not None:
        codec = BPETokenizer.from_file(tokenizer)
        codec.source_path = tokenizer
    reason = ""
    if architecture["arch"] != "gpt2" and hf.window_of(path) is not None:
        reason = (f" (its sliding_window: triax attends to the whole context, which equals sliding-window "
                  f"attention only within the window)")
    return InitSource(path, "transformers", architecture, codec, context_reason=reason)


def check_fits(source: InitSource, data_vocab_size: int, block_size: int) -> None:
    """The data must fit the checkpoint's vocabulary and context."""
    arch = source.architecture
    if data_vocab_size > arch["vocab_size"]:
        raise ConfigError(f"the data has token ids up to {data_vocab_size - 1} but model.init_from={source.path!r} "
                          f"has a vocabulary of {arch['vocab_size']}; use data tokenized with its tokenizer")
    if block_size > arch["block_size"]:
        raise ConfigError(f"data.block_size={block_size} is longer than model.init_from's context of "
                          f"{arch['block_size']} positions{source.context_reason}; use data.block_size <= "
                          f"{arch['block_size']}")


def load_weights(source: InitSource, model, model_config, stored_name) -> None:
    """Overwrite this rank's part of the freshly built model with the checkpoint's values."""
    if source.kind == "run":
        # By the real rows of the embedding and head: the run may have padded its vocabulary otherwise.
        checkpoint.load_snapshot(source.snapshot, model, None, restore_rng=False, stored_name=stored_name,
                                 real_rows=vocabulary_rows(model_config))
        return
    hf.load_into(model, source.path, model_config, stored_name)
