"""The token loss and DPO through the output layer in chunks of positions (parallel.max_logits_mb)
equal their whole-logits path: the loss, the figures and every parameter's gradient, with ignored
targets, a padded vocabulary's masked rows and packed rows; no call of the output layer sees more
than a chunk's positions, forward or backward; under bf16 autocast they agree within a rounding;
and below the limit the whole path runs, bit for bit."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from triax.config.schema import TrainConfig
from triax.data.targets import IGNORE_INDEX
from triax.models import build_model
from triax.models.config import GPTConfig
from triax.objectives import RunParts, StepContext
from triax.objectives.chunked_logits import FP32_BYTES, chunk_positions
from triax.objectives.dpo.build import build as build_dpo
from triax.objectives.dpo.config import DPOConfig
from triax.objectives.dpo.objective import DPOObjective
from triax.objectives.reference import Reference
from triax.objectives.tokens.loss import token_cross_entropy
from triax.objectives.tokens.objective import TokenLoss, build as build_token_loss
from triax.train.step import TrainingStep

VOCAB, PADDED, ROWS, LENGTH = 97, 104, 4, 8
# fp32 throughout: both paths take the same fp32 softmax of the same rows, but a matmul over fewer
# rows may block its sums differently and the chunks' losses are summed in another order: a few
# ulps of values near 1 (gradients summed over 32 positions).
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
CPU = torch.device("cpu")


def tiny_model(arch: str = "gpt2", seed: int = 0, padded: int | None = PADDED, tied: bool = False) -> torch.nn.Module:
    config = GPTConfig(arch=arch, vocab_size=VOCAB, block_size=32, n_layer=2, n_head=2, n_embd=16,
                       tie_embeddings=tied, padded_vocab_size=padded)
    torch.manual_seed(seed)
    return build_model(config)


def limit_for(positions: int, model: torch.nn.Module) -> float:
    """The parallel.max_logits_mb that makes chunks of `positions` positions."""
    return positions * model.config.vocab_rows * FP32_BYTES / 2**20


def context(grad_accum: int = 1) -> StepContext:
    return StepContext(CPU, contextlib.nullcontext, TrainingStep.forward, grad_accum=grad_accum,
                       data_parallel_size=1, data_parallel_rank=0, seed=0)


def token_batch(seed: int, packed: bool = False):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)
    y = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)
    y[:, :3] = IGNORE_INDEX  # a chat prompt's targets: not scored
    y[1] = IGNORE_INDEX  # a row with nothing scored
    if packed:  # two examples in each row: attention and positions confined to each
        return (x, torch.tensor([0, 0, 0, 1, 1, 1, 1, 1]).expand(ROWS, -1)), y
    return x, y


def gradients(model: torch.nn.Module) -> dict:
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None}


def token_loss_and_gradients(model, max_logits_mb: float, batch, per_token):
    model.zero_grad()
    objective = TokenLoss(token_cross_entropy, per_token is not None, max_logits_mb)
    scaled, logged = objective.loss(context(grad_accum=2), model, (*batch, per_token))
    scaled.backward()
    return scaled.detach(), logged.detach(), gradients(model)


@pytest.mark.parametrize("arch,padded,tied", [("gpt2", PADDED, False), ("gpt2", None, True), ("llama", PADDED, False)])
@pytest.mark.parametrize("chunk", [1, 7, ROWS * LENGTH - 1])
@pytest.mark.parametrize("per_token,packed", [(None, False), (0.25, False), (0.25, True)])
def test_the_token_loss_in_chunks_equals_the_whole(arch, padded, tied, chunk, per_token, packed):
    model = tiny_model(arch, padded=padded, tied=tied)
    batch = token_batch(seed=1, packed=packed)
    whole = token_loss_and_gradients(model, 0.0, batch, per_token)
    chunked = token_loss_and_gradients(model, limit_for(chunk, model), batch, per_token)
    torch.testing.assert_close(chunked[0], whole[0], **TOLERANCE)
    torch.testing.assert_close(chunked[1], whole[1], **TOLERANCE)
    assert chunked[2].keys() == whole[2].keys()
    for name, gradient in chunked[2].items():
        torch.testing.assert_close(gradient, whole[2][name], **TOLERANCE, msg=name)
    if padded:  # the padding rows' logits are masked in every chunk: they never move
        assert not chunked[2]["lm_head.weight"][VOCAB:].any()


def test_under_bf16_autocast_the_chunks_equal_the_whole_to_a_rounding():
    """The output layer's matmul in bf16 either way, the loss in fp32 of the same bf16 logits: the
    loss to fp32 round-off, the gradients (bf16 matmuls over fewer rows) within one bf16 rounding."""
    model = tiny_model("llama")
    batch = token_batch(seed=5)
    autocast = StepContext(CPU, lambda: torch.autocast("cpu", dtype=torch.bfloat16), TrainingStep.forward,
                           grad_accum=1, data_parallel_size=1, data_parallel_rank=0, seed=0)
    results = []
    for limit in (0.0, limit_for(7, model)):
        model.zero_grad()
        scaled, logged = TokenLoss(token_cross_entropy, False, limit).loss(autocast, model, (*batch, None))
        scaled.backward()
        results.append((logged.detach(), gradients(model)))
    (whole, whole_gradients), (chunked, chunked_gradients) = results
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, whole, **TOLERANCE)
    for name, gradient in chunked_gradients.items():
        scale = float(whole_gradients[name].abs().max())
        torch.testing.assert_close(gradient, whole_gradients[name], rtol=2**-7, atol=2**-7 * scale, msg=name)


def test_below_the_limit_the_whole_path_runs_bit_for_bit():
    model = tiny_model()
    batch = token_batch(seed=2)
    default = token_loss_and_gradients(model, 0.0, batch, None)
    fits = token_loss_and_gradients(model, limit_for(ROWS * LENGTH, model), batch, None)
    assert torch.equal(fits[1], default[1])
    assert all(torch.equal(fits[2][name], gradient) for name, gradient in default[2].items())


def dpo_pairs(seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)  # 2 pairs: chosen, chosen, rejected, rejected
    y = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)
    y[:, :3] = IGNORE_INDEX  # the prompt's targets are not scored
    y[2, -2:] = IGNORE_INDEX  # a shorter answer
    return x, y


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("chunk", [1, 7])
def test_the_dpo_loss_in_chunks_equals_the_whole(loss_type, chunk):
    policy, frozen = tiny_model(seed=0), tiny_model(seed=1)
    x, y = dpo_pairs(seed=3)
    results = []
    for limit in (0.0, limit_for(chunk, policy)):
        objective = DPOObjective(DPOConfig(beta=0.2, loss_type=loss_type), limit)
        objective.use_reference(Reference(model=frozen))
        policy.zero_grad()
        scaled, logged = objective.loss(context(grad_accum=2), policy, (x, y, None))
        scaled.backward()
        results.append((scaled.detach(), logged.detach(), objective.take_figures(), gradients(policy)))
    (whole_scaled, whole_logged, whole_figures, whole_gradients), chunked = results[0], results[1]
    torch.testing.assert_close(chunked[0], whole_scaled, **TOLERANCE)
    torch.testing.assert_close(chunked[1], whole_logged, **TOLERANCE)
    assert chunked[2].keys() == whole_figures.keys()
    for name, value in whole_figures.items():  # rounded to 6 places, of values near 1 to 100
        assert chunked[2][name] == pytest.approx(value, rel=1e-5, abs=2e-6), name
    for name, gradient in chunked[3].items():
        torch.testing.assert_close(gradient, whole_gradients[name], **TOLERANCE, msg=name)
    assert frozen.lm_head.weight.grad is None  # the reference runs without gradients in both


class HeadPositions:
    """The positions each call of a model's output layer (its lm_head) sees, forward and the
    backward's recomputation alike."""

    def __init__(self, model: torch.nn.Module):
        self.calls: list[int] = []
        self.handle = model.lm_head.register_forward_pre_hook(self.seen)

    def seen(self, module: torch.nn.Module, args: tuple) -> None:
        self.calls.append(args[0].shape[:-1].numel())


