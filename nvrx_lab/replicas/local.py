"""Replica groups on one machine: a coordinator and R torchrun jobs of the trainer, as a cluster would run them.

::

    python -m nvrx_lab.replicas.local --replicas 3 --nproc 1 --out build/replicas -- --steps 30 --faults 1:10:sigkill

Each replica group is ``torchrun --max-restarts K -m nvrx_lab.train --restart replicas --replica-id R ...`` with its
event stream at ``OUT/replica<R>.jsonl`` and output at ``OUT/replica<R>.log``; torchrun replaces a failed group's
workers (the replacement heals from a live replica). The coordinator runs in this process (on EKS: a StatefulSet
behind a Service) and writes ``OUT/coordinator.jsonl``; ``--coordinator-fault STEP[:DELAY]`` crashes it once step
``STEP`` is committed (every connection and its store close, as when its process dies) and starts a new one on the same
address ``DELAY`` seconds later (1 s by default), as a restarted pod behind its Service: the ranks reconnect and it
rebuilds the quorum from what they report (:mod:`.admission`). The arguments after ``--`` go to every group's trainer; a
fault's rank counts across the groups (replica id x ``--nproc`` + rank). At the end: one line per group, the
ledger's line (:mod:`.ledger`), and the exit code of the worst group; each fault and heal is said as it happens, and
what the faults cost the others at the end (:mod:`.console`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from nvrx_lab.dist import child_env
from nvrx_lab.net import free_port, listen, shared_secret, wait_for
from nvrx_lab.observe.events import EventLog
from nvrx_lab.runner import LOOPBACK, Torchrun, Worker

from . import ledger
from .console import Narrator
from .coordinator import Coordinator
from .server import serve

GROUP_ENV = {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""A group's torchrun: one torch thread a worker; a store of its own for each restart round (torchrun's shared one
keeps the last round's gloo addresses under the same keys, and a restarted worker dialled a dead peer's)."""


TRAINER = "nvrx_lab.train"


@dataclass(frozen=True)
class Groups:
    """The replica groups of a local run: ``replicas`` torchrun jobs of ``nproc`` ranks, each running ``module`` (the
    trainer, or a script of one's own that takes the same replica flags: ``nvrx_lab.demo.replica_worker``)."""

    replicas: int
    nproc: int = 1
    max_restarts: int = 3
    """Replacements of each group's workers (torchrun's ``--max-restarts``)."""
    min_replicas: int = 1
    module: str = TRAINER
    await_replacements: bool = False
    """The last step waits until every lost group's replacement joined, or its torchrun gave up (``--await-replacements``)."""


def group_argv(replica: int, groups: Groups, coordinator: str, out: Path, train_args: list[str]) -> list[str]:
    """One replica group's command line: torchrun (its own c10d rendezvous) and the worker module."""
    worker = Worker.of(groups.module, *train_args, restart="replicas", coordinator=coordinator, replica_id=replica,
                       replicas=groups.replicas, metrics=out / f"replica{replica}.jsonl")
    return Torchrun.c10d(groups.nproc, max_restarts=groups.max_restarts, monitor_interval=0.1).argv(worker)


class CoordinatorHost:
    """The coordinator in this process, on a fixed port; :meth:`crash` does to its ranks what its process dying does."""

    def __init__(self, replicas: int, min_replicas: int, events: Path, await_replacements: bool = False):
        self.replicas, self.min_replicas, self.events, self.awaits = replicas, min_replicas, events, await_replacements
        self.port = free_port()
        self.start()

    def start(self) -> None:
        self.coord = Coordinator(self.replicas, self.min_replicas, emit=EventLog(self.events, rank=-1).emit,
                                 secret=shared_secret(),  # $NVRX_LAB_REPLICA_SECRET, which every group inherits
                                 await_replacements=self.awaits)
        ready, self.stop = threading.Event(), threading.Event()
        self.listener = listen(LOOPBACK, self.port)
        self.thread = threading.Thread(target=serve, args=(self.coord, LOOPBACK, self.port, ready, self.stop),
                                       kwargs={"server": self.listener}, daemon=True)
        self.thread.start()
        wait_for(ready.is_set, 30, "the coordinator to listen")

    def crash(self) -> int | None:
        """At once, as a process's death: the listening socket closes (a rank that reconnects finds nobody, not the
        dying coordinator), then every connection (the dead coordinator decides nothing more: its reader threads find
        no member to drop); then its accept loop ends and the groups' store is released. Returns the last step it
        committed, read as it dies (under its lock: a join a moment later could commit one more)."""
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        with self.coord.lock:
            conns = [c for m in self.coord.members.values() for c in m.conns.values()]
            self.coord.members, self.coord.emit, committed = {}, lambda kind, **f: None, self.coord.committed
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self.stop.set()
        self.thread.join(10)
        self.listener.close()
        return committed

    def gone(self, replicas: list[int]) -> None:
        """Groups whose torchrun exited (finished, or gave up): with ``--await-replacements`` the coordinator waits for
        no replacement of theirs. A crashed coordinator is told nothing (:meth:`crash` empties its members under its
        lock: it decides nothing more)."""
        coord = self.coord
        with coord.lock:
            if self.awaits and coord.members:
                for r in replicas:
                    coord.gone(r)

    def fail_at(self, step: int, delay: float, deadline: float) -> None:
        """Crash once ``step`` is committed, and start a new coordinator ``delay`` seconds later (one line each)."""
        try:
            wait_for(lambda: (self.coord.committed or 0) >= step, deadline, f"step {step} to commit", interval=0.05)
        except TimeoutError:
            return  # the job ended first
        committed = self.crash()
        EventLog(self.events, rank=-1).emit("coordinator_killed", committed=committed, delay_s=delay)
        print(f"[nvrx_lab.replicas] FAULT coordinator killed after committed step {committed}; a new one "
              f"starts on port {self.port} in {delay:g} s", flush=True)
        threading.Event().wait(delay)  # the restarted pod's start-up
        self.start()


