"""The scale model's parts: counted store clients, simulated ranks, counted file system calls.

Simulated ranks are threads, each with its own client of one real ``TCPStore`` (as every real
rank has), running the control-plane code of the wrapper itself — :class:`RestartStore`,
:func:`nvrx_lab.inprocess.rendezvous.join`, the store host's :class:`Judge` — in the order
:class:`~nvrx_lab.inprocess.loop.RestartLoop` runs it. What is stubbed is the data plane: no
model, no process group, no tensor. An operation is a request the server handles: ``get`` and
``multi_get`` (of any number of keys) count two, because torch's client first sends a ``wait`` for
the keys and then the read; every other call is one request (``set`` and ``append`` are not even
answered).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from nvrx_lab.inprocess import rendezvous
from nvrx_lab.inprocess.monitor_process import Judge
from nvrx_lab.inprocess.rank_assignment import ShiftRanks
from nvrx_lab.inprocess.store import RestartStore, connect

WAIT_S = 120.0


REQUESTS = {"get": 2, "multi_get": 2}
"""Requests a call sends the server, where it is not one (read off ``strace`` of torch 2.13's client)."""


class CountingClient:
    """A store client that counts the requests of its calls, by call (one counter per client: no sharing)."""

    def __init__(self, client):
        self._client = client
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str):
        fn = getattr(self._client, name)
        if not callable(fn):
            return fn

        def counted(*args, **kwargs):
            self.calls[name] += REQUESTS.get(name, 1)
            return fn(*args, **kwargs)

        return counted


class Ranks:
    """``n`` simulated ranks: a counted client each, connected to the store at ``port``."""

    def __init__(self, n: int, port: int, host: str = "127.0.0.1"):
        self.n = n
        with ThreadPoolExecutor(64) as pool:  # a connect can stall 5 s on a reverse-DNS lookup: overlap them
            self.clients = list(pool.map(lambda _: CountingClient(connect(host, port, WAIT_S)), range(n)))
        self.stores = [RestartStore(c) for c in self.clients]
        self.threads: list[threading.Thread] = []

    def ops(self) -> int:
        return sum(sum(c.calls.values()) for c in self.clients)

    def reset(self) -> None:
        for c in self.clients:
            c.calls.clear()

    def run(self, fn: Callable[[int], object], timeout: float) -> list:
        """``fn(rank)`` in one thread per rank, all at once; returns the results (re-raises the first error)."""
        results: list = [None] * self.n
        errors: list[BaseException] = []

        def body(r: int) -> None:
            try:
                results[r] = fn(r)
            except BaseException as e:
                errors.append(e)

        threading.stack_size(256 * 1024)
        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.n)]
        self.threads = threads
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"{sum(t.is_alive() for t in threads)} of {self.n} simulated ranks still running "
                               f"after {timeout} s")
        if errors:
            raise errors[0]
        return results

    def join(self, timeout: float) -> int:
        """Wait for the last :meth:`run`'s threads (once the store is gone their calls fail); returns how many
        are still alive. A thread left blocked in a store call aborts the interpreter at exit."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return sum(t.is_alive() for t in self.threads)


# -- in-process restart: what every rank does from the fault to its new assignment ----------------
def restart_rank(store: RestartStore, me: int, n: int, previous: dict, faulty: int, go: threading.Barrier,
                 t0: list) -> float:
    """One rank of :class:`RestartLoop` from attempt ``n`` to its assignment for ``n + 1``; returns when it had it."""
    wait = lambda key: store.wait(key, WAIT_S)  # noqa: E731  (the KeyWatch thread's one wait)
    go.wait()
    if me == faulty:
        t0.append(time.monotonic())
        store.report_fault(n, me, "exception", "injected")  # _run_attempt's except branch
    wait(store.end_key(n))  # the monitor thread sees the attempt's end ...
    store.end(n)  # ... and reads it once
    if me == faulty:
        store.faults(n)  # _record before the health check: only a rank that raised (was it the root cause?)
    rendezvous.join(store, n + 1, me, previous, ShiftRanks(), len(previous), wait)
    store.faults(n)  # _record again, once the dead are known
    return time.monotonic()


def measure_restart(ranks: Ranks, timeout: float) -> dict:
    n_ranks = ranks.n
    identity = {r: r for r in range(n_ranks)}
    wait0 = lambda s: (lambda key: s.wait(key, WAIT_S))  # noqa: E731
    t = time.monotonic()
    ranks.run(lambda r: rendezvous.join(ranks.stores[r], 0, r, identity, ShiftRanks(), n_ranks,
                                        wait0(ranks.stores[r])), timeout)
    rendezvous0_s = time.monotonic() - t
    ranks.reset()
    go, t0 = threading.Barrier(n_ranks), []
    ends = ranks.run(lambda r: restart_rank(ranks.stores[r], r, 0, identity, n_ranks - 1, go, t0), timeout)
    return {"restart_s": max(ends) - t0[0], "store_ops_per_restart": ranks.ops(), "rendezvous0_s": rendezvous0_s}


# -- heartbeats: every rank's monitor process beats (its monitor thread only if those stop); the store host judges
def measure_heartbeats(ranks: Ranks, interval: float, rounds: int = 3) -> dict:
    """``rounds`` heartbeat intervals' worth of operations; returns ops per second at ``interval``."""
    judge = Judge(ranks.n, 0.0, 1e9, ShiftRanks())
    host = ranks.stores[0]
    for r in range(ranks.n):
        ranks.stores[r].beat(r)
    judge.tick(host)  # the first tick checks that every rank has started; the others only read
    ranks.reset()
    judge_s = []
    for _ in range(rounds):
        for r in range(ranks.n):
            ranks.stores[r].beat(r)  # the monitor process, from its own interpreter
        t = time.monotonic()
        judge.tick(host)
        judge_s.append(time.monotonic() - t)
    return {"heartbeat_store_ops_per_s": ranks.ops() / rounds / interval, "judge_ms": 1000 * min(judge_s)}


