"""Why the launcher restarted: one line for people, one JSON event for programs.

People read (stderr)::

    [nvrx-lab-launch] worker group failed: rank 1 missed heartbeats for 3.0 s (timeout 3 s); restart 1/3
    [nvrx-lab-launch] restart 1/3: workers respawned in 0.41 s, all ranks beating after 1.02 s

Programs read the run's event stream (:mod:`nvrx_lab.observe.events`, the file the launcher's command
line names: ``--metrics-file``, else ``$NVRX_LAB_METRICS``): ``launcher_failure`` (rank, local_rank,
reason, exit_code, signal, detect_s, restart_count, max_restarts, action), ``launcher_restart``
(respawn_s: detection -> new workers started) and ``launcher_ready`` (ready_s: detection -> every local rank's first heartbeat);
``launcher_failure`` and ``health`` carry this node's ``host``, and a ``RENDEZVOUS`` line (the store's node lost, a
rejoin) is a ``launcher_rendezvous`` event too (``line``): what :mod:`nvrx_lab.observe.attribute` reads.
``detect_s`` is the time from the fault's evidence to the launcher acting: the closed monitor socket
of a dead worker, or the last heartbeat of a hung one.
"""

from __future__ import annotations

import signal as _signal
import socket
import sys
import time
from dataclasses import dataclass

from nvrx_lab.observe.events import EventLog


@dataclass
class Failure:
    """One lost worker."""

    local_rank: int
    """Its local rank on this node."""
    rank: int
    """Its global rank."""
    reason: str
    """``hang``, ``signal`` or ``exit``."""
    detail: str
    """Human description, e.g. ``missed heartbeats for 3.0 s (timeout 3 s)``."""
    exit_code: int | None = None
    """Exit code, or minus the signal number (torchelastic's convention)."""
    detect_s: float | None = None
    """Evidence of the fault -> detection (s); ``None`` when unknown (worker without a client)."""

    @property
    def signal(self) -> str | None:
        if self.exit_code is not None and self.exit_code < 0:
            try:
                return _signal.Signals(-self.exit_code).name
            except ValueError:
                return str(-self.exit_code)
        return None


def describe_exit(code: int) -> tuple[str, str]:
    if code < 0:
        f = Failure(0, 0, "", "", exit_code=code)
        return "signal", f"killed by {f.signal}"
    return "exit", f"exited with code {code}"


class NodeUnhealthy(RuntimeError):
    """This node failed a health check: it leaves before the rendezvous, its workers unstarted."""


class RestartLog:
    """Writes the human line and the JSON events for each failure and restart."""

    def __init__(self, metrics_file: str | None, max_restarts: int, stream=None):
        self.events = EventLog(metrics_file or None)
        self.max_restarts = max_restarts
        self.stream = stream or sys.stderr
        self.lines: list[str] = []
        self._detected_at: float | None = None
        self._restart = 0
        self.host = socket.gethostname()

    def say(self, text: str) -> None:
        line = f"[nvrx-lab-launch] {text}"
        self.lines.append(line)
        print(line, file=self.stream, flush=True)
        if text.startswith("RENDEZVOUS"):  # the store's node gone, or back: no other event says so
            self.events.emit("launcher_rendezvous", rank=-1, host=self.host, line=text)

    def failure(self, failures: list[Failure], restart: int | None, action: str | None = None) -> None:
        """Report lost workers; ``restart`` is the number of the restart about to happen (None: none left)."""
        self._detected_at, self._restart = time.monotonic(), restart or 0
        what = "; ".join(f"rank {f.rank} {f.detail}" for f in failures)
        if action is None:
            action = f"restart {restart}/{self.max_restarts}" if restart else f"no restarts left ({self.max_restarts} used)"
        self.say(f"worker group failed: {what}; {action}")
        self._emit_failures(failures, restart, action)

    def usage_error(self, failure: Failure, lost: list[Failure]) -> None:
        """A worker exited with a usage error: the job stops without a restart."""
        action = "usage error: not restarting"
        self._detected_at = None
        self.say(f"worker rank {failure.rank} exited {failure.exit_code} (usage error): not restarting")
        self._emit_failures(lost, None, action)

    def _emit_failures(self, failures: list[Failure], restart: int | None, action: str) -> None:
        for f in failures:
            self.events.emit("launcher_failure", rank=f.rank, local_rank=f.local_rank, reason=f.reason,
                             detail=f.detail, exit_code=f.exit_code, signal=f.signal, detect_s=f.detect_s,
                             restart_count=restart, max_restarts=self.max_restarts, action=action, host=self.host)

    def trace_dumps(self, replies: dict[int, dict], prefix: str | None) -> None:
        """The flight-recorder dumps taken on a hang (``{global rank: reply}``), in one line and one event each."""
        if prefix is None:
            self.say("flight recorder: not dumped (no folder: set TORCH_FR_DUMP_TEMP_FILE or --metrics-file)")
            return
        for rank, r in sorted(replies.items()):
            self.events.emit("trace_dump", rank=rank, ok=bool(r.get("ok")), path=r.get("path"), entries=r.get("entries"),
                             why=r.get("why"))
        done = {rank: r for rank, r in replies.items() if r.get("ok")}
        said = ", ".join(f"rank {rank} ({r['entries']} entries)" for rank, r in sorted(done.items())) or "none"
        missed = "; ".join(f"rank {rank}: {r.get('why')}" for rank, r in sorted(replies.items()) if not r.get("ok"))
        self.say(f"flight recorder dumped to {prefix}<rank>: {said}" + (f"; not dumped: {missed}" if missed else ""))

    def health(self, verdicts: list) -> None:
        """This node's health verdicts: one line (each failure on its own), one event each; raises
        :class:`NodeUnhealthy` when one failed."""
        for v in verdicts:
            self.events.emit("health", rank=-1, check=v.check, status=v.status, evidence=v.evidence, host=self.host)
        bad = [v for v in verdicts if v.failed]
        self.say("health: " + ", ".join(f"{v.check} {v.status}" for v in verdicts))  # the evidence: the events
        for v in bad:
            self.say(f"health check failed: {v.check}: {v.evidence}; this node leaves the rendezvous (exit 5)")
        if bad:
            raise NodeUnhealthy("; ".join(v.line() for v in bad))

    def restarted(self) -> None:
        if self._detected_at is None:
            return
        respawn = time.monotonic() - self._detected_at
        self.events.emit("launcher_restart", rank=-1, restart_count=self._restart, respawn_s=respawn)
        self.say(f"restart {self._restart}/{self.max_restarts}: workers respawned {respawn:.2f} s after detection")

    def ready(self, first_heartbeat_at: float) -> None:
        if self._detected_at is None:
            return
        ready = first_heartbeat_at - self._detected_at
        self.events.emit("launcher_ready", rank=-1, restart_count=self._restart, ready_s=ready)
        self.say(f"restart {self._restart}/{self.max_restarts}: all local ranks beating {ready:.2f} s after detection")
        self._detected_at = None
