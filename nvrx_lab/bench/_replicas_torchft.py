"""torchft 0.2.0's side of ``python -m nvrx_lab.bench replicas``: :func:`run_torchft` runs one fault, returns one row.

A lighthouse (``torchft_lighthouse``, with the README's settings) and R replica groups of one rank
(:mod:`._torchft_replica`, each its own process) train our small model on loopback. Once every group's Manager is
up, they start together; replica :data:`VICTIM` injects the fault at ``fault_step``. This process supervises them
as ``torchrun --max-restarts`` would (a replica that exits non-zero is started again at once), and, as a hang
watchdog, kills a hung victim after :attr:`Timeouts.hang_hold_s`. When the replacement has trained a few steps
(and the run ``steps``), every group stops at the same committed step (a stop file, written atomically: a group
that leaves early looks like a failure to the others).

The lighthouse runs as the README runs it, a process of its own (its log: ``OUT/lighthouse.log``): in this
process its Rust logger would write a line to our stderr per quorum, a few hundred per row. The figures are read
from the event streams only (``OUT/replica<R>.jsonl``, ``OUT/launcher.jsonl``); see :func:`measure`.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from nvrx_lab.dist import child_env
from nvrx_lab.net import free_port, wait_for
from nvrx_lab.observe.events import EventLog, read_events

SYSTEM = "torchft 0.2.0"
VICTIM = 1
"""The replica group the fault hits (``nvrx_lab.bench.replicas`` hits the same one of ours)."""
FAULTS = ("none", "exception", "sigkill", "hang")
MODEL = ["--seq-len", "32", "--dim", "64", "--n-layers", "2", "--n-heads", "2", "--hidden-dim", "128",
         "--global-batch", "12"]
GLOBAL_BATCH = 12
THREADS = 1
"""torch threads per replica: with 2 on 2 cores (3 processes) a step took 56-105 ms instead of 21-25 ms."""
JOINED_STEPS = 3
"""Participating commits the replacement makes before the run stops."""


@dataclass(frozen=True)
class Timeouts:
    """What decides how long a fault stalls the survivors under torchft."""

    join_timeout_ms: int = 10000
    """Lighthouse: how long a quorum waits for a replica that heartbeats but has not asked to join (a hung one)."""
    heartbeat_timeout_ms: int = 5000
    """Lighthouse: a replica whose last heartbeat is older is dead (a crashed one)."""
    quorum_tick_ms: int = 100
    """Lighthouse: how often a pending quorum is computed again."""
    pg_timeout_s: float = 5.0
    """``ProcessGroupGloo(timeout=)``: a collective with a hung peer fails after this long."""
    manager_timeout_s: float = 30.0
    """``Manager(timeout=)``."""
    quorum_timeout_s: float = 60.0
    """``Manager(quorum_timeout=)``: a quorum that cannot form fails after this long."""

    @property
    def hang_hold_s(self) -> float:
        """How long the watchdog leaves a hung victim: until torchft has gone on without it (the gloo timeout,
        then the lighthouse's join timeout, as the hung replica keeps heartbeating), and 2 s more."""
        return self.pg_timeout_s + self.join_timeout_ms / 1000 + 2.0


README = Timeouts()
"""torchft's README (``torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``, heartbeat
timeout at its default) and ``train_ddp.py`` (gloo 5 s)."""
TUNED = Timeouts(join_timeout_ms=500, heartbeat_timeout_ms=500, quorum_tick_ms=20, pg_timeout_s=1.0,
                 manager_timeout_s=10.0, quorum_timeout_s=30.0)
"""Timeouts cut as far as this machine allows without evicting healthy replicas."""


def _env() -> dict[str, str]:
    """A child's environment: gloo on loopback, one OpenMP thread, and no ``TORCHFT_*`` variable of ours (they
    would override the Manager's arguments, ``torchft/manager.py:251-268``)."""
    env = child_env({"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "RUST_BACKTRACE": "1"})
    return {k: v for k, v in env.items() if not k.startswith("TORCHFT_")}


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_lighthouse(t: Timeouts, out: Path) -> tuple[subprocess.Popen, str]:
    """``torchft_lighthouse`` on loopback at a free port; the process and its address once it listens."""
    port = free_port()
    exe = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent)) or "torchft_lighthouse"
    argv = [exe, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}", "--join_timeout_ms", str(t.join_timeout_ms),
            "--quorum_tick_ms", str(t.quorum_tick_ms), "--heartbeat_timeout_ms", str(t.heartbeat_timeout_ms)]
    with open(out / "lighthouse.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=_env())

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"torchft_lighthouse exited {proc.returncode}")
        return _listening(port)

    wait_for(up, 30, "torchft_lighthouse to listen")
    return proc, f"http://127.0.0.1:{port}"


