"""`triax eval` under parallel.max_logits_mb: a batch whose whole fp32 logits would pass the limit
goes through the output layer in chunks of positions (triax.objectives.chunked_logits), with the
score of the whole logits; below it the whole logits, bit for bit."""

import numpy as np
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from support.hf_scoring import char_validation_ids, hf_mean_loss
from support.helpers import tiny_overrides, train
from triax.config.schema import TrainConfig
from triax.data.targets import IGNORE_INDEX
from triax.data.tokens import TokenDataset, TokenFile
from triax.eval.scoring import score, scoring_logits_limit
from triax.models import build_model
from triax.models.config import GPTConfig
from triax.objectives.chunked_logits import FP32_BYTES
from triax.objectives.dpo.config import DPOConfig
from triax.objectives.dpo.objective import DPOObjective
from triax.objectives.reference import Reference

CPU = torch.device("cpu")
VOCAB, BLOCK, BATCH = 5003, 16, 3  # a vocabulary far wider than the model, as Qwen's is


class HeadPositions:
    """The positions each call of a model's output layer (its lm_head) sees."""

    def __init__(self, model: torch.nn.Module):
        self.calls: list[int] = []
        model.lm_head.register_forward_pre_hook(lambda module, args: self.calls.append(args[0].shape[:-1].numel()))


def limit_for(positions: int, model: torch.nn.Module) -> float:
    """The parallel.max_logits_mb that makes chunks of `positions` positions."""
    return positions * model.config.vocab_rows * FP32_BYTES / 2**20


def sum_tolerance(positions: int) -> float:
    """Relative difference of two fp32 sums of the same `positions` positive losses added in other
    orders (at most (n-1)·2^-24 each), each loss a few ulps apart (a matmul over fewer rows blocks
    its sums otherwise): 4·n·2^-24 bounds both."""
    return 4 * positions * 2.0 ** -24


@pytest.fixture
def token_dataset(tmp_path):
    path = tmp_path / "val.bin"
    np.random.default_rng(0).integers(0, VOCAB, 10 * BLOCK + 5).astype(np.uint16).tofile(path)
    return TokenDataset(TokenFile(LocalFileSystem(), str(path), "uint16", local=True), BLOCK, VOCAB)


