"""A slow rank on demand: what the ``slow:FACTOR`` fault (:mod:`nvrx_lab.faults`) does to a rank.

From the moment :func:`slow_down` is called this process computes ``FACTOR``× slower, for good (a
throttled GPU stays throttled; an in-process restart keeps it, a new process does not). It works
through torch's process-wide hooks, so no training code changes: before each leaf module's forward
and each ``optimizer.step()`` the rank busy-waits ``FACTOR - 1`` times what that call took last
time, and before the backward of a leaf's output twice that (backward costs about two forwards).
A busy wait on this thread's CPU time, not a sleep: it occupies the core as slower compute would,
microsecond-accurate, and measured in the same CPU time as the compute (with one intra-op thread;
with more, the other threads' share is not stretched). On GPUs the wait delays the kernel launches
(the host side), not the kernels. With ``sleep=True`` (the ``slow_sleep`` fault) the rank sleeps the
same time instead: slow, with its thread idle, as a host thread waiting on a slow GPU is.
"""

from __future__ import annotations

import time

import torch
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module


def spin(seconds: float) -> None:
    """Busy-wait until this thread has used ``seconds`` more CPU time (a slower core: time descheduled
    by other processes stretches it, as it would real compute)."""
    deadline = time.thread_time() + seconds
    while time.thread_time() < deadline:
        pass


class Slowdown:
    """Process-wide hooks that stretch every leaf forward, its backward and every optimizer step."""

    def __init__(self, factor: float, sleep: bool = False):
        if factor <= 1.0:
            raise ValueError(f"slowdown factor must be > 1, got {factor}")
        self.extra = factor - 1.0
        self.wait = time.sleep if sleep else spin
        self.last: dict[int, float] = {}
        self.started: dict[int, float] = {}
        self.handles = [nn_module.register_module_forward_pre_hook(self._pre),
                        nn_module.register_module_forward_hook(self._post),
                        optim_module.register_optimizer_step_pre_hook(lambda opt, a, k: self._pre(opt, a)),
                        optim_module.register_optimizer_step_post_hook(lambda opt, a, k: self._post(opt, a, None))]

    def _pre(self, owner, args) -> None:
        if isinstance(owner, torch.nn.Module) and owner._modules:
            return
        self.wait(self.extra * self.last.get(id(owner), 0.0))
        self.started[id(owner)] = time.thread_time()

    def _post(self, owner, args, output) -> None:
        t0 = self.started.pop(id(owner), None)
        if t0 is None:
            return
        took = self.last[id(owner)] = time.thread_time() - t0
        if isinstance(output, torch.Tensor) and output.requires_grad and torch.is_grad_enabled():
            wait = 2.0 * self.extra * took
            output.register_hook(lambda grad: self.wait(wait))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


_active: list[Slowdown] = []


def slow_down(factor: float, sleep: bool = False) -> Slowdown:
    """Make this process ``factor``× slower from now on (a second call replaces the first); ``sleep``: idle, not busy."""
    restore()
    _active.append(Slowdown(factor, sleep))
    return _active[-1]


def restore() -> None:
    """Undo :func:`slow_down` (tests, notebooks)."""
    while _active:
        _active.pop().remove()
