"""`triax eval MODEL`: loss, perplexity (and bits per character for a character model) of a
trained run's newest snapshot, or of a transformers directory (GPT-2, Llama, Qwen2, Mistral), over the
whole of a split or of given token or text files (what is scored: triax.eval.scoring).

Under torchrun each rank scores its share of the windows with a whole copy of the model, and the
summed losses and token counts are added exactly.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
from tqdm import tqdm

from triax.arguments import ArgumentParser, at_least, check_device
from triax.data.text import Vocabulary
from triax.data.tokens import TOKEN_DTYPES
from triax.data.windows import evaluation_windows
from triax.errors import TriaxError, printable
from triax.runtime.place import Place, detect_place, pick_device
from triax.runtime.process_group import init_distributed, shutdown_distributed
from triax.runtime.shared_decisions import gather_floats
from triax.runtime.threads import apply_thread_choice


def parse(argv: list[str]) -> argparse.Namespace:
    parser = ArgumentParser(prog="triax eval", description="loss and perplexity of a run or a transformers "
                                                           "model over a whole split or given files")
    parser.add_argument("model", help="a triax run directory, or a transformers directory (GPT-2, Llama, Qwen2, "
                                      "Mistral)")
    parser.add_argument("--split", choices=("val", "train"), default="val", help="the run's split to score")
    parser.add_argument("--tokens", nargs="+", metavar="FILE", help="token files (flat arrays of ids) to score")
    parser.add_argument("--token-dtype", choices=TOKEN_DTYPES, default="uint16")
    parser.add_argument("--text", nargs="+", metavar="FILE", help="UTF-8 text files, encoded with the model's "
                                                                  "vocabulary or tokenizer.json")
    parser.add_argument("--chat", nargs="+", metavar="FILE", help="chat files (.jsonl/.json/.parquet): the loss on "
                                                                  "the answers, rendered with the model's chat template")
    parser.add_argument("--preference", nargs="+", metavar="FILE", help="preference pairs (.jsonl/.json/.parquet): "
                        "a DPO run's loss and rewards against its reference (default: the run's split)")
    parser.add_argument("--prompts", nargs="+", metavar="FILE", help="prompt records (.jsonl/.json/.parquet): a GRPO "
                        "run's mean reward and pass rate on them (default: the run's split)")
    parser.add_argument("--block-size", type=int, default=None, help="window length; default the model's")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    at_least("--batch-size", args.batch_size, 1)
    if args.block_size is not None:
        at_least("--block-size", args.block_size, 1)
    check_device("--device", args.device)
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    place = detect_place()
    device = pick_device(args.device, place.local_rank)
    if device.type == "cpu":
        apply_thread_choice(place.local_world_size)  # the cores idle now (triax.runtime.threads: why)
    try:
        if place.world_size > 1:
            place = init_distributed(device, place)
        outcome = evaluate(args, place, device)
    finally:
        shutdown_distributed()
    if isinstance(outcome, int):  # a DPO run's preference scores, printed already
        return outcome
    found, totals, vocab = outcome
    loss_sum, tokens = sum(totals[0::2]), int(sum(totals[1::2]))
    loss = loss_sum / tokens
    result = {"model": args.model, "data": [name for name, _ in found], "tokens": tokens, "loss": loss,
              "perplexity": math.exp(loss)}
    # Conversations are scored on their answers alone: the line names what it counted.
    scored = "answer tokens" if all(getattr(dataset, "answers_only", False) for _, dataset in found) else "tokens"
    if isinstance(vocab, Vocabulary) and not args.tokens:
        result["bits_per_character"] = loss / math.log(2)  # one token is one character
    if place.rank == 0:
        if args.json:
            print(json.dumps(result))
        else:
            extra = f", {result['bits_per_character']:.4f} bits/char" if "bits_per_character" in result else ""
            print(printable(f"{', '.join(result['data'])}: {tokens} {scored}, loss {loss:.4f}, perplexity "
                            f"{result['perplexity']:.3f}{extra}"))
    return 0


def evaluate(args: argparse.Namespace, place: Place, device: torch.device) -> int | tuple[list, list, object]:
    """A DPO run's exit code (its preference scores), or ([(name, dataset)], the job's summed
    [loss, tokens] per dataset, the model's text codec)."""
    # The model readers (transformers' formats among them) take a second to import: `--help` and a
    # bad argument are answered without them.
    from triax.eval.scoring import datasets, load_model, score, scoring_logits_limit  # deferred: start-up time

    model, vocab, run_config = load_model(args.model, device)
    if run_config is not None and run_config.data.task == "preference" and not (args.tokens or args.text or
                                                                            args.chat):
        from triax.eval.preference_eval import evaluate_preference  # deferred: DPO runs only

        return evaluate_preference(args, model, run_config, device) if place.rank == 0 else 0
    if run_config is not None and run_config.data.task == "grpo" and not (args.tokens or args.text or args.chat):
        from triax.eval.grpo_eval import evaluate_prompts  # deferred: GRPO runs only

        return evaluate_prompts(args, model, run_config, device) if place.rank == 0 else 0
    if args.prompts:
        raise TriaxError("--prompts scores a GRPO run (data.task=grpo): it needs the run's reward functions; "
                         f"{args.model!r} is not one")
    if args.preference:
        raise TriaxError("--preference scores a DPO run (data.task=preference): it needs the run's reference; "
                         f"{args.model!r} is not one")
    if args.block_size and args.block_size > model.config.block_size:
        raise TriaxError(f"--block-size {args.block_size} is longer than the model's context "
                         f"({model.config.block_size})")
    progress = None
    found = datasets(args, model, vocab, run_config)
    if place.rank == 0 and sys.stderr.isatty() and not args.json:
        batches = sum(-(-len(evaluation_windows(d)) // (args.batch_size * place.world_size)) for _, d in found)
        progress = tqdm(total=batches, unit="batch", leave=False, file=sys.stderr)
    sums, limit = [], scoring_logits_limit(run_config, device)
    for _, dataset in found:
        sums += list(score(model, dataset, args.batch_size, place.rank, place.world_size, device, progress, limit))
    if progress is not None:
        progress.close()
    return found, [sum(column) for column in zip(*gather_floats(sums))], vocab
