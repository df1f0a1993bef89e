"""Tiny random Llama-family checkpoints saved by transformers itself (nothing downloaded): the
model of each model_type, a byte-level BPE tokenizer trained on the test corpus beside it."""

import torch

VOCAB = 301  # odd: tensor parallelism pads it to 302
# 4 query heads sharing 2 key/value heads (grouped-query attention), heads of 8 values.
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             intermediate_size=64, max_position_embeddings=64, rms_norm_eps=1e-5)
# Llama 3.1's rope scaling, with a pre-training context short enough to act on these positions.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def hf_model(model_type, **options):
    """A transformers model of `model_type` with every weight random and distinct (norm gains and
    biases too: transformers starts them at one and zero, which would hide a mix-up)."""
    import transformers

    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}
    config_class, model_class = classes[model_type]
    torch.manual_seed(0)
    model = model_class(config_class(**{**SHAPE, **options}))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model.eval()


def train_tokenizer(corpus, path, special_tokens=()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([corpus], trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                  special_tokens=list(special_tokens)))
    assert tokenizer.get_vocab_size() <= VOCAB
    tokenizer.save(str(path))
    return tokenizer


def save_checkpoint(directory, model_type, corpus=None, **options):
    return saved(hf_model(model_type, **options), directory, corpus)


def saved(model, directory, corpus=None):
    """`model` written as save_pretrained writes it (config.json, model.safetensors), plus a
    tokenizer.json trained on `corpus` when given; returns the model."""
    model.save_pretrained(directory)
    if corpus is not None:
        train_tokenizer(corpus, directory / "tokenizer.json")
    return model
