from triax.data.addition import AdditionDataset
from triax.data.permutation import FeistelPermutation
from triax.data.sampler import GlobalSampler
from triax.data.text import CharDataset, Vocabulary, builtin_corpus, load_char_datasets, read_text
from triax.data.tokens import TokenDataset, load_token_datasets

__all__ = ["AdditionDataset", "CharDataset", "FeistelPermutation", "GlobalSampler", "TokenDataset", "Vocabulary",
           "builtin_corpus", "load_char_datasets", "load_token_datasets", "read_text"]
