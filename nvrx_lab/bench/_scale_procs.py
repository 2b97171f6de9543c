"""The scale model's restart, with the simulated ranks spread over worker processes.

One interpreter holding every simulated rank measures its own GIL, not the protocol: 1,024 threads
woken at once by the same key queue for one lock (a restart took 54 s at 1,024 ranks in one
process against 2.1 s at 512, on a quiet box). Real ranks are processes, so here each of ``procs``
clean interpreters (``python -c``, this module: never the caller's script) runs ``n / procs`` ranks
as threads, each with its own client of the one real ``TCPStore``, through the same code as
:func:`._scale_restart.restart_rank`. The parent waits until every worker has its ranks through the
first rendezvous, then says go through the store; the faulty rank (the last) reports its exception
and each worker prints when its ranks had their new assignments and how many store operations they
made. ``restart_s`` = the last assignment − the fault.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time

from nvrx_lab.net import free_port, wait_for

GO, READY = "scale/go", "scale/ready"


def worker(port: int, first: int, count: int, n: int, timeout: float) -> None:
    """Ranks ``first .. first + count - 1`` of ``n``: the first rendezvous, then one restart on ``GO``."""
    from nvrx_lab.inprocess import rendezvous
    from nvrx_lab.inprocess.rank_assignment import ShiftRanks
    from nvrx_lab.inprocess.store import connect

    from ._scale_model import WAIT_S, Ranks
    from ._scale_restart import restart_rank

    t = time.monotonic()
    ranks, control = Ranks(count, port), connect("127.0.0.1", port, WAIT_S)
    identity = {r: r for r in range(n)}
    print(f"connected {count} clients in {time.monotonic() - t:.1f} s", flush=True)

    def join0(i: int) -> None:
        store = ranks.stores[i]
        rendezvous.join(store, 0, first + i, identity, ShiftRanks(), n, lambda key: store.wait(key, WAIT_S))

    ranks.run(join0, timeout)
    print(f"{READY} after {time.monotonic() - t:.1f} s", flush=True)
    ranks.reset()
    go, t0, box = threading.Barrier(count + 1), [], {}
    runner = threading.Thread(target=lambda: box.update(ends=ranks.run(
        lambda i: restart_rank(ranks.stores[i], first + i, 0, identity, n - 1, go, t0), timeout)))
    runner.start()
    control.add(READY, 1)
    control.wait([GO])
    go.wait()
    runner.join(timeout)
    print(json.dumps({"end": max(box["ends"]), "fault": t0[0] if t0 else None, "ops": ranks.ops()}), flush=True)


def measure_restart_procs(n: int, procs: int, timeout: float) -> dict:
    """One injected exception at ``n`` simulated ranks in ``procs`` worker processes (module docs)."""
    from nvrx_lab.inprocess.store import connect, host

    port = free_port()
    server = host(port)
    sizes = [n // procs + (i < n % procs) for i in range(procs)]
    firsts = [sum(sizes[:i]) for i in range(procs)]
    logs = [tempfile.TemporaryFile() for _ in range(procs)]
    workers = [subprocess.Popen([sys.executable, "-c", "from nvrx_lab.bench._scale_procs import worker; "
                                 f"worker({port}, {first}, {size}, {n}, {timeout})"], stdout=log, stderr=log)
               for first, size, log in zip(firsts, sizes, logs, strict=True)]
    try:
        control = connect("127.0.0.1", port, timeout)

        def ready() -> bool:
            if any(w.poll() not in (None, 0) for w in workers):
                raise RuntimeError(f"a scale worker failed:\n{_tail(workers, logs)}")
            return int(control.add(READY, 0)) == procs

        try:
            wait_for(ready, timeout, f"{procs} scale workers through the first rendezvous", interval=0.05)
        except TimeoutError as e:
            late = [(i, _read(log)) for i, log in enumerate(logs) if READY not in _read(log)]
            raise TimeoutError(f"{e}: {len(late)} not through; " + "; ".join(
                f"worker {i}: {out[-300:]!r}" for i, out in late[:3])) from None
        control.set(GO, "1")
        for w in workers:
            w.wait(timeout)
        if any(w.returncode for w in workers):
            raise RuntimeError(f"a scale worker failed:\n{_tail(workers, logs)}")
        outs = [json.loads(_read(log).splitlines()[-1]) for log in logs]
    finally:
        for w in workers:
            w.kill()
            w.wait()
        del server
    fault = next(o["fault"] for o in outs if o["fault"] is not None)
    return {"restart_s": max(o["end"] for o in outs) - fault, "store_ops_per_restart": sum(o["ops"] for o in outs),
            "processes": procs}


def _read(log) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")


def _tail(workers, logs) -> str:
    return "\n".join(f"worker {i} (exit {w.poll()}): {_read(log)[-1500:]}"
                     for i, (w, log) in enumerate(zip(workers, logs, strict=True)) if w.poll())
