"""``python -m nvrx_lab.bench goodput``: one fault schedule, four ways to recover, goodput side by side.

Modes (the write-up's comparison, on one machine):

* ``baseline`` — Kubernetes-style: any failure tears the whole job down; it is started again from
  scratch after a pod-restart delay and kubelet's CrashLoopBackOff (10 s doubling to 300 s), all
  multiplied by ``--time-scale`` (shown in every output) so a CPU run stays short
* ``launcher`` — ``nvrx_lab.launcher`` restarts the workers inside the job (heartbeats + exits)
* ``inprocess`` — ``--restart inprocess``: the training function restarts inside the same processes
  (started by ``nvrx_lab.inprocess.spawn``, which lets the survivors of a lost rank go on)
* ``launcher+inprocess`` — both: exceptions in-process, dead or frozen processes by the launcher

Every mode resumes from the same async checkpoints and gets the same deterministic faults.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from nvrx_lab.bench._table import report
from nvrx_lab.events import EventLog, read_events
from nvrx_lab.faults import format_schedule, make_schedule
from nvrx_lab.goodput import analyze, format_report
from nvrx_lab.net import free_port_pair
from nvrx_lab.runner import run

MODES = ("baseline", "launcher", "inprocess", "launcher+inprocess")


def crashloop_delay(restart: int, pod_restart_s: float = 10.0, time_scale: float = 1.0) -> float:
    """Seconds before the ``restart``-th restart (1-based): pod restart + kubelet back-off (10 s, 20 s, … 300 s)."""
    backoff = min(300.0, 10.0 * 2 ** (restart - 1))
    return (pod_restart_s + backoff) * time_scale


def trainer_args(args, workdir: Path, mode: str, metrics: Path, faults: str) -> list[str]:
    restart = {"baseline": "none"}.get(mode, mode)
    return ["-m", "nvrx_lab.train", "--steps", str(args.steps), "--ckpt", "async", "--ckpt-interval", str(args.ckpt_interval),
            "--ckpt-dir", str(workdir / "ckpt"), "--metrics", str(metrics), "--faults", faults, "--restart", restart,
            "--log-every", "0", "--pg-timeout", str(args.pg_timeout), "--soft-timeout", str(args.hang_timeout),
            "--hard-timeout", str(args.hang_timeout * 2), "--max-iterations", str(args.faults + 5),
            "--step-sleep", str(args.step_sleep), "--run-id", f"goodput-{mode}",  # a pod restart continues the run
            "--ckpt-wait-writer"]  # as on a real job, whose writer is up long before its first interval ends


def launch_cmd(args, mode: str, port: int) -> list[str]:
    if mode.startswith("launcher"):
        policy = "min-healthy" if mode == "launcher+inprocess" else "any-failed"
        return [sys.executable, "-m", "nvrx_lab.launcher", "--nproc-per-node", str(args.ranks), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", str(args.faults + 2), "--monitor-interval", "0.2",
                "--heartbeat-timeout", str(args.hang_timeout), "--initial-heartbeat-timeout", "60",
                "--restart-policy", policy]
    if mode == "inprocess":  # torchrun would stop the survivors of a SIGKILL; this launcher lets them go on
        return [sys.executable, "-m", "nvrx_lab.inprocess.spawn", "--nproc", str(args.ranks), "--master-port", str(port),
                "--", sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--master-addr", "127.0.0.1",
            "--master-port", str(port)]


def run_mode(args, mode: str, faults: str, workdir: Path, label: str | None = None) -> tuple[dict, list[dict]]:
    """Run ``mode`` to the end (baseline: restarted like a pod) and analyze its events; ``label`` names the row."""
    label = label or mode
    workdir.mkdir(parents=True, exist_ok=True)
    metrics = workdir / "events.jsonl"
    log = EventLog(metrics, rank=0)
    t_start = time.time()
    restarts = 0
    while True:
        cmd = launch_cmd(args, mode, free_port_pair()) + trainer_args(args, workdir, mode, metrics, faults)
        res = run(cmd, timeout=args.timeout)
        if res.returncode == 0:
            break
        restarts += 1
        if mode != "baseline" or restarts > args.faults + 2:
            print(f"[{label}] failed (exit {res.returncode}):\n{res.output[-2000:]}", file=sys.stderr)
            break
        delay = crashloop_delay(restarts, args.pod_restart_s, args.time_scale)
        log.emit("pod_restart", reason=f"job exited {res.returncode}; pod restart + CrashLoopBackOff", delay_s=delay,
                 restart_count=restarts)
        time.sleep(delay)
    events = read_events(metrics)
    t_end = time.time()
    rep = analyze(events, ideal_step_s=args.ideal_step_s, t_start=t_start, t_end=t_end)
    print(format_report(rep, f"--- {label}"))
    return {"mode": label, **rep.row(), "exit": res.returncode, "t_start": t_start, "t_end": t_end,
            "events": str(metrics)}, events


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nvrx_lab.bench goodput", description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--ckpt-interval", type=int, default=20)
    p.add_argument("--faults", type=int, default=5, help="faults per run (deterministic schedule)")
    p.add_argument("--kinds", nargs="+", default=["exception", "sigkill", "hang"], help="fault kinds, cycled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hang-timeout", type=float, default=3.0, help="heartbeat / soft timeout, seconds")
    p.add_argument("--pg-timeout", type=float, default=30.0, help="collective timeout (what a baseline hang waits out)")
    p.add_argument("--pod-restart-s", type=float, default=10.0, help="pod restart delay before back-off, seconds")
    p.add_argument("--time-scale", type=float, default=0.1, help="multiplies every Kubernetes delay")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--ideal-step-s", type=float, default=None, help="default: measured by a fault-free run")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--workdir", default="build/bench/goodput")
    p.add_argument("--out", default="build/bench/goodput.json")
    p.add_argument("--quick", action="store_true", help="100 steps, 2 faults")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.faults, args.ckpt_interval = 100, 2, 10
    schedule = format_schedule(make_schedule(args.faults, args.ranks, args.steps, seed=args.seed,
                                             first_step=min(10, args.steps // 4), kinds=tuple(args.kinds)))
    print(f"fault schedule: {schedule}; Kubernetes delays × {args.time_scale} (time scale)")
    root = Path(args.workdir) / time.strftime("%Y%m%d-%H%M%S")
    rows = []
    if args.ideal_step_s is None:
        clean, _ = run_mode(args, "baseline", "", root / "fault-free", label="fault-free")
        args.ideal_step_s = clean["wall_s"] * clean["training_goodput"] / max(1, clean["steps"])
        rows.append(clean)
    for mode in args.modes:
        row, _ = run_mode(args, mode, schedule, root / mode.replace("+", "_"))
        rows.append(row)
    report("goodput", rows, args.out, "python -m nvrx_lab.bench goodput " + shlex.join(argv or sys.argv[1:]),
           extra={"schedule": schedule, "time_scale": args.time_scale,
                  "notes": [f"Kubernetes delays scaled by {args.time_scale} (time scale)", f"fault schedule {schedule}"]},
           columns=[c for c in rows[0] if c not in ("events", "t_start", "t_end")])
    return 0 if all(r["exit"] == 0 for r in rows) else 1
