"""GRPO's loss equals TRL 1.16's GRPOTrainer._compute_loss on the same tensors: TRL's own method
is run on a stand-in trainer that hands it the log-probabilities (a leaf tensor), so the loss, its
gradient and the logged figures are compared for every loss type, importance-sampling level, with
and without the KL term and with the generating policy's log-probabilities kept (num_iterations > 1)."""

import itertools
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from triax.objectives.grpo.config import GRPOConfig
from triax.objectives.grpo.loss import clip_masks, group_advantages, nan_std, reduce_loss, token_terms
from triax.objectives.grpo.metrics import LossFigures

trl = pytest.importorskip("trl", reason="trl is not installed (pip install 'triax[test]')")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd  # noqa: E402

ROWS, LENGTH, MAX_COMPLETION = 6, 7, 9
GRAD_ACCUM, ITEMS_IN_BATCH = 2, 61.0


def tensors(seed: int):
    generator = torch.Generator().manual_seed(seed)
    logps = -torch.rand(ROWS, LENGTH, generator=generator, dtype=torch.float32) * 3
    old = logps + 0.4 * torch.randn(ROWS, LENGTH, generator=generator)  # far enough that clipping happens
    ref = logps + 0.2 * torch.randn(ROWS, LENGTH, generator=generator)
    lengths = torch.tensor([7, 3, 0, 5, 1, 7])  # a completion with no token in the loss (masked truncated)
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).int()
    advantages = torch.randn(ROWS, generator=generator)
    entropies = torch.rand(ROWS, LENGTH, generator=generator)
    return logps, old, ref, mask, advantages, entropies


def trl_loss(config: GRPOConfig, logps, old, ref, mask, advantages, entropies):
    """TRL's _compute_loss on a stand-in trainer: (loss, gradient of logps, logged metrics)."""
    leaf = logps.clone().requires_grad_(True)
    reduce_identity = SimpleNamespace(reduce=lambda t, reduction: t, gather=lambda t: t, num_processes=1,
                                      gather_for_metrics=lambda t: t)
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (leaf, entropies, None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=config.importance_sampling_level,
        beta=config.beta, loss_type=config.loss_type, epsilon_low=config.epsilon, epsilon_high=config.epsilon_upper(),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=config.use_bias_correction_kl,
                             steps_per_generation=GRAD_ACCUM),
        use_vllm=False, vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=GRAD_ACCUM, max_completion_length=MAX_COMPLETION,
        accelerator=reduce_identity, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)})
    inputs = {"prompt_ids": torch.zeros(ROWS, 2, dtype=torch.long), "prompt_mask": torch.ones(ROWS, 2, dtype=torch.long),
              "completion_ids": torch.zeros(ROWS, LENGTH, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "num_items_in_batch": torch.tensor(ITEMS_IN_BATCH)}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if config.beta:
        inputs["ref_per_token_logps"] = ref
    loss = GRPOTrainer._compute_loss(stand_in, None, inputs)
    loss.backward()
    return loss.detach(), leaf.grad, {name: values[0] for name, values in stand_in._metrics["train"].items()}


def triax_loss(config: GRPOConfig, logps, old, ref, mask, advantages, entropies):
    leaf = logps.clone().requires_grad_(True)
    terms = token_terms(config, leaf, old, ref if config.beta else None, advantages, mask)
    loss = reduce_loss(config, terms.token_loss, mask, GRAD_ACCUM, ITEMS_IN_BATCH, data_parallel_size=1)
    loss.backward()
    figures = LossFigures()
    figures.add(terms, clip_masks(config, terms.ratio, advantages), entropies, mask)
    return loss.detach(), leaf.grad, figures.take()


CASES = list(itertools.product(("grpo", "dr_grpo", "dapo", "bnpo"), ("token", "sequence"), (0.0, 0.04),
                               (False, True))) + [("dapo", "token", 0.04, True, False), ("grpo", "sequence", 0.04, False, False)]


@pytest.mark.parametrize("loss_type,level,beta,kept_old,corrected", [case + (True,) if len(case) == 4 else case
                                                                      for case in CASES])
def test_loss_gradient_and_figures_equal_trl(loss_type, level, beta, kept_old, corrected):
    config = GRPOConfig(loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon=0.2,
                        epsilon_high=0.28, max_completion_length=MAX_COMPLETION, reward_funcs=["exact_match"],
                        use_bias_correction_kl=corrected)
    logps, old, ref, mask, advantages, entropies = tensors(seed=len(loss_type) + int(beta * 100))
    old = old if kept_old else None
    theirs = trl_loss(config, logps, old, ref, mask, advantages, entropies)
    ours = triax_loss(config, logps, old, ref, mask, advantages, entropies)
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=1e-6)
    assert set(ours[2]) == set(theirs[2])
    for name, value in theirs[2].items():
        assert math.isclose(ours[2][name], value, abs_tol=1e-6), (name, ours[2][name], value)
    if kept_old and level == "token":  # the ratios were far from 1: the clipping was exercised
        assert theirs[2]["clip_ratio/region_mean"] > 0


