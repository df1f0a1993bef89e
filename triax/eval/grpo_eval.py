"""`triax eval RUN` for a GRPO run (data.task=grpo), or `triax eval RUN --prompts FILE...`: the mean
reward and the pass rate of num_generations sampled completions of each prompt, scored by the run's
reward functions; the run's validation prompts (or its training ones, --split train) or the files'."""

from __future__ import annotations

import contextlib
import json

import torch

from triax.data.chat import read_records
from triax.data.tokenizer import BPETokenizer
from triax.errors import TriaxError, printable
from triax.objectives import StepContext
from triax.objectives.grpo.build import stop_ids
from triax.objectives.grpo.generation import CachedSampler, SamplingSettings
from triax.objectives.grpo.objective import GRPOObjective
from triax.objectives.grpo.prompts import PromptDataset, encode_prompts, load_prompt_datasets, prompt_encoder_for
from triax.objectives.grpo.rewards import load_rewards
from triax.runs.files import kept_tokenizer


def _prompt_sets(args, config, encoder) -> list[tuple[str, PromptDataset]]:
    block, room = args.block_size or config.data.block_size, config.grpo.max_completion_length
    if not args.prompts:
        data = load_prompt_datasets(config.data.path, config.data.val_path, config.data.train_split, encoder, block,
                                    room)
        return [(f"{args.split} split", data.val if args.split == "val" else data.train)]
    found = []
    for path in args.prompts:
        split = encode_prompts(read_records(path, "--prompts"), encoder, block - room)
        if not split.prompts:
            raise TriaxError(f"--prompts {path!r} has no prompt of at most {block - room} tokens (the context "
                             f"{block} less grpo.max_completion_length={room})")
        found.append((path, PromptDataset(split.prompts, encoder)))
    return found


def evaluate_prompts(args, model: torch.nn.Module, config, device: torch.device) -> int:
    """Score the prompts on this process alone and print the figures (rank 0)."""
    tokenizer_path, description = kept_tokenizer(args.model, "a GRPO run keeps its checkpoint's")
    tokenizer = BPETokenizer.from_file(tokenizer_path).tokenizer
    encoder = prompt_encoder_for(config.data.chat_template, description, args.model, tokenizer)
    grpo, rewards = config.grpo, load_rewards(config.grpo.reward_funcs)
    context = StepContext(device, contextlib.nullcontext, lambda m, x: m(x), 1, 1, 0, config.trainer.seed)
    totals, names = [0.0, 0.0, 0], []
    for name, prompts in _prompt_sets(args, config, encoder):
        ends = stop_ids(prompts)
        settings = SamplingSettings(grpo.num_generations, grpo.max_completion_length, grpo.temperature, grpo.top_p,
                                    grpo.top_k, ends)
        sampler = CachedSampler(model, settings, config.trainer.seed, device)
        objective = GRPOObjective(grpo, prompts, rewards, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                  ends[0], sampler)
        objective.validation = prompts
        figures = objective.evaluate(context)
        count = figures["val_completions"]
        totals = [totals[0] + figures["val_reward"] * count, totals[1] + figures["val_pass_rate"] * count,
                  totals[2] + count]
        names.append(name)
    result = {"model": args.model, "data": names, "completions": totals[2],
              "reward": totals[0] / max(totals[2], 1), "pass_rate": totals[1] / max(totals[2], 1)}
    if args.json:
        print(json.dumps(result))
    else:
        print(printable(f"{', '.join(names)}: {totals[2]} completions, mean reward {result['reward']:.4f}, "
                        f"pass rate {100 * result['pass_rate']:.1f}%"))
    return 0
