"""How a training attempt runs: once, plainly, or again and again inside the in-process restart wrapper.

Both runners take the attempt as ``body(ctx, checkpointer, hooks) -> summary`` (the trainer passes
:func:`nvrx_lab.train.train`), so they know nothing of training itself:

* :func:`run_plain` — under torchrun or ``nvrx_lab.launcher``: whatever fails ends this process (the
  launcher may start a new one);
* :func:`run_inprocess` — inside :class:`nvrx_lab.inprocess.Wrapper`: a fault anywhere interrupts every
  rank, the group is torn down and ``body`` is re-entered in the same processes, resuming from the
  newest checkpoint. :class:`AttemptHooks` are the wrapper's side of the hooks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from nvrx_lab.dist import DistContext, env_rank, init_distributed, join_group_threads, pick_device, shutdown
from nvrx_lab.observe.events import EventLog
from nvrx_lab.train import layers
from nvrx_lab.train.config import TrainConfig
from nvrx_lab.train.hooks import ComposeHooks, Hooks
from nvrx_lab.train.resume import Recovering

Body = Callable[[DistContext, object, Hooks], dict]


def run_plain(cfg: TrainConfig, events: EventLog, hooks: Hooks, body: Body) -> dict:
    """One attempt; the process group and checkpointer live as long as it does."""
    ctx = init_distributed(cfg.device, cfg.pg_timeout)
    ctx.first_start = layers.launcher_restart_count() == 0
    ctx.recovering = layers.launcher_recovering()
    checkpointer = layers.make_checkpointer(cfg, ctx, events)
    clean = False
    try:
        hooks.start()
        summary = body(ctx, checkpointer, hooks)
        clean = True
        return summary
    finally:
        hooks.close()  # first: shutting down the writer is no reason to be declared hung
        if checkpointer is not None:  # a failed or interrupted run abandons its save in flight
            checkpointer.close() if clean else checkpointer.abandon()
            checkpointer = None  # it holds the group, whose threads shutdown joins
        shutdown(ctx, clean)


class AttemptHooks(Hooks):
    """The in-process wrapper's side: checkpoint I/O is atomic (a restart waits for it to end), every
    move of the attempt is progress (the soft timeout counts from the last), a reload is recorded."""

    def __init__(self, call_wrapper):
        self.cw = call_wrapper

    def section(self, name: str):
        return self.cw.atomic()

    def progress(self) -> None:
        self.cw.ping()

    def on_resume(self, load_s: float) -> None:
        self.cw.record("reload_s", load_s)


def run_inprocess(cfg: TrainConfig, events: EventLog, hooks: Hooks, body: Body) -> dict:
    """Attempts inside :class:`nvrx_lab.inprocess.Wrapper` until one finishes or the wrapper gives up.

    The process group comes from the wrapper (its sockets are what an abort cuts); rank and world size
    come from the wrapper too, since they change when a rank is lost. On GPUs one group serves both
    devices (``cpu:gloo,cuda:nccl``), so the abort reaches the CPU-side collectives as well. The
    checkpointer outlives attempts: one writer process, rebound to each new group."""
    from nvrx_lab.inprocess import CallWrapper, Compose, Wrapper, default_health_check

    _, _, local_rank = env_rank()
    device = pick_device(cfg.device, local_rank)
    persistent: dict = {}
    # a poisoned CUDA context leaves instead of retrying; so does a persistent straggler (--straggler-action restart)
    checks = [c for c in (default_health_check(device), *layers.health_checks(hooks)) if c is not None]

    @Wrapper(soft_timeout=cfg.soft_timeout, hard_timeout=cfg.hard_timeout, max_iterations=cfg.max_iterations,
             min_world_size=cfg.min_world_size, pg_timeout=cfg.pg_timeout, emit=events.emit,
             health_check=Compose(*checks) if checks else None)
    def attempt(cw: CallWrapper) -> dict:
        if device.type == "cuda":
            cw.init_process_group(backend="cpu:gloo,cuda:nccl", device_id=device)
        else:
            cw.init_process_group(backend="gloo")
        cw.ping()  # joining the group is progress: the soft timeout counts from here
        restart = cw.last_restart
        ctx = DistContext(cw.rank, cw.world_size, local_rank, device, dist.group.WORLD,
                          first_start=restart is None and layers.launcher_restart_count() == 0,
                          recovering=None if restart is None or restart.t_fault is None else
                          Recovering(restart.t_fault, restart.fault_rank, restart.cause))
        if "ckpt" not in persistent:
            persistent["ckpt"] = layers.make_checkpointer(cfg, ctx, events)
        elif persistent["ckpt"] is not None:
            persistent["ckpt"].rebind(ctx.cpu_group)
        hooks.start()
        summary = body(ctx, persistent["ckpt"], ComposeHooks(AttemptHooks(cw), hooks))  # atomic outermost
        cw.ping()
        return summary

    clean = False
    try:
        summary = attempt()
        clean = True
        return summary
    finally:
        hooks.close()
        if (ckpt := persistent.pop("ckpt", None)) is not None:
            if not clean and getattr(ckpt, "local", None):  # the wrapper gave up: a launcher may restart us
                ckpt.local.close(keep=True)
            ckpt.close()
            del ckpt  # it held the last attempt's group: now its threads can be joined
        if clean:
            join_group_threads()
