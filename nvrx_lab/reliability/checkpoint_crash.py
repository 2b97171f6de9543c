"""SIGKILL mid-save: of the trainer, of its writer
=================================================

The two kill cases of :mod:`nvrx_lab.reliability.checkpoint` (what must hold is listed there).

:func:`sigkill_trainer_mid_save`, one trial, on one checkpoint folder that lives through all trials:

1. a trainer (``python -m nvrx_lab.reliability.checkpoint_child trainer``, in a session of its own)
   resumes from the folder and must report that it loaded exactly the step the parent saved last;
2. it saves step after step (capped bandwidth, ~0.5 s a save); the parent picks, with a seeded RNG,
   the first, second or third save of this run and a delay of 0 to 1.25 save durations after its
   ``saving N`` line, then SIGKILLs the whole process group (even trials) or the trainer alone (odd);
3. the parent then checks the processes (the writer must be gone: at once after a group kill, on its
   own after its trainer alone died: figure ``writer_outlived_s_max``), ``/dev/shm`` (no staging region of
   the dead trainer), and the folder with a fresh checkpointer: every committed step verifies, the latest
   is no older than the last commit the trainer reported and loads exactly, and after the next save
   (done by the parent, which the next trial's trainer must resume from) nothing temporary is left.

The next trials' trainers are started while the current one runs and wait on stdin before they touch
the folder, so their imports (~8 s for a trainer and its writer on 2 cores) overlap with it.

:func:`sigkill_writer_mid_save` kills only the writer of a checkpointer in this process, strictly inside its
capped write: held by the throttle's gate (:data:`~nvrx_lab.checkpoint.throttle.HOLD_NAME`) once a seeded 0 to 0.7
of its shard is on disk, so ``finalize_async_save`` must report the death; each trial pays for one fresh writer.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from nvrx_lab.checkpoint import AsyncCheckpointer, CheckpointError, CheckpointWriterDied, committed_steps, step_dir, verify
from nvrx_lab.checkpoint.staging import shm_dir
from nvrx_lab.checkpoint.throttle import HOLD_NAME
from nvrx_lab.net import wait_for
from nvrx_lab.reliability import Row, logger_at, timed
from nvrx_lab.reliability.checkpoint_child import blank, fresh, holds_step, state_at, stray

MIB = 1 << 20
ORPHAN_S = 30.0
"""A hang guard, no speed bound: a writer still running this long after its trainer died never left on its own."""
AHEAD = 3
"""Trainers started ahead, each waiting on stdin: their imports overlap with the running trial."""


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie waiting to be reaped by its new parent counts as gone."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def _gone_after(pid: int, limit: float) -> float:
    """Seconds until ``pid`` is gone (about ``limit`` if it is still there then)."""
    t0 = time.monotonic()
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: not _alive(pid), limit, f"process {pid} to exit", interval=0.005)
    return time.monotonic() - t0


class _Trainer:
    """One trainer subprocess in its own process group; a thread reads its lines into a queue."""

    def __init__(self, folder: Path, mib: float, bandwidth: float):
        cmd = [sys.executable, "-m", "nvrx_lab.reliability.checkpoint_child", "trainer", str(folder),
               "--mib", str(mib), "--bandwidth", str(bandwidth)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self.reaped = False
        self._queue: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def expect(self, word: str, timeout: float) -> str | None:
        """The next line starting with ``word`` (None at EOF or after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                return None
            if line is None:
                self._queue.put(None)
                return None
            self.lines.append(line)
            if line.startswith(word):
                return line
        return None

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def kill(self, group: bool = True) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL) if group else self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def reap(self) -> list[str]:
        """Kill what is left of the group (once: its id may be reused later); every line it printed."""
        if self.reaped:
            return self.lines
        self.reaped = True
        self.kill(group=True)
        self._reader.join(10)
        while self.expect("", 0.01) is not None:
            pass
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:  # stdin: the trainer is gone, a buffered "go" cannot be flushed
                pass
        return self.lines

    def numbers(self, word: str) -> list[int]:
        return [int(line.split()[1]) for line in self.lines if line.startswith(word + " ")]


