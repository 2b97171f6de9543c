"""A tiny training loop with scheduled faults, run under the launcher by tests, benchmark and notebook 03.

::

    python -m nvrx_lab.launcher --nproc-per-node 2 --max-restarts 3 --heartbeat-timeout 3 \\
        -m nvrx_lab.launcher.demo_worker --steps 30 --fault kill --fault-rank 1 --fault-step 5 --fault-restarts 0

Each step: an all-reduce over gloo, ``--step-time`` of sleep, a heartbeat and a ``step`` event
(every rank) on ``--metrics``. Faults are deterministic: ``--fault KIND`` hits ``--fault-rank`` at
``--fault-step`` on each attempt whose ``TORCHELASTIC_RESTART_COUNT`` is in ``--fault-restarts``
(``0``, ``0-9``, ``0,2``); ``--fault-plan 0:kill,1:hang`` gives each attempt its own kind instead.
Both become a :mod:`nvrx_lab.faults` schedule ``RANK:ATTEMPTS:STEP:KIND`` (``1:0:5:kill,1:1:5:hang``).
Kinds: ``kill`` (SIGKILL itself), ``hang`` (sleeps forever, no heartbeats), ``exit`` (exit code
``--exit-code``, 3 by default; 2 reads as a usage error and is not restarted), ``slow`` (a legitimate
``--slow-s`` pause on every rank, inside section ``--section`` if given). ``--on-peer-loss
continue`` stands in for the in-process wrapper under ``min-healthy``: a rank whose peer died drops
the process group and trains on alone.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

T_PROCESS = time.time()
_t = time.perf_counter()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

IMPORT_S = time.perf_counter() - _t

from nvrx_lab.faults import Fault, parse_schedule  # noqa: E402
from nvrx_lab.launcher.client import RankMonitorClient  # noqa: E402
from nvrx_lab.observe.events import EventLog  # noqa: E402

KINDS = ("kill", "hang", "exit", "slow")


def fault_schedule(args: argparse.Namespace) -> list[Fault]:
    """The fault flags as one schedule: ``--fault-plan ATTEMPT:KIND,…``, or else ``--fault KIND`` in each of
    ``--fault-restarts``; every entry at ``--fault-rank`` and ``--fault-step``."""
    if args.fault_plan:
        plan = [item.partition(":")[::2] for item in args.fault_plan.split(",")]
    else:
        plan = [(attempts, args.fault) for attempts in filter(None, args.fault_restarts.split(","))]
    spec = ",".join(f"{args.fault_rank}:{attempts}:{args.fault_step}:{kind}" for attempts, kind in plan if kind != "none")
    return parse_schedule(spec, kinds=KINDS, phases=("step",), with_attempts=True)


def get_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nvrx_lab.launcher.demo_worker", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="steps per attempt")
    p.add_argument("--step-time", type=float, default=0.05, help="seconds of 'compute' per step")
    p.add_argument("--fault", choices=["none", *KINDS], default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=5)
    p.add_argument("--fault-restarts", default="0", help="attempts that fault: 0 | 0-9 | 0,2")
    p.add_argument("--fault-plan", default="", help="per attempt kinds, e.g. 0:kill,1:hang (overrides --fault)")
    p.add_argument("--exit-code", type=int, default=3, help="exit code of the 'exit' fault")
    p.add_argument("--slow-s", type=float, default=5.0, help="length of the 'slow' phase (s)")
    p.add_argument("--section", default="", help="wrap the slow phase in this section")
    p.add_argument("--calc-timeouts", action="store_true", help="calculate_timeouts() after the slow phase")
    p.add_argument("--metrics", default=os.environ.get("NVRX_LAB_METRICS"), help="JSONL event file")
    p.add_argument("--pg-timeout", type=float, default=60.0, help="gloo collective timeout (s)")
    p.add_argument("--on-peer-loss", choices=["fail", "continue"], default="fail")
    p.add_argument("--no-monitor", action="store_true", help="do not use the heartbeat client")
    p.add_argument("--nvrx-client", action="store_true",
                   help="heartbeats through NVRx's own RankMonitorClient (the peer's ft_launcher; needs .[peers])")
    args = p.parse_args(argv)
    try:
        args.faults = fault_schedule(args)
    except ValueError as e:
        p.error(f"--fault/--fault-plan: {e}")
    return args


def inject(kind: str, exit_code: int) -> None:
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "hang":
        time.sleep(3600)
    elif kind == "exit":
        sys.exit(exit_code)


def slow_phase(client: RankMonitorClient | None, section: str, seconds: float) -> None:
    """A legitimate long phase (checkpoint, evaluation), inside ``section`` if given."""
    if client and section:
        client.start_section(section)
    time.sleep(seconds)
    if client and section:
        client.end_section(section)


def main(argv=None) -> int:
    args = get_args(argv)
    rank, restart = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = EventLog(args.metrics, rank)
    events.emit("worker_start", restart=restart, import_s=IMPORT_S, t_process=T_PROCESS, pid=os.getpid())
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    client = None
    if args.nvrx_client:  # NVRx's client speaks to ft_launcher's rank monitor (same method names as ours)
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient as NVRxClient
        client = NVRxClient()
        client.init_workload_monitoring()
    elif not args.no_monitor and RankMonitorClient.available():
        client = RankMonitorClient()
        client.init_workload_monitoring()
    now = [f for f in args.faults if f.fires_in(restart)]
    mine = {f.step: f.kind for f in now if f.rank == rank}  # what this rank injects, by step
    slow = {f.step for f in now if f.kind == "slow"}  # a legitimate long phase on every rank
    w = torch.zeros(8)
    alone = False
    for step in range(args.steps):
        if step in mine:
            events.emit("fault", step=step, fault=mine[step], restart=restart)
            print(f"rank {rank}: injecting fault {mine[step]!r} at step {step} (restart {restart})", flush=True)
            inject(mine[step], args.exit_code)
        if step in slow:
            slow_phase(client, args.section, args.slow_s)
        g = torch.randn(8, generator=torch.Generator().manual_seed(step))
        if not alone:
            try:
                dist.all_reduce(g)
            except RuntimeError as e:
                if args.on_peer_loss == "fail":
                    raise
                print(f"rank {rank}: peer lost ({type(e).__name__}); continuing alone", flush=True)
                alone = True
        w -= 0.01 * g
        time.sleep(args.step_time)
        if client:
            client.send_heartbeat()
        events.emit("step", step=step, restart=restart, loss=float(w.norm()))
        if client and args.calc_timeouts and step == args.fault_step + 1 and not alone:
            t = client.calculate_timeouts()
            print(f"rank {rank}: calculated timeouts {t.to_dict()}", flush=True)
    if client:
        client.shutdown_workload_monitoring()
    events.emit("worker_done", restart=restart)
    if not alone:
        dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: done (restart {restart}, import torch {IMPORT_S:.3f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
