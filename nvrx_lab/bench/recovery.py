"""Recovery benchmark: fault -> every rank back at its next training step
=======================================================================

``python -m nvrx_lab.bench recovery [--ranks 2 4] [--faults-per-kind 10] [--quick]``; in-process restart
alone from 2 to 16 real ranks: ``--ranks 2 4 8 16 --kinds exception --modes nvrx_lab-inprocess``.

Deterministic faults on rank 1 (exception, hang, SIGKILL) in a small gloo training loop (one
``all_reduce`` + ``--step-time`` sleep a step), each mode side by side in the same run:

* ``nvrx_lab-inprocess`` — :class:`nvrx_lab.inprocess.Wrapper` under
  ``nvrx_lab.inprocess.spawn`` (survivors keep running); many faults in one job, one job per
  SIGKILL (a dead rank is not replaced in process);
* ``nvrx-inprocess`` — NVRx's ``inprocess.Wrapper``: run only if importable (``pip install
  .[peers]``), else reported as skipped;
* ``torchrun`` — ``torchrun --max-restarts N`` (c10d rendezvous), default and with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``;
* ``full-restart`` — the whole job torn down and started again by this script (what a Kubernetes
  pod restart does, without the pod-start delay).

Hangs: the in-process wrapper interrupts after ``soft_timeout``; the other modes only notice
when the peer's gloo collective times out, set to the same value here (default 30 min!).
Each fault is timed from the ``fault`` event (written just before it is injected) to the last
first-step-of-the-next-attempt among the ranks that train again; ``recovered`` counts faults after
which every such rank trained (:func:`nvrx_lab.observe.timeline.recovery_times`). ``step_s`` is a step that
follows no fault at the same world size (:func:`nvrx_lab.observe.timeline.step_periods`), and ``x_step`` the recovery
in such steps: every recovery ends with one step, and on a box with fewer cores than ranks a step grows with
the world size. In-process rows add where the time went (``detect_s`` … ``rendezvous_s``: each restart's
slowest rank, from its ``restart`` events), and every row counts the processes of its jobs still alive
afterwards (``left_running``, then killed); a job that ran past its limit, or a wrapped rank killed outright,
is an ``error`` with the output. Time limits grow with the world size (every rank imports torch on the same
cores). The worker is :mod:`nvrx_lab.demo.recovery_worker`, run as ``python -m nvrx_lab.bench.recovery worker ...``.
"""

from __future__ import annotations

import shlex
import sys
import tempfile
import time
from pathlib import Path

from nvrx_lab.bench._procs import TAG_VAR, leftovers, new_tag
from nvrx_lab.cli import Parser
from nvrx_lab.demo.recovery_worker import KINDS, worker
from nvrx_lab.observe.events import read_events
from nvrx_lab.observe.table import exit_status, median, p95, report
from nvrx_lab.observe.timeline import recovery_times, step_periods
from nvrx_lab.runner import Spawn, Torchrun, run

PHASES = ("detect_s", "abort_s", "health_s", "rendezvous_s")
"""The in-process restart's phases, as its ``restart`` events record them."""


# -- launching ------------------------------------------------------------------------------------
def _worker_cmd(mode: str, kind: str, faults: int, events: Path, a, ranks: int, attempt: int | None = None) -> list[str]:
    """The worker's flags. Its hard and heartbeat timeouts grow with the world size: on 2 cores a rank's
    restart work (the garbage collection of the health phase, the rendezvous) runs ``ranks / 2`` times
    slower, and a rank that is not training again within the hard timeout is killed (16 ranks, 5 s: killed)."""
    return ["-m", "nvrx_lab.bench.recovery", "worker", "--mode", mode, "--faults", f"1:0-{faults - 1}:3:{kind}",
            "--steps", str(a.steps), "--step-time", str(a.step_time), "--timeout", str(a.timeout),
            "--hard-timeout", str(a.timeout + 3 + ranks), "--heartbeat-timeout", str(2 + ranks / 4),
            "--events", str(events), *(["--attempt", str(attempt)] if attempt is not None else [])]


def run_mode(mode: str, kind: str, ranks: int, n: int, tmp: Path, a) -> dict:
    """Inject ``n`` faults of ``kind``: recovery seconds of the recovered faults, faults injected, processes
    left running, and an error (with the output's tail) for a job that ran past its time limit."""
    tag = new_tag(f"recovery-{ranks}")
    env: dict[str, str] = {TAG_VAR: tag}
    events = tmp / f"{mode}-{kind}-{ranks}.jsonl"
    start = 60 + 4 * ranks  # every rank imports torch on 2 cores: start-up grows with the world size
    one, limit = start + a.timeout + 30 + ranks, start + n * (a.timeout + 30 + ranks)
    results = []
    if mode in ("nvrx_lab-inprocess", "nvrx-inprocess"):
        wmode = "inprocess" if mode == "nvrx_lab-inprocess" else "nvrx"
        for faults in ([1] * n if kind == "sigkill" else [n]):  # a dead rank is not replaced: one job per SIGKILL
            results.append(run(Spawn(ranks).argv(_worker_cmd(wmode, kind, faults, events, a, ranks)),
                               one if faults == 1 else limit, env))
    elif mode.startswith("torchrun"):
        if mode == "torchrun-noshare":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        torchrun = Torchrun.c10d(ranks, max_restarts=n, monitor_interval=0.1)
        results.append(run(torchrun.argv(_worker_cmd("plain", kind, n, events, a, ranks)), limit, env))
    elif mode == "full-restart":
        for attempt in range(n + 1):  # a fresh job (and rendezvous port) each time
            cmd = _worker_cmd("plain", kind, n, events, a, ranks, attempt)
            results.append(run(Torchrun.c10d(ranks, max_restarts=0).argv(cmd), one, env))
    times, injected = recovery_times(events) if events.exists() else ([], 0)
    bad = [r for r in results if r.timed_out or (mode.endswith("inprocess") and (  # spawn: a killed rank is no error
        r.returncode != 0 or (kind != "sigkill" and "was killed by" in r.output)))]
    error = (f"{len(bad)} job(s) timed out or failed; last output:\n{bad[-1].output[-2000:]}" if bad else
             None if injected else f"no fault was injected; output:\n{results[-1].output[-2000:]}")
    return {"times": times, "injected": injected, "left": leftovers(tag), "error": error, "events": events}


