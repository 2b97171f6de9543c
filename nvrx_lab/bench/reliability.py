"""``python -m nvrx_lab.bench reliability``: every reliability case at full counts, one table.

Each row is a case of :mod:`nvrx_lab.reliability` (real processes, real files): how many trials held
what the case promises, the wall time, and the figures it measured. The exit code is non-zero when
any trial did not hold; the failures are printed under the table and kept in the JSON.

    python -m nvrx_lab.bench reliability                 # full counts (~15 min on 2 cores)
    python -m nvrx_lab.bench reliability --quick         # small counts (~4 min)
    python -m nvrx_lab.bench reliability --cases crash,soak --seed 3
"""

from __future__ import annotations

import shlex
import sys
import tempfile
from pathlib import Path

from nvrx_lab.cli import Parser
from nvrx_lab.observe.table import report
from nvrx_lab.reliability import Row

GROUPS = ("crash", "corruption", "storage", "local", "soak", "section", "trainer", "bad_input")


def plan(args) -> list[tuple[str, callable]]:
    """(group, thunk) per case, counts from ``--quick`` or the flags."""
    from nvrx_lab.reliability import bad_input, checkpoint, local, restarts, trainer

    q = args.quick
    kills, ip_restarts, ln_restarts = (10, 20, 6) if q else (args.kills, args.inprocess_restarts, args.launcher_restarts)
    local_kills = 4 if q else args.local_kills
    phase, heartbeat = (4.0, 1.5) if q else (10.0, 3.0)
    w = args.work
    return [
        ("crash", lambda: checkpoint.sigkill_trainer_mid_save(w / "trainer_kill", trials=kills, seed=args.seed)),
        ("crash", lambda: checkpoint.sigkill_writer_mid_save(w / "writer_kill", trials=kills, seed=args.seed)),
        ("corruption", lambda: checkpoint.corruption(w / "corruption")),
        ("storage", lambda: checkpoint.disk_full(w / "disk_full")),
        ("storage", lambda: checkpoint.permission_denied(w / "permission")),
        ("local", lambda: local.sigkill_mid_replication(w / "local", trials=local_kills, seed=args.seed)),
        ("local", lambda: local.damaged_replica(w / "replica", rounds=1 if q else 5)),
        ("soak", lambda: restarts.inprocess_soak(w / "inprocess_soak", restarts=ip_restarts)),
        ("soak", lambda: restarts.launcher_soak(w / "launcher_soak", restarts=ln_restarts, seed=args.seed)),
        ("section", lambda: restarts.long_section_no_false_hang(w / "section", phase_s=phase,
                                                                heartbeat_timeout=heartbeat)),
        ("trainer", lambda: trainer.fault_during_save(w / "trainer")),
        ("trainer", lambda: trainer.fault_during_load(w / "trainer")),
        ("trainer", lambda: trainer.fault_during_restart(w / "trainer")),
        ("bad_input", lambda: bad_input.bad_input(w / "bad_input")),
    ]


def _figures(row: Row) -> str:
    parts = []
    for k, v in row.figures.items():
        if isinstance(v, dict):
            continue  # per-trial detail: in the JSON only
        parts.append(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="python -m nvrx_lab.bench reliability", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small counts (a smoke run)")
    ap.add_argument("--cases", default=",".join(GROUPS),
                    help=f"comma list of case groups: {', '.join(GROUPS)} (default: all)")
    ap.add_argument("--kills", type=int, default=100, help="SIGKILL trials each for the trainer and the writer")
    ap.add_argument("--local-kills", type=int, default=20, help="SIGKILLs of a job saving local checkpoints")
    ap.add_argument("--inprocess-restarts", type=int, default=100, help="consecutive in-process restarts")
    ap.add_argument("--launcher-restarts", type=int, default=50, help="launcher restarts (SIGKILL and hang mixed)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill moments and the fault order")
    ap.add_argument("--work", type=Path, default=None, help="working folder (default: a fresh temporary one)")
    ap.add_argument("--out", default="build/bench/reliability.json", help="JSON output")
    args = ap.parse_args(argv)
    groups = [g.strip() for g in args.cases.split(",") if g.strip()]
    if unknown := sorted(set(groups) - set(GROUPS)):
        ap.error(f"--cases: unknown {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    for name in ("kills", "inprocess_restarts", "launcher_restarts"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    with tempfile.TemporaryDirectory(prefix="nvrx-lab-reliability-") as tmp:
        args.work = args.work or Path(tmp)
        rows: list[Row] = []
        for group, run_case in plan(args):
            if group in groups:
                row = run_case()
                rows.append(row)
                print(f"[{row.case}] {row.passed}/{row.trials} in {row.seconds:.1f} s", file=sys.stderr, flush=True)
    table = [{"case": r.case, "held": f"{r.passed}/{r.trials}", "seconds": round(r.seconds, 1),
              "figures": _figures(r), "what must hold": r.holds} for r in rows]
    command = "python -m nvrx_lab.bench reliability " + shlex.join(argv if argv is not None else sys.argv[1:])
    report("reliability", table, args.out, command.strip(), extra={"cases": [r.as_dict() for r in rows]})
    failed = [r for r in rows if not r.ok]
    for r in failed:
        print(f"\n{r.case}: {r.trials - r.passed} of {r.trials} did not hold", file=sys.stderr)
        for why in r.failures:
            print(f"  - {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
