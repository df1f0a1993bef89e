"""A GRPO batch's prompts fed once for all their completions.

A generated batch holds num_generations completions of each prompt, each row the prompt again: fed
as rows, every prompt position is computed (and back-propagated) num_generations times, most of a
step where prompts are longer than completions. Here each run of rows with one prompt becomes one
row: the prompt's tokens, then each completion after it (but its last token, which predicts
nothing), every completion seeing the prompt and its own earlier tokens only, at the positions it
has in its own row (the prompt's length on). The same attention and positions as the rows apart,
so the same numbers up to the order of the sums; the prompt's positions receive the gradients of
all its completions, added.

Only for decoders whose numbers are their mask's and positions' alone (Decoder.attends_by_mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from triax.models.decoder import Packed

PADDING, PROMPT = -1, 0  # segment numbers: a completion g of a group is g + 1


@dataclass
class SharedPrompts:
    ids: torch.Tensor  # (groups, width): each group's prompt, then its completions, then padding
    packed: Packed  # which position sees which, and each one's position in its own row
    predictors: torch.Tensor  # (rows, completion width): the flat position whose state predicts each token


def prompt_runs(prompt_ids: torch.Tensor, prompt_lengths: torch.Tensor, completion_width: int,
                flops_per_token: Callable[[int], float]) -> list[int]:
    """The rows where a group starts (the first row's 0 included): a run of rows with one prompt,
    cut into as many groups as costs least (`groups_of_run`)."""
    differs = (prompt_ids[1:] != prompt_ids[:-1]).any(dim=1) | (prompt_lengths[1:] != prompt_lengths[:-1])
    runs = [0] + (torch.nonzero(differs).flatten() + 1).tolist()
    lengths, starts = prompt_lengths.tolist(), []
    for start, end in zip(runs, runs[1:] + [prompt_ids.size(0)]):
        sizes = groups_of_run(lengths[start], completion_width - 1, end - start, flops_per_token)
        starts += [start + sum(sizes[:group]) for group in range(len(sizes))]
    return starts


def groups_of_run(prompt: int, width: int, completions: int, flops_per_token: Callable[[int], float]) -> list[int]:
    """How many of `completions` (of `width` positions, after one prompt of `prompt`) each group holds:
    the split whose rows cost the fewest training FLOPs, a row of S positions S x flops_per_token(S)
    (the decoder's own count: its weights' 6N per position, and attention over the whole row, which
    the mask does not shorten). One group: the prompt once, but long rows; one per completion: the
    rows apart. Ties go to fewer groups."""
    def split(groups: int) -> list[int]:
        size, more = divmod(completions, groups)
        return [size + 1] * more + [size] * (groups - more)

    def cost(groups: int) -> float:
        return sum((prompt + count * width) * flops_per_token(prompt + count * width) for count in split(groups))
    return split(min(range(1, completions + 1), key=lambda groups: (cost(groups), groups)))


def shared_prompts(prompt_ids: torch.Tensor, prompt_lengths: torch.Tensor, completion_ids: torch.Tensor,
                   starts: list[int], multiple: int = 1) -> SharedPrompts:
    """The groups' rows of left-padded `prompt_ids` and right-padded `completion_ids` (rows in runs
    beginning at `starts`), each group's row rounded up to a multiple of `multiple` positions."""
    rows, width = completion_ids.shape
    fed = width - 1  # a completion's last token predicts nothing: it is not fed
    device = completion_ids.device
    first_rows = torch.tensor(starts, device=device)
    counts = torch.diff(first_rows, append=torch.tensor([rows], device=device))
    prompts = prompt_lengths.to(device)[first_rows]  # (groups,) each group's prompt length
    needed = int((prompts + counts * fed).max())
    length = needed + -needed % multiple
    place = torch.arange(length, device=device)[None, :]  # (1, length): a place in a group's row
    in_prompt = place < prompts[:, None]
    after = (place - prompts[:, None]).clamp(min=0)  # places after the prompt: completion, then step
    generation, step = after // max(fed, 1), after % max(fed, 1)
    in_completion = ~in_prompt & (generation < counts[:, None]) & (fed > 0)
    row = (first_rows[:, None] + generation).clamp(max=rows - 1)
    prompt_place = (prompt_ids.size(1) - prompts[:, None] + place).clamp(max=prompt_ids.size(1) - 1)
    ids = torch.where(in_prompt, prompt_ids[first_rows[:, None], prompt_place],
                      torch.where(in_completion, completion_ids[row, step], 0))
    segments = torch.where(in_prompt, PROMPT, torch.where(in_completion, generation + 1, PADDING))
    positions = torch.where(in_prompt, place, torch.where(in_completion, prompts[:, None] + step, 0))
    # Row r's token 0 is predicted by its prompt's last place, its token t by its own t - 1.
    group = torch.repeat_interleave(torch.arange(len(starts), device=device), counts)
    start = prompts[group] + (torch.arange(rows, device=device) - first_rows[group]) * fed
    steps = torch.arange(width, device=device)[None, :]
    predictors = group[:, None] * length + torch.where(steps == 0, prompts[group][:, None] - 1,
                                                       start[:, None] + steps - 1)
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    query, key = segments[:, :, None], segments[:, None, :]
    # Padding sees padding (a query that saw nothing would give NaN): never a token, nor a token it.
    sees = (query == key) | ((key == PROMPT) & (query > PROMPT))
    return SharedPrompts(ids, Packed((sees & causal)[:, None], positions), predictors)