# -- straggler detection: one report, scored on every rank ---------------------------------------
def measure_straggler_report(n: int, reports: int = 5) -> dict:
    """What one straggler report costs each rank at ``n`` ranks: the bytes its all-gather brings (3 float64 per
    rank) and the CPU time of :meth:`nvrx_lab.straggler.Detector.report` scoring the gathered ``n``-rank
    matrix (the gloo all-gather itself is data plane: not simulated). The last rank is slowed 1.5×; every
    rank's times carry up to 5 % noise. Returns the fastest of ``reports`` reports (the noise is the machine's)."""
    import random

    from nvrx_lab.straggler import SECTIONS, Detector

    rng, sections = random.Random(0), ("compute", *SECTIONS)

    class Gathered(Detector):
        def gather(self, own):  # every rank's means, as the all-gather returns them
            times = [{s: 0.01 * (1 + 0.05 * rng.random()) for s in sections} for _ in range(n)]
            times[-1] = {s: 1.5 * t for s, t in times[-1].items()}
            return times

    detector, best = Gathered(interval=1, patience=2), float("inf")
    for step in range(1, reports + 1):
        t = time.perf_counter()
        report = detector.report(step)
        best = min(best, time.perf_counter() - t)
    if [s.rank for s in report.stragglers] != [n - 1]:
        raise RuntimeError(f"the scale model's straggler report named {report.stragglers}, not rank {n - 1}")
    return {"straggler_report_ms": 1000 * best, "straggler_bytes_per_rank": 8 * len(sections) * n}


# -- file system operations ------------------------------------------------------------------------
FS_EVENTS = {"open", "os.rename", "os.remove", "os.mkdir", "os.rmdir", "os.listdir", "os.scandir", "os.unlink",
             "shutil.rmtree", "os.link", "os.symlink", "os.truncate"}


