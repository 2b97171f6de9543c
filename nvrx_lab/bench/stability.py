"""``python -m nvrx_lab.bench stability``: run the README's trainer commands N times each; how often do they pass?

The three commands of the README, on 2 CPU ranks (smaller batches, same faults):

* ``plain`` — ``torch.distributed.run`` + ``nvrx_lab.train``, 8 steps, no faults
* ``inprocess`` — ``--restart inprocess`` with async checkpoints, an exception at step 12 and a hang at 25
* ``launcher`` — ``python -m nvrx_lab.launcher`` + ``--restart launcher``, a SIGKILL at 12 and a hang at 25

Each run gets a fresh folder (its own ``--ckpt-dir`` and ``--metrics``), a free port and a bounded
wait. A run *passes* when it exits 0, every scheduled fault fired (``fault`` events in its event
stream) and the last ``step`` event reached ``--steps``. ``--load K`` keeps K busy loops running
meanwhile (a shared, noisy machine). The folder of a failed run is kept; a passed one is removed.
The table also shows the steps trained again after the faults (not judged): with a checkpoint every
5 steps and faults at 12 and 25, a run that resumes from steps 10 and 20 redoes 5; one that never
resumes redoes 35.
"""

from __future__ import annotations

import contextlib
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nvrx_lab.cli import Parser
from nvrx_lab.faults import parse_schedule
from nvrx_lab.net import free_port_pair
from nvrx_lab.observe.events import read_events
from nvrx_lab.observe.goodput import analyze
from nvrx_lab.observe.table import median, report
from nvrx_lab.runner import Value, head_for, run, trainer

SMALL = dict(global_batch=4, seq_len=32, log_every=0)


@dataclass(frozen=True)
class Command:
    """One README command: how to launch it and what a successful run shows."""

    steps: int
    """``--steps`` of the trainer: the last step a passing run reaches."""
    faults: str = ""
    """``--faults`` schedule; every entry must fire once."""
    launcher: str = "torchrun"
    """``torchrun`` or ``launcher`` (``python -m nvrx_lab.launcher``)."""
    flags: dict[str, Value] = field(default_factory=dict)
    """Trainer flags besides steps, faults, sizes, ``--ckpt-dir`` and ``--metrics`` (per run), by field name."""


COMMANDS = {
    "plain": Command(8),
    "inprocess": Command(40, "1:12:exception,1:25:hang", flags=dict(
        ckpt="async", ckpt_interval=5, restart="inprocess", soft_timeout=3)),
    "launcher": Command(40, "1:12:sigkill,1:25:hang", launcher="launcher", flags=dict(
        restart="launcher", ckpt="async", ckpt_interval=5)),
}


def command_line(name: str, workdir: Path, port: int | str) -> list[str]:
    c = COMMANDS[name]
    head = head_for("launcher" if c.launcher == "launcher" else "none", 2, port, max_restarts=3, heartbeat_timeout=3,
                    monitor_interval=0.2)
    return head.argv(trainer(steps=c.steps, **SMALL, **c.flags, ckpt_dir=workdir / "ckpt",
                             metrics=workdir / "metrics.jsonl", faults=c.faults or None))


def judge(returncode: int, events: list[dict], steps: int, faults: str, timed_out: bool = False) -> str | None:
    """Why a run failed, or ``None`` when it passed (exit 0, every fault fired, last step reached)."""
    if timed_out:
        return "timed out"
    if returncode != 0:
        return f"exit code {returncode}"
    want = len(parse_schedule(faults))
    fired = sum(1 for e in events if e["kind"] == "fault")
    if fired != want:
        return f"{fired} of {want} scheduled faults fired"
    last = max((e["step"] for e in events if e["kind"] == "step"), default=0)
    if last < steps:
        return f"last step {last}, expected {steps}"
    return None


@dataclass
class Trial:
    command: str
    attempt: int
    exit: int
    wall_s: float
    reason: str | None
    """Why it failed; ``None``: passed."""
    workdir: str
    """The run's folder, kept when it failed; empty: passed, folder removed."""
    tail: str
    """Last lines of the run's output."""
    rollback_steps: int | None = None
    """Steps trained again after the faults (:func:`nvrx_lab.observe.goodput.analyze`): not judged, but a run that
    never resumes from a checkpoint redoes everything since step 0."""


