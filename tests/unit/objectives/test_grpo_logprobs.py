"""Completion log-probabilities through the output layer in chunks equal the whole-logits path
(values, entropies, every parameter's gradient), a left-padded row equals the row alone, and no
tensor the size of the whole logits is ever made, forward or backward."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from triax.models import build_model
from triax.models.config import GPTConfig
from triax.objectives.grpo.logprobs import completion_logps

VOCAB, PROMPT, COMPLETION, ROWS = 97, 5, 8, 4
# fp32 throughout: the chunked and whole paths multiply the same numbers, but a matmul over fewer
# rows may block its sums differently; a few ulps of values near 1 (gradients summed over 32 rows).
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def tiny_model(arch: str, tied: bool = False) -> torch.nn.Module:
    config = GPTConfig(arch=arch, vocab_size=VOCAB, block_size=32, n_layer=2, n_head=2, n_embd=16,
                       tie_embeddings=tied)
    torch.manual_seed(0)
    return build_model(config)


def batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (ROWS, PROMPT), generator=generator)
    completion = torch.randint(0, VOCAB, (ROWS, COMPLETION), generator=generator)
    return prompt, completion


def whole_logits_path(model, prompt, completion, temperature):
    logits = model(torch.cat([prompt, completion], dim=1))[:, prompt.size(1) - 1:-1].float() / temperature
    log_probabilities = F.log_softmax(logits, dim=-1)
    chosen = log_probabilities.gather(-1, completion[..., None]).squeeze(-1)
    return chosen, -(log_probabilities.exp() * log_probabilities).sum(-1)


def gradients(model, logps):
    model.zero_grad()
    (logps * torch.linspace(-1, 1, logps.numel()).view_as(logps)).sum().backward()
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("arch,tied", [("gpt2", False), ("gpt2", True), ("llama", False)])
@pytest.mark.parametrize("chunk_tokens", [1, 5, ROWS * COMPLETION])
def test_chunks_equal_the_whole_logits(arch, tied, chunk_tokens):
    model = tiny_model(arch, tied)
    prompt, completion = batch(seed=1)
    theirs, their_entropy = whole_logits_path(model, prompt, completion, temperature=0.7)
    their_gradients = gradients(model, theirs)
    ours, our_entropy = completion_logps(model, prompt, torch.full((ROWS,), PROMPT), completion, temperature=0.7,
                                         chunk_tokens=chunk_tokens)
    torch.testing.assert_close(ours, theirs, **TOLERANCE)
    torch.testing.assert_close(our_entropy, their_entropy, **TOLERANCE)
    assert not our_entropy.requires_grad  # a figure, not part of the loss
    for name, gradient in gradients(model, ours).items():
        torch.testing.assert_close(gradient, their_gradients[name], **TOLERANCE, msg=name)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_left_padded_row_equals_the_row_alone(arch):
    """Rows of prompts 5, 3 and 1 tokens long, left-padded: each row's numbers are its own alone."""
    model = tiny_model(arch)
    prompt, completion = batch(seed=2)
    lengths = torch.tensor([5, 3, 1, 5])
    padded = torch.where(torch.arange(PROMPT)[None, :] < (PROMPT - lengths)[:, None], 0, prompt)
    together, _ = completion_logps(model, padded, lengths, completion, chunk_tokens=7)
    for row, length in enumerate(lengths.tolist()):
        alone, _ = whole_logits_path(model, prompt[row:row + 1, PROMPT - length:], completion[row:row + 1], 1.0)
        torch.testing.assert_close(together[row:row + 1], alone, **TOLERANCE)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor over the vocabulary (logits, their softmax, their gradient)
    an operation returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.size(-1) == VOCAB:
                self.largest = max(self.largest, tensor.numel())
        return out


def test_no_tensor_holds_every_positions_logits():
    model = tiny_model("gpt2")
    prompt, completion = batch(seed=3)
    chunk = 6
    with LargestTensor() as seen:
        logps, _ = completion_logps(model, prompt, torch.full((ROWS,), PROMPT), completion, chunk_tokens=chunk)
        logps.sum().backward()
    # The head's weight (n_embd x vocabulary, 16 rows) and its gradient are the other tensors over it.
    assert seen.largest <= max(chunk, 16) * VOCAB < ROWS * COMPLETION * VOCAB
    with LargestTensor() as seen:
        whole_logits_path(model, prompt, completion, 1.0)[0].sum().backward()
    assert seen.largest >= ROWS * COMPLETION * VOCAB  # the measure sees the whole logits where they exist
