"""The restart loop: one wrapped call, many attempts
==================================================

What :class:`~.wrap.Wrapper` runs on every rank, top to bottom::

    read the launch once (torchrun's environment: rank, world size, store address; see launch.py)
    start the monitor process (hard timeout, death notice; rank 0's also hosts the store)
    start the monitor thread (heartbeats, fault watch, soft timeout, interrupts)
    rendezvous 0: all ranks meet, ranks assigned
    loop:
        attempt n: fn(call_wrapper)             <- a fault anywhere ends it on every rank
        if every active rank returned: drain and destroy the group; done
        teardown (destroy the group)   -> abort_s
        health checks (the exception, detached from its frames) -> health_s
        release the attempt's memory: gc until nothing is left, then the CUDA cache (teardown.py); limits
        rendezvous n+1 without the dead -> rendezvous_s, new ranks (min_world_size)
        restart record emitted at the next attempt's first ping (reload_s, back_s)
"""

from __future__ import annotations

import os
import sys
import time

from nvrx_lab import liveness
from nvrx_lab.net import wait_for
from nvrx_lab.sockets import socket_fds

from . import monitor_process, rendezvous, teardown
from .call_wrapper import CallWrapper, ConfigError
from .health_check import HealthCheckError
from .interrupt import MainThreadInterrupter, RankShouldRestart, SocketTracker
from .launch import Launch
from .monitor import MonitorThread
from .progress import NoProgress
from .restart_log import RestartLimitError, RestartRecord, root_cause
from .state import State
from .store import RestartStore, connect, connect_reporting
from .watch import KeyWatch, Watched

ATTEMPT_WAIT_S = 365 * 24 * 3600.0  # bound of the wait for an attempt's end: none (it ends with a fault or done)


