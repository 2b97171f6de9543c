"""Which local action unblocks a rank waiting in a gloo collective? (2 ranks, torch 2.13, CPU)

Two phases, each on a fresh process group. Rank 1 enters ``all_reduce`` while rank 0 stays alive
but does not join for ``--peer-wait`` s; 0.5 s in, a thread of rank 1 runs the phase's action:

* ``abort``: ``ProcessGroup.abort()`` (what ``_abort_process_group`` also does for gloo);
* ``cut``: :meth:`nvrx_lab.inprocess.interrupt.SocketTracker.cut` — ``shutdown(SHUT_RDWR)`` of
  the group's connected sockets.

Then rank 0 cuts its own sockets (releasing rank 1 if still waiting). Rank 1 prints one JSON line
per phase: ``{"action", "seconds" (after the action), "error"}``.
"""

import argparse
import datetime
import json
import os
import threading
import time

import torch
import torch.distributed as dist

from nvrx_lab.inprocess.interrupt import SocketTracker


def phase(action: str, store, rank: int, ws: int, peer_wait: float) -> None:
    tracker = SocketTracker()
    tracker.begin()
    dist.init_process_group("gloo", store=dist.PrefixStore(action, store), rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=60))
    tracker.commit()
    t = torch.ones(2)
    dist.all_reduce(t)
    if rank == 0:
        time.sleep(peer_wait)
        tracker.cut()
    else:
        def act():
            time.sleep(0.5)
            tracker.cut() if action == "cut" else dist.group.WORLD.abort()

        threading.Thread(target=act, daemon=True).start()
        t0 = time.monotonic()
        error = None
        try:
            dist.all_reduce(t)
        except Exception as e:
            error = f"{type(e).__name__}: {str(e)[:120]}"
        print(json.dumps({"action": action, "seconds": time.monotonic() - t0 - 0.5, "error": error}), flush=True)
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
