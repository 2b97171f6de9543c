"""``python -m nvrx_lab.bench goodput``: one fault schedule, four ways to recover, goodput side by side.

Modes (the write-up's comparison, on one machine):

* ``baseline`` — Kubernetes-style: any failure tears the whole job down; it is started again from
  scratch after a pod-restart delay and kubelet's CrashLoopBackOff (10 s doubling to 300 s), all
  multiplied by ``--time-scale`` (shown in every output) so a CPU run stays short
* ``launcher`` — ``nvrx_lab.launcher`` restarts the workers inside the job (heartbeats + exits)
* ``inprocess`` — ``--restart inprocess``: the training function restarts inside the same processes
  (started by ``nvrx_lab.inprocess.spawn``, which lets the survivors of a lost rank go on)
* ``launcher+inprocess`` — both: exceptions in-process, dead or frozen processes by the launcher
* ``MODE+local`` — the same with a local checkpoint every ``--local-ckpt-interval`` steps
  (:mod:`nvrx_lab.checkpoint.local`): a fault rolls back to the last step instead of the last storage save

Every mode resumes from the same async checkpoints and gets the same deterministic faults.

**What a fault costs the wall clock** (``--pairs N``, default 1): each mode also runs fault-free, the two runs
interleaved N times with the same seed, and ``cost_per_fault_s`` = median over the pairs of (wall with
faults − wall fault-free) / faults; beside it, per fault of the last run, ``recovery_mean_s`` (the fault → full
speed again) and ``price_mean_s`` (the phases of :mod:`nvrx_lab.observe.price` added up, with the work done twice),
and ``cost_x_recovery``: the wall clock's figure over the reported one. ``rss_x``: the largest peak RSS of a trainer
process (all its attempts) over the fault-free run's. ``baseline``'s first pair reuses its fault-free run.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from nvrx_lab.cli import Parser
from nvrx_lab.faults import format_schedule, make_schedule
from nvrx_lab.net import free_port_pair, wait_for
from nvrx_lab.observe.advisor import crashloop_delay
from nvrx_lab.observe.events import EventLog, read_events
from nvrx_lab.observe.goodput import analyze, format_report
from nvrx_lab.observe.price import paired_cost
from nvrx_lab.observe.table import report
from nvrx_lab.runner import Launcher, RunResult, Spawn, Torchrun, Worker, head_for, run, trainer

RECOVERY = ("baseline", "launcher", "inprocess", "launcher+inprocess")
MODES = (*RECOVERY, *(f"{m}+local" for m in RECOVERY[1:]))
"""Every mode; ``baseline`` has no ``+local``: a job torn down and started again loses the nodes' memory."""
DEFAULT_MODES = (*RECOVERY, "launcher+inprocess+local")


def train_worker(args, workdir: Path, mode: str, metrics: Path, faults: str) -> Worker:
    return trainer(steps=args.steps, ckpt="async", ckpt_interval=args.ckpt_interval, ckpt_dir=workdir / "ckpt",
                   metrics=metrics, faults=faults, restart=restart_of(mode), log_every=0, pg_timeout=args.pg_timeout,
                   soft_timeout=args.hang_timeout, hard_timeout=args.hang_timeout * 2, max_iterations=args.faults + 5,
                   step_sleep=args.step_sleep, run_id=f"goodput-{mode}",  # a pod restart continues the run
                   ckpt_wait_writer=True,  # as on a real job, whose writer is up long before its first interval ends
                   local_ckpt_interval=args.local_ckpt_interval if mode.endswith("+local") else 0)


def root_cause(output: str) -> list[str]:
    """torchrun's ``Root Cause (first observed failure)`` lines in a job's output (rank, exit code, signal), if any."""
    lines = output.splitlines()
    at = next((i for i, x in enumerate(lines) if "Root Cause (first observed failure)" in x), None)
    return [] if at is None else [x.strip() for x in lines[at + 1:at + 9] if x.strip() and not x.startswith("=")]


