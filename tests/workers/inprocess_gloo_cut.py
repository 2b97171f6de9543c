"""Which local action unblocks a rank waiting in a gloo collective? (2 ranks, torch 2.13, CPU)

Two phases, each on a fresh process group. Rank 1 enters ``all_reduce`` while rank 0 stays alive
but does not join; once rank 1's main thread waits in it, a thread of rank 1 runs the phase's action:

* ``abort``: ``ProcessGroup.abort()`` (what ``_abort_process_group`` also does for gloo);
* ``cut``: :meth:`nvrx_lab.inprocess.interrupt.SocketTracker.cut` — ``shutdown(SHUT_RDWR)`` of
  the group's connected sockets.

and then sets the store key ``<action>/acted``. ``--peer-wait`` s after that key, rank 0 cuts its own sockets
(releasing rank 1 if still waiting). Rank 1 prints one JSON line per phase: ``{"action", "seconds" (from the
action to the end of its all_reduce), "error"}``.
"""

import argparse
import datetime
import inspect
import json
import linecache
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from nvrx_lab.inprocess.interrupt import SocketTracker
from nvrx_lab.net import wait_for


def main_thread_waits() -> bool:
    """The main thread stands at ``work.wait()`` in ``dist.all_reduce``: its collective is queued, it waits."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return (frame is not None and frame.f_code is inspect.unwrap(dist.all_reduce).__code__
            and linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() == "work.wait()")


def phase(action: str, store, rank: int, ws: int, peer_wait: float) -> None:
    tracker = SocketTracker()
    tracker.begin()
    dist.init_process_group("gloo", store=dist.PrefixStore(action, store), rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.ones(2)
    dist.all_reduce(t)
    tracker.commit()  # after a collective: gloo may connect a pair only after init_process_group has returned
    if rank == 0:
        store.wait([f"{action}/acted"])
        time.sleep(peer_wait)  # the peer stays away this long after rank 1's action: what the abort phase measures
        tracker.cut()
    else:
        acted = []

        def act():
            wait_for(main_thread_waits, 30, "the main thread to wait in all_reduce", interval=0.01)
            acted.append(time.monotonic())
            tracker.cut() if action == "cut" else dist.group.WORLD.abort()
            store.set(f"{action}/acted", "1")

        threading.Thread(target=act, daemon=True).start()
        error = None
        try:
            dist.all_reduce(t)
        except Exception as e:
            error = f"{type(e).__name__}: {str(e)[:120]}"
        print(json.dumps({"action": action, "seconds": time.monotonic() - acted[0], "error": error}), flush=True)
    dist.destroy_process_group()
    store.add(f"{action}/done", 1)
    store.wait([f"{action}/done"])
    while store.add(f"{action}/done", 0) < ws:
        time.sleep(0.01)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer-wait", type=float, default=3.0)
    a = ap.parse_args()
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), ws, rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    for action in ("abort", "cut"):
        phase(action, store, rank, ws, a.peer_wait)
    time.sleep(0.5)  # rank 0 hosts the store
    os._exit(0)


if __name__ == "__main__":
    main()