def test_no_call_of_the_output_layer_sees_more_than_a_chunk():
    model, frozen = tiny_model(), tiny_model(seed=1)
    chunk = 6
    watch, frozen_watch = HeadPositions(model), HeadPositions(frozen)
    token_loss_and_gradients(model, limit_for(chunk, model), token_batch(seed=4), None)
    # forward and the backward's recomputation, ceil(32 / 6) chunks each
    assert sorted(watch.calls) == [2, 2] + [chunk] * 10
    watch.calls.clear()
    objective = DPOObjective(DPOConfig(beta=0.2), limit_for(chunk, model))
    objective.use_reference(Reference(model=frozen))
    scaled, _ = objective.loss(context(), model, (*dpo_pairs(seed=5), None))
    scaled.backward()
    assert max(watch.calls) == chunk and len(watch.calls) == 12  # the policy: forward and recomputation
    assert max(frozen_watch.calls) == chunk and len(frozen_watch.calls) == 6  # the reference: forward alone
    watch.calls.clear()
    token_loss_and_gradients(model, 0.0, token_batch(seed=4), None)
    assert watch.calls == [ROWS * LENGTH]  # the measure sees the whole logits where they are made


def test_chunk_positions_fit_the_limit():
    model = tiny_model()
    targets = torch.zeros(ROWS, LENGTH, dtype=torch.long)
    assert chunk_positions(model, targets, 0.0) == ROWS * LENGTH  # no limit: the whole logits
    assert chunk_positions(model, targets, 1024.0) == ROWS * LENGTH  # they fit
    assert chunk_positions(model, targets, limit_for(5.5, model)) == 5  # the padded vocabulary's rows count
    assert chunk_positions(model, targets, 1e-12) == 1  # never less than one position
    wrapped = torch.nn.Module()
    wrapped.module = model  # DDP's wrapper holds the decoder as .module
    assert chunk_positions(wrapped, targets, limit_for(7, model)) == 7


def test_the_runs_limit_reaches_both_objectives():
    config = TrainConfig()
    assert config.parallel.max_logits_mb is None  # unset: 256 MB on a CPU (docs/parallelism.md)
    parts = RunParts(config, SimpleNamespace(val=None), None, CPU, contextlib.nullcontext, 1, token_cross_entropy)
    assert build_token_loss(parts).max_logits_mb == build_dpo(parts).max_logits_mb == 256
    config.parallel.max_logits_mb = 3.5
    assert build_token_loss(parts).max_logits_mb == build_dpo(parts).max_logits_mb == 3.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_unset_limit_is_a_quarter_of_its_memory():
    from triax.objectives.chunked_logits import logits_limit_mb

    device = torch.device("cuda")
    assert logits_limit_mb(None, device) == torch.cuda.get_device_properties(device).total_memory / 4 / 2**20
    assert logits_limit_mb(0.0, device) == 0.0
