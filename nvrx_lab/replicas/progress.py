"""How far a rank's step has got, as the device vouches: the evidence that tells a hung member from a slow one.

Every leaf module's forward, the backward through its output and every optimizer step is a *unit* of work. When a
unit completes, the rank's counter advances: on the CPU as the call returns; on a GPU when a CUDA event recorded
after the unit's kernels has completed (a watcher thread queries the pending events every ``WATCH_S``), so a
host thread that races ahead of a stuck GPU, or busy-waits in a synchronize, vouches for nothing. A rank inside
:meth:`Progress.working` (its step's compute, heal and update) with no unit completed for ``hang_after_s`` hangs,
whatever its threads do with the CPU; one whose counter moves is slow at worst, and is waited for.

``hang_after_s`` is the rank's own: ``--replica-hang-timeout`` when set, else ``GAP_MARGIN`` times the longest gap
between two units it has shown in a step that finished, at least ``HANG_FLOOR_S`` (a member suddenly ``k`` times
slower is still seen to move while its units take less than that). Outside :meth:`working` (waiting for a quorum
or in the cross-replica reduction) a rank is waiting, not computing: the reduction's own deadline covers it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque

import torch
from torch.utils.hooks import RemovableHandle

HANG_FLOOR_S = 3.0
"""The least a rank goes without a completed unit before it is called hung (a loaded 2-core box deschedules a
healthy process for a second at times; on p5 a unit is a layer's kernels, milliseconds)."""
GAP_MARGIN = 10.0
"""Times the longest gap between two units of a finished step that a rank may go without one."""
WATCH_S = 0.005
"""How often the GPU watcher looks at the pending events."""


class Progress:
    """One rank's unit counter (see the module docs). ``report()`` is read from the client's reader thread."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 device: torch.device | str = "cpu", hang_timeout: float = 0.0):
        self.device = torch.device(device)
        self.hang_timeout = hang_timeout
        self.ticks = 0
        self.last = time.monotonic()
        self.longest = 0.0  # the longest gap between two units of a step that finished
        self._gap = 0.0  # the longest gap of the step in progress
        self._working = False
        self._lock = threading.Lock()
        self._pending: deque = deque()  # CUDA events of units not completed yet
        self._handles: list[RemovableHandle] = []
        self._stop = threading.Event()
        for module in model.modules():
            if not any(True for _ in module.children()):  # a leaf: its forward, then its backward
                self._handles.append(module.register_forward_hook(self._forward_done))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_post_hook(lambda *_: self.unit()))
        if self.device.type == "cuda":
            threading.Thread(target=self._watch, daemon=True, name="nvrx-replica-progress").start()

    def _forward_done(self, module, args, output) -> None:
        self.unit()
        if isinstance(output, torch.Tensor) and output.requires_grad and torch.is_grad_enabled():
            output.register_hook(self._backward_done)

    def _backward_done(self, grad):
        self.unit()  # the gradient with respect to this leaf's output is computed: its backward comes next
        return None

    def unit(self) -> None:
        """A unit of work was issued: on the CPU it is done; on a GPU it is once its event completes."""
        if self.device.type != "cuda":
            self._tick()
            return
        event = torch.cuda.Event()
        event.record()
        with self._lock:
            self._pending.append(event)

    def _tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._working:
                self._gap = max(self._gap, now - self.last)
            self.ticks += 1
            self.last = now

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_S):  # a periodic look at the pending events until removed
            while True:
                with self._lock:
                    done = bool(self._pending) and self._pending[0].query()
                    if done:
                        self._pending.popleft()
                if not done:
                    break
                self._tick()

    @contextlib.contextmanager
    def working(self):
        """The step's own work (compute, heal, update): a gap here is judged; the step's longest gap is kept."""
        with self._lock:
            self._working, self._gap, self.last = True, 0.0, time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._working = False

    def step_finished(self) -> None:
        """The step reduced on every member: its longest gap is a healthy one."""
        self.longest = max(self.longest, self._gap)

    def hang_after_s(self) -> float:
        return self.hang_timeout or max(HANG_FLOOR_S, GAP_MARGIN * self.longest)

    def report(self) -> dict:
        """What the coordinator's probe gets: units so far, seconds since the last one, whether it computes, its limit."""
        with self._lock:
            return {"ticks": self.ticks, "idle_s": round(time.monotonic() - self.last, 4), "working": self._working,
                    "hang_after_s": round(self.hang_after_s(), 3)}

    def remove(self) -> None:
        self._stop.set()
        for handle in self._handles:
            handle.remove()
        self._handles = []
