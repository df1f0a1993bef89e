"""Which skip tensors cross partitions, and so must be copied to another partition's device.

Worked out once from the partitions' layers when a `Pipe` is built: a skip whose stash and pop
sit in one partition stays in that micro-batch's tracker; one that crosses is copied by a portal
straight from the stash partition's device to the pop partition's, just before the pop partition
runs that micro-batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from triax.pipe.skip.skippable import Skippable

if TYPE_CHECKING:
    from triax.pipe.skip.namespace import Namespace


class SkipLayout:
    """The skip routes of a pipe: {(namespace, name): (stash partition, pop partition)}."""

    def __init__(self, num_partitions: int, skip_routes: dict):
        self.by_ns_name = dict(skip_routes)
        # For each pop partition, the skips to copy in, by stash partition (a stable order).
        self._copies_into: list[list[tuple]] = [[] for _ in range(num_partitions)]
        for (ns, name), (stash_partition, pop_partition) in skip_routes.items():
            if stash_partition != pop_partition:
                self._copies_into[pop_partition].append((stash_partition, ns, name))
        for routes in self._copies_into:
            routes.sort(key=lambda route: (route[0], route[2]))

    def copy_policy(self, partition: int) -> list[tuple]:
        """(stash partition, namespace, name) of each skip to copy into `partition` before it runs."""
        return list(self._copies_into[partition])

    def requires_copy(self, ns: Namespace, name: str) -> bool:
        """Whether the skip crosses partitions (a skip unknown to the layout does not: it is nested
        inside a layer, so it is stashed and popped in one partition)."""
        stash_partition, pop_partition = self.by_ns_name.get((ns, name), (-1, -1))
        return stash_partition != pop_partition


def inspect_skip_layout(partitions: list[nn.Sequential]) -> SkipLayout:
    """The layout of the skippable layers among the partitions' children (checked by verify_skippables)."""
    routes = {}
    stashed_in = {}
    for partition_index, partition in enumerate(partitions):
        for layer in partition.children():
            if not isinstance(layer, Skippable):
                continue
            for key in layer.stashable():
                stashed_in[key] = partition_index
            for key in layer.poppable():
                routes[key] = (stashed_in.pop(key), partition_index)
    return SkipLayout(len(partitions), routes)