def test_one_iteration_loss_is_zero_but_its_gradient_is_the_advantage():
    """With old = logps (detached) the ratio is 1: a zero-mean advantage gives loss 0, the gradient A / tokens."""
    config = GRPOConfig(loss_type="bnpo", reward_funcs=["exact_match"])
    logps, _, _, mask, _, _ = tensors(seed=3)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    leaf = logps.clone().requires_grad_(True)
    loss = reduce_loss(config, token_terms(config, leaf, None, None, advantages, mask).token_loss, mask, 1, 0.0, 1)
    loss.backward()
    expected = -advantages[:, None] * mask / mask.sum()
    torch.testing.assert_close(leaf.grad, expected.float(), rtol=0, atol=1e-7)


def test_nan_std_equals_trl():
    values = torch.tensor([[1.0, float("nan"), 3.0, 4.0], [2.0, 2.0, float("nan"), float("nan")],
                           [float("nan")] * 3 + [5.0]])
    torch.testing.assert_close(nan_std(values, dim=1), nanstd(values, dim=1), equal_nan=True)
    torch.testing.assert_close(nan_std(values), nanstd(values), equal_nan=True)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_by_hand(scale_rewards):
    """Two groups of 3: [1, 0, 2] (mean 1, std 1) and [None, 1, 1] (one unscored: mean 1, std 0)."""
    nan = float("nan")
    per_function = torch.tensor([[1.0, nan], [0.0, nan], [1.0, 1.0], [nan, nan], [0.5, 0.5], [1.0, nan]])
    weights = torch.tensor([1.0, 1.0])
    result = group_advantages(per_function, weights, num_generations=3, scale_rewards=scale_rewards)
    rewards = torch.tensor([1.0, 0.0, 2.0, nan, 1.0, 1.0])
    torch.testing.assert_close(result.rewards, rewards, equal_nan=True)
    centred = torch.tensor([0.0, -1.0, 1.0, 0.0, 0.0, 0.0])
    divisor = {"group": torch.tensor([1.0, 1, 1, 0, 0, 0]) + 1e-4,
               "batch": nanstd(rewards) + 1e-4, "none": torch.tensor(1.0)}[scale_rewards]
    torch.testing.assert_close(result.advantages, centred / divisor, rtol=0, atol=1e-6)
    assert result.advantages[3] == 0  # no function scored it: no advantage
    if scale_rewards != "batch":
        assert result.std_is_zero.tolist() == [False] * 3 + [True] * 3


def test_weights_scale_each_function():
    per_function = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    result = group_advantages(per_function, torch.tensor([2.0, 0.5]), num_generations=2, scale_rewards="none")
    torch.testing.assert_close(result.rewards, torch.tensor([2.0, 0.5]))
    torch.testing.assert_close(result.advantages, torch.tensor([0.75, -0.75]))


def test_truncated_completions_leave_the_loss_as_trls_rule_says():
    """TRL: a completion whose last id is neither an eos nor the pad is truncated; masked, its row is 0."""
    from triax.objectives.grpo.generation import Completion
    from triax.objectives.grpo.rollout import completion_tensors

    completions = [Completion([5, 6, 2], False), Completion([5, 6, 7, 8], True), Completion([9], True)]
    ids, mask = completion_tensors(completions, pad_id=0, mask_truncated=False)
    assert ids.tolist() == [[5, 6, 2, 0], [5, 6, 7, 8], [9, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    eos_and_pad = [2, 0]
    truncated = torch.tensor([ids_[-1] not in eos_and_pad for ids_ in ([5, 6, 2], [5, 6, 7, 8], [9])])
    _, masked = completion_tensors(completions, pad_id=0, mask_truncated=True)
    assert masked.tolist() == (mask * (~truncated).unsqueeze(1).int()).tolist() == [[1, 1, 1, 0], [0] * 4, [0] * 4]
