"""Completion log-probabilities without the whole logits tensor.

The log-probability of each completion token needs a softmax over the vocabulary at its position;
done at once, that is a (rows x completion length x vocabulary) tensor in fp32 (with Qwen's 151,936
words, 1,024-token completions and 16 rows: 10 GB), kept again for the backward. The completion
positions' final hidden states go through the output layer a chunk of positions at a time instead
(triax.objectives.chunked_logits, the path the token loss and DPO share), recomputed in the
backward, so neither pass holds more than one chunk's logits. The numbers are those of the
whole-logits path: the same fp32 softmax of the same rows.

Rows are prompt + completion, the prompt left-padded (`prompt_lengths` says where each row's prompt
starts): padding is given an example number of its own (the decoder's packed attention), so a row's
tokens attend only to themselves and take positions from 0, as the row alone would.
"""

from __future__ import annotations

import torch

from triax.objectives.chunked_logits import DEFAULT_CHUNK_TOKENS, logps_of_hidden, output_layer
from triax.objectives.grpo.shared_prompts import prompt_runs, shared_prompts


def row_documents(prompt_lengths: torch.Tensor, prompt_width: int, width: int) -> torch.Tensor:
    """(rows, width) example numbers: -1 over each row's left padding, 0 over its tokens."""
    index = torch.arange(width, device=prompt_lengths.device)[None, :]
    return torch.where(index < (prompt_width - prompt_lengths)[:, None], -1, 0)


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
            return logps_of_hidden(output_layer(model), hidden, completion_ids, temperature, chunk_tokens)
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
    logps, entropies = logps_of_hidden(output_layer(model), hidden, completion_ids, temperature, chunk_tokens)
    return logps[:, :width], entropies[:, :width]
