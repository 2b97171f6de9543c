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

from nvrx_lab.checkpoint import CheckpointManager
from nvrx_lab.dist import DistContext, LaunchEnv, init_distributed, join_group_threads, pick_device, shutdown
from nvrx_lab.observe.events import EventLog
from nvrx_lab.train import layers
from nvrx_lab.train.config import TrainConfig
from nvrx_lab.train.hooks import Attempt, ComposeHooks, Hooks, Recovering
from nvrx_lab.train.launcher_hooks import launcher_recovering

Body = Callable[[Attempt, CheckpointManager | None, Hooks], dict]


def run_plain(cfg: TrainConfig, launch: LaunchEnv, events: EventLog, hooks: Hooks, body: Body) -> dict:
    """One attempt; the process group and checkpointer live as long as it does."""
    ctx = init_distributed(launch, cfg.device, cfg.pg_timeout)
    attempt = Attempt(ctx, events, first_start=launch.restart_count == 0, recovering=launcher_recovering(launch))
    checkpointer = layers.make_checkpointer(cfg, ctx, events)
    clean = False
    try:
        hooks.start(attempt)
        summary = body(attempt, checkpointer, hooks)
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

    def __init__(self, call_wrapper, count):
        self.cw, self.count = call_wrapper, count

    def section(self, name: str):
        return self.cw.atomic()

    def progress(self) -> None:
        self.cw.ping()

    def on_resume(self, load_s: float) -> None:
        self.cw.record("reload_s", load_s)

    def resumed(self, step: int) -> None:
        """Every rank resumed from the same ``step``, so every rank stops together or none does
        (:class:`~nvrx_lab.inprocess.progress.ProgressCount`; the wrapper ends the attempt as a finished one)."""
        self.count.resumed(step, restart=self.cw.iteration > 0)


def recovering(cw) -> Recovering | None:
    """What the wrapper saw of the fault that began this attempt (None in the first)."""
    restart = cw.last_restart
    return None if restart is None or restart.t_fault is None else Recovering(restart.t_fault, restart.fault_rank,
                                                                             restart.cause)


def inprocess_floor(min_world_size: int, launch: LaunchEnv) -> int:
    """The in-process wrapper's ``min_world_size`` under ``nvrx_lab.launcher``: a rank lost beyond what the launcher
    tolerates makes it restart the whole group, so the survivors leave at once instead of training a smaller world
    (whose steps, and local checkpoints taken at that size, the restart would throw away). Rank 0 says so once."""
    if launch.launcher_tolerates is None:
        return min_world_size
    floor = max(min_world_size, launch.world_size - launch.launcher_tolerates)
    if floor > min_world_size and launch.rank == 0 and launch.restart_count == 0:
        print(f"[nvrx_lab] in-process restart goes on with at least {floor} of {launch.world_size} ranks: the launcher "
              f"restarts the group when more than {launch.launcher_tolerates} worker(s) of a node are lost "
              "(--restart-policy min-healthy --min-healthy sets that)", flush=True)
    return floor


def run_inprocess(cfg: TrainConfig, launch: LaunchEnv, events: EventLog, hooks: Hooks, body: Body) -> dict:
    """Attempts inside :class:`nvrx_lab.inprocess.Wrapper` until one finishes or the wrapper gives up.

    The process group comes from the wrapper (its sockets are what an abort cuts); rank and world size
    come from the wrapper too, since they change when a rank is lost. On GPUs one group serves both
    devices (``cpu:gloo,cuda:nccl``), so the abort reaches the CPU-side collectives as well. The
    checkpointer outlives attempts: one writer process, rebound to each new group. The layers' health checks
    are hooks (a persistent straggler's); a poisoned CUDA context's comes with the wrapper's default."""
    from nvrx_lab.inprocess import CallWrapper, Compose, NoProgress, ProgressCount, Wrapper, default_health_check

    device = pick_device(cfg.device, launch.local_rank)
    persistent: dict = {}
    count = ProgressCount(cfg.restart.max_no_progress_cycles)  # across this process's attempts
    checks = [c for c in (default_health_check(device), hooks.health_check) if c is not None]
    r = cfg.restart

    @Wrapper(soft_timeout=r.soft_timeout, hard_timeout=r.hard_timeout, max_iterations=r.max_iterations,
             min_world_size=inprocess_floor(r.min_world_size, launch), pg_timeout=cfg.pg_timeout, emit=events.emit,
             health_check=Compose(*checks))
    def attempt(cw: CallWrapper) -> dict:
        if device.type == "cuda":
            cw.init_process_group(backend="cpu:gloo,cuda:nccl", device_id=device)
        else:
            cw.init_process_group(backend="gloo")
        cw.ping()  # joining the group is progress: the soft timeout counts from here
        ctx = DistContext(cw.rank, cw.world_size, launch.local_rank, device, dist.group.WORLD, launch)
        now = Attempt(ctx, events, cw.iteration, first_start=cw.last_restart is None and launch.restart_count == 0,
                      recovering=recovering(cw))
        if "ckpt" not in persistent:
            persistent["ckpt"] = layers.make_checkpointer(cfg, ctx, events)
        elif persistent["ckpt"] is not None:
            persistent["ckpt"].rebind(ctx.cpu_group)
        hooks.start(now)
        summary = body(now, persistent["ckpt"], ComposeHooks(AttemptHooks(cw, count), hooks))  # atomic outermost
        cw.ping()
        return summary

    clean = False
    try:
        summary = attempt()
        clean = True
        return summary
    except NoProgress:
        clean = True  # every rank stopped together, its group drained: closed as after a finished run
        raise
    finally:
        hooks.close()
        if (ckpt := persistent.pop("ckpt", None)) is not None:
            if clean:
                ckpt.close()
            else:  # the wrapper gave up and the group is gone (its store too, when the launcher restarts the workers):
                ckpt.abandon()  # stop at once, keeping the node's copies for the restarted group; never raise over why
            del ckpt  # it held the last attempt's group: now its threads can be joined
        if clean:
            join_group_threads()
