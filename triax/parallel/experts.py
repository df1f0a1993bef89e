"""Which layouts a mixture of experts (and Qwen3's q/k norms) composes with today, checked before
any process group forms.

Data parallelism (replicated or fully sharded: FSDP shards the batched expert tensors along the
expert dimension like any other parameter) composes as for a dense model. Refused, one line each:
- tensor parallelism of routed layers: the tensor-parallel plan splits Linear layers by heads and
  widths; the experts are batched parameters it has no plan for.
- tensor parallelism with q/k norms: the norm's gain would see only this rank's heads, so its
  gradient would need a reduction over the tensor-parallel ranks the plan does not make.
- the router's losses under pipeline parallelism: the schedule computes the loss from the last
  stage's logits only, without the router logits of every stage.
"""

from __future__ import annotations

from triax.errors import ConfigError


def check_layout(model_config, layout) -> None:
    if layout.tp > 1 and model_config.num_experts:
        raise ConfigError(f"parallel.tp={layout.tp} with model.arch={model_config.arch}: tensor parallelism of "
                          "mixture-of-experts layers is not supported; use parallel.dp_shard (FSDP shards the experts)")
    if layout.tp > 1 and model_config.qk_norm:
        raise ConfigError(f"parallel.tp={layout.tp} with model.qk_norm=true (model.arch={model_config.arch}): tensor "
                          "parallelism of per-head q/k norms is not supported; use parallel.dp_shard")
    if layout.pp > 1 and (model_config.router_aux_loss_coef or model_config.router_z_loss_coef):
        raise ConfigError(f"parallel.pp={layout.pp} with model.router_aux_loss_coef="
                          f"{model_config.router_aux_loss_coef} / router_z_loss_coef={model_config.router_z_loss_coef}: "
                          "the pipeline's loss does not see the router logits; set both to 0 or use parallel.pp=1")
