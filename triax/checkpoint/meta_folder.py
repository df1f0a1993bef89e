"""Meta's Llama checkpoint folder, as Meta's download gives it: `params.json` (the shapes),
`consolidated.00.pth` (the weights, torch.save of a dict in Meta's layout: triax/models/
meta_llama.py) and `tokenizer.model`.

A model saved for N-way model parallelism is N files, `consolidated.00.pth` to `.NN.pth`, each
holding a slice of every tensor, cut along a dimension that depends on the tensor and the Llama
version (the embedding by columns in Llama 2 and by rows in Llama 3): such a folder is refused in
one line (transformers' convert_llama_weights_to_hf.py knows each version's cuts).

The weights file is a pickle: read through torch's weights-only loader only, memory-mapped, so
a rank pages in only the slices it copies. `tokenizer.model` is SentencePiece's (Llama 2) or
tiktoken's (Llama 3), which triax does not read: text is encoded with a tokenizer.json put in the
folder (a transformers tokenizer's save_pretrained writes it), else the run trains on token files.
"""

from __future__ import annotations

import os
import re

import torch

from triax.checkpoint.pickled import PickledFileError, load_pickled_mapped
from triax.models import meta_llama
from triax.models.hf_files import CheckpointError, checkpoint_file, read_json

PARAMS_FILE = "params.json"
WEIGHTS_FILE = "consolidated.00.pth"
SHARD_FILE = re.compile(r"consolidated\.(\d+)\.pth")


def is_meta_folder(path: str) -> bool:
    """A folder holding Meta's weights files (its params.json missing is the reader's one line)."""
    return os.path.isdir(path) and any(SHARD_FILE.fullmatch(name) for name in os.listdir(path))


class MetaFolder:
    """A checked Meta folder: its architecture (GPTConfig fields) and its tensors, read by box
    (`entries()`, `read(name, box)`, for meta_llama.MetaWeights)."""

    def __init__(self, path: str):
        self.path = path
        shards = sorted(name for name in os.listdir(path) if SHARD_FILE.fullmatch(name))
        if shards != [WEIGHTS_FILE]:
            raise CheckpointError(f"{path} holds {len(shards)} model-parallel files ({', '.join(shards[:3])}...); "
                                  f"triax reads Meta's one-file {WEIGHTS_FILE} only: convert the folder with transformers' "
                                  "convert_llama_weights_to_hf.py and give model.init_from that directory")
        params = read_json(path, PARAMS_FILE, "give the params.json Meta's download holds")
        # Checked before the weights are touched: a params.json of a trillion values is one line.
        where = os.path.join(path, PARAMS_FILE)
        meta_llama.architecture_from_params(params, where, vocab_rows=1)
        weights = checkpoint_file(path, WEIGHTS_FILE)
        state = load_pickled_mapped(weights, "Meta's Llama weights")
        if not isinstance(state, dict) or not all(isinstance(key, str) and isinstance(value, torch.Tensor)
                                                  for key, value in state.items()):
            raise PickledFileError(f"{os.path.join(path, WEIGHTS_FILE)} holds no dictionary of named tensors; "
                                   "not Meta's consolidated weights")
        self.tensors = state
        embedding = state.get("tok_embeddings.weight")
        self.fields = meta_llama.architecture_from_params(params, where, embedding.shape[0] if embedding is not None
                                                          and embedding.dim() == 2 else None)
        self.fields["tie_embeddings"] = "output.weight" not in state  # Llama 3.2's small models

    def entries(self) -> dict:
        return {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in self.tensors.items()
                if name not in meta_llama.NOT_WEIGHTS}

    def read(self, name: str, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        return self.tensors[name][tuple(slice(start, stop) for start, stop in box)]