class Replicas:
    """The replica groups' processes, supervised as ``torchrun --max-restarts`` supervises its workers; each spawn,
    exit and kill is an event of ``OUT/launcher.jsonl``."""

    def __init__(self, out: Path, argv: list[str], replicas: int, fault_argv: list[str], max_restarts: int = 3):
        self.out, self.argv, self.fault_argv, self.max_restarts = out, argv, fault_argv, max_restarts
        self.events = EventLog(out / "launcher.jsonl", rank=-1)
        self.incarnation: dict[int, int] = {}
        self.procs: dict[int, subprocess.Popen] = {}
        self.everyone: list[subprocess.Popen] = []
        for r in range(replicas):
            self.spawn(r)

    def spawn(self, r: int) -> None:
        """Start replica ``r`` (again); only its first incarnation gets the fault."""
        inc = self.incarnation[r] = self.incarnation.get(r, -1) + 1
        argv = [*self.argv, "--replica", str(r), "--incarnation", str(inc), "--events", str(self.out / f"replica{r}.jsonl"),
                *(self.fault_argv if inc == 0 else [])]
        with open(self.out / f"replica{r}.{inc}.log", "w") as log:
            self.procs[r] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                             env=_env())
        self.everyone.append(self.procs[r])
        self.events.emit("spawn", replica=r, incarnation=inc, pid=self.procs[r].pid)

    def supervise(self) -> None:
        """Start again each replica whose process exited non-zero; out of restarts: ``RuntimeError``."""
        for r, p in list(self.procs.items()):
            if p.poll() is None or p.returncode == 0:
                continue
            self.events.emit("exit", replica=r, incarnation=self.incarnation[r], returncode=p.returncode)
            if self.incarnation[r] >= self.max_restarts:
                raise RuntimeError(f"replica {r} exited {p.returncode} after {self.max_restarts} restarts")
            self.spawn(r)

    def kill(self, r: int) -> None:
        self.events.emit("kill", replica=r, incarnation=self.incarnation[r])
        _killpg(self.procs[r])

    def close(self) -> None:
        for p in self.everyone:
            _killpg(p)
        self.events.close()


