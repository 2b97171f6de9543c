"""``python -m nvrx_lab.bench launcher``: fault -> every rank training again, per launcher and fault kind.

2 ranks on gloo run :mod:`nvrx_lab.demo.launcher_worker`; rank 1 injects one fault per attempt
(SIGKILL itself, or hang without heartbeats) for ``--faults-per-kind`` attempts, then the job ends
normally. Recovery of one fault = the later of the two ranks' first ``step`` event in the next
attempt, minus the ``fault`` event's time (from the event stream only). Side by side in one run:

* ``nvrx_lab`` — ``python -m nvrx_lab.launcher`` with warm standby workers (heartbeat timeout 3 s)
* ``nvrx_lab --no-standby`` — the same, workers started by torchelastic (pays ``import torch``)
* ``torchrun-noshare`` — ``--max-restarts`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store per
  rendezvous round); a hang is only noticed when the gloo collective times out (``--pg-timeout``), and a
  restart that fails to rendezvous counts as not recovered. ``torchrun`` (the shared store, its default) on
  request: its restarts fail here, the new round reading the dead round's gloo address
* NVRx ``ft_launcher`` — with heartbeats from NVRx's own ``RankMonitorClient`` in the worker, timeouts checked
  every 0.1 s; only when ``nvidia_resiliency_ext`` is importable (else: skipped)

A row that does not recover every fault is an error, printed with its output; the bench then exits 1.

Also: the cost of ``send_heartbeat`` (µs, in-process client and monitor), and ``import torch`` in a
fresh interpreter vs in a standby worker.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nvrx_lab.cli import Parser
from nvrx_lab.observe.events import read_events
from nvrx_lab.observe.table import exit_status, median, p95, report
from nvrx_lab.runner import Launcher, Torchrun, Worker, flat, run


def heartbeat_cost_us(n: int = 50000, batches: int = 5) -> float:
    from nvrx_lab.launcher import RankMonitorClient, Timeouts
    from nvrx_lab.launcher.monitor import MonitorServer

    server = MonitorServer(1, Timeouts())
    try:
        client = RankMonitorClient(server.dir, 0)
        client.init_workload_monitoring()
        per = []
        for _ in range(batches):
            t0 = time.perf_counter()
            for _ in range(n):
                client.send_heartbeat()
            per.append((time.perf_counter() - t0) / n * 1e6)
        client.shutdown_workload_monitoring()
        return median(per)
    finally:
        server.close()


def cold_import_torch_s(runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", "import time; t=time.perf_counter(); import torch; "
                              "print(time.perf_counter()-t)"], capture_output=True, text=True, timeout=120)
        times.append(float(out.stdout.strip().splitlines()[-1]))
    return median(times)


PEERS = ("torchrun", "torchrun-noshare", "ft_launcher")


def ft_launcher() -> str:
    """NVRx's launcher script beside this interpreter (a venv not activated has it only there)."""
    return shutil.which("ft_launcher", path=str(Path(sys.executable).parent)) or "ft_launcher"


