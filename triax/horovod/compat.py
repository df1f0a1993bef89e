"""torch.distributed names that changed between the torch versions triax supports (>= 2.6)."""

import torch.distributed as dist

# torch 2.13 renamed the *_into_tensor / *_tensor forms to *_single and deprecated the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
