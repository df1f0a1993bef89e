"""Which layouts a mixture of experts (and Qwen3's q/k norms) composes with today, checked before
any process group forms.

Data parallelism (replicated or fully sharded: FSDP shards the batched expert tensors along the
expert dimension like any other parameter) composes as for a dense model. Refused, one line each:
- tensor parallelism together with expert parallelism: tensor parallelism runs a routed MLP whole
  on every tensor-parallel rank (triax/models/moe/parallel.py), and the expert-parallel exchange is
  not built to run inside it; nothing tests the pair.
- tensor parallelism with activation checkpointing: recomputed, the routed MLP run whole gives the
  router's loss other gradients than one process's (measured), not yet understood.
- the router's losses under pipeline parallelism: the schedule computes the loss from the last
  stage's logits only, without the router logits of every stage.
- context parallelism of routed layers: the balancing loss and the bias update see one rank's
  slice of each sequence (and expert parallelism's exchange is not built over the cp ranks), so the
  run would not equal one process; nothing tests it yet.
"""

from __future__ import annotations

from triax.errors import ConfigError
from triax.models.config import GPTConfig
from triax.parallel.mesh import Layout


def check_layout(model_config: GPTConfig, layout: Layout, checkpointing: str = "none") -> None:
    """The refusals above (expert parallelism's own rules are the layout's: triax.parallel.mesh);
    `checkpointing`: parallel.activation_checkpointing."""
    if layout.tp > 1 and checkpointing != "none" and model_config.num_experts:
        raise ConfigError(f"parallel.tp={layout.tp} with parallel.activation_checkpointing={checkpointing} "
                          f"(model.arch={model_config.arch}): a routed MLP recomputed under tensor parallelism does "
                          "not give one process's gradients yet; use parallel.activation_checkpointing=none")
    if layout.tp > 1 and layout.ep > 1 and model_config.num_experts:
        raise ConfigError(f"parallel.tp={layout.tp} with parallel.ep={layout.ep} (model.arch={model_config.arch}): "
                          "tensor and expert parallelism together are not supported; set one of them to 1")
    if layout.cp > 1 and model_config.num_experts:
        raise ConfigError(f"parallel.cp={layout.cp} with model.arch={model_config.arch}: context parallelism of "
                          "mixture-of-experts layers is not supported; use parallel.cp=1")
    if layout.pp > 1 and model_config.router_bias_update_rate:
        raise ConfigError(f"parallel.pp={layout.pp} with model.router_bias_update_rate="
                          f"{model_config.router_bias_update_rate}: each stage holds other layers, whose loads "
                          "cannot be summed over all ranks; set it to 0 or use parallel.pp=1")
    if layout.pp > 1 and (model_config.router_aux_loss_coef or model_config.router_z_loss_coef):
        raise ConfigError(f"parallel.pp={layout.pp} with model.router_aux_loss_coef="
                          f"{model_config.router_aux_loss_coef} / router_z_loss_coef="
                          f"{model_config.router_z_loss_coef}: "
                          "the pipeline's loss does not see the router logits; set both to 0 or use parallel.pp=1")

