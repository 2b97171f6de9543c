"""The straggler detection's settings: one object, the trainer's ``--straggler-*`` flags (``TrainConfig.straggler``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nvrx_lab.cli import Settings

from .scores import THRESHOLD

ACTIONS = ("report", "restart")


@dataclass
class StragglerConfig(Settings):
    """Straggler detection (``nvrx_lab.straggler``); off unless ``interval`` > 0."""

    interval: int = 0
    """Every N steps the ranks exchange their compute times and score each other (nvrx_lab.straggler); 0 = off."""
    threshold: float = THRESHOLD
    """A rank whose speed relative to the fastest rank (1.0 = fastest) is below this is reported; in (0, 1]."""
    action: Literal["report", "restart"] = "report"
    """report (an event and a console line), or restart (a rank reported twice in a row leaves the job at an
    in-process restart; needs --restart inprocess)."""

    def __post_init__(self):
        if self.interval < 0:
            raise ValueError(f"--straggler-interval {self.interval} must be >= 0 steps (0 = off)")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"--straggler-threshold {self.threshold} must be in (0, 1] (a rank's speed "
                             "relative to the fastest rank's, below which it is reported)")
        if self.action not in ACTIONS:
            raise ValueError(f"--straggler-action {self.action!r} must be report or restart")
        if self.action == "restart" and not self.interval:
            raise ValueError("--straggler-action restart needs --straggler-interval N > 0 (detection is off)")
