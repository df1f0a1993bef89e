"""Namespaces let one skip name be used by several stash/pop pairs in one model.

    ns1, ns2 = Namespace(), Namespace()
    model = nn.Sequential(Down().isolate(ns1), Down().isolate(ns2), Up().isolate(ns2), Up().isolate(ns1))

A skip is known by (namespace, name); `None` is the namespace of every skip not isolated.
"""

from __future__ import annotations

import abc
import functools
import uuid


@functools.total_ordering
class Namespace(metaclass=abc.ABCMeta):
    """A fresh namespace, equal only to itself and its copies."""

    __slots__ = ("id",)

    def __init__(self):
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace '{self.id}'>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and other is not None and self.id == other.id

    def __lt__(self, other: object) -> bool:
        # Any fixed order will do (skips are sorted for a stable copy order); the ids are random.
        return isinstance(other, Namespace) and other is not None and self.id < other.id


# As in FairScale, the default namespace None is a Namespace: isinstance(None, Namespace) is True.
Namespace.register(type(None))
