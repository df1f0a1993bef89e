"""Reward functions for GRPO (docs/grpo.md), with TRL's signature: the prompts, the completions
(text, or a list with one assistant message for conversational prompts), their token ids, and every
other field of the prompt records by name; one float per completion, or None where it does not apply.

    triax train ... 'grpo.reward_funcs=[exact_match,examples/grpo_rewards.py:one_word]'
"""


def completion_text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def one_word(prompts, completions, completion_ids, **columns):
    """1 for an answer of one word and a full stop ("five."), else 0: a format reward."""
    scores = []
    for completion in completions:
        text = completion_text(completion).strip()
        scores.append(1.0 if text.endswith(".") and len(text.split()) == 1 else 0.0)
    return scores