class FsCounter:
    """Counts metadata operations (open, stat, rename, unlink, mkdir, listing) under ``root``, from
    any thread: the audit hooks of the calls that have one, and a wrapped ``os.stat``
    (``Path.exists``) for the one that has none."""

    _installed = False
    _active: FsCounter | None = None

    def __init__(self, root):
        self.root = os.fspath(root)
        self.ops = 0
        self._lock = threading.Lock()
        self._stat = os.stat
        if not FsCounter._installed:
            sys.addaudithook(FsCounter._audit)
            FsCounter._installed = True

    def hit(self) -> None:
        with self._lock:
            self.ops += 1

    @staticmethod
    def _audit(event: str, args: tuple) -> None:
        me = FsCounter._active
        if me is not None and event in FS_EVENTS and args and me.root in str(args[0]):
            me.hit()

    def __enter__(self) -> FsCounter:
        real = self._stat

        def stat(path, *a, **k):
            if self.root in str(path):
                self.hit()
            return real(path, *a, **k)

        os.stat = stat
        FsCounter._active = self
        return self

    def __exit__(self, *exc) -> None:
        os.stat = self._stat
        FsCounter._active = None


# -- checkpoint commit: every rank's shard and post, rank 0's finalize --------------------------------
def measure_commit(ranks: Ranks, root, timeout: float, shard_bytes: int = 4096) -> dict:
    """One save of N ranks through :func:`nvrx_lab.checkpoint.commit.commit_ready` and the completion
    board: rank 0 makes the folder while planning, a finalize runs while the save is pending (an idle
    training step), every rank's writer writes its shard file and posts, then rank 0 commits. The shard
    is a stub (``shard_bytes`` of zeros, its CRC32C computed in memory as the writer's metered stream does)."""
    import pickle
    import uuid
    from pathlib import Path

    from torch.distributed.checkpoint.metadata import Metadata

    from nvrx_lab.checkpoint import commit as cm
    from nvrx_lab.checkpoint.checksum import KEY, crc32c
    from nvrx_lab.checkpoint.completion import StoreBoard, done_entry
    from nvrx_lab.checkpoint.integrity import VERIFY_CHUNK

    root, step, save_id = Path(root), 10, uuid.uuid4().hex[:12]
    boards = [StoreBoard(c) for c in ranks.clients]
    tmp, payload, errors = cm.tmp_dir(root, step, save_id), bytes(shard_bytes), []
    entry = {"size": shard_bytes, "chunk_bytes": VERIFY_CHUNK, KEY: [crc32c(payload)]}
    pending = [{"step": step, "tmp": tmp, "metadata": Metadata(state_dict_metadata={}), "t0": time.monotonic(),
                "save_id": save_id}]
    finalize = lambda: cm.commit_ready(pending, root, boards[0], ranks.n, cm.KeepLast(3), 0.0,  # noqa: E731
                                       errors.append, lambda *a, **k: None, set())

    def write(r: int) -> None:
        cm.write_durable(tmp / f"__{r}_0.distcp", payload)
        boards[r].post(save_id, r, done_entry({f"__{r}_0.distcp": entry}, pickle.dumps([]), 0.0))

    root.mkdir(parents=True, exist_ok=True)
    ranks.reset()
    with FsCounter(root) as fs:
        cm.make_tmp(root, step, save_id)
        before, store_before = fs.ops, sum(ranks.clients[0].calls.values())
        finalize()  # a training step while the save is written: no rank has posted yet
        idle_fs, idle_store = fs.ops - before, sum(ranks.clients[0].calls.values()) - store_before
        ranks.run(write, timeout)
        committed = finalize()
        total = fs.ops
    if errors or committed != [step]:
        raise RuntimeError(f"the simulated save did not commit: {committed} {errors[:1]}")
    return {"commit_fs_ops_per_save": total - idle_fs, "idle_step_fs_ops": idle_fs,
            "idle_step_store_ops": idle_store, "commit_store_ops": ranks.ops() - idle_store}
