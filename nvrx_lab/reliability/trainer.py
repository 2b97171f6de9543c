"""The trainer under a fault during a save, during a load and during a restart
==============================================================================

Each trial runs the real trainer (``python -m nvrx_lab.train``, 2 gloo ranks, async checkpoints every
3 steps) under a restart layer, with one fault placed inside the checkpoint or restart machinery:

* **during a save** — ``1:6:sigkill:save`` under the launcher: rank 1 dies while its writer is still
  writing step 6 (the write is capped at 8 MiB/s); under in-process restart, an exception at the same
  moment (the persistent writer lives on). Step 6 may commit only if every rank's shard was complete.
* **during a load** — a first fault at step 8, then rank 0 fails *while it reads* the checkpoint it
  resumes from (step 6, or 3 when 6 has not committed yet): SIGKILL under the launcher, an exception
  under in-process restart.
* **during a restart** — a first fault (rank 1, step 8), then rank 0 is SIGKILLed from outside while the
  job is restarting: under the launcher as soon as its replacement worker starts, under
  launcher + in-process as soon as the first fault is reported (the in-process restart is under way).

What must hold in every trial: the job exits 0; every step 1..N ran and a step redone after a restart
gave bit for bit the same loss (a half-written or wrong checkpoint would change it), or, redone by a
world of another size (a survivor training alone until the launcher restarts the group), the same loss
up to rounding; every resume loaded a step that had committed before it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from nvrx_lab.observe.events import read_events
from nvrx_lab.reliability import Row, timed
from nvrx_lab.runner import Value, head_for, run, trainer

STEPS = 12
TRAIN = dict(ckpt="async", ckpt_wait_writer=True, ckpt_interval=3, steps=STEPS, log_every=0, global_batch=4, seq_len=32)
SLOW_WRITES = dict(ckpt_write_bandwidth=8 << 20)


ROUNDING = 1e-6
"""How far a step redone at another world size may move the loss (relative): its sums (the mean over ranks, the
gradients' reduce-scatter) add in another order, so the last bits may differ (a float32 ULP is 1.2e-7)."""


def curve_problem(events: list[dict], steps: int) -> str | None:
    """Why the step events are not one loss curve over 1..steps (``None`` when they are): a step redone at the
    same world size must give bit for bit the same loss, at another one the same up to :data:`ROUNDING`."""
    world: dict[int, int | None] = {}  # each rank's world size: its last start or resume says
    by_step: dict[int, dict[int | None, set[float]]] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        if e["kind"] in ("start", "resume"):
            world[e["rank"]] = e.get("world_size")
        elif e["kind"] == "step":
            by_step.setdefault(e["step"], {}).setdefault(world.get(e["rank"]), set()).add(e["loss"])
    if sorted(by_step) != list(range(1, steps + 1)):
        missing = sorted(set(range(1, steps + 1)) - set(by_step))
        return f"steps missing: {missing}"
    redone = {}
    for s, per_world in by_step.items():
        losses = sorted(set().union(*per_world.values()))
        if any(len(v) > 1 for v in per_world.values()) or losses[-1] - losses[0] > ROUNDING * abs(losses[0]):
            redone[s] = {w: sorted(v) for w, v in per_world.items()} if len(per_world) > 1 else losses
    return f"a redone step gave another loss: {redone}" if redone else None


def resume_problem(events: list[dict], ckpt_dir: Path | None = None) -> str | None:
    """Why some resume loaded a step that had not committed before it (``None`` if none did). A commit is the
    ``ckpt_commit`` event, or the manifest in ``ckpt_dir`` written before the resume: a rank killed between writing
    the manifest and its event committed the step all the same."""
    committed: set[int] = set()
    on_disk = {}
    if ckpt_dir is not None:
        for manifest in Path(ckpt_dir).glob("step_*/nvrx_commit.json"):
            on_disk[int(manifest.parent.name.split("_")[1])] = manifest.stat().st_mtime
    for e in sorted(events, key=lambda e: e["t"]):
        if e["kind"] == "ckpt_commit":
            committed.add(e["step"])
        elif e["kind"] == "resume" and on_disk.get(e["step"], float("inf")) <= e["t"]:
            committed.add(e["step"])
        elif e["kind"] == "resume" and e["step"] not in committed:
            return f"rank {e['rank']} resumed from step {e['step']}, committed before it: {sorted(committed)}"
    return None


def trainer_cmd(work: Path, restart: str, faults: str, **extra: Value) -> list[str]:
    """The trainer on 2 ranks: under ``nvrx_lab.launcher`` for the launcher modes, else under torchrun."""
    metrics = work / "m.jsonl"
    head = head_for(restart, 2, max_restarts=3, heartbeat_timeout=3, initial_heartbeat_timeout=60, monitor_interval=0.2,
                    metrics_file=metrics)
    inprocess = dict(soft_timeout=3, hard_timeout=30) if restart.endswith("inprocess") else {}
    return head.argv(trainer(restart=restart, ckpt_dir=work / "ckpt", faults=faults, metrics=metrics, **TRAIN,
                             **inprocess, **extra))


def kill_when(metrics: Path, match, stop: threading.Event, timeout: float = 120) -> threading.Thread:
    """SIGKILL the pid of the first event ``match(event, events)`` returns a pid for (a watcher thread)."""

    def watch():
        deadline = time.monotonic() + timeout
        while not stop.is_set() and time.monotonic() < deadline:
            events = read_events(metrics) if metrics.exists() else []
            for e in events:
                pid = match(e, events)
                if pid:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def check_run(row: Row, name: str, cmd: list[str], work: Path, expect_faults: int, expect_phase: str = "step",
              killer=None, timeout: float = 240) -> None:
    stop = threading.Event()
    thread = killer(work / "m.jsonl", stop) if killer else None
    res = run(cmd, timeout=timeout)
    stop.set()
    if thread is not None:
        thread.join(5)
    events = read_events(work / "m.jsonl") if (work / "m.jsonl").exists() else []
    fired = [e for e in events if e["kind"] == "fault"]
    why = (f"exit code {res.returncode}: {_failure_lines(res.output)}" if res.returncode != 0 else
           f"{len(fired)} faults fired, expected {expect_faults}" if len(fired) != expect_faults else
           f"no fault fired in phase {expect_phase}" if expect_phase not in {e.get("phase") for e in fired} else
           curve_problem(events, STEPS) or resume_problem(events, work / "ckpt"))
    row.check(why is None, f"{name}: {why}")
    row.figures.setdefault("wall_s", {})[name] = round(res.wall_s, 1)


def _failure_lines(output: str) -> str:
    """What a failed run said about why: exit codes, errors and faults, not torchrun's banner."""
    keys = ("exitcode", "Error", "error:", "FAULT", "RESTART", "terminate", "Traceback")
    lines = [ln.strip() for ln in output.splitlines() if any(k in ln for k in keys)]
    return " | ".join(lines[-12:]) or output[-600:]


def _trial_dir(work: Path, phase: str, mode: str) -> Path:
    w = work / phase / mode.replace("+", "_")
    w.mkdir(parents=True, exist_ok=True)
    return w


def _fault_in_phase(row: Row, work: Path, modes: tuple[str, ...], phase: str, schedule, expect_faults: int,
                    **extra: Value) -> Row:
    """One trial per mode with the faults ``schedule(kind)``: SIGKILL under the launcher, else an exception."""
    with timed(row):
        for mode in modes:
            kind = "sigkill" if mode == "launcher" else "exception"
            w = _trial_dir(work, phase, mode)
            check_run(row, f"{mode} {kind}", trainer_cmd(w, mode, schedule(kind), **extra), w,
                      expect_faults=expect_faults, expect_phase=phase)
    return row


def fault_during_save(work: Path, modes: tuple[str, ...] = ("launcher", "inprocess")) -> Row:
    row = Row("fault during a save", "job recovers; it resumes only from committed steps; one loss curve")
    return _fault_in_phase(row, work, modes, "save", lambda kind: f"1:6:{kind}:save", 1, **SLOW_WRITES)


def fault_during_load(work: Path, modes: tuple[str, ...] = ("launcher", "inprocess")) -> Row:
    row = Row("fault during a load", "job recovers from the load's failure; one loss curve")
    # the resume loads step 6, or step 3 if 6 has not committed yet: a fault waits in both loads
    return _fault_in_phase(row, work, modes, "load", lambda kind: f"1:8:{kind},0:3:{kind}:load,0:6:{kind}:load", 2)


def _restarted_rank0(event: dict, events: list[dict]) -> int | None:
    """The launcher's replacement rank 0 as soon as it starts."""
    return event["pid"] if event["kind"] == "start" and event["rank"] == 0 and event["restart_count"] == 1 else None


def _rank0_once_faulted(event: dict, events: list[dict]) -> int | None:
    """Rank 0 of the first attempt, as soon as rank 1's fault is reported."""
    if event["kind"] != "fault":
        return None
    starts = [e for e in events if e["kind"] == "start" and e["rank"] == 0]
    return starts[0]["pid"] if starts else None


def fault_during_restart(work: Path, modes: tuple[str, ...] = ("launcher", "launcher+inprocess")) -> Row:
    row = Row("fault during a restart", "a second failure while restarting is recovered too; one loss curve")
    with timed(row):
        for mode in modes:
            kind, match, victim = (("sigkill", _restarted_rank0, "replacement rank 0 killed") if mode == "launcher" else
                                   ("exception", _rank0_once_faulted, "rank 0 killed mid-restart"))
            w = _trial_dir(work, "restart", mode)
            check_run(row, f"{mode}: {victim}", trainer_cmd(w, mode, f"1:8:{kind}"), w, expect_faults=1,
                      killer=lambda metrics, stop, match=match: kill_when(metrics, match, stop))
    return row


__all__ = ["fault_during_save", "fault_during_load", "fault_during_restart", "curve_problem", "resume_problem"]
