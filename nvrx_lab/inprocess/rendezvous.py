"""Rendezvous between attempts: the live ranks agree on the next attempt's members
====================================================================================

Rendezvous ``n`` expects the members of attempt ``n - 1`` (everyone for ``n = 0``). It is
*complete* once every expected rank has arrived or is known dead; whoever sees it complete
first decides: it applies the rank assignment policy to the survivors and proposes the result
with ``compare_set`` (the first proposal wins, every caller gets the winner). The policy is
deterministic, so it does not matter who decides — a rank that arrives, or the monitor process
that announces a death (the dead cannot arrive; its notice may be what completes the set)::

    rank      arrive (append + add: 2 ops) -> maybe complete? (1 op) -> decide? -> wait(members) -> get
    announcer dead/<r> (3 ops) -> try_decide(newest decided + 1)

A rank's cost per rendezvous is O(1) store operations: it reads the arrival list only when the
counters say the set may be complete (arrived + dead >= expected), and it waits for the decision
with one blocking ``wait`` instead of polling. At N ranks that is about 5 N operations in total
(``python -m nvrx_lab.bench scale``); the first version polled every rank's keys every 2 ms.
"""

from __future__ import annotations

from collections.abc import Callable

from .rank_assignment import RankAssignment
from .store import RestartStore


def previous_assignment(store: RestartStore, n: int, world_size: int) -> dict[int, int | None] | None:
    """The assignment of attempt ``n - 1`` (the identity before attempt 0); ``None`` if undecided."""
    if n == 0:
        return {r: r for r in range(world_size)}
    return store.decided_members(n - 1)


def try_decide(store: RestartStore, n: int, policy: RankAssignment, world_size: int,
               previous: dict[int, int | None] | None = None) -> dict[int, int | None] | None:
    """Decide rendezvous ``n`` if it is complete; returns the decided assignment (maybe someone else's), or
    ``None`` while an expected rank has neither arrived nor died."""
    if previous is None:
        previous = previous_assignment(store, n, world_size)
        if previous is None:
            return None
    expected = set(previous)
    dead = store.dead_ranks() & expected
    arrived = store.arrived(n) & expected
    if not (expected - dead) <= arrived:
        return None
    survivors = sorted(arrived - dead)
    assignment = policy(survivors, previous, world_size)
    return store.decide_members(n, assignment)


def join(store: RestartStore, n: int, me: int, previous: dict[int, int | None], policy: RankAssignment,
         world_size: int, wait: Callable[[str], None]) -> dict[int, int | None]:
    """Arrive at rendezvous ``n``, decide it if this arrival completes it, wait for the decision.

    ``wait(key)`` blocks until ``key`` exists (a store ``wait``; the wrapper waits in a thread of
    its own so the rank keeps reporting progress). Returns ``{initial rank: new rank or None}``;
    raises :class:`ExcludedError` if the decision left this rank out (it arrived too late)."""
    count = store.arrive(n, me)
    if count + store.ndead() >= len(previous):
        try_decide(store, n, policy, world_size, previous)
    wait(store.members_key(n))
    assignment = store.decided_members(n, known_to_exist=True)
    if me not in assignment:
        raise ExcludedError(f"rank {me} was excluded from attempt {n} (it arrived after the survivors "
                            f"{sorted(assignment)} were decided)")
    return assignment


def help_decide(store: RestartStore, policy: RankAssignment, world_size: int) -> dict | None:
    """After a death notice: complete the open rendezvous if the dead rank was the last one missing."""
    return try_decide(store, store.latest_decided() + 1, policy, world_size)


class ExcludedError(RuntimeError):
    """This rank is not among the decided members of an attempt."""
