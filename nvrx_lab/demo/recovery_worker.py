"""A gloo training loop whose rank 1 faults: the workload of the recovery benchmark and notebook 02.

::

    python -m nvrx_lab.inprocess.spawn --nproc 2 -- python -m nvrx_lab.demo.recovery_worker \\
        --mode inprocess --faults 1:0-1:3:hang --events /tmp/ev.jsonl

Each step all-reduces a tensor and sleeps ``--step-time``. ``--faults`` is a :mod:`nvrx_lab.faults`
schedule whose ATTEMPTS are this worker's attempts (``1:0-1:3:hang``: rank 1 hangs at step 3 of attempts 0
and 1); ``exception``, ``hang`` and ``sigkill`` are what the benchmark injects. In a plain run a hang lasts the
gloo ``--timeout`` + 10 s, then the rank is gone (SIGKILL), so the job ends and can be started again.
``--mode``:

* ``plain`` — no wrapper, gloo timeout ``--timeout``; a launcher restarts it (the attempt is
  ``TORCHELASTIC_RESTART_COUNT``, or ``NVRX_BENCH_ATTEMPT`` for a job started again from scratch);
* ``inprocess`` — under :class:`nvrx_lab.inprocess.Wrapper` (soft timeout ``--timeout``);
* ``nvrx`` — under NVRx's own ``inprocess.Wrapper``, as its ``examples/inprocess/basic_example.py``
  uses it (only when ``nvidia_resiliency_ext`` is installed: ``pip install .[peers]``).

Events on ``--events``: ``fault`` (attempt, step, fault_kind) just before a fault is injected and
``step`` (attempt, step, world_size) after every step; :func:`nvrx_lab.observe.timeline.recovery_times`
turns them into recovery times. ``python -m nvrx_lab.bench recovery`` runs it in every mode.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from nvrx_lab.cli import Parser
from nvrx_lab.dist import LaunchEnv
from nvrx_lab.faults import FaultInjector, parse_schedule
from nvrx_lab.observe.events import EventLog

KINDS = ("exception", "hang", "sigkill")
"""What the recovery benchmark injects (:data:`nvrx_lab.faults.KINDS` has more)."""


def parse(argv: list[str]) -> argparse.Namespace:
    ap = Parser(prog="python -m nvrx_lab.demo.recovery_worker", description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["inprocess", "nvrx", "plain"], required=True)
    ap.add_argument("--faults", default="", help="RANK:ATTEMPTS:STEP:KIND,... (nvrx_lab.faults)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=2.0, help="soft timeout / gloo timeout (s)")
    ap.add_argument("--hard-timeout", type=float, default=None, help="in-process hard timeout (s; default --timeout + 3)")
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0, help="in-process: a silent peer is dead after (s)")
    ap.add_argument("--events", required=True)
    ap.add_argument("--attempt", type=int, default=None,
                    help="this run's attempt, for a job started again from scratch (default: the launcher's restarts)")
    a = ap.parse_args(argv)
    try:
        a.faults = parse_schedule(a.faults)
    except ValueError as e:
        ap.error(str(e))
    return a


def make_loop(a: argparse.Namespace, log: EventLog, rank0: int):
    """``loop(attempt, ping, world_size)``: the training function's body."""
    def hang_then_go(_fault) -> None:  # a plain run: long enough for the peer's gloo timeout, then gone
        time.sleep(a.timeout + 10)
        os.kill(os.getpid(), signal.SIGKILL)

    def loop(attempt: int, ping, world_size: int) -> None:
        injector = FaultInjector(a.faults, rank0, attempt=attempt,
                                 emit=lambda kind, **f: log.emit(kind, fault_kind=f["fault"], **f),
                                 actions={"hang": hang_then_go} if a.mode == "plain" else None)
        for step in range(a.steps):
            injector(step)
            t = torch.ones(4)
            dist.all_reduce(t)
            time.sleep(a.step_time)
            ping()
            log.emit("step", attempt=attempt, step=step, world_size=world_size)
    return loop


def run_plain(a: argparse.Namespace, loop) -> None:
    base_attempt = a.attempt if a.attempt is not None else LaunchEnv.read().restart_count
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout))
    loop(base_attempt, lambda: None, dist.get_world_size())
    dist.destroy_process_group()


def run_nvrx(a: argparse.Namespace, loop) -> None:
    """NVRx's ``inprocess.Wrapper`` as its ``examples/inprocess/basic_example.py`` builds it (a store per
    attempt, ``multi_tenant`` on libuv, at ``MASTER_PORT + 2 + iteration``; CUDA health check), with the
    timings of the ``inprocess`` mode: intervals of 0.2 s instead of the 1 s defaults, and the same soft, hard
    and heartbeat timeouts, so neither side waits longer than the other by configuration."""
    import nvidia_resiliency_ext.inprocess as nvrx

    launch = LaunchEnv.read()
    tick = datetime.timedelta(seconds=0.2)

    def train(call_wrapper=None):
        rank, ws = launch.rank, launch.world_size
        store = dist.TCPStore(launch.master_addr, launch.master_port + 2 + call_wrapper.iteration,
                              ws, rank == 0, timeout=datetime.timedelta(seconds=60), multi_tenant=True, use_libuv=True)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=ws,
                                timeout=datetime.timedelta(seconds=a.timeout))
        loop(call_wrapper.iteration, call_wrapper.ping, ws)
        dist.destroy_process_group()

    # NVRx finds the parameter to pass its CallWrapper by the annotation's class: a real one, not the string
    # this module's ``from __future__ import annotations`` would make of it
    train.__annotations__ = {"call_wrapper": nvrx.CallWrapper}
    train = nvrx.Wrapper(store_kwargs={"port": launch.master_port + 1},
                         health_check=nvrx.health_check.CudaHealthCheck(),
                         monitor_thread_interval=tick, monitor_process_interval=tick, last_call_wait=tick,
                         heartbeat_interval=tick, heartbeat_timeout=datetime.timedelta(seconds=a.heartbeat_timeout),
                         soft_timeout=datetime.timedelta(seconds=a.timeout),
                         hard_timeout=datetime.timedelta(seconds=a.hard_timeout or a.timeout + 3))(train)
    train()


def run_inprocess(a: argparse.Namespace, loop, log: EventLog) -> None:
    from nvrx_lab.inprocess import Wrapper

    attempts = max((f.attempts.stop for f in a.faults if f.attempts is not None), default=1)
    @Wrapper(soft_timeout=a.timeout, hard_timeout=a.hard_timeout or a.timeout + 3, max_iterations=attempts + 2,
             heartbeat_interval=0.2, heartbeat_timeout=a.heartbeat_timeout, emit=log.emit)
    def train(cw):
        cw.init_process_group("gloo")
        loop(cw.iteration, cw.ping, cw.world_size)

    train()


def worker(argv: list[str]) -> int:
    a = parse(argv)
    rank0 = LaunchEnv.read().rank
    log = EventLog(a.events, rank0)
    loop = make_loop(a, log, rank0)
    if a.mode == "plain":
        run_plain(a, loop)
    elif a.mode == "nvrx":
        run_nvrx(a, loop)
    else:
        run_inprocess(a, loop, log)
    return 0


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