def _killpg(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def _committed(out: Path, r: int) -> list[dict]:
    return [e for e in read_events(out / f"replica{r}.jsonl", "step") if e["committed"]]


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader never sees it half written


def _train(group: Replicas, out: Path, fault: str, steps: int, hold_s: float, timeout_s: float) -> None:
    """Start every group together, wait for the fault and the replacement's return (killing a hung victim after
    ``hold_s``), then stop every group at one committed step."""
    n = len(group.procs)
    wait_for(lambda: all(read_events(out / f"replica{r}.jsonl", "ready") for r in range(n)), timeout_s,
             "every Manager to be up", interval=0.1, on_poll=group.supervise)
    _write_atomically(out / "go", "go")
    killed = []

    def watchdog() -> None:
        group.supervise()
        hung = read_events(out / f"replica{VICTIM}.jsonl", "fault") if fault == "hang" and not killed else []
        if hung and time.time() >= hung[0]["t"] + hold_s:
            group.kill(VICTIM)
            killed.append(VICTIM)

    def done() -> bool:
        reached = min(max((e["step"] for e in _committed(out, r)), default=0) for r in range(n)) >= steps
        return reached and (fault == "none" or len(_rejoined(read_events(out / f"replica{VICTIM}.jsonl", "step")))
                            >= JOINED_STEPS)

    wait_for(done, timeout_s, f"{steps} committed steps and the replacement back", interval=0.2, on_poll=watchdog)
    last = max(e["step"] for r in range(n) for e in _committed(out, r))
    _write_atomically(out / "stop", str(last + 3))
    wait_for(lambda: all(p.poll() is not None for p in group.procs.values()), 30, "every group to stop", interval=0.1)
    if codes := {r: p.returncode for r, p in group.procs.items() if p.returncode}:
        raise RuntimeError(f"replica groups exited non-zero at the end: {codes}")


def _tails(out: Path, chars: int = 1500) -> str:
    return "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in sorted(out.glob("*.log")))


def run_torchft(fault: str, out: Path, replicas: int = 3, steps: int = 40, fault_step: int = 15, tuned: bool = False,
                timeout_s: float = 120.0, model: list[str] = MODEL) -> dict:
    """One torchft run with ``fault`` (one of :data:`FAULTS`) on replica :data:`VICTIM` at ``fault_step``; its row.

    Keys: ``system``, ``fault``, ``survivor_stall_x``, ``steps_lost``, ``heal_s``, ``samples_lost``,
    ``samples_duplicated``, ``goodput`` (1.0 for ``none``; else None: the caller divides ``samples_per_s`` by a
    fault-free run's), ``samples_per_s``, ``median_step_s``, ``wall_s``, ``log_dir`` (see :func:`measure`).
    A run that times out, loses a replica for good or commits nothing raises ``RuntimeError`` with the logs' tails."""
    if fault not in FAULTS or not 4 <= fault_step <= steps - 4 or replicas < 2:
        raise ValueError(f"fault {fault!r} (one of {FAULTS}), 4 <= fault_step ({fault_step}) <= steps - 4 ({steps - 4}) "
                         f"and replicas >= 2 ({replicas})")
    t, out = (TUNED if tuned else README), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.jsonl"), *out.glob("*.log"), out / "go", out / "stop"]:
        old.unlink(missing_ok=True)
    t0, lighthouse, group = time.monotonic(), None, None
    try:
        lighthouse, address = start_lighthouse(t, out)
        argv = [sys.executable, "-m", "nvrx_lab.bench._torchft_replica", "--replicas", str(replicas),
                "--lighthouse", address, "--go", str(out / "go"), "--stop", str(out / "stop"),
                "--pg-timeout", str(t.pg_timeout_s), "--manager-timeout", str(t.manager_timeout_s),
                "--quorum-timeout", str(t.quorum_timeout_s), "--threads", str(THREADS), *model]
        faulty = [] if fault == "none" else ["--fault", fault, "--fault-step", str(fault_step), "--victim", str(VICTIM)]
        group = Replicas(out, argv, replicas, faulty)
        _train(group, out, fault, steps, t.hang_hold_s, timeout_s)
        row = measure(out, replicas, VICTIM if fault != "none" else None, GLOBAL_BATCH)
    except (RuntimeError, TimeoutError, ValueError) as e:  # ValueError: a figure with nothing to measure
        raise RuntimeError(f"torchft {fault} run failed: {e} (logs in {out}){_tails(out)}") from None
    finally:
        if group is not None:
            group.close()
        if lighthouse is not None:
            _killpg(lighthouse)
    return {"system": f"{SYSTEM} ({'tuned' if tuned else 'README'})", "fault": fault, **row,
            "goodput": 1.0 if fault == "none" else None, "wall_s": time.monotonic() - t0, "log_dir": str(out)}


def _rejoined(steps: list[dict]) -> list[dict]:
    """A replica's participating commits after its first incarnation (its replacement's, back in the quorum)."""
    return [e for e in steps if e["incarnation"] > 0 and e["committed"] and e["participating"]]


def measure(out: Path, replicas: int, victim: int | None, global_batch: int) -> dict:
    """A run's figures from its event streams (``victim`` None: a fault-free run):

    * ``median_step_s`` — the survivors' median time between two commits, after step 2 and before the fault;
    * ``survivor_stall_x`` — their longest time between two commits from the fault until the replacement's first
      participating commit (the rejoin included) ÷ ``median_step_s``;
    * ``steps_lost`` — the most attempts a survivor did not commit after the fault, plus any committed step it
      went back on;
    * ``heal_s`` — the replacement's spawn to its first participating commit;
    * ``samples_lost`` / ``samples_duplicated`` — of the global sample sequence up to the last committed step
      (step ``k`` of a fault-free run trains samples ``B(k-1) .. Bk - 1``): samples no committed, participating
      step trained, and trainings of a sample beyond its first;
    * ``samples_per_s`` — distinct samples trained after the first commit ÷ the first commit to the last."""
    steps = {r: read_events(out / f"replica{r}.jsonl", "step") for r in range(replicas)}
    commits = {r: [e for e in s if e["committed"]] for r, s in steps.items()}
    faults = read_events(out / f"replica{victim}.jsonl", "fault") if victim is not None else [{"t": math.inf}]
    if not all(commits.values()) or not faults:
        raise RuntimeError(f"a replica group committed no step, or the fault did not fire (see {out})")
    t_fault, survivors = faults[0]["t"], [r for r in range(replicas) if r != victim]
    since = 0.0 if victim is None else t_fault
    pairs = {r: list(pairwise(commits[r])) for r in survivors}
    gaps = [(b, b["t"] - a["t"]) for r in survivors for a, b in pairs[r]]
    median = statistics.median(g for b, g in gaps if b["step"] > 2 and b["t"] < t_fault)
    lost = max(sum(1 for e in steps[r] if e["t"] > since and not e["committed"])
               + sum(max(0, a["step"] - b["step"] + 1) for a, b in pairs[r] if b["t"] > since)
               for r in survivors)
    row = {"survivor_stall_x": None, "steps_lost": lost, "heal_s": None, **_ledger(steps, global_batch),
           "median_step_s": median}
    if victim is None:
        return row
    joined = _rejoined(steps[victim])
    spawns = [e for e in read_events(out / "launcher.jsonl", "spawn") if e["replica"] == victim and e["incarnation"] == 1]
    if not joined or not spawns:
        raise RuntimeError(f"replica {victim}'s replacement never trained in the quorum (see {out})")
    stall = max(g for b, g in gaps if b["t"] > t_fault and b["step"] <= joined[0]["step"])
    return {**row, "survivor_stall_x": stall / median, "heal_s": joined[0]["t"] - spawns[0]["t"]}


def _ledger(steps: dict[int, list[dict]], global_batch: int) -> dict:
    commits = [e for s in steps.values() for e in s if e["committed"]]
    trained = Counter(i for e in commits if e["participating"] for i in e["sample_ids"])
    horizon = max(e["step"] for e in commits) * global_batch
    first, last = min(commits, key=lambda e: e["t"]), max(e["t"] for e in commits)
    fresh = {i for e in commits if e["participating"] and e["step"] > first["step"] for i in e["sample_ids"]}
    return {"samples_lost": sum(1 for i in range(horizon) if not trained[i]),
            "samples_duplicated": sum(n - 1 for n in trained.values()),
            "samples_per_s": len(fresh) / (last - first["t"])}
