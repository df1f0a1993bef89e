"""Skip connections across the partitions of a `Pipe` (FairScale's `fairscale.nn.pipe.skip`).

`from triax.pipe.skip import skippable, stash, pop, Namespace, verify_skippables` replaces
`from fairscale.nn.pipe.skip import ...`; see skippable.py for how a layer stashes and pops.
"""

from triax.pipe.skip.namespace import Namespace
from triax.pipe.skip.skippable import pop, skippable, stash, verify_skippables

__all__ = ["skippable", "stash", "pop", "verify_skippables", "Namespace"]
