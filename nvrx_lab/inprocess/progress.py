"""No-progress stop for in-process restarts: attempts that resume from the same checkpoint end the job.

A rank whose every attempt fails before the next checkpoint (a bad GPU, a sample that crashes the model) would spend
every one of ``max_iterations`` restarts reloading the same step. The launcher stops such a job after
``max_no_progress_cycles`` restarts without a newer commit (:mod:`nvrx_lab.launcher.progress`); this is the same
count for the wrapper: the function reports the step each attempt resumed from (:meth:`ProgressCount.resumed`), and
after ``limit`` restarts in a row that resumed from no newer step it raises :class:`NoProgress` on every rank at
once (every rank resumes from the step they agreed on), which the wrapper re-raises instead of restarting.
"""

from __future__ import annotations

from nvrx_lab.exit_codes import NO_PROGRESS


class NoProgress(Exception):
    """Restarts resumed from the same checkpoint ``limit`` times in a row: no restart mends it, the wrapper re-raises
    it (the trainer exits :data:`~nvrx_lab.exit_codes.NO_PROGRESS`, which the rendered ``podFailurePolicy`` fails the
    Job on)."""


class ProgressCount:
    """The step each attempt of this process resumed from, and the restarts in a row that resumed from no newer one."""

    def __init__(self, limit: int):
        self.limit = limit
        self.last: int | None = None
        self.without = 0

    def resumed(self, step: int, restart: bool) -> None:
        """Count an attempt that resumed from ``step`` (``restart``: not this process's first); raises
        :class:`NoProgress` once ``limit`` restarts in a row resumed from no newer step (0: never)."""
        moved = self.last is None or step > self.last
        self.without = 0 if (moved or not restart) else self.without + 1
        self.last = step if moved else self.last
        if self.limit > 0 and self.without >= self.limit:
            raise NoProgress(f"no progress: {self.without} in-process restarts in a row resumed from step {self.last} "
                             f"(nothing newer committed); stopping with exit {NO_PROGRESS} instead of restarting "
                             f"(--max-no-progress-cycles {self.limit})")