def run_one(mode: str, kind: str, faults: int, hb_timeout: float, pg_timeout: float, workdir: Path) -> dict:
    metrics = workdir / f"{mode.replace(' ', '_')}_{kind}.jsonl"
    worker = Worker.of("nvrx_lab.demo.launcher_worker", steps=10, faults=f"1:0-{faults - 1}:5:{kind}",
                       pg_timeout=pg_timeout, metrics=metrics)
    torchrun = Torchrun.c10d(2, max_restarts=faults, monitor_interval=0.1)
    if mode.startswith("nvrx_lab"):
        cmd = Launcher.local(2, max_restarts=faults, monitor_interval=0.1, heartbeat_timeout=hb_timeout,
                             initial_heartbeat_timeout=60, metrics_file=metrics, standby="no-standby" not in mode).argv(worker)
    elif mode.startswith("torchrun"):
        cmd = torchrun.argv(worker.with_flags(no_monitor=True))
    else:  # NVRx ft_launcher: torchrun's flags and its own; heartbeats from NVRx's client, timeouts checked as
        # often as our monitors check (its default is every 5 s)
        cmd = [ft_launcher(), *flat(torchrun.flags()), "--ft-rank-heartbeat-timeout", str(hb_timeout),
               "--ft-initial-rank-heartbeat-timeout", "60", "--ft-workload-check-interval", "0.1",
               "--ft-enable-nic-monitor", "false", *worker.with_flags(nvrx_client=True).args()]
    env = {"LOGLEVEL": "ERROR"}
    if mode == "torchrun-noshare":  # a fresh store per rendezvous round (the shared one hands out a dead round's address)
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    res = run(cmd, timeout=60 + faults * (pg_timeout + hb_timeout + 10), env=env)
    rc, wall = "timeout" if res.timed_out else res.returncode, res.wall_s
    ev = read_events(metrics)
    first_step: dict[tuple[int, int], float] = {}
    for e in ev:
        if e["kind"] == "step":
            first_step.setdefault((e["restart"], e["rank"]), e["t"])
    recov = []
    fault_events = [e for e in ev if e["kind"] == "fault"]
    attempts = sorted({a for a, _ in first_step})
    trained = [a for a in attempts if all((a, r) in first_step for r in (0, 1))]
    for f in fault_events:  # the first later attempt in which every rank trains (failed restarts included)
        nxt = [a for a in trained if a > f["restart"]]
        if nxt:
            recov.append(max(first_step[(nxt[0], r)] for r in (0, 1)) - f["t"])
    started = {e["restart"] for e in ev if e["kind"] == "worker_start"}
    failed_restarts = len([a for a in started if a > 0 and a not in trained])
    detect = [e["detect_s"] for e in ev if e["kind"] == "launcher_failure" and e["rank"] == 1 and e["detect_s"]]
    ready = [e["ready_s"] for e in ev if e["kind"] == "launcher_ready"]
    imports = [e["import_s"] for e in ev if e["kind"] == "worker_start" and e["restart"] > 0]
    row_error = None
    if not fault_events or len(recov) < len(fault_events):  # an error with its output, never a row of nan
        lines = res.output.strip().splitlines()
        why = [ln for ln in lines if "Error" in ln or "error:" in ln][-5:]  # the cause, above torchrun's summary
        row_error = (f"{mode} / {kind}: {len(recov)} of {len(fault_events)} fault(s) recovered (exit {rc}); errors:\n"
                     + "\n".join(why) + "\nlast output:\n" + "\n".join(lines[-10:]))
        print(row_error, file=sys.stderr, flush=True)
    return {"launcher": mode, "fault": kind, "injected": len(fault_events), "recovered": len(recov), "error": row_error,
            "failed_restarts": failed_restarts,
            "median_s": median(recov), "p95_s": p95(recov), "detect_s": median(detect),
            "ready_s": median(ready), "worker_import_s": median(imports), "exit": rc, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m nvrx_lab.bench launcher", description=__doc__.split("\n")[0])
    p.add_argument("--faults-per-kind", type=int, default=10, help="faults of each kind per launcher")
    p.add_argument("--quick", action="store_true", help="2 faults per kind (CI/smoke)")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0)
    p.add_argument("--pg-timeout", type=float, default=10.0, help="gloo collective timeout (torchrun's only hang detector)")
    p.add_argument("--launchers", default="nvrx_lab,nvrx_lab --no-standby,torchrun-noshare,ft_launcher",
                   help="comma-separated; also torchrun (its rendezvous store shared across rounds: restarts fail here)")
    p.add_argument("--out", default="build/bench/launcher.json")
    args = p.parse_args(argv)
    faults = 2 if args.quick else args.faults_per_kind
    rows, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="nvrx-bench-launcher-") as tmp:
        for mode in [m.strip() for m in args.launchers.split(",") if m.strip()]:
            if mode == "ft_launcher" and importlib.util.find_spec("nvidia_resiliency_ext") is None:
                print("ft_launcher: skipped (nvidia-resiliency-ext not installed; pip install -e .[peers])")
                skipped.append("ft_launcher")
                continue
            for kind in ("sigkill", "hang"):
                print(f"running {mode} / {kind} x{faults} ...", flush=True)
                rows.append(run_one(mode, kind, faults, args.heartbeat_timeout, args.pg_timeout, Path(tmp)))
    hb = heartbeat_cost_us()
    cold = cold_import_torch_s()
    print(f"send_heartbeat: {hb:.2f} us/call; import torch: {cold:.2f} s cold vs "
          f"{median([r['worker_import_s'] for r in rows if r['launcher'] == 'nvrx_lab']):.4f} s in a standby worker")
    ours = {r["fault"]: r for r in rows if r["launcher"] == "nvrx_lab"}
    ratios = {}
    for kind, mine in ours.items():  # against the best peer that recovered every fault of the kind
        peers = [r for r in rows if r["fault"] == kind and r["launcher"] in PEERS and not r["error"]]
        if peers and mine["median_s"] == mine["median_s"]:
            best = min(peers, key=lambda r: r["median_s"])
            ratios[kind] = {"best_peer": best["launcher"], "x": mine["median_s"] / best["median_s"]}
            print(f"{kind}: nvrx_lab {mine['median_s']:.2f} s = {ratios[kind]['x']:.2f}x the best peer "
                  f"({best['launcher']}, {best['median_s']:.2f} s)")
    columns = ["launcher", "fault", "injected", "recovered", "failed_restarts", "median_s", "p95_s", "detect_s",
               "ready_s", "worker_import_s", "exit", "wall_s"]
    report("launcher", rows, args.out, "python -m nvrx_lab.bench launcher " + " ".join(argv or sys.argv[1:]),
           extra={"heartbeat_us": hb, "cold_import_torch_s": cold, "ratio_vs_best_peer": ratios,
                  "skipped": skipped, "heartbeat_timeout_s": args.heartbeat_timeout, "faults_per_kind": faults},
           columns=columns)
    return exit_status([f"{r['launcher']} / {r['fault']}" for r in rows if r["error"]])
