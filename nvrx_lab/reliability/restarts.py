"""Restart cases: many restarts in a row, and a long phase that must not look like a hang
=====================================================================================

Three cases of the reliability suite (:mod:`nvrx_lab.reliability`), each a real job of 2 ranks over gloo, judged
from its event stream and from the process table only:

* :func:`inprocess_soak` — :mod:`nvrx_lab.demo.inprocess_worker` under the in-process
  :class:`~nvrx_lab.inprocess.Wrapper`; rank 1 raises in every attempt, so the same two processes restart
  ``restarts`` times until ``max_iterations`` stops them. Threads and open fds must stay flat and RSS within +5 %
  (an early attempt after warm-up against the last), every restart must be logged by both ranks.
* :func:`launcher_soak` — ``python -m nvrx_lab.launcher`` running :mod:`nvrx_lab.demo.launcher_worker`; rank 1 is
  SIGKILLed or hangs in every attempt (a seeded shuffle) for ``restarts`` attempts, then the job finishes: each
  fault followed by both ranks training in the next attempt, exit 0.
* :func:`long_section_no_false_hang` — a legitimate ``phase_s`` pause inside a section whose timeout allows it: no
  launcher failure during it; outside the section (the control), a hang named during the pause (from the events).

No process may outlive a run: each run's unique ``NVRX_LAB_RUN_ID``, inherited by every process it starts (launcher,
zygote and forks, attach processes, workers, monitor processes, a checkpoint writer), still carried a short grace
after the job exited marks an orphan, counted and then killed.
"""

from __future__ import annotations

import collections
import random
import statistics
import time
import uuid
from pathlib import Path

import psutil

from nvrx_lab import runner
from nvrx_lab.net import wait_for
from nvrx_lab.observe.events import read_events
from nvrx_lab.reliability import Row, timed
from nvrx_lab.runner import Launcher, Spawn, Worker

RUN_ENV = "NVRX_LAB_RUN_ID"
"""Marks every process of one run (inherited through fork and exec)."""
LINGER_S = 15.0
"""How long processes of a finished run may take to exit before they count as orphans."""


