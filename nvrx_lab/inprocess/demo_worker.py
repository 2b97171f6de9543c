"""A small training function under :class:`~nvrx_lab.inprocess.Wrapper` with a deterministic fault schedule.

Run by the tests, the reliability suite and notebook 02, always under a launcher that lets the
survivors run::

    python -m nvrx_lab.inprocess.spawn --nproc 2 -- python -m nvrx_lab.inprocess.demo_worker \
        --steps 20 --faults 1:0:5:exception --events /tmp/ev.jsonl --ckpt-dir /tmp/ck

Each step all-reduces a tensor over gloo and sleeps ``--step-time``; rank 0 saves the step
counter every ``--ckpt-every`` steps (atomically, inside ``call_wrapper.atomic()``) and every
attempt reloads it. Events (``step``, ``fault``, ``restart``, ``resources``, ``done``) go to
``--events``.

``--faults`` is a comma list of ``rank:iteration:step:kind`` (``iteration`` may be ``*`` or
``a-b``); kinds: exception, hang (time.sleep), hang_socket (blocked recv), hang_native (signals
blocked: only the hard timeout ends it), sigkill, sigkill_all (also kills the monitor process:
peers must fall back to heartbeats). ``--resources`` adds a ``resources`` event (threads, open
fds, RSS) at the start of every attempt, for leak checks over many restarts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist

from nvrx_lab.events import EventLog
from nvrx_lab.inprocess import CallWrapper, FillGaps, ShiftRanks, Wrapper


def parse_faults(spec: str) -> list[tuple[int, range | None, int, str]]:
    out = []
    for item in filter(None, spec.split(",")):
        rank, it, step, kind = item.split(":")
        if it == "*":
            its = None
        elif "-" in it:
            a, b = it.split("-")
            its = range(int(a), int(b) + 1)
        else:
            its = range(int(it), int(it) + 1)
        out.append((int(rank), its, int(step), kind))
    return out


def fault_for(faults, rank, iteration, step):
    for r, its, s, kind in faults:
        if r == rank and s == step and (its is None or iteration in its):
            return kind
    return None


def inject(kind: str) -> None:
    if kind == "exception":
        raise RuntimeError("injected exception")
    if kind == "hang":
        time.sleep(3600)
    elif kind == "hang_socket":
        a, b = socket.socketpair()
        try:
            a.recv(1)
        finally:
            a.close(), b.close()
    elif kind == "hang_native":
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
        time.sleep(3600)
    elif kind in ("sigkill", "sigkill_all"):
        if kind == "sigkill_all":
            with open(f"/proc/self/task/{os.getpid()}/children") as f:
                for pid in f.read().split():
                    os.kill(int(pid), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        raise ValueError(f"unknown fault kind {kind!r}")


def resources() -> dict:
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
            "rss_mb": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nvrx_lab.inprocess.demo_worker",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--step-time", type=float, default=0.02)
    ap.add_argument("--ckpt-every", type=int, default=5)
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--events", default=None)
    ap.add_argument("--faults", default="")
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
    rank0 = int(os.environ["RANK"])
    log = EventLog(a.events, rank0)
    faults = parse_faults(a.faults)
    policy = (ShiftRanks if a.assignment == "shift" else FillGaps)(spares=a.spares)

    @Wrapper(soft_timeout=a.soft_timeout, hard_timeout=a.hard_timeout, max_iterations=a.max_iterations,
             min_world_size=a.min_world_size, heartbeat_interval=a.heartbeat_interval,
             heartbeat_timeout=a.heartbeat_timeout, rank_assignment=policy, emit=log.emit, barrier_timeout=30.0)
    def train(cw: CallWrapper):
        if a.resources:
            log.emit("resources", iteration=cw.iteration, **resources())
        cw.init_process_group(backend="gloo")
        t0 = time.monotonic()
        step = 0
        path = os.path.join(a.ckpt_dir, "state.json") if a.ckpt_dir else None
        if path and os.path.exists(path):
            with open(path) as f:
                step = json.load(f)["step"]
        cw.record("reload_s", time.monotonic() - t0)
        while step < a.steps:
            kind = fault_for(faults, cw.initial_rank, cw.iteration, step)
            if kind:
                log.emit("fault", fault_kind=kind, iteration=cw.iteration, step=step)
                inject(kind)
            t = torch.full((4,), float(step + 1))
            dist.all_reduce(t)
            assert t[0].item() == (step + 1) * cw.world_size, t
            time.sleep(a.step_time)
            step += 1
            cw.ping()
            log.emit("step", step=step, iteration=cw.iteration, new_rank=cw.rank, world_size=cw.world_size)
            if path and cw.rank == 0 and step % a.ckpt_every == 0:
                with cw.atomic():
                    tmp = f"{path}.tmp"
                    with open(tmp, "w") as f:
                        json.dump({"step": step}, f)
                    os.replace(tmp, path)
        dist.barrier()
        return step, cw.iteration, cw.rank, cw.world_size

    step, iteration, rank, ws = train()
    log.emit("done", step=step, iteration=iteration, new_rank=rank, world_size=ws, **resources())
    print(f"rank {rank0}: done step={step} iteration={iteration} rank={rank} world_size={ws}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
