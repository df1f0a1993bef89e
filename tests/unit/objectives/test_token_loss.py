"""The trainer's loss compiled (parallel.compile) equals the eager one: the same fp32 cross-entropy
of bf16 logits, ignored targets skipped, for both reductions, and the same gradient."""

import pytest
import torch

from triax.data.targets import IGNORE_INDEX
from triax.objectives.tokens.loss import compiled_token_cross_entropy, loss_function, token_cross_entropy


def logits_and_targets(dtype):
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 17, 101, generator=generator) * 4).to(dtype)
    targets = torch.randint(101, (3, 17), generator=generator)
    targets[0, :5] = IGNORE_INDEX  # a chat prompt, not scored
    return logits, targets


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_compiled_loss_and_gradient_equal_the_eager_ones(dtype, reduction):
    logits, targets = logits_and_targets(dtype)
    results = []
    for loss in (token_cross_entropy, compiled_token_cross_entropy):
        leaf = logits.clone().requires_grad_()
        value = loss(leaf, targets, reduction)
        value.backward()
        results.append((value.detach(), leaf.grad))
    (eager, eager_grad), (compiled, compiled_grad) = results
    assert eager.dtype == compiled.dtype == torch.float32
    # fp32 sums in another order: a few units in the last place of 300-odd terms.
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert compiled_grad.dtype == dtype
    # The gradient comes back in the logits' dtype: within one rounding of it (bf16 keeps 8 bits).
    rounding = {torch.bfloat16: 2**-7, torch.float32: 1e-6}[dtype]
    scale = float(eager_grad.abs().max())
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=rounding, atol=rounding * scale)
    assert not compiled_grad[0, :5].any(), "an ignored target must not move its logits"


def test_the_trainer_compiles_the_loss_only_with_its_blocks():
    assert loss_function(False) is token_cross_entropy
    assert loss_function(True) is compiled_token_cross_entropy
