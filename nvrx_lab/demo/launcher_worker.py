"""A tiny training loop with scheduled faults, run under the launcher by tests, benchmark and notebook 03.

::

    python -m nvrx_lab.launcher --nproc-per-node 2 --max-restarts 3 --heartbeat-timeout 3 \\
        -m nvrx_lab.demo.launcher_worker --steps 30 --faults 1:0:5:sigkill

Each step: an all-reduce over gloo, ``--step-time`` of sleep, a heartbeat and a ``step`` event
(every rank) on ``--metrics``. ``--faults`` is a :mod:`nvrx_lab.faults` schedule, its ATTEMPTS the
launcher's restarts (``TORCHELASTIC_RESTART_COUNT``): ``1:0:5:sigkill,1:1:5:hang`` kills rank 1 at step 5 of
the first attempt and hangs it in the second. The kinds these demos use: ``sigkill``, ``hang`` (no more
heartbeats), ``exit:CODE`` (2 reads as a usage error and is not restarted) and ``pause:SECONDS`` (a
legitimate long phase, inside section ``--section`` if given; ``*:0:3:pause:5`` pauses every rank).
A fault without ATTEMPTS fires once per process, or once per job with ``--fault-state DIR`` (each rank's fired
faults in a file of that folder, read by the next attempt's worker). ``--on-peer-loss continue`` stands in for
the in-process wrapper under ``min-healthy``: a rank whose peer died drops the process group and trains on alone.
The ``worker_start`` event says whether torch was imported before this module (``torch_preloaded``: a warm standby).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

T_PROCESS = time.time()
TORCH_PRELOADED = "torch" in sys.modules
_t = time.perf_counter()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

IMPORT_S = time.perf_counter() - _t

from nvrx_lab.cli import Parser  # noqa: E402
from nvrx_lab.dist import LaunchEnv  # noqa: E402
from nvrx_lab.faults import FaultInjector, parse_schedule  # noqa: E402
from nvrx_lab.launcher.client import RankMonitorClient  # noqa: E402
from nvrx_lab.observe.events import EventLog  # noqa: E402


def get_args(argv=None) -> argparse.Namespace:
    p = Parser(prog="python -m nvrx_lab.demo.launcher_worker", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="steps per attempt")
    p.add_argument("--step-time", type=float, default=0.05, help="seconds of 'compute' per step")
    p.add_argument("--faults", default="", help="RANK:ATTEMPTS:STEP:KIND[:ARG],... (nvrx_lab.faults; attempts: restarts)")
    p.add_argument("--fault-state", default=None, help="folder: fire-once faults remembered across restarts")
    p.add_argument("--section", default="", help="run a pause fault inside this section")
    p.add_argument("--calc-timeouts", action="store_true", help="calculate_timeouts() at the step after the first fault")
    p.add_argument("--metrics", default=None, help="JSONL event file")
    p.add_argument("--pg-timeout", type=float, default=60.0, help="gloo collective timeout (s)")
    p.add_argument("--on-peer-loss", choices=["fail", "continue"], default="fail")
    p.add_argument("--no-monitor", action="store_true", help="do not use the heartbeat client")
    p.add_argument("--nvrx-client", action="store_true",
                   help="heartbeats through NVRx's own RankMonitorClient (the peer's ft_launcher; needs .[peers])")
    args = p.parse_args(argv)
    try:
        args.faults = parse_schedule(args.faults)
    except ValueError as e:
        p.error(str(e))
    return args


def slow_phase(client: RankMonitorClient | None, section: str, seconds: float) -> None:
    """A legitimate long phase (checkpoint, evaluation), inside ``section`` if given."""
    if client and section:
        client.start_section(section)
    time.sleep(seconds)
    if client and section:
        client.end_section(section)


def main(argv=None) -> int:
    args = get_args(argv)
    launch = LaunchEnv.read()
    rank, restart = launch.rank, launch.restart_count
    events = EventLog(args.metrics, rank)
    events.emit("worker_start", restart=restart, import_s=IMPORT_S, torch_preloaded=TORCH_PRELOADED,
                t_process=T_PROCESS, pid=os.getpid())
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
    state = os.path.join(args.fault_state, f"rank{rank}.jsonl") if args.fault_state else None
    injector = FaultInjector(args.faults, rank, attempt=restart, state_file=state,
                             emit=lambda kind, **f: events.emit(kind, restart=restart, **f),
                             actions={"pause": lambda fault: slow_phase(client, args.section, fault.value)})
    calc_at = min((f.step for f in args.faults if f.fires_in(restart)), default=-2) + 1
    w = torch.zeros(8)
    alone = False
    for step in range(args.steps):
        injector(step)
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
        if client and args.calc_timeouts and step == calc_at and not alone:
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
