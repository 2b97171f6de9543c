"""The scale model: simulated ranks, each with a counted store client; what they are measured on is a module each
(``_scale_restart``, ``_scale_heartbeats``, ``_scale_straggler``, ``_scale_commit``).

Simulated ranks are threads, each with its own client of one real ``TCPStore`` (as every real
rank has), running the control-plane code of the wrapper itself — :class:`RestartStore`,
:func:`nvrx_lab.inprocess.rendezvous.join`, the store host's :class:`~nvrx_lab.inprocess.monitor_process.Judge` — in the order
:class:`~nvrx_lab.inprocess.loop.RestartLoop` runs it. What is stubbed is the data plane: no
model, no process group, no tensor. An operation is a request the server handles: ``get`` and
``multi_get`` (of any number of keys) count two, because torch's client first sends a ``wait`` for
the keys and then the read; every other call is one request (``set`` and ``append`` are not even
answered).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from nvrx_lab.bench._scale_straggler import measure_straggler_report  # noqa: F401 - until bench/straggler.py imports it
from nvrx_lab.inprocess.store import RestartStore, connect

WAIT_S = 120.0


REQUESTS = {"get": 2, "multi_get": 2}
"""Requests a call sends the server, where it is not one (read off ``strace`` of torch 2.13's client)."""


class CountingClient:
    """A store client that counts the requests of its calls, by call (one counter per client: no sharing): the calls
    of ``torch.distributed.Store`` the control plane makes, each forwarded to the real client."""

    def __init__(self, client):
        self._client = client
        self.calls: Counter[str] = Counter()

    def _count(self, name: str) -> None:
        self.calls[name] += REQUESTS.get(name, 1)

    def add(self, key: str, amount: int) -> int:
        self._count("add")
        return self._client.add(key, amount)

    def append(self, key: str, value: str | bytes) -> None:
        self._count("append")
        self._client.append(key, value)

    def check(self, keys: list[str]) -> bool:
        self._count("check")
        return self._client.check(keys)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        self._count("compare_set")
        return self._client.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        self._count("delete_key")
        return self._client.delete_key(key)

    def get(self, key: str) -> bytes:
        self._count("get")
        return self._client.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._count("multi_get")
        return self._client.multi_get(keys)

    def set(self, key: str, value: str | bytes) -> None:
        self._count("set")
        self._client.set(key, value)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._count("wait")
        self._client.wait(keys) if timeout is None else self._client.wait(keys, timeout)


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
