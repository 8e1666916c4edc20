"""Labels of ranks (hosts, sites, workers) as indices and as groups of ranks: the one numbering
the planner, the probe, host detection, DiLoCo's workers and the simulator share. Pure: no
imports beyond typing."""
from __future__ import annotations

from typing import Hashable, Sequence


def renumber(labels: Sequence[Hashable]) -> tuple[int, ...]:
    """Labels -> 0, 1, ... in order of first appearance, i.e. by lowest rank
    (``["b", "a", "b"]`` -> ``(0, 1, 0)``)."""
    index: dict[Hashable, int] = {}
    return tuple(index.setdefault(label, len(index)) for label in labels)


def ranks_by_label(labels: Sequence[Hashable]) -> list[list[int]]:
    """The ranks of each label, labels in order of first appearance (by lowest rank), ranks
    ascending (``["b", "a", "b"]`` -> ``[[0, 2], [1]]``)."""
    groups: dict[Hashable, list[int]] = {}
    for rank, label in enumerate(labels):
        groups.setdefault(label, []).append(rank)
    return list(groups.values())