def _kill(cur: _Trainer, alone: bool, rng: random.Random, save_s: float, figures: dict) -> tuple[list[str], int]:
    """Step 2: SIGKILL at a random moment of a random save; returns (problems, the step aimed at)."""
    nth, delay = rng.randrange(3), rng.uniform(0.0, 1.25 * save_s)
    for _ in range(nth + 1):
        if (line := cur.expect("saving", 60)) is None:
            return [f"the trainer died or stalled before save {nth + 1}: {cur.lines[-5:]}"], -1
    time.sleep(delay)
    writer, target = cur.numbers("writer")[0], int(line.split()[1])
    cur.kill(group=not alone)
    after, gone = _gone_after(writer, ORPHAN_S), not _alive(writer)  # before reap() kills it: it left on its own
    figures["trainer_alone" if alone else "group"] += 1
    if alone:
        figures["writer_outlived_s_max"] = round(max(figures["writer_outlived_s_max"], after), 3)
        figures["writer_left_on_its_own"] += gone
    if gone:
        return [], target
    return [f"writer {writer} still ran {after:.1f} s after its trainer died alone: it never left" if alone
            else f"writer {writer} survived the SIGKILL of its process group"], target


def _check_folder(folder: Path, cur: _Trainer, resume: int, target: int, mib: float,
                  figures: dict) -> tuple[list[str], int]:
    """Step 3 on files; returns (problems, the step saved next, which the next trainer must resume from)."""
    problems = []
    if leaked := sorted(Path(shm_dir()).glob(f"nvrx_ckpt_{cur.proc.pid}_*")):
        problems.append(f"staging region left in shared memory: {[p.name for p in leaked]}")
        for p in leaked:
            p.unlink()
    for s in committed_steps(folder):
        try:
            verify(step_dir(folder, s))
        except CheckpointError as e:
            problems.append(f"committed step {s} does not verify: {e}")
    reported, started = max(cur.numbers("committed"), default=resume), max(cur.numbers("saving"), default=resume)
    ckpt = AsyncCheckpointer(folder, keep_last=2, start_writer=False)  # what a restarted trainer sees
    latest = ckpt.latest_step()
    if latest is None or not reported <= latest <= started:
        problems.append(f"latest_step() is {latest}; the trainer reported commits up to {reported}, "
                        f"saves up to {started}")
        latest = max(committed_steps(folder), default=resume)
    else:
        figures["killed_after_commit"] += latest >= target >= 0
        state = blank(mib)
        try:
            ckpt.load(state, step=latest)
            if not holds_step(state, latest, mib):
                problems.append(f"step {latest} loads, but not what step {latest} saved")
        except CheckpointError as e:
            problems.append(f"latest step {latest} does not load: {e}")
    ckpt.save(state_at(latest + 1, mib), step=latest + 1)  # the next save
    ckpt.close()
    if left := stray(folder):
        problems.append(f"stray entries after the next save: {left}")
    return problems, latest + 1


def _trial(cur: _Trainer, folder: Path, resume: int, alone: bool, rng: random.Random, mib: float,
           save_s: float, figures: dict) -> tuple[list[str], int]:
    """One trial; returns (problems, the step the next trainer must resume from)."""
    if cur.expect("ready", 300) is None:
        return [f"trainer never got ready: {cur.reap()[-8:]}"], resume
    cur.go()
    said = cur.expect("resumed", 60)
    problems = [] if said == f"resumed {resume}" else [f"expected 'resumed {resume}', the trainer said {said!r}"]
    killed, target = _kill(cur, alone, rng, save_s, figures)
    cur.reap()
    more, resume = _check_folder(folder, cur, resume, target, mib, figures)
    return problems + killed + more, resume


