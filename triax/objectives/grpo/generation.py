"""Sampling GRPO's completions: num_generations per prompt, with a key/value cache, each token drawn
with randomness that comes from the completion's place.

Each completion is numbered by its place: (trainer.seed, the optimizer step, the prompt's global
sample index, its number within the group). That place seeds the completion's own stream of
uniform numbers, one per token, so a completion does not depend on which rank samples it, on what
else is in its batch, or on whether the run was resumed in between: the same seed gives the same
completions in any layout (as a data sample's place decides its order, triax.data.sampler). A token
is drawn by inverting the cumulative distribution of the tempered, top-k and top-p filtered
probabilities at that uniform number.

Rows of one prompt length are sampled together (every generation of every such prompt), so the
decoder's key/value cache needs no padding; each step feeds one new token per row. A row stops at
its first stop token (end-of-turn, end-of-text), which it keeps (TRL keeps the eos in the
completion); a row that reaches max_completion_length without one is truncated. The loop ends when
every row has stopped, or, where several ranks must run each forward together (sharded weights),
when `all_stopped` says every rank's rows have; such ranks also agree on how many batches of rows
they sample (`agree`: the most any rank has), a rank with fewer sampling its first batch again
and dropping it, so that every rank makes the same forwards.

Under tensor parallelism the decoder's sequence-parallel regions split every forward's positions
over the ranks, so a forward must feed a multiple of their number (`multiple`): the prompt and
each new token are fed with copies of their last token after them, whose keys and values are
dropped from the cache again (causal attention: no real position sees them), and the
vocabulary-sharded logits of the real position are gathered whole. The same logits as one
process, up to the order of the sums.

`Sampler` is the interface the objective calls: an inference engine can stand behind it later.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from triax.models.decoder import KVCache, Packed
from triax.objectives.chunked_logits import output_layer


@dataclass
class SamplingSettings:
    num_generations: int
    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    stop_ids: tuple[int, ...] = ()


@dataclass
class Completion:
    ids: list[int]  # the sampled tokens, the stop token included where one was drawn
    truncated: bool  # reached max_completion_length without a stop token


class Sampler(Protocol):
    def complete(self, prompts: Sequence[list[int]], prompt_numbers: Sequence[int], step: int) -> list[Completion]:
        """num_generations completions of each prompt, prompt after prompt (TRL's order).
        `prompt_numbers`: each prompt's global sample index; `step`: the optimizer step."""


def place_seed(seed: int, step: int, prompt_number: int, generation: int) -> int:
    """A 63-bit seed of a completion's place: a hash, so that near places give unrelated streams."""
    key = f"{seed}/{step}/{prompt_number}/{generation}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def place_uniforms(seeds: Sequence[int], count: int) -> torch.Tensor:
    """(rows, count) uniform numbers in [0, 1), row r from a generator seeded by seeds[r] (float64)."""
    return torch.stack([torch.rand(count, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
                        for seed in seeds])


def filtered_probabilities(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The sampling distribution of (rows, vocabulary) logits: tempered, then the top_k most likely
    tokens, then the smallest set whose probability reaches top_p (the order and the tie rules of
    transformers' temperature, top-k and top-p logits processors)."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(logits, descending=False)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return F.softmax(logits, dim=-1)


def draw(probabilities: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token of each row whose cumulative probability first passes the row's uniform number
    (a token of probability 0 is never drawn: the sum does not pass anything there)."""
    cumulative = probabilities.double().cumsum(dim=-1)
    target = (uniforms.to(cumulative) * cumulative[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cumulative, target, right=True).clamp(max=probabilities.size(-1) - 1).squeeze(-1)


class CachedSampler:
    """Sampling with a triax decoder and its key/value cache (the policy itself, in its layout)."""

    def __init__(self, model: torch.nn.Module, settings: SamplingSettings, seed: int, device: torch.device,
                 autocast: Callable[[], ContextManager] = contextlib.nullcontext,
                 all_stopped: Callable[[bool], bool] | None = None, agree: Callable[[int], int] | None = None,
                 multiple: int = 1):
        self.model, self.settings, self.seed, self.device = model, settings, seed, device
        self.multiple = multiple  # positions per forward: a multiple of this (tensor-parallel ranks)
        self.autocast = autocast
        self.all_stopped = all_stopped or (lambda stopped_here: stopped_here)
        self.agree = agree or (lambda count: count)

    @torch.no_grad()
    def complete(self, prompts: Sequence[list[int]], prompt_numbers: Sequence[int], step: int) -> list[Completion]:
        generations = self.settings.num_generations
        completions: list[Completion | None] = [None] * (len(prompts) * generations)
        batches = self._batches(prompts)
        for batch in range(self.agree(len(batches))):
            indices = batches[min(batch, len(batches) - 1)]  # past this rank's own: its last again, dropped
            seeds = [place_seed(self.seed, step, prompt_numbers[index], generation)
                     for index in indices for generation in range(generations)]
            sampled = self._sample([prompts[index] for index in indices], seeds)
            if batch < len(batches):
                for row, completion in enumerate(sampled):
                    completions[indices[row // generations] * generations + row % generations] = completion
        return completions

    def _batches(self, prompts: Sequence[list[int]]) -> list[list[int]]:
        """The prompts sampled together: all of them, left-padded, where the decoder attends by its mask
        alone (one forward per token for the whole batch); otherwise those of one length at a time."""
        if getattr(getattr(self.model, "module", self.model), "attends_by_mask", False):
            return [list(range(len(prompts)))] if prompts else []
        by_length: dict[int, list[int]] = {}
        for index, prompt in enumerate(prompts):
            by_length.setdefault(len(prompt), []).append(index)
        return [by_length[length] for length in sorted(by_length)]

    def _last_logits(self, new: torch.Tensor, cache: KVCache, valid: torch.Tensor | None = None,
                     positions: torch.Tensor | None = None) -> torch.Tensor:
        """(rows, vocabulary) logits of the last of the `new` positions, fed after the cached ones
        (rounded up to a multiple of self.multiple positions, the extra ones dropped again). `valid`:
        (rows, at least every position fed) whether a position holds a token, not left padding, and
        `positions` each new one's place in its row (None: no padding, plain causal attention)."""
        length, extra = cache.length + new.size(1), -new.size(1) % self.multiple
        if extra:
            new = torch.cat([new, new[:, -1:].expand(-1, extra)], dim=1)
        packed = None
        if valid is not None:
            if extra:  # the copies take the last place again: dropped, they must only fit the block
                positions = torch.cat([positions, positions[:, -1:].expand(-1, extra)], dim=1)
            packed = padded_attention(valid[:, :length + extra], new.size(1), positions)
        last = new.size(1) - extra - 1
        with self.autocast():
            if self.multiple == 1:  # the head on the last position alone: a prompt's logits are never held
                hidden = self.model(new, cache, logits=False, **({} if packed is None else {"packed": packed}))
                logits = output_layer(self.model)(hidden[:, last:last + 1])[:, 0]
            else:  # positions sharded over tensor-parallel ranks: the head's output is sliced instead
                logits = self.model(new, cache, **({} if packed is None else {"packed": packed}))[:, last, :]
        if extra:
            cache.truncate(length)
        return logits.full_tensor() if isinstance(logits, DTensor) else logits

    def _sample(self, prompts: list[list[int]], seeds: list[int]) -> list[Completion]:
        """num_generations completions of each of `prompts` (rows prompt after prompt): each prompt's
        positions computed once, its keys and values then repeated for its generations."""
        settings, generations = self.settings, self.settings.num_generations
        uniforms = place_uniforms(seeds, settings.max_completion_length).to(self.device)
        stop = torch.tensor(sorted(set(settings.stop_ids)), dtype=torch.long, device=self.device)
        rows, cache, width = len(seeds), KVCache(), max(len(prompt) for prompt in prompts)
        prompt_ids = torch.tensor([[prompt[0]] * (width - len(prompt)) + prompt for prompt in prompts],
                                  dtype=torch.long, device=self.device)
        valid = positions = None
        if any(len(prompt) < width for prompt in prompts):  # left padding: masked, and positions from 0
            lengths = torch.tensor([len(prompt) for prompt in prompts], device=self.device)
            places = torch.arange(width, device=self.device)[None, :] - (width - lengths)[:, None]
            valid = torch.cat([places >= 0, places.new_ones(len(prompts), settings.max_completion_length
                                                            + self.multiple, dtype=torch.bool)], dim=1)
            positions = places.clamp(min=0)
        logits = self._last_logits(prompt_ids, cache, valid, positions).repeat_interleave(generations, dim=0)
        cache.repeat_rows(generations)
        if valid is not None:
            valid = valid.repeat_interleave(generations, dim=0)
            positions = lengths.repeat_interleave(generations)[:, None]
        stopped = torch.zeros(rows, dtype=torch.bool, device=self.device)
        ends_at = torch.full((rows,), settings.max_completion_length, dtype=torch.long, device=self.device)
        tokens = []
        for position in range(settings.max_completion_length):
            if position:
                logits = self._last_logits(tokens[-1][:, None], cache, valid,
                                           None if positions is None else positions + position - 1)
            token = draw(filtered_probabilities(logits, settings.temperature, settings.top_k, settings.top_p),
                         uniforms[:, position])
            tokens.append(token)
            ends = torch.isin(token, stop) & ~stopped if stop.numel() else torch.zeros_like(stopped)
            ends_at = torch.where(ends, position + 1, ends_at)
            stopped = stopped | ends
            if self.all_stopped(bool(stopped.all())):
                break
        completion_ids = torch.stack(tokens, dim=1).tolist()
        return [Completion(row_ids[:int(length)], not bool(done))
                for row_ids, length, done in zip(completion_ids, ends_at.tolist(), stopped.tolist())]


def padded_attention(valid: torch.Tensor, new: int, positions: torch.Tensor) -> Packed:
    """What the last `new` of a row's positions see: the earlier and themselves, tokens only among
    tokens (`valid`, rows x positions so far), padding only among padding (a padding query that saw
    nothing would give NaN, which masked weights of 0 would still carry into the tokens' sums)."""
    keys = valid.size(1)
    if new == 1:  # one token fed after the rest (padding is fed only before): it sees every token
        return Packed(valid[:, None, None, :], positions)
    causal = torch.ones(new, keys, dtype=torch.bool, device=valid.device).tril(diagonal=keys - new)
    mask = (valid[:, keys - new:, None] == valid[:, None, :]) & causal
    return Packed(mask[:, None], positions)
