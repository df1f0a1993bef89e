"""A tiny random GPT-2 checkpoint saved by transformers, with a byte-level BPE tokenizer trained
here (nothing downloaded): the `model.init_from` directory of the init-from, eval and console tests."""

import torch

VOCAB = 301  # odd: tensor parallelism pads it to 302


def build_gpt2(directory, corpus, tie):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([corpus], trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tokenizer.get_vocab_size() <= VOCAB
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        tie_word_embeddings=tie, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():  # transformers zero-initialises biases and ones LayerNorms: make every tensor distinct
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    model.save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    return model.eval()
