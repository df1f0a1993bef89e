"""A prompt fed once for all its completions (triax.objectives.grpo.shared_prompts) gives each row
the log-probabilities, entropies and gradients of the row alone, feeds fewer positions than the rows
apart, and is used only where it costs fewer FLOPs."""

import pytest
import torch

from triax.models import build_model
from triax.models.config import GPTConfig
from triax.objectives.grpo.logprobs import completion_logps
from triax.objectives.grpo.shared_prompts import groups_of_run

VOCAB, PROMPT, COMPLETION, GENERATIONS = 97, 6, 4, 3
# fp32: the same products, summed in another order (a prompt position's gradient adds its completions'
# first, and a matmul over other rows may block its sums differently): a few ulps.
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def tiny_model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(GPTConfig(arch=arch, vocab_size=VOCAB, block_size=32, n_layer=2, n_head=2, n_embd=16))


def grouped_batch():
    """Prompts of 6, 3, 3 (the same one twice, in a row) and 1 tokens, left-padded, GENERATIONS rows each."""
    generator = torch.Generator().manual_seed(4)
    lengths = [6, 3, 3, 1]
    prompts = [torch.randint(1, VOCAB, (length,), generator=generator) for length in lengths]
    prompts[2] = prompts[1]
    rows = [prompt for prompt in prompts for _ in range(GENERATIONS)]
    padded = torch.stack([torch.cat([torch.zeros(PROMPT - len(row), dtype=torch.long), row]) for row in rows])
    row_lengths = torch.tensor([len(row) for row in rows])
    completion = torch.randint(0, VOCAB, (len(rows), COMPLETION), generator=generator)
    return padded, row_lengths, completion


def weighted_gradients(model, logps, weights):
    model.zero_grad()
    (logps * weights).sum().backward()
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_shared_prompts_equal_the_rows_alone(arch):
    model = tiny_model(arch)
    prompt, lengths, completion = grouped_batch()
    weights = torch.linspace(-1, 1, completion.numel()).view_as(completion)
    positions = []
    hook = model.register_forward_pre_hook(lambda module, args: positions.append(args[0].numel()))
    together, entropy = completion_logps(model, prompt, lengths, completion, chunk_tokens=5)
    hook.remove()
    assert positions[0] < prompt.numel() + completion.numel()  # fewer positions than the rows apart
    ours = weighted_gradients(model, together, weights)
    alone = [completion_logps(model, prompt[row:row + 1], lengths[row:row + 1], completion[row:row + 1])
             for row in range(prompt.size(0))]
    torch.testing.assert_close(together, torch.cat([logps for logps, _ in alone]), **TOLERANCE)
    torch.testing.assert_close(entropy, torch.cat([entropies for _, entropies in alone]), **TOLERANCE)
    theirs = weighted_gradients(model, torch.cat([logps for logps, _ in alone]), weights)
    for name, gradient in ours.items():
        torch.testing.assert_close(gradient, theirs[name], **TOLERANCE, msg=name)


def test_a_run_is_shared_only_where_that_costs_fewer_flops():
    flops = build_model(GPTConfig(arch="llama", vocab_size=322, block_size=256, n_layer=2, n_head=4,
                                  n_embd=64)).flops_per_token
    assert groups_of_run(20, 16, 8, flops) == [8]  # short completions after a prompt: one row
    assert groups_of_run(20, 16, 24, flops) == [6, 6, 6, 6]  # more: rows cut where attention grows
    assert groups_of_run(100, 1024, 8, flops) == [1] * 8  # long completions: the rows apart


@pytest.mark.parametrize("width", [1, 2])
def test_completions_of_one_or_two_tokens(width):
    """A completion's last token is not fed (it predicts nothing): one token long, only its prompt is."""
    model = tiny_model("llama")
    prompt, lengths, completion = grouped_batch()
    completion = completion[:, :width]
    together, _ = completion_logps(model, prompt, lengths, completion)
    alone = [completion_logps(model, prompt[row:row + 1], lengths[row:row + 1], completion[row:row + 1])[0]
             for row in range(prompt.size(0))]
    torch.testing.assert_close(together, torch.cat(alone), **TOLERANCE)