def restart_phases(events: Path) -> dict[str, float]:
    """Where an in-process restart's time goes: per restart the slowest rank's seconds in each phase of
    its ``restart`` events (:mod:`nvrx_lab.inprocess.restart_log`), then the median over restarts."""
    per: dict[tuple, dict[str, float]] = {}
    for e in (read_events(events, "restart") if events.exists() else []):
        slot = per.setdefault((e["iteration"], e.get("t_fault")), {})
        for f in PHASES:
            slot[f] = max(slot.get(f, 0.0), e.get(f) or 0.0)
    return {f: median([s[f] for s in per.values()]) for f in PHASES} if per else {}


def _row(ranks: int, kind: str, mode: str, r: dict, t0: float) -> dict:
    times, left = r["times"], r["left"]
    steps = step_periods(r["events"]) if r["events"].exists() else []
    row = {"ranks": ranks, "kind": kind, "mode": mode, "median_s": median(times), "p95_s": p95(times),
           "step_s": median(steps), "x_step": median(times) / median(steps) if steps else float("nan"),
           "recovered": f"{len(times)}/{r['injected']}", **restart_phases(r["events"]), "left_running": len(left),
           "wall_s": time.monotonic() - t0}
    print(f"[recovery] {ranks} ranks {kind:9s} {mode:20s} median {median(times):.3f} s ({len(times)}/{r['injected']})"
          + (f"; LEFT RUNNING: {left}" if left else ""), flush=True)
    if r["error"]:
        row["error"] = r["error"]
        print(f"[recovery] error: {r['error']}", flush=True)
    return row


def _nvrx_available() -> bool:
    try:
        import nvidia_resiliency_ext.inprocess  # noqa: F401
        return True
    except Exception:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    ap = Parser(prog="python -m nvrx_lab.bench recovery", description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2], help="world sizes to run (e.g. 2 4)")
    ap.add_argument("--faults-per-kind", type=int, default=10, help="faults injected per kind and mode")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    modes = ["nvrx_lab-inprocess", "nvrx-inprocess", "torchrun", "torchrun-noshare", "full-restart"]
    ap.add_argument("--modes", nargs="+", default=modes, choices=modes)
    ap.add_argument("--timeout", type=float, default=2.0, help="soft timeout (in-process) = gloo timeout (others), s")
    ap.add_argument("--steps", type=int, default=6, help="steps per attempt")
    ap.add_argument("--step-time", type=float, default=0.05, help="sleep per step (s)")
    ap.add_argument("--quick", action="store_true", help="2 faults per kind")
    ap.add_argument("--out", default="build/bench/recovery.json")
    a = ap.parse_args(argv)
    n = 2 if a.quick else a.faults_per_kind
    rows = []
    with tempfile.TemporaryDirectory(prefix="nvrx_recovery_") as tmp:
        for ranks in a.ranks:
            for kind in a.kinds:
                for mode in a.modes:
                    if mode == "nvrx-inprocess" and not _nvrx_available():
                        print(f"[recovery] {mode}: skipped (nvidia_resiliency_ext not importable; pip install .[peers])")
                        rows.append({"ranks": ranks, "kind": kind, "mode": mode, "recovered": "skipped"})
                        continue
                    t0 = time.monotonic()
                    rows.append(_row(ranks, kind, mode, run_mode(mode, kind, ranks, n, Path(tmp), a), t0))
    for r in rows:  # ratios against nvrx_lab in-process, same ranks and kind
        base = next((b for b in rows if b["ranks"] == r["ranks"] and b["kind"] == r["kind"]
                     and b["mode"] == "nvrx_lab-inprocess"), None)
        if base and "median_s" in r and base.get("median_s", 0) > 0:
            r["x_vs_nvrx_lab"] = r["median_s"] / base["median_s"]
        small = next((b for b in rows if b["ranks"] == min(a.ranks) and b["kind"] == r["kind"]
                      and b["mode"] == r["mode"]), None)  # the target: 16 ranks <= 2x 2 ranks
        if small and "median_s" in r and small.get("median_s", 0) > 0:
            r["x_vs_fewest_ranks"] = r["median_s"] / small["median_s"]
    command = "python -m nvrx_lab.bench recovery " + shlex.join(argv)
    report("recovery", rows, a.out, command, extra={"faults_per_kind": n, "timeout_s": a.timeout},
           columns=["ranks", "kind", "mode", "median_s", "p95_s", "step_s", "x_step", "x_vs_nvrx_lab", "x_vs_fewest_ranks",
                    "recovered", *PHASES, "left_running", "wall_s"])
    return exit_status([f"{r['ranks']} ranks {r['kind']} {r['mode']}" for r in rows if r.get("error")])


if __name__ == "__main__":
    sys.exit(main())
