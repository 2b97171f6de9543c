"""Recovery benchmark: fault -> every rank back at its next training step
=======================================================================

``python -m nvrx_lab.bench recovery [--ranks 2 4] [--faults-per-kind 10] [--quick]``

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
which every such rank trained (:func:`nvrx_lab.timeline.recovery_times`). The worker is
:mod:`nvrx_lab.recovery_worker`, run as ``python -m nvrx_lab.bench.recovery worker ...``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

from nvrx_lab.recovery_worker import KINDS, worker
from nvrx_lab.runner import Spawn, Torchrun, run
from nvrx_lab.table import median, p95, report
from nvrx_lab.timeline import recovery_times


# -- launching ------------------------------------------------------------------------------------
def _worker_cmd(mode: str, kind: str, faults: int, events: Path, a) -> list[str]:
    return ["-m", "nvrx_lab.bench.recovery", "worker", "--mode", mode, "--kind", kind, "--faults", str(faults),
            "--steps", str(a.steps), "--step-time", str(a.step_time), "--timeout", str(a.timeout),
            "--events", str(events)]


def run_mode(mode: str, kind: str, ranks: int, n: int, tmp: Path, a) -> tuple[list[float], int]:
    """Inject ``n`` faults of ``kind``; returns (recovery seconds of recovered faults, injected)."""
    env: dict[str, str] = {}
    events = tmp / f"{mode}-{kind}-{ranks}.jsonl"
    limit = 60 + n * (a.timeout + 30)
    if mode in ("nvrx_lab-inprocess", "nvrx-inprocess"):
        wmode = "inprocess" if mode == "nvrx_lab-inprocess" else "nvrx"
        jobs = [(1, i) for i in range(n)] if kind == "sigkill" else [(n, 0)]
        for faults, _ in jobs:
            run(Spawn(ranks).argv(_worker_cmd(wmode, kind, faults, events, a)), limit, env)
    elif mode.startswith("torchrun"):
        if mode == "torchrun-noshare":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        torchrun = Torchrun.c10d(ranks, max_restarts=n, monitor_interval=0.1)
        run(torchrun.argv(_worker_cmd("plain", kind, n, events, a)), limit, env)
    elif mode == "full-restart":
        for attempt in range(n + 1):  # a fresh job (and rendezvous port) each time
            run(Torchrun.c10d(ranks, max_restarts=0).argv(_worker_cmd("plain", kind, n, events, a)),
                60 + a.timeout + 30, {"NVRX_BENCH_ATTEMPT": str(attempt)})
    return recovery_times(events)


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
    ap = argparse.ArgumentParser(prog="python -m nvrx_lab.bench recovery", description=__doc__.splitlines()[0])
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
                    times, injected = run_mode(mode, kind, ranks, n, Path(tmp), a)
                    rows.append({"ranks": ranks, "kind": kind, "mode": mode, "median_s": median(times),
                                 "p95_s": p95(times), "recovered": f"{len(times)}/{injected}",
                                 "wall_s": time.monotonic() - t0})
                    print(f"[recovery] {ranks} ranks {kind:9s} {mode:20s} median {median(times):.3f} s "
                          f"({len(times)}/{injected})", flush=True)
    for r in rows:  # ratios against nvrx_lab in-process, same ranks and kind
        base = next((b for b in rows if b["ranks"] == r["ranks"] and b["kind"] == r["kind"]
                     and b["mode"] == "nvrx_lab-inprocess"), None)
        if base and "median_s" in r and base.get("median_s", 0) > 0:
            r["x_vs_nvrx_lab"] = r["median_s"] / base["median_s"]
    command = "python -m nvrx_lab.bench recovery " + shlex.join(argv)
    report("recovery", rows, a.out, command, extra={"faults_per_kind": n, "timeout_s": a.timeout},
           columns=["ranks", "kind", "mode", "median_s", "p95_s", "x_vs_nvrx_lab", "recovered", "wall_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
