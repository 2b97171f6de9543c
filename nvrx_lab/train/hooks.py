"""The trainer's one extension point: :class:`Hooks`, the moments of a training attempt a layer may join.

:func:`nvrx_lab.train.train` takes one ``Hooks`` object and calls it at each moment; every method does
nothing by default, and a layer overrides the few it needs. :class:`ComposeHooks` fans one call out to
several layers' hooks, in order — as ``Compose`` does for the in-process restart policies::

    hooks = ComposeHooks(AttemptHooks(call_wrapper), LauncherHooks(), FaultHooks(injector))
    train(cfg, attempt, checkpointer, hooks)

The moments, in the order an attempt meets them::

    start(attempt)               the process group exists (re-entered on each in-process attempt): the
                                 :class:`Attempt` says which ranks, groups, device, event log, which restart
    progress()                   the attempt moved on: model built, state loaded, a step done, waiting well
    section(name)                a context around checkpoint I/O: "checkpoint_load", "checkpoint",
                                 "checkpoint_commit" (the per-step commit poll), "checkpoint_local" (a
                                 local snapshot), "checkpoint_finalize"
    during(phase, step)          inside that I/O: "load" once read, "save" once handed over
    on_resume(load_s)            a checkpoint was loaded
    resumed(step)                the attempt starts at this step (0: nothing committed), checkpoints on
    before_step(step)            ...the step runs...   after_step(step), then its save if one is due
    after_save()                 a save was handed over
    health_check(state)          an in-process restart is under way: raise to make this rank leave the job
    close()                      the run is over (after the last attempt)

A hook with a ``name`` keeps state in the checkpoint under that key (``state_dict``/``load_state_dict``),
e.g. the launcher's heartbeat timeouts. The layers' hooks are built in :mod:`nvrx_lab.train.layers`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nvrx_lab.dist import DistContext
from nvrx_lab.observe.events import EventLog


@dataclass(frozen=True)
class Recovering:
    """The fault a restart layer saw before this attempt: its moment (wall clock), rank and cause."""

    t: float
    rank: int
    cause: str


@dataclass
class Attempt:
    """One training attempt, as the layers' hooks see it (:meth:`Hooks.start`): where it runs, where it reports,
    and what it recovers from."""

    dist: DistContext
    events: EventLog
    iteration: int = 0
    """The in-process restart's attempt (0: the first of this process)."""
    first_start: bool = True
    """The first attempt of this launch (no launcher restart, no in-process restart before it)."""
    recovering: Recovering | None = None
    """What the restart layer saw of the fault this attempt recovers from."""

    rank = property(lambda self: self.dist.rank)
    world_size = property(lambda self: self.dist.world_size)
    device = property(lambda self: self.dist.device)

    @property
    def cpu_group(self) -> dist.ProcessGroup | None:
        """The gloo group for CPU-side collectives (the default group itself on CPU)."""
        return self.dist.cpu_group

    @property
    def on_cuda(self) -> bool:
        return self.dist.device.type == "cuda" and torch.cuda.is_available()


class Hooks:
    """Every moment of an attempt, doing nothing; subclass and override what a layer needs."""

    name: str = ""
    """Key of this hook's state in the checkpoint; empty: it keeps none."""

    def start(self, attempt: Attempt) -> None: ...
    def progress(self) -> None: ...
    def before_step(self, step: int) -> None: ...
    def after_step(self, step: int) -> None: ...
    def during(self, phase: str, step: int) -> None: ...
    def after_save(self) -> None: ...
    def on_resume(self, load_s: float) -> None: ...
    def resumed(self, step: int) -> None: ...
    def close(self) -> None: ...

    def health_check(self, state: Any) -> Any:
        """An in-process restart is under way (``state``: the wrapper's); raise to make this rank leave the job."""
        return state

    def section(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def state_dict(self) -> Any:
        return None

    def load_state_dict(self, state: Any) -> None: ...


class ComposeHooks(Hooks):
    """Several layers' hooks as one: each call goes to every hook in order; sections nest, the first
    outermost. ``close`` runs every hook's even when one raises (the first error is raised after)."""

    def __init__(self, *hooks: Hooks | None):
        self.hooks: list[Hooks] = []
        for hook in hooks:
            if isinstance(hook, ComposeHooks):
                self.hooks.extend(hook.hooks)
            elif hook is not None:
                self.hooks.append(hook)

    def _each(self, moment: str, *args) -> None:
        for hook in self.hooks:
            getattr(hook, moment)(*args)

    def start(self, attempt: Attempt) -> None: self._each("start", attempt)
    def progress(self) -> None: self._each("progress")
    def before_step(self, step: int) -> None: self._each("before_step", step)
    def after_step(self, step: int) -> None: self._each("after_step", step)
    def during(self, phase: str, step: int) -> None: self._each("during", phase, step)
    def after_save(self) -> None: self._each("after_save")
    def on_resume(self, load_s: float) -> None: self._each("on_resume", load_s)
    def resumed(self, step: int) -> None: self._each("resumed", step)

    def close(self) -> None:
        with contextlib.ExitStack() as stack:  # unwinds in reverse, each callback runs, the first error wins
            for hook in reversed(self.hooks):
                stack.callback(hook.close)

    def health_check(self, state: Any) -> Any:
        for hook in self.hooks:
            state = hook.health_check(state)
        return state

    @contextlib.contextmanager
    def section(self, name: str):
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(hook.section(name))
            yield

    def state_dict(self) -> dict:
        return {hook.name: hook.state_dict() for hook in self.hooks if hook.name}

    def load_state_dict(self, state: dict) -> None:
        for hook in self.hooks:
            if hook.name and state.get(hook.name) is not None:
                hook.load_state_dict(state[hook.name])
