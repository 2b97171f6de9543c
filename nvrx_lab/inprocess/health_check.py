"""Health checks: run on every rank after an abort, before it rejoins
=====================================================================

``check(state)`` returns the state or raises; a rank whose check raises leaves the job (it does
not rejoin the rendezvous) and its peers restart without it if ``min_world_size`` allows.
Small callables, combined with :class:`~.compose.Compose`.
"""

from __future__ import annotations

import abc
import collections
import threading

import torch

from .state import State


class HealthCheckError(RuntimeError):
    """A rank failed its health check and leaves the job."""


class HealthCheck(abc.ABC):
    @abc.abstractmethod
    def __call__(self, state: State) -> State: ...


class CudaHealthCheck(HealthCheck):
    """Synchronises ``device`` (default: the current CUDA device): a sticky CUDA error (a
    device-side assert, an illegal address) surfaces here and the rank leaves, instead of failing
    every later attempt the same way. The synchronize runs in a thread and is given ``timeout``
    seconds: a kernel that never ends makes the check fail instead of hanging the restart. No-op
    without CUDA, or before this process has used it."""

    def __init__(self, device: torch.device | int | None = None, timeout: float = 30.0):
        self.device = device
        self.timeout = timeout

    def __call__(self, state: State) -> State:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return state
        # the current device is per thread: resolve it here, not in the helper thread
        device = self.device if self.device is not None else torch.cuda.current_device()
        outcome: list[BaseException | None] = []

        def sync():
            try:
                torch.cuda.synchronize(device)
                outcome.append(None)
            except BaseException as e:  # handed to the caller
                outcome.append(e)

        t = threading.Thread(target=sync, name="nvrx-cuda-health-check", daemon=True)
        t.start()
        t.join(self.timeout)
        where = f"rank {state.initial_rank}, device {device}"
        if not outcome:
            raise HealthCheckError(f"CUDA device unhealthy ({where}): synchronize did not return within "
                                   f"{self.timeout:g} s (a kernel that never ends)")
        if outcome[0] is not None:
            raise HealthCheckError(f"CUDA device unhealthy ({where}): {outcome[0]}") from outcome[0]
        return state

    def __repr__(self) -> str:
        return f"CudaHealthCheck(device={self.device!r}, timeout={self.timeout!r})"


def default_health_check(device: torch.device | str | None) -> HealthCheck | None:
    """The health check a trainer on ``device`` should pass to the Wrapper: :class:`CudaHealthCheck`
    on a CUDA device, ``None`` (no check) on the CPU."""
    if device is None:
        return None
    device = torch.device(device)
    return CudaHealthCheck(device) if device.type == "cuda" else None


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
