"""Health checks: run on every rank after an abort, before it rejoins
=====================================================================

``check(state)`` returns the state or raises; a rank whose check raises leaves the job (it does
not rejoin the rendezvous) and its peers restart without it if ``min_world_size`` allows.
Small callables, combined with :class:`~.compose.Compose`.
"""

from __future__ import annotations

import abc
import collections

import torch

from .state import State


class HealthCheckError(RuntimeError):
    """A rank failed its health check and leaves the job."""


class HealthCheck(abc.ABC):
    @abc.abstractmethod
    def __call__(self, state: State) -> State: ...


class CudaHealthCheck(HealthCheck):
    """Synchronises the current CUDA device (a sticky CUDA error surfaces here); no-op on CPU."""

    def __call__(self, state: State) -> State:
        if torch.cuda.is_available():
            try:
                torch.cuda.synchronize()
            except Exception as e:
                raise HealthCheckError(f"CUDA device unhealthy on rank {state.initial_rank}: {e}") from e
        return state


class FaultCounter(HealthCheck):
    """A rank that caused more than ``max_faults`` restarts with its own exception leaves.

    (``state.fn_exception`` is set only on the rank whose exception was the restart's cause.)"""

    def __init__(self, max_faults: int = 3):
        if max_faults < 0:
            raise ValueError(f"FaultCounter.max_faults must be >= 0, got {max_faults}")
        self.max_faults = max_faults
        self.counts: collections.Counter = collections.Counter()

    def __call__(self, state: State) -> State:
        if isinstance(state.fn_exception, Exception):
            self.counts[state.initial_rank] += 1
            if self.counts[state.initial_rank] > self.max_faults:
                raise HealthCheckError(
                    f"rank {state.initial_rank} raised {self.counts[state.initial_rank]} times "
                    f"(FaultCounter.max_faults={self.max_faults})")
        return state
