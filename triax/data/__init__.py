"""The data room: datasets, samplers, token files and `triax tokenize`.

Its datasets are imported when asked for (PEP 562): `triax tokenize`'s worker processes import
only the encoding modules, not torch (a second and a few hundred MB each, which made two workers
slower than one)."""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for readers of the code and the API pages (mkdocstrings); at run time: __getattr__
    from triax.data.addition import AdditionDataset
    from triax.data.permutation import FeistelPermutation
    from triax.data.sampler import GlobalSampler
    from triax.data.text import CharDataset, Vocabulary, builtin_corpus, load_char_datasets, read_text
    from triax.data.tokens import TokenDataset, load_token_datasets

__all__ = ["AdditionDataset", "CharDataset", "FeistelPermutation", "GlobalSampler", "TokenDataset", "Vocabulary",
           "builtin_corpus", "load_char_datasets", "load_token_datasets", "read_text"]


def __getattr__(name: str) -> object:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # the module of each name (the rest are in triax.data.text)
    module = {"AdditionDataset": "addition", "FeistelPermutation": "permutation", "GlobalSampler": "sampler",
              "TokenDataset": "tokens", "load_token_datasets": "tokens"}.get(name, "text")
    value = getattr(importlib.import_module(f"triax.data.{module}"), name)
    globals()[name] = value
    return value