def tiny_model(arch: str = "llama", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = GPTConfig(arch=arch, vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=2, n_embd=16,
                       padded_vocab_size=5056)
    return build_model(config).eval()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("chunk", [1, 7, BATCH * BLOCK - 1])
def test_scores_in_chunks_equal_the_whole_logits_and_never_hold_them(token_dataset, arch, chunk):
    model = tiny_model(arch)
    watch = HeadPositions(model)
    whole = score(model, token_dataset, BATCH, 0, 1, CPU, max_logits_mb=0.0)
    assert max(watch.calls) == BATCH * BLOCK  # the whole path: a batch's logits at once
    watch.calls.clear()
    chunked = score(model, token_dataset, BATCH, 0, 1, CPU, max_logits_mb=limit_for(chunk, model))
    assert max(watch.calls) == chunk  # never more than a chunk's positions through the output layer
    assert chunked[1] == whole[1] == 10 * BLOCK + 4  # every target once
    assert chunked[0] == pytest.approx(whole[0], rel=sum_tolerance(BATCH * BLOCK))


def test_below_the_limit_the_score_is_the_whole_logits_bit_for_bit(token_dataset):
    model = tiny_model()
    watch = HeadPositions(model)
    default = score(model, token_dataset, BATCH, 0, 1, CPU, max_logits_mb=scoring_logits_limit(None, CPU))
    assert max(watch.calls) == BATCH * BLOCK  # 3 x 16 x 5,056 fp32 logits: far below 256 MB
    assert default == score(model, token_dataset, BATCH, 0, 1, CPU, max_logits_mb=0.0)


def test_the_limit_is_the_runs_else_the_devices_default():
    config = TrainConfig()
    assert scoring_logits_limit(None, CPU) == 256.0  # a transformers directory: the CPU's default
    assert scoring_logits_limit(config, CPU) == 256.0  # a run that left it unset
    config.parallel.max_logits_mb = 0.5
    assert scoring_logits_limit(config, CPU) == 0.5
    config.parallel.max_logits_mb = 0.0
    assert scoring_logits_limit(config, CPU) == 0.0  # the run asked for the whole logits at any size


def dpo_pairs(pairs: int = 2, length: int = 12):
    generator = torch.Generator().manual_seed(3)
    x = torch.randint(0, VOCAB, (2 * pairs, length), generator=generator)
    y = torch.randint(0, VOCAB, (2 * pairs, length), generator=generator)
    y[:, :4] = IGNORE_INDEX  # the prompt's targets
    y[0, 9:] = IGNORE_INDEX  # a shorter answer
    return x, y


@pytest.mark.parametrize("chunk", [1, 5])
def test_a_dpo_runs_pairs_are_scored_in_chunks_as_the_whole(chunk):
    policy, frozen = tiny_model(), tiny_model(seed=1)
    watch, frozen_watch = HeadPositions(policy), HeadPositions(frozen)
    x, y = dpo_pairs()
    results = []
    for limit in (0.0, limit_for(chunk, policy)):
        objective = DPOObjective(DPOConfig(beta=0.2), limit)
        objective.use_reference(Reference(model=frozen))
        results.append(objective.pair_terms_plain(policy, x, y))
    assert max(watch.calls[1:]) == max(frozen_watch.calls[1:]) == chunk  # after the whole path's one call each
    (whole_losses, whole_stats), (losses, stats) = results
    # An answer's log-probability sums at most 8 fp32 losses of about ln(5,003) = 8.5 in another
    # order: within 8·2^-24 relative of about 70 (8e-6 of it at most); the loss and rewards follow.
    torch.testing.assert_close(losses, whole_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats, whole_stats, rtol=1e-5, atol=1e-5)


@pytest.mark.multiprocess
def test_eval_of_a_run_takes_its_limit_and_equals_transformers(tmp_path, tiny_corpus, monkeypatch, capsys):
    """A run with a tiny parallel.max_logits_mb: `triax eval` scores it a few positions at a time
    and agrees with transformers' whole-logits loss on the exported weights."""
    from triax.commands import eval as eval_command
    from triax.commands.export import main as export_main
    from triax.eval import scoring
    from triax.runtime.place import detect_place

    run_dir = tmp_path / "run"
    limit = 0.001  # MB: a few positions of a character vocabulary's logits
    train(tiny_overrides(run_dir, tiny_corpus, **{"parallel.max_logits_mb": limit}))
    export_main([str(run_dir), str(tmp_path / "hf"), "--format", "hf"])
    ids = char_validation_ids(run_dir, tiny_corpus)
    expected, tokens = hf_mean_loss(str(tmp_path / "hf"), ids, block_size=16)

    calls, rows, load = [], [], scoring.load_model

    def watched_load(path, device):
        model, codec, config = load(path, device)
        rows.append(model.config.vocab_rows)
        model.lm_head.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[:-1].numel()))
        return model, codec, config

    monkeypatch.setattr(scoring, "load_model", watched_load)
    args = eval_command.parse([str(run_dir), "--batch-size", "5", "--json"])
    _, totals, _ = eval_command.evaluate(args, detect_place(), CPU)
    chunk = int(limit * 2**20) // (rows[0] * FP32_BYTES)
    assert 1 <= max(calls) == chunk < 5 * 16  # the run's limit: never a batch's whole logits
    assert int(totals[1]) == tokens == len(ids) - 1
    # The mean of a few hundred fp32 losses, summed in other orders by triax and transformers (the
    # tolerance the whole-logits comparison in test_evaluation.py takes).
    assert totals[0] / totals[1] == pytest.approx(expected, rel=1e-5)
