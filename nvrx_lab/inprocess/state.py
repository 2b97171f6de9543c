"""What the policies see: a frozen snapshot of the wrapper's state."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class State:
    """Read-only view handed to abort, health-check and rank-assignment policies."""

    initial_rank: int
    """This process's rank when the job started (``RANK``); it never changes."""
    initial_world_size: int
    """``WORLD_SIZE`` when the job started."""
    iteration: int = 0
    """Index of the current attempt (0 for the first call, +1 per restart)."""
    rank: int | None = None
    """Rank in the current attempt; ``None`` while this process is a spare."""
    world_size: int = 0
    """Number of active ranks in the current attempt."""
    members: tuple[int, ...] = ()
    """Initial ranks of every live process (active and spare) in the current attempt."""
    assignment: dict = field(default_factory=dict)
    """``{initial_rank: rank or None}`` for every member; ``None`` marks a spare."""
    fn_exception: BaseException | None = None
    """The exception that ended the previous attempt on this rank, if any."""

    def replace(self, **changes) -> State:
        return dataclasses.replace(self, **changes)
