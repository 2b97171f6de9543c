"""Worker side of the heartbeat protocol: :class:`RankMonitorClient`.

::

    from nvrx_lab.launcher import RankMonitorClient
    client = RankMonitorClient()
    client.init_workload_monitoring()        # after init_process_group
    client.load_state_dict(ckpt["monitor"])  # optional: timeouts computed in an earlier run
    for step in ...:
        train_step()
        client.send_heartbeat()              # a 2-byte send on a Unix socket (measure: bench launcher)
        if step % 100 == 0:
            client.start_section("checkpoint"); save(); client.end_section("checkpoint")
            client.calculate_timeouts()      # longest observed gaps x safety factor
            ckpt["monitor"] = client.state_dict()
    client.shutdown_workload_monitoring()

The client finds its monitor through ``NVRX_LAB_MONITOR_DIR`` and ``LOCAL_RANK``, which
``python -m nvrx_lab.launcher`` sets. It imports only the standard library (torch only inside
:meth:`RankMonitorClient.calculate_timeouts`, to agree on timeouts across ranks).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from nvrx_lab.flight_recorder import DumpListener
from nvrx_lab.launcher.monitor import LAST_FAILURE_ENV, MONITOR_DIR_ENV, socket_path
from nvrx_lab.launcher.timeouts import Observed, Timeouts, calculate


class RankMonitorClientError(RuntimeError):
    """The monitor is missing, refused us, or went away."""


class RankMonitorClient:
    """Heartbeats and sections from one rank to its monitor in the launcher."""

    def __init__(self, directory: str | None = None, local_rank: int | None = None):
        self.directory = directory or os.environ.get(MONITOR_DIR_ENV)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
        self.timeouts: Timeouts | None = None
        """Timeouts in force (the monitor's after init, or restored by :meth:`load_state_dict`)."""
        self.observed = Observed()
        """Longest intervals seen by this process (input of :meth:`calculate_timeouts`)."""
        self._sock: socket.socket | None = None
        self._t_init = self._last = 0.0
        self._first = True
        self._sections: dict[str, float] = {}
        self._dumps: DumpListener | None = None

    @staticmethod
    def last_failure() -> dict | None:
        """The failure the launcher restarted this worker group for: ``{"t", "rank", "cause"}`` (``t``: wall-clock
        moment of its evidence: the exit seen, or the last heartbeat of a hung rank), or None in a first start."""
        try:
            failure = json.loads(os.environ.get(LAST_FAILURE_ENV, ""))
        except json.JSONDecodeError:
            return None
        return failure if isinstance(failure, dict) and {"t", "rank", "cause"} <= set(failure) else None

    @staticmethod
    def available() -> bool:
        """Whether this process runs under ``nvrx_lab.launcher`` (a monitor to talk to)."""
        return bool(os.environ.get(MONITOR_DIR_ENV))

    @property
    def is_initialized(self) -> bool:
        return self._sock is not None

    def init_workload_monitoring(self, timeout: float = 10.0) -> None:
        """Connect to this rank's monitor; from now on the initial timeout runs."""
        if not self.directory:
            raise RankMonitorClientError(
                f"{MONITOR_DIR_ENV} is not set: run the workers with `python -m nvrx_lab.launcher ...` "
                "(or check RankMonitorClient.available() first)")
        path = socket_path(self.directory, self.local_rank)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            hello = {"pid": os.getpid(), "rank": int(os.environ.get("RANK", "0")),
                     "timeouts": self.timeouts.to_dict() if self.timeouts else None}
            sock.sendall(b"i " + json.dumps(hello).encode() + b"\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    raise RankMonitorClientError(f"rank monitor at {path} refused this process")
                reply += chunk
        except (ConnectionResetError, BrokenPipeError):
            sock.close()
            raise RankMonitorClientError(f"rank monitor at {path} refused this process") from None
        except OSError as e:
            sock.close()
            raise RankMonitorClientError(f"cannot reach the rank monitor at {path}: {e}") from e
        sock.settimeout(None)
        self.timeouts = Timeouts.from_dict(json.loads(reply))
        self._sock = sock
        self._t_init = self._last = time.monotonic()
        self._first = True
        if self._dumps is None:  # the launcher asks for this rank's flight recorder on a hang
            self._dumps = DumpListener(self.directory, self.local_rank)

    def _send(self, payload: bytes) -> None:
        if self._sock is None:
            raise RankMonitorClientError("call init_workload_monitoring() first")
        try:
            self._sock.send(payload)
        except OSError as e:
            raise RankMonitorClientError(f"lost the rank monitor: {e}") from e

    def send_heartbeat(self) -> None:
        """Tell the monitor this rank is alive (call at least once per steady timeout)."""
        now = time.monotonic()
        if not self._sections:
            gap = now - self._last
            if self._first:
                self.observed.initial, self._first = max(gap, self.observed.initial or 0.0), False
            elif gap > (self.observed.steady or 0.0):
                self.observed.steady = gap
        self._last = now
        self._send(b"h\n")

    def start_section(self, name: str) -> None:
        """Open a section: its own timeout replaces the heartbeat timeout until :meth:`end_section`."""
        if not name or any(c.isspace() for c in name):
            raise ValueError(f"section name must be non-empty without whitespace, got {name!r}")
        self._sections[name] = time.monotonic()
        self._send(b"s " + name.encode() + b"\n")

    def end_section(self, name: str) -> None:
        if name not in self._sections:
            raise RankMonitorClientError(f"end_section({name!r}) without start_section; open: {sorted(self._sections)}")
        now = time.monotonic()
        took = now - self._sections.pop(name)
        self.observed.sections[name] = max(took, self.observed.sections.get(name, 0.0))
        self._last = now
        self._send(b"e " + name.encode() + b"\n")

    def calculate_timeouts(self, safety_factor: float = 5.0, floor: float = 1.0, sync: bool = True) -> Timeouts:
        """Set timeouts from the longest observed intervals × ``safety_factor`` and send them to the monitor.

        With ``sync`` and an initialized ``torch.distributed`` group this is a collective: all ranks
        agree on the maximum observed intervals, so every monitor enforces the same limits.
        """
        observed = self.observed
        dist = sys.modules.get("torch.distributed")
        if sync and dist is not None and dist.is_available() and dist.is_initialized():
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, observed.__dict__)
            for other in gathered:
                observed = observed.merge(Observed(**other))
        self.timeouts = calculate(observed, self.timeouts or Timeouts(), safety_factor, floor)
        if self._sock is not None:
            self._send(b"t " + json.dumps(self.timeouts.to_dict()).encode() + b"\n")
        return self.timeouts

    def state_dict(self) -> dict:
        """Timeouts and observations, to store with the checkpoint."""
        return {"timeouts": self.timeouts.to_dict() if self.timeouts else None,
                "observed": dict(self.observed.__dict__)}

    def load_state_dict(self, state: dict) -> None:
        """Restore timeouts saved by :meth:`state_dict` (sent to the monitor now or at init)."""
        if state.get("observed"):
            self.observed = self.observed.merge(Observed(**state["observed"]))
        if state.get("timeouts"):
            self.timeouts = Timeouts.from_dict(state["timeouts"])
            if self._sock is not None:
                self._send(b"t " + json.dumps(self.timeouts.to_dict()).encode() + b"\n")

    def shutdown_workload_monitoring(self) -> None:
        """Stop being watched (end of training); safe to call twice."""
        if self._sock is None:
            return
        try:
            self._sock.send(b"q\n")
        except OSError:
            pass
        self._sock.close()
        self._sock = None
        if self._dumps is not None:
            self._dumps.close()
            self._dumps = None
