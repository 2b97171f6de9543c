"""A tiny training loop with scheduled faults, run under the launcher by tests, benchmark and notebook 03.

::

    python -m nvrx_lab.launcher --nproc-per-node 2 --max-restarts 3 --heartbeat-timeout 3 \\
        -m nvrx_lab.launcher.demo_worker --steps 30 --fault kill --fault-rank 1 --fault-step 5 --fault-restarts 0

Each step: an all-reduce over gloo, ``--step-time`` of sleep, a heartbeat and a ``step`` event
(every rank) on ``--metrics``. Faults are deterministic: ``--fault KIND`` hits ``--fault-rank`` at
``--fault-step`` on each attempt whose ``TORCHELASTIC_RESTART_COUNT`` is in ``--fault-restarts``
(``0``, ``0-9``, ``0,2``). Kinds: ``kill`` (SIGKILL itself), ``hang`` (sleeps forever, no heartbeats),
``exit`` (exit code ``--exit-code``, 3 by default; 2 reads as a usage error and is not restarted),
``slow`` (a legitimate ``--slow-s`` pause, inside section ``--section`` if given). ``--on-peer-loss
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

from nvrx_lab.events import EventLog  # noqa: E402
from nvrx_lab.launcher.client import RankMonitorClient  # noqa: E402


def parse_restarts(text: str) -> set[int]:
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def get_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nvrx_lab.launcher.demo_worker", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="steps per attempt")
    p.add_argument("--step-time", type=float, default=0.05, help="seconds of 'compute' per step")
    p.add_argument("--fault", choices=["none", "kill", "hang", "exit", "slow"], default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=5)
    p.add_argument("--fault-restarts", type=parse_restarts, default={0}, help="attempts that fault: 0 | 0-9 | 0,2")
    p.add_argument("--fault-plan", default="", help="per attempt kinds, e.g. 0:kill,1:hang (overrides --fault)")
    p.add_argument("--exit-code", type=int, default=3, help="exit code of the 'exit' fault")
    p.add_argument("--slow-s", type=float, default=5.0, help="length of the 'slow' phase (s)")
    p.add_argument("--section", default="", help="wrap the slow phase in this section")
    p.add_argument("--calc-timeouts", action="store_true", help="calculate_timeouts() after the slow phase")
    p.add_argument("--metrics", default=os.environ.get("NVRX_LAB_METRICS"), help="JSONL event file")
    p.add_argument("--pg-timeout", type=float, default=60.0, help="gloo collective timeout (s)")
    p.add_argument("--on-peer-loss", choices=["fail", "continue"], default="fail")
    p.add_argument("--no-monitor", action="store_true", help="do not use the heartbeat client")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = get_args(argv)
    rank, restart = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = EventLog(args.metrics, rank)
    events.emit("worker_start", restart=restart, import_s=IMPORT_S, t_process=T_PROCESS, pid=os.getpid())
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    client = None
    if not args.no_monitor and RankMonitorClient.available():
        client = RankMonitorClient()
        client.init_workload_monitoring()
    if args.fault_plan:
        plan = dict(item.split(":") for item in args.fault_plan.split(","))
        args.fault, args.fault_restarts = plan.get(str(restart), "none"), {restart}
    faulty = rank == args.fault_rank and restart in args.fault_restarts and args.fault != "none"
    w = torch.zeros(8)
    alone = False
    for step in range(args.steps):
        if faulty and step == args.fault_step:
            events.emit("fault", step=step, fault=args.fault, restart=restart)
            print(f"rank {rank}: injecting fault {args.fault!r} at step {step} (restart {restart})", flush=True)
            if args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif args.fault == "hang":
                time.sleep(3600)
            elif args.fault == "exit":
                sys.exit(args.exit_code)
        if args.fault == "slow" and step == args.fault_step and restart in args.fault_restarts:
            if client and args.section:
                client.start_section(args.section)
            time.sleep(args.slow_s)  # a legitimate long phase (checkpoint, evaluation) on every rank
            if client and args.section:
                client.end_section(args.section)
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
