"""A run begun on transformers' Trainer, for `triax train trainer.continue_from` to continue
(docs/switching.md): a tiny GPT-2 trained on token files in nanoGPT's layout, its checkpoints in
OUT/checkpoint-<step>.

python examples/hf_trainer_run.py OUT [--steps 4] [--save-steps 2] [--block-size 32]

Writes OUT/data/{train,val}.bin and meta.json (random token ids: a stand-in for your own data),
then trains with the Trainer's defaults (AdamW, the linear schedule) on windows of block_size + 1
tokens, as triax's token data cuts them.
"""

import argparse
import json
import os

import numpy as np
import torch
import transformers

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--save-steps", type=int, default=2)
parser.add_argument("--block-size", type=int, default=32)
parser.add_argument("--vocab-size", type=int, default=256)
args = parser.parse_args()

data = os.path.join(args.out, "data")
os.makedirs(data, exist_ok=True)
rng = np.random.default_rng(0)
for split, count in (("train", 20000), ("val", 4000)):
    rng.integers(0, args.vocab_size, count, dtype=np.uint16).tofile(os.path.join(data, f"{split}.bin"))
with open(os.path.join(data, "meta.json"), "w") as handle:
    json.dump({"vocab_size": args.vocab_size, "dtype": "uint16"}, handle)

tokens = torch.from_numpy(np.fromfile(os.path.join(data, "train.bin"), dtype=np.uint16).astype(np.int64))
windows = tokens[: len(tokens) // (args.block_size + 1) * (args.block_size + 1)].view(-1, args.block_size + 1)
samples = [{"input_ids": window, "labels": window} for window in windows]  # the model shifts the labels

torch.manual_seed(0)
config = transformers.GPT2Config(vocab_size=args.vocab_size, n_positions=2 * args.block_size, n_embd=32, n_layer=2,
                                 n_head=2, bos_token_id=0, eos_token_id=0)
training = transformers.TrainingArguments(output_dir=args.out, max_steps=args.steps, save_steps=args.save_steps,
                                          per_device_train_batch_size=8, learning_rate=1e-3, weight_decay=0.1,
                                          use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=1)
transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=training, train_dataset=samples).train()
saved = sorted(name for name in os.listdir(args.out) if name.startswith("checkpoint-"))
print(f"wrote {', '.join(saved)} in {args.out}")
