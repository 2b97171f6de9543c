"""Per-rank compute timing, without the time spent waiting in collectives
=======================================================================

In a synchronous step every rank waits for the slowest one, so the step time is the same on all ranks
and says nothing about *which* rank is slow. What differs is each rank's own compute. The
:class:`ComputeTimer` times it in sections, through torch's process-wide hooks, so that the training
loop needs no change:

* ``forward`` — the sum of the forward calls of *leaf* modules (``Linear``, ``RMSNorm``, ``Embedding``
  …). FSDP2 gathers a block's parameters in the block's own pre-forward hook, outside any leaf, so the
  all-gather wait is not counted; neither is the loss all-reduce;
* ``optimizer`` — ``optimizer.step()`` (a local update on sharded parameters: no collective).

On CPU each call is timed with the CPU time the process spent in it (``clock="cpu"``, the default:
``time.thread_time`` with one intra-op thread, ``time.process_time`` with more) or with
``time.perf_counter`` (``clock="wall"``). Wall time counts the moments a rank was descheduled by
other processes: on a shared CPU box (two busy loops, other jobs) that noise alone names ranks
wrongly, and every rank slowed alike is no straggler; CPU time does not count them. On a GPU the
kernels run later than the Python that launched them, so a pair of ``torch.cuda.Event`` is recorded
on the current stream around each call instead and resolved once per reporting interval (one
synchronize per interval, not per call).
Backward is not timed: FSDP2's gradient reduce-scatter runs between the leaves' backward kernels.
"""

from __future__ import annotations

import time

import torch
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module

SECTIONS = ("forward", "optimizer")
CLOCKS = ("cpu", "wall")


def _is_leaf(module: torch.nn.Module) -> bool:
    return not module._modules


class ComputeTimer:
    """Times this rank's compute sections per step; ``install()`` once, ``end_step()`` after each step.

    ``times()`` returns the steps ended since the last call, as ``{section: seconds}`` per step."""

    def __init__(self, device: torch.device | None = None, clock: str = "cpu"):
        if clock not in CLOCKS:
            raise ValueError(f"ComputeTimer clock {clock!r} is not one of {', '.join(CLOCKS)}")
        self.cuda = device is not None and device.type == "cuda"
        self.clock = clock
        self._now = time.perf_counter
        self._handles: list = []
        self._open: dict[int, object] = {}
        self._step: list[tuple[str, object, object]] = []
        self._steps: list[list[tuple[str, object, object]]] = []

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self) -> None:
        """Register the process-wide hooks (idempotent). Hooks registered later (e.g. a ``slow`` fault's)
        run inside this timer's window: its pre-hooks run first, its post-hooks before theirs."""
        if self._handles:
            return
        if self.clock == "wall":
            self._now = time.perf_counter
        else:  # the main thread's CPU time is cheaper and exact when it does all the compute
            self._now = time.thread_time if torch.get_num_threads() == 1 else time.process_time
        self._handles = [nn_module.register_module_forward_pre_hook(self._forward_pre),
                         nn_module.register_module_forward_hook(self._forward_post),
                         optim_module.register_optimizer_step_pre_hook(self._optim_pre),
                         optim_module.register_optimizer_step_post_hook(self._optim_post)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._open.clear()

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self._now()

    def _forward_pre(self, module, args) -> None:
        if _is_leaf(module):
            self._open[id(module)] = self._mark()

    def _forward_post(self, module, args, output) -> None:
        start = self._open.pop(id(module), None)
        if start is not None:
            self._step.append(("forward", start, self._mark()))

    def _optim_pre(self, optimizer, args, kwargs) -> None:
        self._open[id(optimizer)] = self._mark()

    def _optim_post(self, optimizer, args, kwargs) -> None:
        start = self._open.pop(id(optimizer), None)
        if start is not None:
            self._step.append(("optimizer", start, self._mark()))

    def end_step(self) -> None:
        """The step is over: what was timed since the last ``end_step`` is one step."""
        self._steps.append(self._step)
        self._step = []
        self._open.clear()

    def discard(self) -> None:
        """Forget what was timed (a new attempt starts)."""
        self._step, self._steps = [], []
        self._open.clear()

    def times(self) -> list[dict[str, float]]:
        """Seconds per section of each step ended since the last call, and their sum as ``compute``
        (on GPUs: synchronizes once)."""
        steps, self._steps = self._steps, []
        if self.cuda and steps and any(steps):
            last = next(pairs[-1][2] for pairs in reversed(steps) if pairs)
            last.synchronize()
        out = []
        for pairs in steps:
            totals = dict.fromkeys(SECTIONS, 0.0)
            for section, start, end in pairs:
                totals[section] += start.elapsed_time(end) / 1e3 if self.cuda else end - start
            totals["compute"] = sum(totals[s] for s in SECTIONS)
            out.append(totals)
        return out
