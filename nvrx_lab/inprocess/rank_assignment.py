"""Rank assignment: who gets which rank after a restart
=====================================================

After a fault the live processes meet in the store; a rank-assignment policy maps their
*initial* ranks to the ranks of the next attempt. Every process computes the same answer from
the same inputs (the sorted survivors and the previous assignment), so no extra round trip.

* :class:`ShiftRanks` — survivors keep their order and close up: ``{0, 2, 3} -> {0, 1, 2}``.
  Every rank behind a hole changes, which suits data-parallel jobs that reshard anyway.
* :class:`FillGaps` — survivors keep their rank where possible; the highest ranks move into the
  holes: ``{0, 2, 3} -> 0->0, 2->2, 3->1``. Fewer ranks change (less state to move).

Both take ``spares``: the last ``spares`` processes of the first attempt wait idle and step in
when an active rank is lost, so the world size stays the same while spares last.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence


class RankAssignment(abc.ABC):
    """``assign(survivors, previous, initial_world_size) -> {initial_rank: rank or None}``."""

    def __init__(self, spares: int = 0):
        if spares < 0:
            raise ValueError(f"spares must be >= 0, got {spares}")
        self.spares = spares
        """Processes kept idle (rank ``None``) to replace lost ranks."""

    def target_world_size(self, initial_world_size: int) -> int:
        if self.spares >= initial_world_size:
            raise ValueError(f"spares={self.spares} leaves no active rank of WORLD_SIZE={initial_world_size}")
        return initial_world_size - self.spares

    @abc.abstractmethod
    def __call__(self, survivors: Sequence[int], previous: dict[int, int | None],
                 initial_world_size: int) -> dict[int, int | None]: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}(spares={self.spares})"


def _order(survivors: Sequence[int], previous: dict[int, int | None]) -> list[int]:
    """Active ranks first in their rank order, then spares in initial-rank order."""
    big = 1 << 30
    return sorted(survivors, key=lambda r: (previous.get(r) if previous.get(r) is not None else big + r))


class ShiftRanks(RankAssignment):
    """Survivors, in their previous rank order, take ranks ``0..W-1``; the rest stay spares."""

    def __call__(self, survivors, previous, initial_world_size):
        target = self.target_world_size(initial_world_size)
        order = _order(survivors, previous)
        return {r: (i if i < target else None) for i, r in enumerate(order)}


class FillGaps(RankAssignment):
    """Survivors below the new world size keep their rank; holes get the highest-ranked others."""

    def __call__(self, survivors, previous, initial_world_size):
        target = self.target_world_size(initial_world_size)
        world = min(target, len(survivors))
        order = _order(survivors, previous)
        out: dict[int, int | None] = {}
        taken = set()
        for r in order:
            p = previous.get(r)
            if p is not None and p < world and p not in taken:
                out[r] = p
                taken.add(p)
        holes = [i for i in range(world) if i not in taken]
        # active ranks beyond the new size move first (highest first), then spares in order
        active_movers = [r for r in reversed(order) if r not in out and previous.get(r) is not None]
        spare_movers = [r for r in order if r not in out and previous.get(r) is None]
        for hole, r in zip(holes, active_movers + spare_movers, strict=False):
            out[r] = hole
        for r in order:
            out.setdefault(r, None)
        return out
