"""Meta's Llama checkpoint folder, as Meta's download gives it: `params.json` (the shapes),
`consolidated.00.pth` (the weights, torch.save of a dict in Meta's layout:
triax/interop/meta/weights.py) and `tokenizer.model`.

A model saved for N-way model parallelism (Llama 2 and 3 70B: 8 files) is `consolidated.00.pth`
to `.NN.pth`, file k holding part k of every tensor, as Meta's fairscale layers cut them: the
column-parallel projections (wq, wk, wv, w1, w3, output) by rows, the row-parallel ones (wo, w2)
by columns, the norms whole in every file. The embedding is cut by columns in Llama 2 and by rows
in Llama 3; which one a folder holds is read from its shapes (a part as wide as `dim` was cut by
rows). A tensor is the parts put end to end along its cut, and a rank reads only the parts its
box overlaps.

The files are pickles: read through torch's weights-only loader only, memory-mapped, so a rank
pages in only the slices it copies. `tokenizer.model` is SentencePiece's (Llama 2) or tiktoken's
(Llama 3), which triax does not read: text is encoded with a tokenizer.json put in the folder (a
transformers tokenizer's save_pretrained writes it), else the run trains on token files.
"""

from __future__ import annotations

import os
import re

import torch

from triax.interop.shared.pickled import PickledFileError, load_pickled_mapped
from triax.interop.meta import weights as meta_llama
from triax.interop.hf.files import CheckpointError, checkpoint_file, read_json

PARAMS_FILE = "params.json"
SHARD_FILE = re.compile(r"consolidated\.(\d+)\.pth")
MAX_SHARDS = 1024  # Meta's largest model-parallel degree is 16; more is not Meta's folder
# The dimension each tensor kind is cut along in a model-parallel folder (None: whole in every
# file); the embedding's is read from the shapes.
CUT_DIMENSIONS = {"attention.wq.weight": 0, "attention.wk.weight": 0, "attention.wv.weight": 0,
                  "attention.wo.weight": 1, "feed_forward.w1.weight": 0, "feed_forward.w3.weight": 0,
                  "feed_forward.w2.weight": 1, "output.weight": 0, "attention_norm.weight": None,
                  "ffn_norm.weight": None, "norm.weight": None}


def is_meta_folder(path: str) -> bool:
    """A folder holding Meta's weights files (its params.json missing is the reader's one line)."""
    return os.path.isdir(path) and any(SHARD_FILE.fullmatch(name) for name in os.listdir(path))


class MetaFolder:
    """A checked Meta folder: its architecture (GPTConfig fields) and its tensors, read by box
    (`entries()`, `read(name, box)`, for meta_llama.MetaWeights)."""

    def __init__(self, path: str, rope_factor: float = 8.0):
        """`rope_factor`: the run's, for a params.json that scales rotary positions without
        saying by how much (meta_llama.META_ROPE_SCALING)."""
        self.path = path
        numbers = sorted(int(found.group(1)) for name in os.listdir(path) if (found := SHARD_FILE.fullmatch(name)))
        if numbers != list(range(len(numbers))) or len(numbers) > MAX_SHARDS:
            raise CheckpointError(f"{path} holds consolidated files numbered {numbers[:4]}..., not 00 upwards; a file "
                                  "of Meta's model-parallel checkpoint is missing")
        params = read_json(path, PARAMS_FILE, "give the params.json Meta's download holds")
        # Checked before the weights are touched: a params.json of a trillion values is one line.
        where = os.path.join(path, PARAMS_FILE)
        dim = meta_llama.architecture_from_params(params, where, vocab_rows=1)["n_embd"]
        self.parts = []
        for number in numbers:
            self.parts.append(self._read(f"consolidated.{number:02d}.pth"))
        self.cuts, self.shapes = {}, {}
        for name, tensor in self.parts[0].items():
            if name not in meta_llama.NOT_WEIGHTS:
                self.cuts[name], self.shapes[name] = self._joined(name, tensor, dim)
        embedding = self.shapes.get("tok_embeddings.weight")
        self.fields = meta_llama.architecture_from_params(params, where, embedding[0] if embedding else None,
                                                          rope_factor)
        self.fields["tie_embeddings"] = "output.weight" not in self.shapes  # Llama 3.2's small models

    def _read(self, name: str) -> dict:
        state = load_pickled_mapped(checkpoint_file(self.path, name),
                                    f"{os.path.join(self.path, name)} (Meta's Llama weights)")
        if not isinstance(state, dict) or not all(isinstance(key, str) and isinstance(value, torch.Tensor)
                                                  for key, value in state.items()):
            raise PickledFileError(f"{os.path.join(self.path, name)} holds no dictionary of named tensors; not "
                                   "Meta's consolidated weights")
        if self.parts and state.keys() != self.parts[0].keys():
            raise CheckpointError(f"{os.path.join(self.path, name)} holds other tensors than consolidated.00.pth; "
                                  "the files are not parts of one checkpoint")
        return state

    def _joined(self, name: str, first: torch.Tensor, dim: int) -> tuple[int | None, tuple[int, ...]]:
        """(the dimension `name` is cut along, its whole shape), checked across the files."""
        kind = name.split(".", 2)[-1] if name.startswith("layers.") else name
        if len(self.parts) == 1:
            return None, tuple(first.shape)
        if kind == "tok_embeddings.weight":
            cut = 0 if first.dim() == 2 and first.shape[1] == dim else 1
        elif kind in CUT_DIMENSIONS:
            cut = CUT_DIMENSIONS[kind]
        else:
            raise CheckpointError(f"{self.path}: {name} is not a tensor of Meta's Llama; the folder is not Meta's")
        shapes = [tuple(part[name].shape) for part in self.parts]
        if cut is None:
            if any(shape != shapes[0] for shape in shapes):
                raise CheckpointError(f"{self.path}: {name} differs in shape across the files, but Meta's files "
                                      "each hold it whole")
            return None, shapes[0]
        if any(len(shape) != len(shapes[0]) or cut >= len(shape)
               or shape[:cut] + shape[cut + 1:] != shapes[0][:cut] + shapes[0][cut + 1:] for shape in shapes):
            raise CheckpointError(f"{self.path}: the parts of {name} ({shapes[0]}, ...) do not fit end to end; the "
                                  "files are not parts of one checkpoint")
        whole = list(shapes[0])
        whole[cut] = sum(shape[cut] for shape in shapes)
        return cut, tuple(whole)

    def entries(self) -> dict:
        return {name: (self.parts[0][name].dtype, shape) for name, shape in self.shapes.items()}

    def read(self, name: str, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        cut = self.cuts[name]
        if cut is None:
            return self.parts[0][name][tuple(slice(start, stop) for start, stop in box)]
        pieces, offset = [], 0
        start, stop = box[cut]
        for part in self.parts:  # the parts the box overlaps along the cut, each sliced
            size = part[name].shape[cut]
            low, high = max(start, offset), min(stop, offset + size)
            if low < high:
                index = [slice(*edges) for edges in box]
                index[cut] = slice(low - offset, high - offset)
                pieces.append(part[name][tuple(index)])
            offset += size
        return torch.cat(pieces, dim=cut)
