"""Completion log-probabilities without the whole logits tensor.

The log-probability of each completion token needs a softmax over the vocabulary at its position;
done at once, that is a (rows x completion length x vocabulary) tensor in fp32 (with Qwen's 151,936
words, 1,024-token completions and 16 rows: 10 GB), kept again for the backward. Here the final
hidden states of the completion positions are cut into chunks of `chunk_tokens` positions; each
chunk goes through the output layer, its softmax gives its tokens' log-probabilities and entropies,
and its logits are freed before the next chunk. Under autograd each chunk is recomputed in the
backward (torch.utils.checkpoint) instead of saved, so the backward too holds one chunk's logits at
a time. The numbers are those of the whole-logits path: the same fp32 softmax of the same rows.

Rows are prompt + completion, the prompt left-padded (`prompt_lengths` says where each row's prompt
starts): padding is given an example number of its own (the decoder's packed attention), so a row's
tokens attend only to themselves and take positions from 0, as the row alone would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from triax.objectives.grpo.shared_prompts import prompt_runs, shared_prompts

DEFAULT_CHUNK_TOKENS = 256  # positions per chunk: 256 x 151,936 fp32 logits = 156 MB


def row_documents(prompt_lengths: torch.Tensor, prompt_width: int, width: int) -> torch.Tensor:
    """(rows, width) example numbers: -1 over each row's left padding, 0 over its tokens."""
    index = torch.arange(width, device=prompt_lengths.device)[None, :]
    return torch.where(index < (prompt_width - prompt_lengths)[:, None], -1, 0)


def _chunk_logps(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    # At most two (chunk x vocabulary) tensors at once: the logits are dropped once the log-softmax
    # (which its backward keeps, not its input) exists, and the entropy's product is made in place.
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probabilities = F.log_softmax(logits, dim=-1)
    del logits
    if isinstance(log_probabilities, DTensor):
        # Tensor parallelism's vocabulary-sharded logits: the chosen token's log-probability as the
        # negative log-likelihood, which loss_parallel computes on each rank's columns (the caller
        # runs the forward and the backward under it, as the step does its loss).
        chosen = (-F.nll_loss(log_probabilities, targets, reduction="none")).full_tensor()
    else:
        chosen = log_probabilities.gather(-1, targets[:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -log_probabilities.exp().mul_(log_probabilities).sum(-1)
    return chosen, entropy.full_tensor() if isinstance(entropy, DTensor) else entropy


def logps_of_hidden(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities, entropies), each (rows, length), of `targets` (rows, length) under the
    logits `head` gives of `hidden` (rows, length, width), `chunk_tokens` positions at a time."""
    rows, length = targets.shape
    flat_hidden, flat_targets = hidden.reshape(rows * length, -1), targets.reshape(-1)
    chosen, entropies = [], []
    # One chunk holds its logits until the backward either way: recomputing it would save nothing.
    recompute = torch.is_grad_enabled() and flat_hidden.requires_grad and rows * length > chunk_tokens
    for start in range(0, rows * length, chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if recompute:
            logps, entropy = checkpoint(_chunk_logps, head, flat_hidden[part], flat_targets[part], temperature,
                                        use_reentrant=False)
        else:
            logps, entropy = _chunk_logps(head, flat_hidden[part], flat_targets[part], temperature)
        chosen.append(logps)
        entropies.append(entropy)
    return torch.cat(chosen).view(rows, length), torch.cat(entropies).view(rows, length)


def completion_logps(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_lengths: torch.Tensor,
                     completion_ids: torch.Tensor, temperature: float = 1.0,
                     chunk_tokens: int = DEFAULT_CHUNK_TOKENS, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities, entropies), each (rows, completion length), of the completion tokens
    after their left-padded prompts, under `model` (a triax decoder) at `temperature` (TRL scores
    the tempered distribution it sampled from). `multiple`: the rows are fed rounded up to a
    multiple of this many positions (tensor parallelism's sequence sharding), the extra positions
    after the completion (causal: nothing before them sees them) and left out of the result. Rows
    that repeat a prompt (a group's generations, consecutive) feed it once where the decoder allows
    (triax.objectives.grpo.shared_prompts)."""
    width = completion_ids.size(1)
    decoder = getattr(model, "module", model)  # DDP's wrapper holds the decoder as .module
    if getattr(decoder, "attends_by_mask", False) and multiple == 1:
        parameters = decoder.num_params()
        starts = prompt_runs(prompt_ids, prompt_lengths, width, lambda seq: decoder.flops_per_token(seq, parameters))
        if len(starts) < prompt_ids.size(0):  # prompts repeat (a group's generations): each fed once
            shared = shared_prompts(prompt_ids, prompt_lengths, completion_ids, starts, multiple)
            hidden = model(shared.ids, packed=shared.packed, logits=False)
            hidden = hidden.reshape(-1, hidden.size(-1))[shared.predictors]
            return logps_of_hidden(decoder.output_logits, hidden, completion_ids, temperature, chunk_tokens)
    extra = -(prompt_ids.size(1) + width) % multiple
    if extra:
        completion_ids = torch.cat([completion_ids, completion_ids[:, -1:].expand(-1, extra)], dim=1)
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    if bool((prompt_lengths == prompt_ids.size(1)).all()):  # no padding: plain causal attention, its fast kernel
        hidden = model(ids, logits=False)
    else:
        hidden = model(ids, documents=row_documents(prompt_lengths, prompt_ids.size(1), ids.size(1)), logits=False)
    # Position t's hidden state predicts token t + 1: the completion's tokens are predicted from the
    # last prompt position on.
    hidden = hidden[:, prompt_ids.size(1) - 1:-1]
    logps, entropies = logps_of_hidden(decoder.output_logits, hidden, completion_ids, temperature, chunk_tokens)
    return logps[:, :width], entropies[:, :width]
