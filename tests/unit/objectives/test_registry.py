"""The objectives' registry (data.task -> objective) and the pieces every objective shares: the
reference model in its three forms, the router losses added to any objective, and DPO behind the
narrow StepContext computing what its loss functions compute."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from triax.config.compose import compose_config
from triax.data.targets import IGNORE_INDEX
from triax.errors import ConfigError
from triax.models import GPT, GPTConfig
from triax.models.lora import apply_lora, is_adapter
from triax.models.lora_config import LoRAConfig
from triax.objectives import StepContext
from triax.objectives.dpo.config import DPOConfig
from triax.objectives.dpo.loss import answer_logps, pair_losses
from triax.objectives.dpo.objective import DPOObjective
from triax.objectives.reference import Reference, kept_adapters, reference_for
from triax.objectives.registry import OBJECTIVES, added_terms, loss_coefficients, objective_for, sections

CPU = torch.device("cpu")


def tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.0))


def test_every_data_task_has_an_objective_and_a_section_applies_to_one_task():
    assert list(OBJECTIVES) == ["char", "tokens", "addition", "chat", "preference", "grpo"]
    assert sections() == {"dpo": "preference", "grpo": "grpo"}
    with pytest.raises(ConfigError, match=r"^data.task='nope' is invalid; use char, tokens, addition, chat, "
                                          r"preference or grpo$"):
        objective_for("nope")
    # The line of a run whose loss stopped being finite, as it read when the trainer named them.
    assert loss_coefficients() == "dpo.beta, the router's"


def test_the_config_checks_each_objectives_keys_through_the_registry(tmp_path):
    with pytest.raises(ConfigError, match="dpo.beta"):  # checked whatever the task, as before
        compose_config(["dpo.beta=0", f"trainer.run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="apply to data.task=grpo only"):
        compose_config(["grpo.num_generations=4", f"trainer.run_dir={tmp_path}"])


def test_only_a_mixture_of_experts_adds_router_losses():
    dense = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16)
    assert added_terms(dense) == []
    (term,) = added_terms(SimpleNamespace(num_experts=4))  # what the registry reads of a mixture's config
    assert [field.name for field in term.line_fields] == ["router_loss", "expert_share_min"]


def test_the_reference_as_read_is_put_in_place_and_the_trained_adapters_come_back():
    model = tiny_model()
    apply_lora(model, LoRAConfig(rank=2, targets=["q", "v"]))
    adapters = [parameter for name, parameter in model.named_parameters() if is_adapter(name)]
    with torch.no_grad():
        for parameter in adapters:
            parameter.fill_(0.5)
    reference = Reference(kept=kept_adapters(model))
    with torch.no_grad():
        for parameter in adapters:
            parameter.fill_(2.0)  # trained since
    with reference.switched():
        assert all(bool((parameter == 0.5).all()) for parameter in adapters)
    assert all(bool((parameter == 2.0).all()) for parameter in adapters)
    assert reference.module(model) is model
    frozen = tiny_model(1)
    assert Reference(model=frozen).module(model) is frozen


def test_the_run_decides_the_references_form():
    policy, frozen = tiny_model(0), tiny_model(1)
    apply_lora(policy, LoRAConfig(rank=2, targets=["q", "v"]))
    assert reference_for(LoRAConfig(rank=0), policy, lambda: frozen).model is frozen  # full fine-tuning
    unbuilt = lambda: pytest.fail("with LoRA no second model is built")  # noqa: E731
    kept = reference_for(LoRAConfig(rank=2, init_from="adapters"), policy, unbuilt)
    assert kept.model is None and len(kept.kept) == 4  # lora_A and lora_B of q and v in its one block
    assert reference_for(LoRAConfig(rank=2), policy, unbuilt).kept is None  # new adapters: the base, adapters off


def test_dpo_on_the_step_context_is_its_pair_losses_against_the_reference():
    policy, frozen = tiny_model(0), tiny_model(1)
    config = DPOConfig(beta=0.2)
    objective = DPOObjective(config)
    objective.use_reference(Reference(model=frozen))
    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(3))
    y[:, :3] = IGNORE_INDEX  # the prompt's targets are not scored
    context = StepContext(CPU, contextlib.nullcontext, lambda model, ids: model(ids), grad_accum=2,
                          data_parallel_size=1, data_parallel_rank=0, seed=0)
    scaled, logged = objective.loss(context, policy, (x, y, None))
    with torch.no_grad():
        expected, stats = pair_losses(config, answer_logps(policy(x), y), answer_logps(frozen(x), y),
                                      (y != IGNORE_INDEX).sum(dim=1))
    assert torch.equal(logged.detach(), expected.mean()) and torch.equal(scaled.detach(), expected.mean() / 2)
    figures = objective.take_figures()
    assert figures["rewards/accuracies"] == round(float(stats[:, 2].mean()), 6)