def sigkill_trainer_mid_save(work: Path, trials: int = 100, seed: int = 0, mib: float = 2.0) -> Row:
    """SIGKILL a trainer subprocess (its group, or it alone) at a random moment of a save, ``trials`` times."""
    row = Row("sigkill trainer mid-save", "latest step loads what it saved and is no older than the last "
              "reported commit; every committed step verifies; the writer dies with its trainer; no staging "
              "file or temp folder left after the next save")
    rng, folder = random.Random(seed), fresh(Path(work) / "ckpt")
    save_s = 0.5
    bandwidth = mib * MIB / save_s
    figures = row.figures
    figures.update(group=0, trainer_alone=0, writer_outlived_s_max=0.0, writer_left_on_its_own=0, killed_after_commit=0)
    with timed(row):
        with AsyncCheckpointer(folder, keep_last=2, start_writer=False) as ckpt:
            ckpt.save(state_at(0, mib), step=0)
        resume, cur, spares = 0, None, collections.deque()
        try:
            for trial in range(trials):
                while len(spares) < min(AHEAD, trials - trial):
                    spares.append(_Trainer(folder, mib, bandwidth))
                cur = spares.popleft()
                try:
                    problems, resume = _trial(cur, folder, resume, trial % 2 == 1, rng, mib, save_s, figures)
                except Exception as e:  # noqa: BLE001 - a crash of the harness fails the trial, with its reason
                    problems = [f"{type(e).__name__}: {e}"]
                    cur.reap()
                    resume = max(committed_steps(folder), default=resume)
                row.check(not problems, f"trial {trial}: " + "; ".join(problems))
        finally:
            for t in [cur, *spares]:
                if t is not None:
                    t.reap()
    figures["s_per_trial"] = round(row.seconds / max(1, trials), 2)
    return row


def _kill_writer_once(ckpt: AsyncCheckpointer, good: int, at: int, bandwidth: float, mib: float) -> list[str]:
    """Save ``good + 1`` (capped), SIGKILL the writer held with ``at`` bytes of it on disk, check, save it again."""
    step, problems, hold = good + 1, [], ckpt.root / HOLD_NAME
    ckpt.config.write_bandwidth = bandwidth
    hold.write_text(str(at))  # before the save: the writer reads it whole
    shard = lambda: sum(p.stat().st_size for p in ckpt.root.glob(f".tmp_step_{step:08d}_*/__0_0.distcp"))  # noqa: E731
    try:
        ckpt.async_save(state_at(step, mib), step=step)
        wait_for(lambda: shard() >= max(at, 1), 60, f"{at} bytes of step {step}'s shard on disk")
        dead = ckpt.writer_pid
        os.kill(dead, signal.SIGKILL)
    finally:
        hold.unlink(missing_ok=True)
    try:
        ckpt.finalize_async_save(blocking=True)
        problems.append("finalize_async_save raised nothing")
    except CheckpointWriterDied as e:
        if e.step != step or f"step {step}" not in str(e):
            problems.append(f"the error does not name step {step}: {e}")
    state = blank(mib)
    if ckpt.latest_step() != good or ckpt.load(state) != good or not holds_step(state, good, mib):
        problems.append(f"the previous step {good} is not the latest or does not load exactly")
    ckpt.config.write_bandwidth = None
    ckpt.async_save(state_at(step, mib), step=step)
    if ckpt.finalize_async_save(blocking=True) != [step] or ckpt.writer_pid == dead:
        problems.append(f"the next save of step {step} did not commit with a fresh writer")
    if left := stray(ckpt.root):
        problems.append(f"stray entries after the next save: {left}")
    return problems


def sigkill_writer_mid_save(work: Path, trials: int = 100, seed: int = 0, mib: float = 2.0) -> Row:
    """SIGKILL ``ckpt.writer_pid`` at a random moment of its write, ``trials`` times in one checkpointer."""
    row = Row("sigkill writer mid-save", "finalize raises CheckpointWriterDied naming the step; the previous "
              "step stays latest and loads; the next save (fresh writer) commits; no temp folder left")
    rng, write_s = random.Random(seed), 0.6
    # every trial's save fails on purpose (and is checked): keep the checkpointer's error log quiet
    quiet = logger_at("nvrx_lab.checkpoint.checkpointer", logging.CRITICAL)
    with timed(row), quiet, AsyncCheckpointer(fresh(Path(work) / "ckpt"), keep_last=2) as ckpt:
        ckpt.async_save(state_at(0, mib), step=0)
        ckpt.finalize_async_save(blocking=True)
        for trial in range(trials):
            good = max(committed_steps(ckpt.root), default=0)
            at = int(rng.uniform(0.0, 0.7) * mib * MIB)  # held there: strictly inside the write
            try:
                problems = _kill_writer_once(ckpt, good, at, mib * MIB / write_s, mib)
            except Exception as e:  # noqa: BLE001 - an unexpected error fails the trial, with its reason
                problems = [f"{type(e).__name__}: {e}"]
            row.check(not problems, f"trial {trial} (step {good + 1}, killed held at {at} bytes): "
                      + "; ".join(problems))
    row.figures["s_per_trial"] = round(row.seconds / max(1, trials), 2)
    return row
