"""Write a tiny random Llama-family checkpoint, as transformers' save_pretrained writes one, with a
byte-level BPE tokenizer.json trained on a text file: a stand-in for a downloaded model directory
(SmolLM, TinyLlama, Qwen2.5, Mistral...) to try `model.init_from` with, on a CPU, with nothing
downloaded (docs/llama.md).

    python examples/tiny_llama.py path/to/llama --corpus input.txt
    python examples/tiny_llama.py path/to/qwen2 --corpus input.txt --model-type qwen2
"""

from __future__ import annotations

import argparse
import os

import torch


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="where to write config.json, model.safetensors and tokenizer.json")
    parser.add_argument("--corpus", required=True, help="a UTF-8 text file to train the tokenizer on")
    parser.add_argument("--model-type", choices=("llama", "qwen2", "mistral"), default="llama")
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args()

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([args.corpus], trainers.BpeTrainer(vocab_size=args.vocab_size,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}
    config_class, model_class = classes[args.model_type]
    # 4 query heads sharing 2 key/value heads (grouped-query attention), as the real ones do.
    config = config_class(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=176,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    os.makedirs(args.directory, exist_ok=True)
    model = model_class(config)
    model.save_pretrained(args.directory)
    tokenizer.save(os.path.join(args.directory, "tokenizer.json"))
    print(f"wrote a random {args.model_type} of {sum(p.numel() for p in model.parameters()):,} "
          f"parameters and its tokenizer to {args.directory}")


if __name__ == "__main__":
    main()
