"""No-progress stop: restarts that commit no new checkpoint end the job instead of spending every restart.

A node with a bad GPU, a corrupt shard or a data file that crashes at the same sample fails every attempt the same
way; the launcher would restart ``--max-restarts`` times (and Kubernetes would replace the pods ``backoffLimit``
times more), each attempt loading the same checkpoint and idling every node. NVRx 0.7's progress tracker stops a job
after ``max_no_progress_cycles`` restarts without progress; here progress is a durable checkpoint: the trainer's
``ckpt_commit`` events in the metrics stream the launcher already writes to. :class:`ProgressTracker` reads what the
stream gained since the last look; after ``max_no_progress_cycles`` failed attempts in a row that committed no newer
step the launcher stops with :data:`NO_PROGRESS` (the rendered ``podFailurePolicy`` fails the Job on it: not
retried) and one line naming the last committed step.
"""

from __future__ import annotations

import json
import os

from nvrx_lab.exit_codes import NO_PROGRESS


class ProgressTracker:
    """The newest committed step of the metrics stream ``path``, read incrementally; the restarts since it moved."""

    def __init__(self, path: str | None, limit: int):
        self.path, self.limit = path, limit
        self.offset = 0
        self.committed: int | None = None
        """The newest step a ``ckpt_commit`` event reported (``None``: none yet)."""
        self.said_off = False
        self.checkpointing = False
        """Whether the workers checkpoint (a ``start`` event with ``ckpt`` other than ``none``, or any ``ckpt_*``
        event): only then is a restart without a new commit a restart without progress."""
        self.without: int = 0
        """Failed attempts in a row that ended with no newer committed step."""
        self._read()  # what earlier launches of this run committed: progress is a newer step than that
        self.at_last_restart = self.committed

    @property
    def enabled(self) -> bool:
        return bool(self.path) and self.limit > 0

    def _read(self) -> None:
        if not self.path or not os.path.exists(self.path):
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data.rfind(b"\n") + 1  # a torn last line waits for the next look
        self.offset += complete
        for line in data[:complete].splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            kind = event.get("kind")
            if kind in ("ckpt_save", "ckpt_commit") or (kind == "start" and event.get("ckpt") not in (None, "none")):
                self.checkpointing = True
            if kind == "ckpt_commit" and isinstance(event.get("step"), int):
                self.committed = max(event["step"], self.committed or 0)

    def restart(self) -> bool:
        """Count one failed attempt; True once ``limit`` attempts in a row ended with no newer committed step."""
        if not self.enabled:
            return False
        self._read()
        if not self.checkpointing:  # a script of one's own without our checkpoints: progress cannot be seen
            return False
        moved = self.committed is not None and (self.at_last_restart is None or self.committed > self.at_last_restart)
        self.without = 0 if moved else self.without + 1
        self.at_last_restart = self.committed
        return self.without >= self.limit

    def off_line(self) -> str | None:
        """Why restarts are not counted, the first time they are not (the launcher says it once), else None; nothing
        when the setting turned it off (0)."""
        if self.limit <= 0 or self.said_off or (self.path and self.checkpointing):
            return None
        self.said_off = True
        if not self.path:
            return "no-progress stop: restarts not counted (no --metrics-file to read the workers' commits from)"
        return f"no-progress stop: restarts not counted (the workers' events in {self.path} show no checkpoints)"

    def line(self) -> str:
        last = "none yet" if self.committed is None else f"step {self.committed}"
        return (f"no progress: {self.without} attempts in a row ended without committing a newer checkpoint (the last "
                f"committed: {last}); stopping with exit {NO_PROGRESS} instead of restarting (--max-no-progress-cycles "
                f"{self.limit})")