def restart_of(mode: str) -> str:
    """The trainer's ``--restart`` for a mode (``baseline``: none, Kubernetes restarts the pod)."""
    mode = mode.removesuffix("+local")
    return {"baseline": "none"}.get(mode, mode)


def launch_head(args, mode: str, port: int) -> Torchrun | Launcher | Spawn:
    """The launcher (both launcher modes; min-healthy when in-process restarts handle exceptions), spawn for
    ``inprocess`` (torchrun would stop the survivors of a SIGKILL; spawn lets them go on), else torchrun."""
    policy = "min-healthy" if restart_of(mode) == "launcher+inprocess" else "any-failed"
    return head_for(restart_of(mode), args.ranks, port, spawn=True, max_restarts=args.faults + 2, monitor_interval=0.2,
                    heartbeat_timeout=args.hang_timeout, initial_heartbeat_timeout=60, restart_policy=policy)


def run_mode(args, mode: str, faults: str, workdir: Path, label: str | None = None) -> tuple[dict, list[dict]]:
    """Run ``mode`` to the end (baseline: restarted like a pod) and analyze its events; ``label`` names the row."""
    label = label or mode
    workdir.mkdir(parents=True, exist_ok=True)
    metrics = workdir / "events.jsonl"
    log = EventLog(metrics, rank=0)
    t_start = time.time()
    restarts, res = 0, None

    def over() -> RunResult | None:
        """Run the job once: its result once it is over (exit 0, or a failure nobody starts again), else None."""
        nonlocal restarts, res
        res = run(launch_head(args, mode, free_port_pair()).argv(train_worker(args, workdir, mode, metrics, faults)),
                  timeout=args.timeout, env={"NVRX_LAB_METRICS": str(metrics),  # the launcher's events join the stream
                                             # flight-recorder dumps (a hang's, an in-process abort's) beside it
                                             "TORCH_FR_DUMP_TEMP_FILE": str((workdir / "nccl-trace").absolute() / "rank_")})
        for line in (x for x in res.output.splitlines() if x.startswith("[nvrx_lab.runner]")):
            print(f"[{label}] {line}", file=sys.stderr, flush=True)  # a helper that outlived the job, killed
        if res.returncode == 0:
            return res
        restarts += 1
        if mode == "baseline" and restarts <= args.faults + 2:
            return None  # Kubernetes starts the pod again, after back_off()
        print(f"[{label}] failed (exit {res.returncode}):\n{res.output[-2000:]}", file=sys.stderr)
        return res

    def back_off() -> float:
        """The pause before the pod starts again (pod restart + CrashLoopBackOff), in the event stream."""
        delay = crashloop_delay(restarts, args.pod_restart_s, args.time_scale)
        log.emit("pod_restart", reason=f"job exited {res.returncode}; pod restart + CrashLoopBackOff", delay_s=delay,
                 restart_count=restarts, job_log=root_cause(res.output))  # what the pod's log says (observe.attribute)
        return delay

    res = wait_for(over, float("inf"), f"the {label} job to end", interval=back_off)  # each run bounded by --timeout
    events = read_events(metrics)
    t_end = time.time()
    rep = analyze(events, ideal_step_s=args.ideal_step_s, t_start=t_start, t_end=t_end)
    print(format_report(rep, f"--- {label}"))
    return {"mode": label, **rep.row(), "exit": res.returncode, "t_start": t_start, "t_end": t_end,
            "events": str(metrics)}, events


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m nvrx_lab.bench goodput", description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=MODES)
    p.add_argument("--local-ckpt-interval", type=int, default=1, help="steps between local checkpoints (+local modes)")
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
    p.add_argument("--pairs", type=int, default=1, help="fault-free runs of each mode, interleaved with its faulty ones")
    p.add_argument("--quick", action="store_true", help="100 steps, 2 faults")
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error(f"--pairs must be at least 1 (each mode's fault-free twin), got {args.pairs}")
    if args.quick:
        args.steps, args.faults, args.ckpt_interval = 100, 2, 10
    schedule = format_schedule(make_schedule(args.faults, args.ranks, args.steps, seed=args.seed,
                                             first_step=min(10, args.steps // 4), kinds=tuple(args.kinds)))
    print(f"fault schedule: {schedule}; Kubernetes delays × {args.time_scale} (time scale)")
    root = Path(args.workdir) / time.strftime("%Y%m%d-%H%M%S")
    rows, clean = [], None
    if args.ideal_step_s is None:
        clean, _ = run_mode(args, "baseline", "", root / "fault-free", label="fault-free")
        args.ideal_step_s = clean["wall_s"] * clean["training_goodput"] / max(1, clean["steps"])
        rows.append(clean)
    for mode in args.modes:
        rows.append(paired(args, mode, schedule, root / mode.replace("+", "_"), clean if mode == "baseline" else None))
    report("goodput", rows, args.out, "python -m nvrx_lab.bench goodput " + shlex.join(argv or sys.argv[1:]),
           extra={"schedule": schedule, "time_scale": args.time_scale, "pairs": args.pairs,
                  "notes": [f"Kubernetes delays scaled by {args.time_scale} (time scale)", f"fault schedule {schedule}",
                            f"cost_per_fault_s: median of {args.pairs} paired run(s), (faulty - fault-free wall) / faults"]},
           columns=[c for c in rows[-1] if c not in HIDDEN])
    return 0 if all(r["exit"] == 0 and r.get("free_exit", 0) == 0 for r in rows) else 1


HIDDEN = ("events", "t_start", "t_end", "phases_median_s", "pairs", "cost_each_s", "free_exit", "back_median_s",
          "recovery_p95_s", "recovery_max_s", "price_median_s", "slow_lost_s")
"""Columns in the JSON only (the table would be too wide)."""


def peak_rss(row: dict) -> float:
    """The largest peak RSS (MiB) a trainer process of the run reached (its ``end`` event; 0 if none ended)."""
    return max((e.get("rss_peak_mib") or 0.0 for e in read_events(row["events"]) if e["kind"] == "end"), default=0.0)


def paired(args, mode: str, schedule: str, workdir: Path, first_free: dict | None) -> dict:
    """``args.pairs`` runs of ``mode`` with the faults, each after the same run without them; the last faulty run's
    row with the wall-clock cost per fault of the pairs, and every pair's figures under ``pairs``."""
    runs = []
    for i in range(args.pairs):
        free = first_free if i == 0 and first_free else run_mode(args, mode, "", workdir / f"free-{i}",
                                                                 label=f"{mode} fault-free ({i + 1}/{args.pairs})")[0]
        row, _ = run_mode(args, mode, schedule, workdir / f"faults-{i}", label=mode)
        runs.append((free, row))
    cost = paired_cost([(f["wall_s"], r["wall_s"]) for f, r in runs], args.faults)
    peaks = [(peak_rss(f), peak_rss(r)) for f, r in runs]  # each run's events read once
    rss = [faulty / free for free, faulty in peaks if free]
    row = runs[-1][1]
    row.update(rss_x=max(rss, default=float("nan")),  # a process's peak over all its attempts, against fault-free
               cost_per_fault_s=cost["cost_per_fault_s"], cost_each_s=cost["each_s"],
               cost_x_recovery=cost["cost_per_fault_s"] / row["recovery_mean_s"] if row["recovery_mean_s"] else
               float("nan"), free_wall_s=runs[-1][0]["wall_s"], free_exit=max(f["exit"] for f, _ in runs),
               pairs=[{"free_wall_s": f["wall_s"], "wall_s": r["wall_s"], "recovery_median_s": r["recovery_median_s"],
                       "price_median_s": r["price_median_s"], "events": r["events"], "free_events": f["events"]}
                      for f, r in runs])
    print(f"[{mode}] wall-clock cost per fault {cost['cost_per_fault_s']:.2f} s (median of {len(runs)} pair(s): "
          f"{', '.join(f'{c:.2f}' for c in cost['each_s'])}); recovery to full speed {row['recovery_mean_s']:.2f} s "
          f"and price {row['price_mean_s']:.2f} s a fault (means of the last run)", flush=True)
    return row