def run_once(name: str, attempt: int, root: Path, timeout: float) -> Trial:
    workdir = Path(tempfile.mkdtemp(prefix=f"{name}-{attempt}-", dir=root))
    res = run(command_line(name, workdir, free_port_pair()), timeout=timeout)
    events = read_events(workdir / "metrics.jsonl")
    c = COMMANDS[name]
    reason = judge(res.returncode, events, c.steps, c.faults, res.timed_out)
    if reason is None:
        shutil.rmtree(workdir, ignore_errors=True)
    tail = "\n".join(res.output.rstrip().splitlines()[-15:])
    rollback = sum(f.rollback_steps for f in analyze(events).faults) if events else None
    return Trial(name, attempt, res.returncode, round(res.wall_s, 2), reason, "" if reason is None else str(workdir),
                 tail, rollback)


@contextlib.contextmanager
def busy_load(k: int):
    """``k`` busy-loop processes for the duration of the block; always stopped, on Ctrl-C or SIGTERM too."""
    procs: list[subprocess.Popen] = []
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM unwinds like Ctrl-C
    try:
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
        signal.signal(signal.SIGTERM, previous)


def summarize(trials: list[Trial], names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        mine = [t for t in trials if t.command == name]
        passed = sum(t.reason is None for t in mine)
        rows.append({"command": name, "runs": len(mine), "passed": passed, "failed": len(mine) - passed,
                     "exit_codes": dict(sorted(Counter(t.exit for t in mine).items())),
                     "median_wall_s": median([t.wall_s for t in mine]),
                     "median_rollback_steps": median([t.rollback_steps for t in mine if t.rollback_steps is not None])})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m nvrx_lab.bench stability", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs of each command")
    p.add_argument("--commands", nargs="+", default=list(COMMANDS), choices=list(COMMANDS))
    p.add_argument("--load", type=int, default=0, metavar="K", help="busy-loop processes running meanwhile")
    p.add_argument("--timeout", type=float, default=240, help="seconds before a run is killed (and failed)")
    p.add_argument("--workdir", default=None, help="where run folders go (default: a temporary folder)")
    p.add_argument("--out", default="build/bench/stability.json")
    args = p.parse_args(argv)
    if args.runs < 1 or args.load < 0:
        p.error("--runs must be >= 1 and --load >= 0")
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="nvrx-stability-", dir=args.workdir))
    trials: list[Trial] = []
    print(f"{args.runs} run(s) each of {', '.join(args.commands)}; load {args.load}; run folders under {root}")
    try:
        with busy_load(args.load):
            for attempt in range(1, args.runs + 1):  # round robin: a slow spell of the machine hits every command
                for name in args.commands:
                    t = run_once(name, attempt, root, args.timeout)
                    trials.append(t)
                    verdict = "ok" if t.reason is None else f"FAILED: {t.reason} (kept {t.workdir})"
                    print(f"[{name} {attempt}/{args.runs}] exit {t.exit} in {t.wall_s:.1f} s: {verdict}", flush=True)
    except KeyboardInterrupt:
        print(f"interrupted after {len(trials)} run(s): run and load processes stopped; folders under {root}",
              file=sys.stderr)
        return 130
    if not any(Path(root).iterdir()):
        root.rmdir()
    for name in args.commands:
        first = next((t for t in trials if t.command == name and t.reason is not None), None)
        if first is not None:
            print(f"\n--- first failure of {name} (run {first.attempt}: {first.reason}), last lines:\n{first.tail}")
    print()
    rows = summarize(trials, args.commands)
    cmdlines = {n: shlex.join(command_line(n, Path("RUN"), "PORT")) for n in args.commands}
    report("stability", rows, args.out, "python -m nvrx_lab.bench stability " + shlex.join(argv or sys.argv[1:]),
           extra={"load": args.load, "timeout_s": args.timeout, "commands": cmdlines,
                  "trials": [asdict(t) for t in trials]})
    return 0 if all(r["failed"] == 0 for r in rows) else 1
