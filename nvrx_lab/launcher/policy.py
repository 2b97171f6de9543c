"""Restart policies: given how many local workers are still healthy, restart the group or not?

A policy is a small callable ``policy(healthy, total) -> bool`` (True: stop everything and restart).

* ``any-failed`` (torchrun's behaviour): any lost worker restarts the whole group.
* ``min-healthy`` (for use with the in-process wrapper, :mod:`nvrx_lab.inprocess`): the launcher
  only removes what kills or freezes a process — a hung worker is stopped, a dead one left dead —
  and the surviving ranks carry on, re-forming their group in-process; the launcher restarts the
  group only when fewer than ``min_workers`` local workers remain. Exceptions never reach the
  launcher: the in-process wrapper handles them inside the process.

Whatever the policy, a worker that exits with :data:`~nvrx_lab.exit_codes.USAGE_ERROR` (2) stops the job at once: a bad flag
fails the same way on every attempt, so restarting would only repeat the error message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

RestartPolicy = Callable[[int, int], bool]

TOLERATES_ENV = "NVRX_LAB_LAUNCHER_TOLERATES"
"""Set in each worker's environment: how many of the node's workers the launcher lets go without restarting the
group (``any-failed``: 0). In-process restart keeps at least ``world_size - tolerated`` ranks: a smaller world
would be trained only for the launcher to restart the group and throw it away."""



def any_failed(healthy: int, total: int) -> bool:
    """Restart as soon as one worker is lost."""
    return healthy < total


@dataclass
class MinHealthy:
    """Restart only when fewer than ``min_workers`` local workers are healthy."""

    min_workers: int
    """Smallest number of live local workers the job can continue with (>= 1)."""

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ValueError(f"min_healthy must be >= 1, got {self.min_workers}")

    def __call__(self, healthy: int, total: int) -> bool:
        return healthy < self.min_workers


def make_policy(name: str, nproc_per_node: int, min_healthy: int | None) -> RestartPolicy:
    if name == "any-failed":
        return any_failed
    if name == "min-healthy":
        n = nproc_per_node if min_healthy is None else min_healthy
        if n > nproc_per_node:
            raise ValueError(f"min_healthy={n} exceeds --nproc-per-node={nproc_per_node}")
        return MinHealthy(n)
    raise ValueError(f"restart_policy must be 'any-failed' or 'min-healthy', got {name!r}")


def tolerated_losses(policy: RestartPolicy, nproc_per_node: int) -> int:
    """Local workers ``policy`` lets go before it restarts the group."""
    return next((lost for lost in range(nproc_per_node + 1) if policy(nproc_per_node - lost - 1, nproc_per_node)),
                nproc_per_node)
