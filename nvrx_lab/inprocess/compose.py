"""``Compose(a, b, c)``: run small policies in order, each getting the state the previous returned.

Used for aborts and health checks, e.g. ``Compose(AbortTorchDistributed(), AbortCallback(cancel_writer))``
(:mod:`.abort`; ``cancel_writer(state)`` is any function of yours).
"""

from __future__ import annotations

from collections.abc import Callable

from .state import State


class Compose:
    """Calls ``policies`` left to right: ``state = p(state) or state``."""

    def __init__(self, *policies: Callable[[State], State | None]):
        for p in policies:
            if not callable(p):
                raise TypeError(f"Compose: {p!r} is not callable; pass policy instances such as ShiftRanks()")
        self.policies = policies

    def __call__(self, state: State) -> State:
        for p in self.policies:
            state = p(state) or state
        return state

    def __repr__(self) -> str:
        return f"Compose({', '.join(map(repr, self.policies))})"
