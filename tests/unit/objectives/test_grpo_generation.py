"""GRPO's sampling: the filtered distribution equals transformers' temperature/top-k/top-p
processors, the cached sampler equals sampling without a cache from the same numbers, a completion
depends only on its place (not on its batch), stops at its first stop token, and top_k=1 is the
decoder's own greedy generation."""

import pytest
import torch

from triax.models import build_model
from triax.models.config import GPTConfig
from triax.objectives.grpo.generation import (CachedSampler, SamplingSettings, draw, filtered_probabilities,
                                              place_seed, place_uniforms)

transformers = pytest.importorskip("transformers")
VOCAB = 53


def tiny_model(arch="llama"):
    torch.manual_seed(0)
    return build_model(GPTConfig(arch=arch, vocab_size=VOCAB, block_size=48, n_layer=2, n_head=2, n_embd=16)).eval()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 7, 0.5),
                                                      (1.0, 1, 0.9)])
def test_filtered_distribution_equals_transformers_processors(temperature, top_k, top_p):
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    logits[0, :4] = 2.5  # ties at the cut
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)] + (
        [TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
    theirs = processors(torch.zeros(6, 1, dtype=torch.long), logits.clone()).softmax(dim=-1)
    torch.testing.assert_close(filtered_probabilities(logits, temperature, top_k, top_p), theirs)


def test_draw_inverts_the_cumulative_distribution_and_never_draws_a_zero():
    probabilities = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 4)
    tokens = draw(probabilities, torch.tensor([0.0, 0.2499, 0.25, 0.9999], dtype=torch.float64))
    assert tokens.tolist() == [1, 1, 3, 3]


def test_place_streams_differ_and_repeat():
    assert place_seed(1, 2, 3, 4) == place_seed(1, 2, 3, 4)
    assert len({place_seed(1, 2, 3, g) for g in range(8)} | {place_seed(1, 3, 3, 0), place_seed(2, 2, 3, 0)}) == 10
    torch.testing.assert_close(place_uniforms([5, 6], 4)[1], place_uniforms([6], 4)[0])


def uncached(model, prompt, uniforms, settings):
    """The same draws, every step recomputing the whole sequence (no cache)."""
    ids = torch.tensor([prompt])
    for position in range(settings.max_completion_length):
        logits = model(ids)[:, -1, :]
        token = draw(filtered_probabilities(logits, settings.temperature, settings.top_k, settings.top_p),
                     uniforms[position:position + 1])
        ids = torch.cat([ids, token[:, None]], dim=1)
        if int(token) in settings.stop_ids:
            break
    return ids[0, len(prompt):].tolist()


PROMPTS = [[3, 4, 5], [7, 8], [9, 10, 11], [12, 13, 14, 15]]


def test_the_cached_sampler_equals_sampling_without_a_cache():
    model = tiny_model()
    settings = SamplingSettings(num_generations=3, max_completion_length=12, temperature=0.9, top_p=0.95, top_k=20,
                                stop_ids=(2,))
    completions = CachedSampler(model, settings, seed=7, device=torch.device("cpu")).complete(PROMPTS, [0, 1, 2, 3], 5)
    assert len(completions) == 12
    for row, completion in enumerate(completions):
        prompt_index, generation = divmod(row, 3)
        uniforms = place_uniforms([place_seed(7, 5, prompt_index, generation)], 12)[0]
        assert completion.ids == uncached(model, PROMPTS[prompt_index], uniforms, settings)
        assert completion.truncated == (2 not in completion.ids)
        assert 2 not in completion.ids[:-1]  # stops at its first stop token, which it keeps


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3_moe"])
def test_the_output_layer_sees_one_position_a_row(arch):
    """A prompt's positions go through the blocks, only its last through the output layer: at a
    large vocabulary no prompt's logits are held (a cached step feeds one position anyway)."""
    torch.manual_seed(0)
    extra = dict(num_experts=4, experts_per_token=2) if arch == "qwen3_moe" else {}
    model = build_model(GPTConfig(arch=arch, vocab_size=VOCAB, block_size=48, n_layer=2, n_head=2, n_embd=16,
                                  **extra)).eval()
    seen = []
    model.lm_head.register_forward_hook(lambda module, inputs, output: seen.append(tuple(inputs[0].shape[:-1])))
    settings = SamplingSettings(num_generations=3, max_completion_length=6, stop_ids=(2,))
    CachedSampler(model, settings, seed=7, device=torch.device("cpu")).complete(PROMPTS, [0, 1, 2, 3], 5)
    assert seen and all(positions == 1 for _, positions in seen), seen


def test_a_completion_depends_on_its_place_not_its_batch():
    model = tiny_model("gpt2")
    settings = SamplingSettings(num_generations=4, max_completion_length=10, stop_ids=(1, 2))
    sampler = CachedSampler(model, settings, seed=3, device=torch.device("cpu"))
    together = sampler.complete(PROMPTS, [40, 41, 42, 43], step=2)
    alone = sampler.complete([PROMPTS[2]], [42], step=2)
    assert [c.ids for c in alone] == [c.ids for c in together[8:12]]
    assert len({tuple(c.ids) for c in together}) > 4  # the generations of a group differ
    elsewhere = sampler.complete([PROMPTS[2]], [42], step=3)
    assert [c.ids for c in elsewhere] != [c.ids for c in alone]  # another step, other draws


def test_top_k_one_is_the_decoders_greedy_generation():
    model = tiny_model()
    settings = SamplingSettings(num_generations=2, max_completion_length=8, top_k=1)
    completions = CachedSampler(model, settings, seed=0, device=torch.device("cpu")).complete([PROMPTS[0]], [0], 0)
    greedy = model.generate(torch.tensor([PROMPTS[0]]), 8, greedy=True)[0, 3:].tolist()
    assert completions[0].ids == completions[1].ids == greedy and completions[0].truncated


def test_sharded_ranks_run_until_every_rank_stopped():
    """`all_stopped` decides when the loop ends: told another rank still runs, it goes on to the end."""
    model = tiny_model()
    settings = SamplingSettings(num_generations=2, max_completion_length=9, top_k=1)
    greedy_first = model.generate(torch.tensor([PROMPTS[1]]), 1, greedy=True)[0, -1].item()
    settings.stop_ids = (greedy_first,)
    calls = []
    sampler = CachedSampler(model, settings, 0, torch.device("cpu"), all_stopped=lambda here: calls.append(here) or False)
    completions = sampler.complete([PROMPTS[1]], [0], 0)
    assert len(calls) == 9 and calls[0] is True
    assert [c.ids for c in completions] == [[greedy_first]] * 2 and not completions[0].truncated


def test_ranks_agree_on_how_many_batches_they_sample():
    """Told another rank has one batch of rows more, a rank samples its last again and drops it (a
    Llama samples prompts of every length in one batch: 2 batches of 4 forwards)."""
    model = tiny_model()
    settings = SamplingSettings(num_generations=2, max_completion_length=4)
    plain = CachedSampler(model, settings, 0, torch.device("cpu")).complete(PROMPTS[:2], [0, 1], 0)
    forwards = []
    hook = model.register_forward_hook(lambda *args: forwards.append(1))
    agreed = CachedSampler(model, settings, 0, torch.device("cpu"), agree=lambda count: count + 1)
    assert [c.ids for c in agreed.complete(PROMPTS[:2], [0, 1], 0)] == [c.ids for c in plain]
    hook.remove()
    assert len(forwards) == 2 * 4


@pytest.mark.multiprocess
def test_tensor_parallel_sampling_equals_one_process(tmp_path):
    """Two ranks holding half the heads and half the vocabulary each (sequence-parallel norms: every
    forward rounded up to an even number of positions) sample the completions one process samples."""
    import json
    import os
    import subprocess
    import sys

    from support.chat_files import write_chat_checkpoint
    from triax.testing import quiet_env

    write_chat_checkpoint(tmp_path / "base")
    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = quiet_env(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        filter(None, [os.getcwd(), tests, os.environ.get("PYTHONPATH")])))
    worker = os.path.join(tests, "support", "workers", "grpo_tp_sampling.py")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             worker, str(tmp_path / "base"),
                             str(tmp_path / "out.json")], capture_output=True, text=True, env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    sampled = json.load(open(tmp_path / "out.json"))
    assert sampled["parallel"] == sampled["whole"]
    assert len(sampled["whole"]) == 9 and sum(len(ids) for ids in sampled["whole"]) > 9 * 3
