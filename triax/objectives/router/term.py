"""What a mixture of experts adds to any objective: the router's losses in the loss
(triax/models/router_loss.py) and, on logged steps, the router loss and each expert's share of the
routed tokens beside the loss, with a warning when experts stop receiving tokens (a collapsed
router trains a fraction of the model it holds)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from triax.models.config import GPTConfig
from triax.models.experts import update_expert_bias
from triax.models.router_loss import collapsed, expert_shares, router_loss
from triax.tracking.line_fields import LineField

# On the step line: the router's losses and the least-loaded expert's share of the routed tokens
# (1 / num_experts when balanced; near 0 when the router starves an expert).
LINE_FIELDS = (LineField("router_loss", ".4f"), LineField("expert_share_min", ".3f"))


class RouterLoss:
    """The router's losses of a mixture of experts (model.num_experts > 0), a term added to the loss
    of every micro-batch, and its figures."""

    line_fields = LINE_FIELDS

    def __init__(self, model_config: GPTConfig):
        self.model_config = model_config
        self.last: torch.Tensor | None = None  # the term of the last forward, for the record

    def loss(self, model: torch.nn.Module) -> torch.Tensor | None:
        """router_aux_loss_coef x load balancing + router_z_loss_coef x z-loss of the last forward
        (None for both coefficients 0)."""
        config = self.model_config
        self.last = router_loss(model, config.router_aux_loss_coef, config.router_z_loss_coef)
        return self.last

    def after_step(self, model: torch.nn.Module) -> None:
        """After the optimizer step: the per-expert selection biases move toward an even load, by the
        load summed over every rank (the same update everywhere). Tensor-parallel peers each count the
        same whole batch (their routed MLPs run whole), so the sum holds every load tp times: a common
        factor, which the update's sign (load against the mean) does not see."""
        if not self.model_config.router_bias_update_rate:
            return
        reduce = dist.all_reduce if dist.is_available() and dist.is_initialized() else None
        update_expert_bias(model, self.model_config.router_bias_update_rate, reduce)

    def record(self, model: torch.nn.Module) -> tuple[dict, str | None]:
        """({router_loss, expert_share, expert_share_min} of the last step, a warning if experts
        collapsed) for the log. expert_share_min is a number of its own: TensorBoard and the trackers
        plot numbers, not the list."""
        shares = expert_shares(model)
        if not shares:
            return {}, None
        fields = {"expert_share": [round(share, 4) for share in shares], "expert_share_min": round(min(shares), 4)}
        if self.last is not None:
            fields["router_loss"] = round(float(self.last.detach()), 6)
        dead = collapsed(shares)
        warning = None
        if dead:
            warning = (f"triax: warning: experts {dead} received under a tenth of an even share of the tokens this "
                       "step (router collapse); raise model.router_aux_loss_coef (transformers uses 0.001-0.02)")
        return fields, warning

