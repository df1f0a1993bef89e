"""Side by side with TRL 1.16's GRPOTrainer: triax's GRPO objective trains a tiny Llama checkpoint
for a few steps in a plain loop (its own sampler, rewards, advantages, chunked log-probabilities and
loss); TRL's trainer trains the same checkpoint on the same prompts, handed triax's completions of
each step through its `rollout_func`. The loss and the gradient norm of every step, and the final
model's logits, agree, for the dapo and grpo losses, without and with the KL term."""

import contextlib
import warnings

import pytest
import torch

from support.chat_files import write_chat_checkpoint
from triax.data.tokenizer import BPETokenizer
from triax.interop.hf.files import description_files
from triax.interop.hf.whole_model import load_hf_model
from triax.objectives import StepContext
from triax.objectives.grpo.config import GRPOConfig
from triax.objectives.grpo.generation import CachedSampler, SamplingSettings
from triax.objectives.grpo.objective import GRPOObjective
from triax.objectives.grpo.prompts import PromptDataset, encode_prompts, prompt_encoder_for
from triax.objectives.grpo.rewards import RewardFunction

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl", reason="trl is not installed (pip install 'triax[test]')")
datasets = pytest.importorskip("datasets")

PROMPTS, GENERATIONS, LENGTH, LR, TEMPERATURE = 2, 4, 8, 3e-3, 0.8
LONGEST = 20  # steps of the longest comparison
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
CPU = torch.device("cpu")
# fp32 on both sides; the two compute the same sums in different orders (attention kernels, the
# chunked softmax), so each step agrees to a few ulps of its values, which a few Adam steps at this
# learning rate carry into the weights: 1e-5 of the loss and gradient norm (both near 1) over the
# first steps, 1e-4 over 20 (the bounds; TRL differs from a replay of itself by 2e-5 there).
TOLERANCE, LATER_TOLERANCE, FIRST_STEPS = 1e-5, 1e-4, 5


def multiples_of_three(prompts, completions, completion_ids, **kwargs):
    """A reward that varies within each group: the completion's tokens whose id divides by 3."""
    return [float(sum(1 for token in ids if token % 3 == 0)) for ids in completion_ids]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = tmp_path_factory.mktemp("grpo-trl") / "base"
    write_chat_checkpoint(directory)
    return directory


def records():
    """As many prompts as the steps take (TRL's sampler and triax's loop then agree on the order)."""
    pairs = [(number % 5, (number * 3) % 5) for number in range(LONGEST * PROMPTS)]
    return [{"prompt": f"{WORDS[a]} plus {WORDS[b]}?", "answer": WORDS[a + b]} for a, b in pairs]


