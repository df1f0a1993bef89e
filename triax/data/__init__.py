from triax.data.addition import AdditionDataset
from triax.data.sampler import GlobalSampler
from triax.data.text import CharDataset, Vocabulary, builtin_corpus, load_char_datasets, read_text

__all__ = ["AdditionDataset", "CharDataset", "GlobalSampler", "Vocabulary", "builtin_corpus",
           "load_char_datasets", "read_text"]