# -- running a job and looking for what it left behind ------------------------------------------
def _marked(run_id: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``NVRX_LAB_RUN_ID=run_id`` (zombies excluded)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(RUN_ENV) == run_id:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _orphans(run_id: str, grace: float = LINGER_S) -> tuple[list[str], float]:
    """Wait up to ``grace`` s for the run's processes to exit; ``(survivors, seconds waited)``.
    Survivors are described (pid and command line) and then SIGKILLed."""
    t0 = time.monotonic()
    try:
        wait_for(lambda: not _marked(run_id), grace, "the run's processes to exit", interval=0.1)
    except TimeoutError:
        pass
    left = _marked(run_id)
    waited = time.monotonic() - t0
    described = []
    for p in left:
        try:
            described.append(f"pid {p.pid}: {' '.join(p.cmdline())[:160]}")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return described, waited


def _run(cmd: list[str], work: Path, name: str, timeout: float) -> dict:
    """Run ``cmd`` (:func:`nvrx_lab.runner.run`, its group left alone after a clean exit) with a fresh run id;
    output goes to ``work/<name>.log``. Returns ``rc`` (``None`` on timeout), ``log``, ``wall_s``, ``orphans``,
    ``linger_s``."""
    run_id = uuid.uuid4().hex
    res = runner.run(cmd, timeout, env={RUN_ENV: run_id, "LOGLEVEL": "WARNING"}, cwd=work, log=work / f"{name}.log",
              kill_leftovers=False)
    if res.timed_out:
        for p in _marked(run_id):  # workers live in sessions of their own
            p.kill()
    orphans, linger = ([], 0.0) if res.timed_out else _orphans(run_id)
    return {"rc": None if res.timed_out else res.returncode, "log": res.output, "wall_s": res.wall_s,
            "orphans": orphans, "linger_s": linger}


def _fresh_events(folder: Path) -> Path:
    """``folder/events.jsonl``, the folder created and the file gone: a run's events only."""
    folder.mkdir(parents=True, exist_ok=True)
    ev = folder / "events.jsonl"
    ev.unlink(missing_ok=True)
    return ev


def least(samples: list[dict | None]) -> dict | None:
    """The per-key minimum of the ``resources`` events of a window of attempts (None if one is missing)."""
    if not samples or any(x is None for x in samples):
        return None
    return {key: min(x[key] for x in samples) for key in ("threads", "fds", "rss_mb")}


def fd_diff(a: dict | None, b: dict | None) -> str:
    """What kinds of fds one ``resources`` sample has more or fewer of than another, e.g. ``socket +1``."""
    ka, kb = (collections.Counter((x or {}).get("fd_kinds") or {}) for x in (a, b))
    return ", ".join(f"{k} {kb[k] - ka[k]:+d}" for k in sorted(ka | kb) if kb[k] != ka[k]) or "same kinds"


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def _tail(text: str, n: int = 300) -> str:
    return text[-n:].replace("\n", " | ")


# -- in-process ---------------------------------------------------------------------------------
def inprocess_soak_limits(restarts: int) -> tuple[float, float]:
    """(the job's limit: 60 s + 1.5 s a restart; the most :func:`inprocess_soak` takes: that + the run's 10 s + linger)."""
    job = 60 + 1.5 * restarts
    return job, job + 10 + LINGER_S


def inprocess_soak(work: Path, restarts: int = 100) -> Row:
    """``restarts`` in-process restarts of 2 ranks in the same processes; nothing may leak.

    Trials: one per restart (both ranks logged it), one per rank and resource (threads, fds,
    RSS), one for the ``max_iterations`` limit stopping the job, one for the error output not
    growing with restarts (``[rank1]: `` once per line), one for no process left."""
    if restarts < 2:
        raise ValueError(f"inprocess_soak needs restarts >= 2, got {restarts}")
    work = Path(work)
    ev = _fresh_events(work)
    row = Row(f"in-process: {restarts} restarts in the same processes",
              "every restart logged by both ranks; threads and fds flat, RSS <= +5 % (least of attempts 5-9 vs of the "
              "last 5); the limit stops the job; error lines not repeated per restart; no process left")
    with timed(row):
        limit, _ = inprocess_soak_limits(restarts)
        cmd = Spawn(2, timeout=limit).argv(Worker.of("nvrx_lab.demo.inprocess_worker", steps=3, step_time=0,
                                                     faults="1:*:1:exception", max_iterations=restarts + 1,
                                                     resources=True, events=ev))
        run = _run(cmd, work, "inprocess", timeout=limit + 10)
        restart_ev = read_events(ev, "restart")
        count = collections.Counter((e["rank"], e["iteration"]) for e in restart_ev)
        for i in range(restarts):
            row.check(count[0, i] == count[1, i] == 1,
                      f"restart after attempt {i} logged {count[0, i]} time(s) by rank 0, {count[1, i]} by rank 1")
        res = {(e["rank"], e["iteration"]): e for e in read_events(ev, "resources")}
        early, last = min(5, restarts // 2), restarts
        first_last = {}
        for rank in (0, 1):
            # a leak grows with restarts, so it shows in the least count of a few attempts; one sample can
            # catch a connection in passing (rank 0 hosts the store: a peer's old client not yet reaped)
            w = max(1, min(5, (last - early + 1) // 2))
            a, b = (least([res.get((rank, i)) for i in range(lo, lo + w)]) for lo in (early, last - w + 1))
            first_last[rank] = (a, b)
            for key, ok in (("threads", lambda x, y: y == x), ("fds", lambda x, y: y == x),
                            ("rss_mb", lambda x, y: y <= x * 1.05)):
                row.check(a is not None and b is not None and ok(a[key], b[key]),
                          f"rank {rank} {key}: attempts {early}+ {a and a[key]} -> attempts ..{last} {b and b[key]}"
                          + (f" (open: {fd_diff(res.get((rank, early)), res.get((rank, last)))})" if key == "fds" else ""))
        stopped = (run["rc"] not in (None, 0) and f"gave up: max_iterations={restarts + 1} reached" in run["log"]
                   and f"restarts ({restarts + 1}):" in run["log"])
        row.check(stopped, f"expected the limit to stop the job; exit {run['rc']}: {_tail(run['log'])}")
        stacked = [f"[rank{r}]: [rank{r}]:" for r in (0, 1) if f"[rank{r}]: [rank{r}]:" in run["log"]]
        row.check(not stacked, f"torch's excepthook wrapped once per restart: {stacked} in the output")
        row.check(not run["orphans"], f"processes left after {run['linger_s']:.0f} s: {run['orphans'][:3]}")
        pairs = [fl for fl in first_last.values() if fl[0] and fl[1]]
        total = lambda key, i: sum(fl[i][key] for fl in pairs) if len(pairs) == 2 else None  # noqa: E731
        row.figures = {
            "restarts_logged": sum(1 for i in range(restarts) if count[0, i] == count[1, i] == 1),
            "threads_first": total("threads", 0), "threads_last": total("threads", 1),
            "fds_first": total("fds", 0), "fds_last": total("fds", 1),
            "rss_growth_pct": round(max((b["rss_mb"] / a["rss_mb"] - 1) * 100 for a, b in pairs), 2) if pairs else None,
            "restart_median_s": _median([e["back_s"] for e in restart_ev if e.get("back_s") is not None]),
            "orphans": len(run["orphans"]), "linger_s": round(run["linger_s"], 2), "job_s": round(run["wall_s"], 1),
        }
    return row


# -- launcher -----------------------------------------------------------------------------------
def _launcher_cmd(ev: Path, heartbeat_timeout: float, launcher_flags: dict, worker_flags: list[str]) -> list[str]:
    launcher = Launcher.local(2, monitor_interval=0.1, shutdown_timeout=2, heartbeat_timeout=heartbeat_timeout,
                              initial_heartbeat_timeout=60, metrics_file=ev, **launcher_flags)
    return launcher.argv(Worker.of("nvrx_lab.demo.launcher_worker", *worker_flags, metrics=ev))


def fault_plan(restarts: int, seed: int = 0) -> list[str]:
    """``restarts`` fault kinds, half ``sigkill`` and half ``hang``, in a seeded order."""
    kinds = [("sigkill", "hang")[i % 2] for i in range(restarts)]
    random.Random(seed).shuffle(kinds)
    return kinds


def launcher_soak(work: Path, restarts: int = 50, seed: int = 0, heartbeat_timeout: float = 2.0) -> Row:
    """``restarts`` launcher restarts, SIGKILL and hang mixed, then a clean finish.

    Trials: one per fault (injected in attempt ``r``, blamed on rank 1, both ranks training in
    attempt ``r + 1``), one for the job finishing with exit 0, one for no process left."""
    if restarts < 1:
        raise ValueError(f"launcher_soak needs restarts >= 1, got {restarts}")
    work = Path(work)
    ev = _fresh_events(work)
    kinds = fault_plan(restarts, seed)
    row = Row(f"launcher: {restarts} restarts (SIGKILL and hang, seed {seed})",
              "every fault followed by both ranks training in the next attempt; exit 0; no process left")
    with timed(row):
        plan = ",".join(f"1:{r}:2:{k}" for r, k in enumerate(kinds))  # rank 1, step 2 of attempt r
        cmd = _launcher_cmd(ev, heartbeat_timeout, dict(max_restarts=restarts),
                            ["--steps", "4", "--step-time", "0.02", "--faults", plan, "--pg-timeout", "30"])
        run = _run(cmd, work, "launcher", timeout=60 + restarts * (heartbeat_timeout + 10))
        events = read_events(ev)
        first_step = {(e["restart"], e["rank"]): e["t"] for e in reversed(events) if e["kind"] == "step"}  # the first wins
        faults = {e["restart"]: e for e in events if e["kind"] == "fault" and e["rank"] == 1}
        blamed = {e["restart_count"]: e for e in events if e["kind"] == "launcher_failure" and e["rank"] == 1}
        recovery: dict[str, list[float]] = {"sigkill": [], "hang": []}  # seconds to both ranks training
        hang_detect: list[float] = []  # a hang's detect_s
        for r, kind in enumerate(kinds):
            f, b = faults.get(r), blamed.get(r + 1, {})
            back = [first_step.get((r + 1, rank)) for rank in (0, 1)]
            # a kill is a signal; a hang is named only once the rank was silent for the heartbeat timeout
            named = ((b.get("reason"), b.get("signal")) == ("signal", "SIGKILL") if kind == "sigkill" else
                     b.get("reason") == "hang" and (b.get("detect_s") or 0) >= heartbeat_timeout)
            ok = f is not None and f["fault"] == kind and None not in back and named
            said = {k: b.get(k) for k in ("reason", "signal", "detect_s")}
            if row.check(ok, f"attempt {r} ({kind}): fault event {f is not None}, rank 1 blamed {said}, "
                             f"both ranks back {None not in back}"):
                recovery[kind].append(max(back) - f["t"])
                hang_detect += [b["detect_s"]] if kind == "hang" else []
        done = {e["rank"] for e in events if e["kind"] == "worker_done" and e["restart"] == restarts}
        row.check(run["rc"] == 0 and done == {0, 1},
                  f"exit {run['rc']}, ranks done in attempt {restarts}: {sorted(done)}: {_tail(run['log'])}")
        row.check(not run["orphans"], f"processes left after {run['linger_s']:.0f} s: {run['orphans'][:3]}")
        row.figures = {
            "recovered": sum(len(v) for v in recovery.values()), "restarts": restarts,
            "recovery_median_s_kill": _median(recovery["sigkill"]), "recovery_median_s_hang": _median(recovery["hang"]),
            "hang_detect_s_min": min(hang_detect, default=None),
            "orphans": len(run["orphans"]), "linger_s": round(run["linger_s"], 2), "job_s": round(run["wall_s"], 1),
        }
    return row


def _in_pauses(events: list[dict]) -> list[tuple[dict, dict]]:
    """``(launcher_failure, pause fault)``: a failure from a rank's pause fault event to its next step event (or the end)."""
    steps = [e for e in events if e["kind"] == "step"]
    pairs = []
    for f in (e for e in events if e["kind"] == "fault" and e["fault"] == "pause"):
        end = min((e["t"] for e in steps if e["rank"] == f["rank"] and e["t"] > f["t"]), default=float("inf"))
        pairs += [(e, f) for e in events if e["kind"] == "launcher_failure" and f["t"] <= e["t"] <= end]
    return pairs


def long_section_no_false_hang(work: Path, phase_s: float = 10, heartbeat_timeout: float = 3) -> Row:
    """Every rank pauses ``phase_s`` in a section (timeout ``2 * phase_s``), heartbeat timeout ``heartbeat_timeout``:
    no launcher failure until its next step; exit 0 (it may restart once, for a miss outside the pause, which fires
    once per job: ``--fault-state``). Control, no section, no restart: a hang named during the pause. Two trials."""
    if not phase_s > heartbeat_timeout:
        raise ValueError(f"phase_s ({phase_s}) must exceed heartbeat_timeout ({heartbeat_timeout}) "
                         "or the control cannot tell a section from no section")
    work = Path(work)
    row = Row(f"launcher: {phase_s:g} s phase in a section, heartbeat timeout {heartbeat_timeout:g} s",
              "inside the section: no launcher failure during the pause, exit 0; control outside it: a hang named "
              "during the pause; no process left")
    with timed(row):
        runs = {}
        for name, launcher_flags, worker_flags in (
                ("section", dict(max_restarts=1, section_timeouts=f"checkpoint={2 * phase_s:g}"), ["--section", "checkpoint"]),
                ("control", dict(max_restarts=0), [])):
            ev = _fresh_events(work / name)
            slow = ["--steps", "5", "--step-time", "0.05", "--faults", f"*:2:pause:{phase_s:g}",
                    "--fault-state", str(work / name / "fired"), "--pg-timeout", str(phase_s + 60)]
            cmd = _launcher_cmd(ev, heartbeat_timeout, launcher_flags, [*slow, *worker_flags])
            runs[name] = (_run(cmd, work / name, "launcher", timeout=phase_s + 90), read_events(ev))
        run, events = runs["section"]
        false_kills = [(e["rank"], e["reason"]) for e, _ in _in_pauses(events)]
        resumed = {f["rank"] for f in events if f["kind"] == "fault"  # the pause ended: the rank stepped again
                   and any(e["kind"] == "step" and e["rank"] == f["rank"] and e["t"] > f["t"] for e in events)}
        done = {e["rank"] for e in events if e["kind"] == "worker_done"}
        row.check(run["rc"] == 0 and not false_kills and resumed == done == {0, 1} and not run["orphans"],
                  f"inside the section: exit {run['rc']}, failures during a pause {false_kills}, ranks that paused and "
                  f"stepped again {sorted(resumed)}, done {sorted(done)}, orphans {run['orphans'][:3]}: {_tail(run['log'])}")
        section_s, (run, events) = run["wall_s"], runs["control"]
        hangs = [e for e, f in _in_pauses(events) if e["reason"] == "hang" and e["rank"] == f["rank"]]
        detect = min((e["detect_s"] for e in hangs if e["detect_s"] is not None), default=None)
        row.check(run["rc"] == 1 and detect is not None and detect >= heartbeat_timeout and not run["orphans"],
                  f"control (no section): exit {run['rc']}, hang named during a pause after {detect} s of silence "
                  f"(timeout {heartbeat_timeout:g} s), orphans {run['orphans'][:3]}: {_tail(run['log'])}")
        row.figures = {"section_job_s": round(section_s, 1), "control_detect_s": detect and round(detect, 2),
                       "control_job_s": round(run["wall_s"], 1)}
    return row


__all__ = ["inprocess_soak", "inprocess_soak_limits", "launcher_soak", "long_section_no_false_hang", "fault_plan"]
