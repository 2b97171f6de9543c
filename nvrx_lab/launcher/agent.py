"""The launcher's agent: torchelastic's ``LocalElasticAgent`` plus heartbeats and fresh stores.

What it changes, and why:

* **Monitoring.** torchelastic polls worker *exits* every ``--monitor-interval``; a hung worker
  looks healthy forever (until a collective timeout, minutes later). :meth:`HeartbeatAgent._monitor_workers`
  also asks the rank monitors (:mod:`nvrx_lab.launcher.monitor`) which ranks stopped beating, and
  applies the restart policy (:mod:`nvrx_lab.launcher.policy`) to both kinds of loss. Stopping is
  torchelastic's: SIGTERM to each worker's process group, SIGKILL after ``--shutdown-timeout``.
* **Fresh rendezvous state per restart.** torchrun's default lets the workers of every round share
  one TCPStore (``TORCHELASTIC_USE_AGENT_STORE``) at the same port, so keys of the dead round
  (gloo addresses, barrier counters) are still there when the new round starts; on this machine
  that made restarts fail 5 times out of 6. After each c10d rendezvous the agent of group rank 0
  starts a *new* TCPStore on a fresh port and publishes it under the round's prefix; workers of
  that round use only it (MASTER_ADDR/MASTER_PORT), and the previous one is closed.
* **A replacement node can join.** With the store shared (above), torch's c10d handler publishes rank 0's
  ``MASTER_ADDR``/``MASTER_PORT`` only in the first round, yet a node joining a later round (a pod
  replaced after its node was lost) waits for them in *its* round's store: 60 s, then every agent of
  that round fails. Rank 0's agent publishes them again in every round (:func:`~nvrx_lab.launcher.rounds.republish_bootstrap`).
* **Warm standby** (optional, :mod:`nvrx_lab.launcher.standby`): after torchelastic stops workers
  the zygote is asked to SIGKILL anything left, so a new round never overlaps the old one.
* **Restart log** (:mod:`nvrx_lab.launcher.restart_log`): why, how fast detected, how fast respawned.
* **The workers' environment, passed explicitly.** torchelastic hands each worker an environment
  (``RANK``, ``MASTER_ADDR``, ...); the agent adds, per worker, where its rank monitor listens and, after
  a restart, the failure it was for (:meth:`HeartbeatAgent._set_local_rank_env`), without writing them
  into the launcher's own environment.
* **No restart for a usage error.** A worker that exits 2 (:data:`~nvrx_lab.exit_codes.USAGE_ERROR`,
  argparse's code for a bad flag) would fail the same way on every attempt: the group is stopped at
  once and the launcher exits 2.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import time
from collections.abc import Callable

from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from nvrx_lab.exit_codes import USAGE_ERROR
from nvrx_lab.flight_recorder import request_dumps
from nvrx_lab.launcher.monitor import LAST_FAILURE_ENV, MonitorServer
from nvrx_lab.launcher.policy import TOLERATES_ENV, RestartPolicy, any_failed, tolerated_losses
from nvrx_lab.launcher.progress import ProgressTracker
from nvrx_lab.launcher.restart_log import Failure, RestartLog, describe_exit
from nvrx_lab.launcher.rounds import reachable, republish_bootstrap, round_number, serve_reachable, wait_only_with_room
from nvrx_lab.launcher.standby import Zygote
from nvrx_lab.net import listen, wait_for

log = logging.getLogger(__name__)
_STORE_KEY = "nvrx_lab/worker_store"
SETTLE_S = 0.5
"""After a worker fails, how long the agent waits for the rest of its group to fail or exit before it acts. One
rank's loss takes its partners down a moment later (gloo: connection reset; a hang: silent in the next
collective, their last heartbeats microseconds apart), and which of them a poll sees first is chance. So the
agent names every worker that failed and judges a usage error on all of their exit codes. It acts as soon as
every worker has exited or failed: the wait costs time only where a survivor stays up."""


def _listen_with_successor(addr: str, tries: int = 50) -> tuple[socket.socket, socket.socket]:
    """The round store's listening socket on a port whose successor is free too, and a socket holding that successor.
    The in-process wrapper's store listens on ``MASTER_PORT + 1`` by default; a fresh port's successor was never
    reserved, and a restarted worker found it taken (``Address already in use``, 1 fresh-clone run in 3)."""
    for _ in range(tries):
        sock = listen(addr)  # that address only, not every interface
        try:
            return sock, listen(addr, sock.getsockname()[1] + 1)
        except OSError:
            sock.close()
    raise RuntimeError(f"no port on {addr} whose successor is free too in {tries} tries")


class HeartbeatAgent(LocalElasticAgent):
    """``LocalElasticAgent`` that also restarts on missed heartbeats and uses a fresh store per round."""

    def __init__(self, spec, logs_specs, monitors: MonitorServer, restart_log: RestartLog,
                 policy: RestartPolicy = any_failed, zygote: Zygote | None = None,
                 start_method: str = "spawn", shutdown_timeout: int = 5):
        super().__init__(spec, logs_specs, start_method=start_method, shutdown_timeout=shutdown_timeout)
        republish_bootstrap(spec.rdzv_handler)
        wait_only_with_room(spec.rdzv_handler)
        serve_reachable(spec.rdzv_handler)
        self.monitors, self.restart_log, self.policy, self.zygote = monitors, restart_log, policy, zygote
        self._round_store: TCPStore | None = None
        self._successor: socket.socket | None = None  # MASTER_PORT + 1, held free until the round's workers start
        self._tolerated: set[int] = set()
        self._awaiting_ready = False
        self._last_failure: str | None = None  # JSON for the next workers: the failure they restart from
        self.progress: ProgressTracker | None = None
        """Counts restarts that committed no newer checkpoint; None: not counted."""
        self.no_progress: str | None = None
        """Set (the line to say) when the launcher stopped for want of progress."""
        self.health: Callable[[], list] | None = None
        """This node's health checks (:func:`nvrx_lab.health.checks.run_all`), run before each rendezvous round."""
        self.trace_dump_prefix: str | None = None
        """Where a hang's flight-recorder dumps go (``<prefix><rank>``); None: not dumped, and said."""
        self.usage_error: Failure | None = None
        """The worker that exited with a usage error, if one did: the job stopped without a restart."""
        self.admitted = False
        """Whether a rendezvous round admitted this node: a node beyond ``--nnodes`` waits as a hot spare until then."""
        self.spare = False
        """Set when the rendezvous closed while this node waited: whether it was a spare then (never admitted, or the
        round full without it), so the job ended without needing it."""

    @property
    def restart_count(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    # ------------------------------------------------------------ rendezvous: a fresh store per round
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        if self.health is not None:  # before this node joins a round: a bad GPU or a down port does not rejoin
            self.restart_log.health(self.health())
        t0 = time.monotonic()
        super()._rendezvous(worker_group)
        number = round_number(self._rdzv_handler)
        rank, world = worker_group.group_rank, worker_group.group_world_size
        if not self.admitted and number is not None and (number or world > 1):  # this node's role, said once: arrival
            admitted = f"rendezvous: admitted as node {rank} of {world} in round {number}"  # decides who trains
            self.restart_log.say(f"{admitted}, after {time.monotonic() - t0:.1f} s waiting: a hot spare (or a replacement "
                                 "pod) taking a lost node's place" if number else admitted)
        self.admitted = True
        store = worker_group.store  # prefixed with this round's number by the c10d handler
        if worker_group.group_rank == 0:
            if self._successor is not None:  # a round that started no workers
                self._successor.close()
            host = reachable(worker_group.master_addr)
            sock, self._successor = _listen_with_successor(host)
            old, self._round_store = self._round_store, TCPStore(
                host_name=host, port=sock.getsockname()[1], is_master=True,
                wait_for_workers=False, master_listen_fd=sock.detach())
            del old  # closes the previous round's store (its workers are gone)
            store.set(_STORE_KEY, f"{host}:{self._round_store.port}")
        addr, port = store.get(_STORE_KEY).decode().rsplit(":", 1)
        worker_group.master_addr, worker_group.master_port = addr, int(port)

    # ------------------------------------------------------------ start / stop
    def _start_workers(self, worker_group: WorkerGroup):
        self.monitors.reset()
        self._tolerated.clear()
        if self._successor is not None:  # for the workers' in-process store, if they run one
            self._successor.close()
            self._successor = None
        ids = super()._start_workers(worker_group)
        if self.restart_count > 0:
            self.restart_log.restarted()
            self._awaiting_ready = True
        return ids

    def _set_local_rank_env(self, worker_env: dict, local_rank: int, spec) -> None:
        """torchelastic's per-worker environment (torch calls this for each worker it starts), and ours: where the
        worker's rank monitor listens, and after a restart the failure it was for."""
        super()._set_local_rank_env(worker_env, local_rank, spec)
        worker_env.update(self.monitors.env())
        worker_env[TOLERATES_ENV] = str(tolerated_losses(self.policy, spec.local_world_size))
        if self._last_failure is not None:
            worker_env[LAST_FAILURE_ENV] = self._last_failure

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        super()._shutdown(death_sig, timeout)
        if self.zygote is not None and self.zygote.proc.poll() is None:
            self.zygote.kill_workers()

    def _stop_one(self, local_rank: int) -> None:
        """SIGTERM one worker's process group, SIGKILL after the grace (min-healthy policy)."""
        handler = self._pcontext.subprocess_handlers[local_rank]
        handler.close(signal.SIGTERM)
        try:
            handler.proc.wait(self._shutdown_timeout)
        except subprocess.TimeoutExpired:
            handler.close(signal.SIGKILL)
            handler.proc.wait(self._shutdown_timeout)

    def _dump_traces(self, workers, exits: dict[int, int | None]) -> None:
        """Every live local rank's flight recorder, to ``trace_dump_prefix`` (said in the restart log)."""
        prefix = self.trace_dump_prefix
        live = {lr: workers[lr].global_rank for lr, rc in exits.items() if rc is None}
        replies = request_dumps(self.monitors.dir, live, prefix) if prefix and live else {}
        self.restart_log.trace_dumps(replies, prefix)

    # ------------------------------------------------------------ monitoring
    def _losses(self, workers) -> tuple[dict[int, int | None], list[Failure]]:
        """Each local worker's exit code (``None``: running) and the failures among them: errors and hangs."""
        exits = {lr: h.proc.poll() for lr, h in self._pcontext.subprocess_handlers.items()}
        lost: list[Failure] = []
        now = time.monotonic()
        for lr, rc in sorted(exits.items()):
            if rc and lr not in self._tolerated:
                reason, detail = describe_exit(rc)
                lost_at = self.monitors.state(lr).lost_at
                lost.append(Failure(lr, workers[lr].global_rank, reason, detail, exit_code=rc,
                                    detect_s=None if lost_at is None else now - lost_at))
        for lr, detail, silent in self.monitors.hung(now):
            if exits[lr] is None and lr not in self._tolerated:
                lost.append(Failure(lr, workers[lr].global_rank, "hang", detail, detect_s=silent))
        return exits, lost

    def _settle(self, workers) -> tuple[dict[int, int | None], list[Failure], dict[int, int]]:
        """Exits and losses once the rest of the group has followed a failure (every worker failed, tolerated or
        exited), or after :data:`SETTLE_S`; and the poll in which each failure was first seen."""
        exits, lost = self._losses(workers)
        seen = {f.local_rank: 0 for f in lost}
        polls = 0

        def settled() -> bool:
            nonlocal exits, lost, polls
            if polls:  # after the first look: look again
                exits, lost = self._losses(workers)
                for f in lost:
                    seen.setdefault(f.local_rank, polls)
            polls += 1
            done = {f.local_rank for f in lost} | self._tolerated | {lr for lr, rc in exits.items() if rc is not None}
            return not lost or len(done) == len(exits)

        if lost:
            try:
                wait_for(settled, SETTLE_S, "the rest of the worker group to fail or exit", interval=0.01)
            except TimeoutError:
                pass  # a survivor stays up: act on what failed
        return exits, lost, seen

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._pcontext is None:
            raise AssertionError("no workers started")
        workers = worker_group.workers
        exits, lost, seen = self._settle(workers)
        # the likely cause first: seen first, and a signal (nothing but a kill) before a hang or an error exit
        lost.sort(key=lambda f: (seen.get(f.local_rank, 0), ("signal", "hang", "exit").index(f.reason), f.local_rank))
        exited = {lr: rc for lr, rc in exits.items() if rc is not None}

        if not lost:
            if len(exited) == len(exits):  # everyone finished
                if self._tolerated and all(rc == 0 for lr, rc in exited.items() if lr not in self._tolerated):
                    self._pcontext.close()
                    return RunResult(state=WorkerState.SUCCEEDED, return_values={w.global_rank: None for w in workers})
                return super()._monitor_workers(worker_group)
            if self._awaiting_ready and self.monitors.all_beating():
                self._awaiting_ready = False
                self.restart_log.ready(max(self.monitors.state(lr).first_heartbeat_at for lr in exits))
            return RunResult(state=WorkerState.HEALTHY)

        usage = next((f for f in lost if f.exit_code == USAGE_ERROR), None)
        if usage is not None:  # the next attempt would fail the same way
            self.usage_error = usage
            self._remaining_restarts = 0  # torchelastic stops the group and returns FAILED
            self.restart_log.usage_error(usage, lost)
            return RunResult(state=WorkerState.FAILED)

        total = len(exits)
        healthy = total - len(self._tolerated) - len(lost)
        if not self.policy(healthy, total):
            self.restart_log.failure(lost, None, action=f"{healthy} of {total} local workers healthy, "
                                                        "policy min-healthy: continuing without restart")
            for f in lost:
                if f.reason == "hang":
                    self._stop_one(f.local_rank)
                self._tolerated.add(f.local_rank)
            return RunResult(state=WorkerState.HEALTHY)
        if self._remaining_restarts > 0 and self.progress is not None:
            if self.progress.restart():
                self.no_progress = self.progress.line()
                self._remaining_restarts = 0  # torchelastic stops the group and returns FAILED
            elif (off := self.progress.off_line()) is not None:
                self.restart_log.say(off)
        nxt = self.restart_count + 1 if self._remaining_restarts > 0 else None
        self.restart_log.failure(lost, nxt, action=None if self.no_progress is None else "no progress: not restarting")
        if any(f.reason == "hang" for f in lost):  # before the stop: which collective never completed, rank by rank
            self._dump_traces(workers, exits)
        first = lost[0]  # the likely cause: what the next workers say they recovered from (their environment)
        self._last_failure = json.dumps({"t": time.time() - (first.detect_s or 0.0), "rank": first.rank,
                                         "cause": first.reason})
        hung_only = all(f.reason == "hang" for f in lost)
        return RunResult(state=WorkerState.UNHEALTHY if hung_only else WorkerState.FAILED)
