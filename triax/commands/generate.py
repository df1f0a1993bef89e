"""`triax generate RUN`: sample text from a trained run's newest good snapshot; with
`--chat MESSAGE`, the run's model answers one user message (triax.runs.chat_generate)."""

from __future__ import annotations

import argparse
import math
import sys

from triax.arguments import ArgumentParser, FormOption, at_least, check_device, need
from triax.errors import TriaxError, UsageError, printable

# Below this the logits divided by the temperature overflow float32 (probabilities of NaN); above
# it sampling is uniform in all but name.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3
MAX_GENERATE_TOKENS = 1_000_000


def parse(argv: list[str]) -> argparse.Namespace:
    parser = ArgumentParser(prog="triax generate",
                            description="sample text from a trained run, or (--chat) answer one user message "
                                        "with a chat run")
    parser.add_argument("run_dir")
    parser.add_argument("--prompt", default=None, help="text to continue (default a newline; not with --chat)")
    # Once read, errors name `triax generate --chat`, as the chat form's own parser did.
    parser.add_argument("--chat", action=FormOption, form="triax generate --chat", default=None, metavar="MESSAGE",
                        help="the user message to answer")
    parser.add_argument("--system", default=None, help="with --chat: a system message before it")
    parser.add_argument("--tokens", type=int, default=300,
                        help="tokens (characters for a char run) to generate; with --chat, at most this many "
                             "tokens of answer")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--greedy", action="store_true",
                        help="always take the most likely token (a character in a character-level run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.chat is None:
        if args.system is not None:
            raise UsageError("--system is a system message for --chat; give --chat MESSAGE with it")
        args.prompt = "\n" if args.prompt is None else args.prompt
    elif args.prompt is not None:
        raise UsageError("--prompt continues text; with --chat the message itself is the prompt: leave --prompt out")
    return args


def check_sampling(args: argparse.Namespace) -> None:
    """Every argument is checked before the model is read or built."""
    chat = args.chat is not None
    if chat:
        need(args.chat.strip() != "", "--chat", args.chat, "give a message to answer")
    else:
        need(args.prompt != "", "--prompt", args.prompt, "give at least one character to start from")
    at_least("--tokens", args.tokens, 1 if chat else 0)
    need(args.tokens <= MAX_GENERATE_TOKENS, "--tokens", args.tokens,
         f"use at most {MAX_GENERATE_TOKENS}" + ("" if chat else " (generation is one forward pass per token)"))
    if not args.greedy:  # --greedy ignores the temperature
        need(math.isfinite(args.temperature) and MIN_TEMPERATURE <= args.temperature <= MAX_TEMPERATURE,
             "--temperature", args.temperature,
             f"use a number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]" +
             (", or --greedy" if chat else " (e.g. 0.8), or --greedy for the most likely token"))
    if args.top_k is not None:
        at_least("--top-k", args.top_k, 1)
    need(0 <= args.seed < 2**63, "--seed", args.seed, "use 0 .. 2**63-1")
    check_device("--device", args.device)


def main(argv: list[str]) -> int:
    args = parse(argv)
    check_sampling(args)
    # deferred: torch and the checkpoint layer, after the arguments are checked
    from triax.runtime.place import pick_device
    from triax.runs.reader import run_snapshot_root  # deferred: torch and the models, after the arguments are checked

    if args.chat is not None:
        run_snapshot_root(args.run_dir)  # one line if it is not a run directory
    device = pick_device(args.device)
    if device.type == "cpu":
        from triax.runtime.threads import apply_thread_choice  # deferred: as the imports above

        apply_thread_choice()  # the cores idle now (triax.runtime.threads: why)
    text = answer(args, device) if args.chat is not None else sample(args, device)
    # Exactly the text into a file or a pipe; on a terminal, no escape sequence the data taught it.
    print(printable(text, keep="\n\t") if sys.stdout.isatty() else text)
    return 0


def answer(args: argparse.Namespace, device: object) -> str:
    from triax.runs.chat_generate import generate_chat  # deferred: torch and the models, after the checks

    return generate_chat(args.run_dir, args.chat, args.system, args.tokens, args.temperature, args.top_k,
                         args.greedy, args.seed, device)


def sample(args: argparse.Namespace, device: object) -> str:
    import torch  # deferred: after the arguments are checked

    from triax.runs.reader import load_run_model, run_snapshot_root, with_fallback  # deferred: as torch

    def load(*opened: object) -> tuple:
        vocab = opened[2]
        if vocab is None:
            raise TriaxError(f"{args.run_dir!r} has no vocab.json or tokenizer.json (trained on ids without a "
                             "tokenizer, or on the addition task); nothing to decode text with")
        prompt_ids = vocab.encode(args.prompt)  # one line naming characters the run never saw
        if not prompt_ids:
            raise TriaxError(f"--prompt {args.prompt!r} encodes to no tokens; give at least one character")
        model, vocab, _ = load_run_model(args.run_dir, device, opened)
        return model, vocab, prompt_ids

    model, vocab, prompt_ids = with_fallback(args.run_dir, run_snapshot_root(args.run_dir), load)
    idx = torch.tensor([prompt_ids], device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    out = model.generate(idx, args.tokens, temperature=args.temperature, top_k=args.top_k,
                         vocab_limit=min(len(vocab), model.config.vocab_size),
                         greedy=args.greedy, generator=generator)
    return vocab.decode(out[0].tolist())