def run_local(groups: Groups, out: Path, train_args: list[str], timeout: float = 600.0,
              coordinator_fault: tuple[int, float] | None = None) -> int:
    replicas = groups.replicas
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("replica*.jsonl"), *out.glob("replica*.faults.jsonl"), out / "coordinator.jsonl"]:
        old.unlink(missing_ok=True)
    host = CoordinatorHost(replicas, groups.min_replicas, out / "coordinator.jsonl", groups.await_replacements)
    port = host.port
    if coordinator_fault is not None:
        threading.Thread(target=host.fail_at, args=(*coordinator_fault, timeout), daemon=True).start()
    procs, narrator = [], Narrator(out, replicas)
    try:
        for r in range(replicas):
            log = open(out / f"replica{r}.log", "w")
            argv = group_argv(r, groups, f"{LOOPBACK}:{port}", out, train_args)
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          env=child_env(GROUP_ENV)))
            log.close()
        wait_for(lambda: all(p.poll() is not None for p in procs), timeout, f"{replicas} replica groups to finish",
                 interval=0.1, on_poll=lambda: host.gone([r for r, p in enumerate(procs) if p.poll() is not None]))
    finally:
        for p in procs:
            _stop(p)
        host.stop.set()
        narrator.stop()
    for r, p in enumerate(procs):
        print(f"replica {r}: exit {p.returncode} (log {out / f'replica{r}.log'})", flush=True)
    return max(p.returncode for p in procs)


def _stop(proc: subprocess.Popen) -> None:
    """Stop one group: torchrun's workers run in sessions of their own, so its process tree is read first (a
    SIGKILLed torchrun would orphan them), torchrun is asked to stop them, and whatever is left is killed."""
    import psutil

    try:
        tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    except psutil.Error:
        tree = [proc.pid]
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def check_train_args(train_args: list[str], replicas: int, nproc: int, out: Path) -> None:
    """The trainer's checks of a group's command line, here, before anything starts: a usage error is one ``error:``
    line and exit 2, as the trainer says it (every group would say it and exit 2, and no step would commit)."""
    from nvrx_lab.cli import parse_dataclass
    from nvrx_lab.train.config import TrainConfig
    from nvrx_lab.train.layers import check_flags

    worker = group_argv(0, Groups(replicas, nproc), f"{LOOPBACK}:1", out, train_args)
    cfg = parse_dataclass(TrainConfig, worker[worker.index(TRAINER) + 1:], prog=f"python -m {TRAINER}")
    try:
        check_flags(cfg, nproc)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def global_batch_of(train_args: list[str]) -> int:
    from nvrx_lab.train.config import TrainConfig

    return TrainConfig.from_args(train_args).global_batch


def main(argv: list[str] | None = None) -> int:
    from nvrx_lab.cli import Parser

    argv = sys.argv[1:] if argv is None else argv
    ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = Parser(prog="python -m nvrx_lab.replicas.local", description=__doc__.split("\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3, help="replica groups (torchrun jobs)")
    ap.add_argument("--nproc", type=int, default=1, help="ranks per replica group (FSDP inside it)")
    ap.add_argument("--max-restarts", type=int, default=3, help="replacements of each group's workers (torchrun's)")
    ap.add_argument("--min-replicas", type=int, default=1,
                    help="fewest replica groups a new step starts with (the survivors wait at the step for replacements)")
    ap.add_argument("--await-replacements", action="store_true",
                    help="the last step waits until every lost group's replacement joined (or its torchrun gave up), so "
                         "each replacement heals and trains before the job ends (a demo's choice: a job would not wait)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before every group is killed")
    ap.add_argument("--out", default="build/replicas", help="folder for the event streams and logs (emptied first)")
    ap.add_argument("--worker", default=TRAINER, metavar="MODULE",
                    help=f"what each group's torchrun runs (default {TRAINER}; a script of one's own takes the replica "
                         "flags: nvrx_lab.demo.replica_worker)")
    ap.add_argument("--coordinator-fault", default="", metavar="STEP[:DELAY]",
                    help="crash the coordinator once STEP is committed; a new one starts DELAY s later (default 1)")
    a = ap.parse_args(ours)
    if a.replicas < 1 or a.nproc < 1:
        ap.error("--replicas and --nproc must be >= 1")
    if not 1 <= a.min_replicas <= a.replicas:
        ap.error(f"--min-replicas must be in 1..--replicas ({a.replicas}), got {a.min_replicas}")
    fault = None
    if a.coordinator_fault:
        step, _, delay = a.coordinator_fault.partition(":")
        try:
            fault = (int(step), float(delay or 1.0))
        except ValueError:
            fault = (0, -1.0)
        if fault[0] < 1 or not 0 <= fault[1] < float("inf"):
            ap.error(f"--coordinator-fault {a.coordinator_fault!r}: expected STEP[:DELAY], a step >= 1 and seconds >= 0 "
                     "(e.g. 4:2)")
    out = Path(a.out)
    if a.worker == TRAINER:  # a script of one's own says its usage errors itself
        check_train_args(train_args, a.replicas, a.nproc, out)
    code = run_local(Groups(a.replicas, a.nproc, a.max_restarts, a.min_replicas, a.worker, a.await_replacements), out,
                     train_args, a.timeout, fault)
    print(ledger.check_dir(out, global_batch_of(train_args)).line(), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