class RestartLoop:
    def __init__(self, cfg, fn):
        self.cfg, self.fn = cfg, fn
        self.history: list[RestartRecord] = []
        self.proc = self.progress = self.monitor = self.store = self.watch = None
        self._froze = False
        self._emitted: set[int] = set()
        self.stopped: NoProgress | None = None

    # -- entry ---------------------------------------------------------------------------------
    def run(self, args, kwargs):
        cfg = self.cfg
        self.launch = Launch.from_env(os.environ)  # the one read of the launcher's environment: passed down from here
        self.me, self.ws = self.launch.rank, self.launch.world_size
        self.host, self.port = self.launch.store_address(cfg.store_host, cfg.store_port)
        self.emit = cfg.emit or (lambda kind, **fields: None)
        self.interrupter = MainThreadInterrupter()
        self.excepthook = sys.excepthook
        self.sockets = SocketTracker()
        prefix = self.launch.trace_dump_prefix
        self.abort = cfg.bind_abort(self.sockets, None if prefix is None else f"{prefix}{self.me}")
        try:
            self.proc, self.progress = monitor_process.start(cfg.process_settings(self.launch))
            # every client is made now, before the monitor thread runs: a TCPStore client holds
            # the GIL while it connects (incl. a reverse-DNS lookup that can stall for seconds)
            self.store = RestartStore(connect(self.host, self.port, cfg.barrier_timeout))
            self.store.beat(self.me)  # every member has a counter before rendezvous 0
            monitor_store = RestartStore(connect(self.host, self.port, cfg.barrier_timeout))
            self.watch = KeyWatch(RestartStore(connect(self.host, self.port, cfg.barrier_timeout)))
            self._new_pg_client()
            self.monitor = MonitorThread(monitor_store, self.me, self.interrupter, self.abort, cfg.thread_settings(),
                                         page=self.progress)
            self.monitor.start()
            self.watch.start()
            self.progress.write(armed=True)
            self._froze = teardown.freeze_what_lives()
            return self._loop(args, kwargs)
        finally:
            self._shutdown()

    def _loop(self, args, kwargs):
        cfg, me = self.cfg, self.me
        assignment = self._rendezvous(0, {r: r for r in range(self.ws)})
        iteration, pending = 0, None
        while True:
            active = sorted(r for r, k in assignment.items() if k is not None)
            state = State(me, self.ws, iteration, assignment[me], len(active), tuple(sorted(assignment)), assignment)
            outcome, value, own_exc, t_stop, records = self._attempt(state, pending, args, kwargs)
            if pending is not None and id(pending) not in self._emitted:
                self._emit(pending, records)  # the attempt ended before its first ping
            if outcome == "ok":
                self._finish(iteration)
                if self.stopped is not None:
                    raise self.stopped
                return value
            t0 = time.monotonic()
            self.monitor.disarm()
            self._teardown()
            self.progress.write()  # each of the restart's phases gets the whole hard timeout
            abort_s = time.monotonic() - t0
            record = RestartRecord(iteration, "", -1, "", None)
            if own_exc is not None:  # only a rank that raised reads the fault reports now (was it the root cause?)
                self._record(iteration, t_stop, record)  # ... every rank reads them after the rendezvous
            record.abort_s = abort_s
            if (dumped := cfg.dumped()) is not None:
                record.trace_dump = dumped["path"] if dumped.get("ok") else f"not dumped: {dumped.get('why')}"
            t0 = time.monotonic()
            own = own_exc if (record.fault_rank == me and record.cause == "exception") else None
            try:
                if cfg.health_check is not None:
                    cfg.health_check(state.replace(fn_exception=own))
            except Exception as e:
                detail = f"health check failed: {type(e).__name__}: {e}"
                self.store.announce_death(me, "unhealthy", detail, time.time())
                rendezvous.help_decide(self.store, cfg.rank_assignment, self.ws)  # we may be the last one missing
                raise HealthCheckError(f"rank {me} leaves the job: {detail}") from e
            # the failed attempt goes now (own_exc was detached from its frames; its own attributes
            # may hold data too), and the cache only after the health check's bounded synchronize
            own = own_exc = None
            teardown.collect_garbage(on_round=self.progress.write)
            teardown.release_cuda_cache()
            record.cuda_peak_bytes, record.cuda_left_bytes = teardown.cuda_memory()
            record.health_s = time.monotonic() - t0
            self.history.append(record)
            if cfg.max_iterations is not None and iteration + 1 >= cfg.max_iterations:
                raise RestartLimitError(f"max_iterations={cfg.max_iterations} reached", self.history)
            t0 = time.monotonic()
            assignment = self._rendezvous(iteration + 1, assignment)
            rendezvous_s = time.monotonic() - t0
            # the dead are known once the rendezvous is decided: attribute the fault now
            record = self._record(iteration, t_stop, record)
            record.rendezvous_s = rendezvous_s
            record.world_size = sum(k is not None for k in assignment.values())
            record.new_rank = assignment[me]
            if record.world_size < cfg.min_world_size:
                raise RestartLimitError(f"only {record.world_size} ranks left, min_world_size={cfg.min_world_size} "
                                        f"(live: {sorted(assignment)})", self.history)
            iteration, pending = iteration + 1, record

    # -- one attempt -----------------------------------------------------------------------------
    def _attempt(self, state: State, pending, args, kwargs):
        n = state.iteration
        self.progress.write(iteration=n)
        # init_process_group wraps sys.excepthook (a rank prefix) and nothing unwraps it: without
        # this, every restart adds a wrapper (one '[rankN]: ' more on every error line)
        sys.excepthook = self.excepthook
        on_first = (lambda cw: self._emit_unarmed(pending, cw.records)) if pending is not None else None
        cw = CallWrapper(state, self.pg_client, self.pg_client_fds, self.monitor, self.sockets, self.progress,
                         self.cfg.group_settings(self.launch), on_first)
        cw.last_restart, stop_listening = pending, liveness.listen(cw._touch)  # a layer's bounded wait: progress
        active = [r for r, k in state.assignment.items() if k is not None]
        end = self.watch.watch(self.store.end_key(n), ATTEMPT_WAIT_S)
        self.monitor.arm(state, end)
        try:
            return self._run_attempt(state, cw, active, end, args, kwargs)
        finally:
            stop_listening()
            cw.close()

    def _run_attempt(self, state: State, cw: CallWrapper, active: list[int], end: Watched, args, kwargs):
        """-> (outcome, value, own exception detached from its frames, t_stop, the attempt's records)."""
        n, me = state.iteration, self.me
        try:
            try:
                self.interrupter.armed = True
                if state.rank is None:
                    value = self._await(end, "the attempt to end (spare)", on_poll=cw.ping)
                else:
                    try:
                        value = self.fn(cw, *args, **kwargs)
                    except NoProgress as e:  # every rank at once: the attempt ends as a finished one, then it is raised
                        value, self.stopped = None, e
            finally:
                self.interrupter.armed = False
            if state.rank is not None:
                self.store.mark_done(n, me, len(active))
            # done: waiting on the others is no hang of this rank (theirs are reported by their own monitors)
            self._await(end, f"all ranks to finish in-process restart attempt {n}", self.cfg.barrier_timeout, cw._touch)
            if end.value is None:
                end.value = self.store.end(n)
            if end.value == "done":
                self.monitor.disarm()
                return "ok", value, None, time.time(), dict(cw.records)
            return "fault", None, None, time.time(), dict(cw.records)
        except RankShouldRestart as e:
            self.progress.write()  # out of the attempt (a frozen rank never is): the teardown gets a whole hard timeout
            teardown.detach_exception(e)
            return "fault", None, None, time.time(), dict(cw.records)
        except ConfigError:
            raise  # the same on every attempt: no restart mends it
        except Exception as e:
            t = time.time()
            self.progress.write()  # as above (a collective the abort cut raises this way too)
            self.store.report_fault(n, me, "exception", f"{type(e).__name__}: {e}", t)
            try:
                self.abort(state)  # cut our sockets: peers blocked with us fail now, not at a timeout
            except Exception:
                pass
            # the health check gets the exception, not its frames (the failed attempt's locals)
            return "fault", None, teardown.detach_exception(e), t, dict(cw.records)

    def _await(self, handle: Watched, what: str, timeout: float | None = None, on_poll=None) -> None:
        """Wait for a watched key, polling only the local flag (progress keeps being written)."""
        wait_for(handle.is_set, timeout or handle.timeout, what, interval=0.002, on_poll=on_poll or self.progress.write)
        if handle.error is not None:
            raise TimeoutError(f"waiting for {what}: {handle.error}")

    def _finish(self, iteration: int) -> None:
        """Every rank is done: no collective of the attempt may still be in flight at exit."""
        error = teardown.drain_and_destroy(self.cfg.barrier_timeout)
        if error is not None:
            print(f"[in-process rank {self.me}] attempt {iteration} finished, but draining its process group "
                  f"failed (destroyed anyway): {error}", file=sys.stderr, flush=True)
        self.sockets.reset()

    def _teardown(self) -> None:
        teardown.destroy_group()
        if self.sockets.cut_init_only:  # an abort cut the group's store client mid-rendezvous
            self.sockets.cut_init_only = False
            self._new_pg_client()
        self.sockets.reset()

    def _new_pg_client(self) -> None:
        """The store client the attempts' process groups rendezvous through (reused: no new
        connection per restart unless an abort had to cut it), connected while progress is written."""
        before = socket_fds()
        self.pg_client = connect_reporting(self.host, self.port, self.cfg.barrier_timeout, self.progress.write)
        self.pg_client_fds = socket_fds() - before

    # -- rendezvous ----------------------------------------------------------------------------
    def _rendezvous(self, n: int, previous: dict) -> dict:
        """Meet the live members of the previous attempt (see :mod:`.rendezvous`)."""
        cfg, what = self.cfg, f"the live ranks to meet for in-process restart attempt {n}"

        def wait(key: str) -> None:
            try:
                self._await(self.watch.watch(key, cfg.barrier_timeout), what)
            except TimeoutError as e:
                expected = set(previous)
                raise TimeoutError(f"{e}: expected {sorted(expected)}, arrived {sorted(self.store.arrived(n))}, "
                                   f"dead {sorted(self.store.dead_ranks() & expected)} "
                                   f"(monitor error: {self.monitor.error!r})") from None

        try:
            return rendezvous.join(self.store, n, self.me, previous, cfg.rank_assignment, self.ws, wait)
        except rendezvous.ExcludedError as e:
            raise RestartLimitError(str(e), self.history) from None

    def _record(self, iteration: int, t_stop: float, record: RestartRecord) -> RestartRecord:
        """Fill the attempt's restart record from every fault report in the store."""
        faults = self.store.faults(iteration)
        root = root_cause(faults)
        record.cause, record.fault_rank, record.detail, record.t_fault = (root["cause"], root["rank"],
                                                                          root["detail"], root["t"])
        record.detect_s = max(0.0, t_stop - root["t"]) if root["t"] else 0.0
        record.reports = [(f["cause"], f["rank"]) for f in faults]
        return record

    def _emit_unarmed(self, record: RestartRecord, records: dict) -> None:
        """At the first ping: the record is written whole or not at all (the monitor re-sends an interrupt)."""
        armed, self.interrupter.armed = self.interrupter.armed, False
        try:
            self._emit(record, records)
        finally:
            self.interrupter.armed = armed

    def _emit(self, record: RestartRecord, records: dict) -> None:
        if id(record) in self._emitted:
            return
        if record.t_fault is not None:
            record.back_s = time.time() - record.t_fault
        record.reload_s = records.get("reload_s")
        self.emit("restart", **{**record.fields(), "rank": self.me})
        self._emitted.add(id(record))
        if record.new_rank == 0:  # one console line per restart, as the launcher prints its own
            print(f"[nvrx_lab.inprocess] RESTART {record.line()}", file=sys.stderr, flush=True)

    def _shutdown(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
        if self.watch is not None:
            self.watch.close()
        if self.progress is not None:
            self.progress.write(armed=False, finished=True)
        if self.proc is not None and not (self.me == 0 and self.cfg.host_store):
            try:
                self.proc.wait(timeout=2.0)
            except Exception:
                self.proc.kill()
        if self.progress is not None:
            self.progress.close()
        self.interrupter.restore()
        teardown.thaw(self._froze)
