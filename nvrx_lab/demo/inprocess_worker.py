"""A small training function under :class:`~nvrx_lab.inprocess.Wrapper` with a deterministic fault schedule.

Run by the tests, the reliability suite and notebook 02, always under a launcher that lets the
survivors run::

    python -m nvrx_lab.inprocess.spawn --nproc 2 -- python -m nvrx_lab.demo.inprocess_worker \
        --steps 20 --faults 1:0:5:exception --events /tmp/ev.jsonl --ckpt-dir /tmp/ck

Each step all-reduces a tensor over gloo and sleeps ``--step-time``; rank 0 saves the step
counter every ``--ckpt-every`` steps (atomically, inside ``call_wrapper.atomic()``) and every
attempt reloads it. Events (``step``, ``fault``, ``restart``, ``resources``, ``done``) go to
``--events``.

``--faults`` is a schedule in :mod:`nvrx_lab.faults`'s grammar, ``RANK:ATTEMPTS:STEP:KIND``, where
ATTEMPTS are the wrapper's iterations (``0``, ``0-2`` or ``*``; without them a fault fires once), e.g.
``1:0:5:exception,0:*:3:hang``. The kinds these demos use: exception, hang (time.sleep), hang_socket (a
blocked recv), hang_native (signals blocked: only the hard timeout ends it), sigkill, sigkill_all (also
kills the monitor process: peers must fall back to heartbeats). ``--resources`` adds a ``resources`` event
(threads, open fds, RSS) at the start of every attempt, for leak checks over many restarts.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import psutil
import torch
import torch.distributed as dist

from nvrx_lab.cli import Parser
from nvrx_lab.dist import LaunchEnv
from nvrx_lab.faults import FaultInjector, parse_schedule
from nvrx_lab.inprocess import CallWrapper, FillGaps, ShiftRanks, Wrapper
from nvrx_lab.observe.events import EventLog


def resources() -> dict:
    """Threads, open fds (and what each is: ``socket``, ``pipe``, ``anon_inode:[eventfd]``, a path) and RSS."""
    me = psutil.Process()
    return {"threads": me.num_threads(), "fds": me.num_fds(), "rss_mb": me.memory_info().rss / 2**20,
            "fd_kinds": dict(collections.Counter(fd_kind(fd) for fd in os.listdir("/proc/self/fd")))}


def fd_kind(fd: str) -> str:
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the fd listing itself, closed since
        return "gone"
    return target.split(":[")[0] if target.startswith(("socket:", "pipe:")) else target


def get_args(argv=None) -> argparse.Namespace:
    ap = Parser(prog="python -m nvrx_lab.demo.inprocess_worker", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--step-time", type=float, default=0.02)
    ap.add_argument("--ckpt-every", type=int, default=5)
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--events", default=None)
    ap.add_argument("--faults", default="", help="RANK[:ATTEMPTS]:STEP:KIND,... (see above)")
    ap.add_argument("--soft-timeout", type=float, default=2.0)
    ap.add_argument("--hard-timeout", type=float, default=4.0)
    ap.add_argument("--heartbeat-interval", type=float, default=0.2)
    ap.add_argument("--heartbeat-timeout", type=float, default=1.5)
    ap.add_argument("--max-iterations", type=int, default=10)
    ap.add_argument("--min-world-size", type=int, default=1)
    ap.add_argument("--assignment", choices=["shift", "fill"], default="shift")
    ap.add_argument("--spares", type=int, default=0)
    ap.add_argument("--resources", action="store_true", help="emit a resources event each attempt")
    a = ap.parse_args(argv)
    try:
        a.faults = parse_schedule(a.faults)
    except ValueError as e:
        ap.error(str(e))
    return a


def load_step(path: str | None) -> int:
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f)["step"]
    return 0


def save_step(path: str, step: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"step": step}, f)
    os.replace(tmp, path)


def main(argv=None) -> int:
    a = get_args(argv)
    rank0 = LaunchEnv.read().rank
    log = EventLog(a.events, rank0)
    policy = (ShiftRanks if a.assignment == "shift" else FillGaps)(spares=a.spares)
    path = os.path.join(a.ckpt_dir, "state.json") if a.ckpt_dir else None

    @Wrapper(soft_timeout=a.soft_timeout, hard_timeout=a.hard_timeout, max_iterations=a.max_iterations,
             min_world_size=a.min_world_size, heartbeat_interval=a.heartbeat_interval,
             heartbeat_timeout=a.heartbeat_timeout, rank_assignment=policy, emit=log.emit, barrier_timeout=30.0)
    def train(cw: CallWrapper):
        if a.resources:
            log.emit("resources", iteration=cw.iteration, **resources())
        cw.init_process_group(backend="gloo")
        t0 = time.monotonic()
        step = load_step(path)
        cw.record("reload_s", time.monotonic() - t0)
        injector = FaultInjector(a.faults, cw.initial_rank, attempt=cw.iteration,
                                 emit=lambda kind, **f: log.emit(kind, iteration=cw.iteration, fault_kind=f["fault"], **f))
        for done in range(step, a.steps):
            injector(done)
            t = torch.full((4,), float(done + 1))
            dist.all_reduce(t)
            assert t[0].item() == (done + 1) * cw.world_size, t
            time.sleep(a.step_time)  # the step's compute
            step = done + 1
            cw.ping()
            log.emit("step", step=step, iteration=cw.iteration, new_rank=cw.rank, world_size=cw.world_size)
            if path and cw.rank == 0 and step % a.ckpt_every == 0:
                with cw.atomic():
                    save_step(path, step)
        dist.barrier()
        return step, cw.iteration, cw.rank, cw.world_size

    step, iteration, rank, ws = train()
    log.emit("done", step=step, iteration=iteration, new_rank=rank, world_size=ws, **resources())
    print(f"rank {rank0}: done step={step} iteration={iteration} rank={rank} world_size={ws}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