def triax_run(base, config, steps):
    """The objective in a plain loop: per step, its rollout of the next prompts in file order, its loss,
    AdamW (TRL's settings) after clipping to norm 1. Returns the completions, losses, norms and model."""
    model = load_hf_model(str(base), CPU).train()
    tokenizer = BPETokenizer.from_file(str(base / "tokenizer.json")).tokenizer
    encoder = prompt_encoder_for(None, description_files(str(base)), str(base), tokenizer)
    prompts = PromptDataset(encode_prompts(((f"p.jsonl:{n + 1}", r) for n, r in enumerate(records())), encoder,
                                           100).prompts)
    eos = tokenizer.token_to_id("<|eot_id|>")
    sampler = CachedSampler(model, SamplingSettings(GENERATIONS, LENGTH, TEMPERATURE, stop_ids=(eos,)), seed=0,
                            device=CPU)
    objective = GRPOObjective(config, prompts, [RewardFunction("multiples_of_three", multiples_of_three)],
                              lambda ids: tokenizer.decode(ids, skip_special_tokens=True), pad_id=eos, sampler=sampler)
    if config.beta:
        objective.reference = load_hf_model(str(base), CPU).eval().requires_grad_(False)
    context = StepContext(CPU, contextlib.nullcontext, lambda m, x: m(x), grad_accum=1, data_parallel_size=1,
                          data_parallel_rank=0, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    history = []
    for step in range(steps):  # num_iterations > 1: each block of that many steps trains on its first's batch
        block = step // config.num_iterations
        indices = torch.arange(block * PROMPTS, (block + 1) * PROMPTS)
        rollout = objective.produce_batch(context, step + 1, indices, model)
        loss, _ = objective.loss(context, model, rollout)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        history.append({"loss": loss.item(), "grad_norm": norm.item(), "completions": rollout.completions,
                        "prompt_ids": [prompt.ids for prompt in prompts.records(indices)],
                        **objective.take_figures()})
    return history, model


def trl_run(base, root, history, steps, **options):
    """TRL's GRPOTrainer on the prompts in file order, each generation's completions triax's (TRL generates
    on the first step of each block of num_iterations steps)."""

    def rollout_func(prompts, trainer):
        step = history[trainer.state.global_step]
        block = trainer.state.global_step // options.get("num_iterations", 1)
        prompt_ids = [ids for ids in step["prompt_ids"] for _ in range(GENERATIONS)]
        assert prompts == [record["prompt"] for record in records()[block * PROMPTS:][:PROMPTS]
                           for _ in range(GENERATIONS)]
        return {"prompt_ids": prompt_ids, "completion_ids": step["completions"],
                "logprobs": [[0.0] * len(ids) for ids in step["completions"]]}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = trl.GRPOConfig(output_dir=str(root / "trl"), report_to=[], per_device_train_batch_size=PROMPTS * GENERATIONS,
                              num_generations=GENERATIONS, max_completion_length=LENGTH, temperature=TEMPERATURE,
                              max_steps=steps, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                              weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                              logging_steps=1, save_strategy="no", use_cpu=True, seed=0, shuffle_dataset=False,
                              bf16=False, gradient_checkpointing=False, **options)
        trainer = trl.GRPOTrainer(model=str(base), reward_funcs=[multiples_of_three], args=args,
                                  train_dataset=datasets.Dataset.from_list(records()),
                                  processing_class=transformers.AutoTokenizer.from_pretrained(str(base)),
                                  rollout_func=rollout_func)
        trainer.train()
    return [entry for entry in trainer.state.log_history if "grad_norm" in entry], trainer.model


@pytest.mark.parametrize("loss_type,beta,steps,extra", [
    ("dapo", 0.0, LONGEST, {}), ("grpo", 0.0, 4, {}), ("dapo", 0.05, 4, {}), ("grpo", 0.05, LONGEST, {}),
    ("dr_grpo", 0.0, 4, {"scale_rewards": "none"}), ("bnpo", 0.0, 4, {"scale_rewards": "batch"}),
    ("grpo", 0.0, 4, {"importance_sampling_level": "sequence", "epsilon_high": 0.28}),
    # num_iterations > 1: the later steps of a block train on its batch again, the ratio moves off 1
    ("dapo", 0.0, 9, {"num_iterations": 3}), ("grpo", 0.05, 6, {"num_iterations": 2, "epsilon": 0.05})])
def test_grpo_equals_trl_grpo_trainer_step_by_step(base, tmp_path, loss_type, beta, steps, extra):
    options = dict(loss_type=loss_type, beta=beta, **extra)
    ours, model = triax_run(base, GRPOConfig(num_generations=GENERATIONS, max_completion_length=LENGTH,
                                             temperature=TEMPERATURE, reward_funcs=["multiples_of_three"], **options),
                            steps)
    theirs, their_model = trl_run(base, tmp_path, ours, steps, **options)
    assert len(theirs) == steps
    for step, (mine, other) in enumerate(zip(ours, theirs)):
        tolerance = TOLERANCE if step < FIRST_STEPS else LATER_TOLERANCE
        # A step that reused its batch logs no rollout figures (as TRL: they are the generating step's).
        names = ("loss", "grad_norm", "entropy", "clip_ratio/region_mean", *(["kl"] if beta else []),
                 *(("reward", "reward_std", "completions/mean_length") if "reward" in other else ()))
        assert ("reward" in mine) == ("reward" in other), step + 1
        for name in names:
            assert abs(mine[name] - other[name]) <= tolerance, (step + 1, name, mine[name], other[name])
    assert all(record["grad_norm"] > 0.01 for record in ours)  # the updates were real
    ids = torch.tensor([ours[0]["prompt_ids"][0] + ours[0]["completions"][0]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), their_model(ids).logits, rtol=0, atol=1e-4)
