"""Two ranks exchange straggler scores; rank 1 dies (SIGKILL) or hangs while rank 0 is inside the exchange.

Run with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; rank 0 prints one JSON line: how its exchange
ended (``ok`` or ``error`` with the exception) and how long it took."""

from __future__ import annotations

import argparse
import inspect
import json
import linecache
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from nvrx_lab.net import wait_for
from nvrx_lab.straggler import Detector


def say_when_waiting(store) -> None:
    """Set ``exchanging`` once the main thread stands at ``work.wait()`` in ``dist.all_gather`` (its part is sent)."""
    code = inspect.unwrap(dist.all_gather).__code__

    def waiting() -> bool:
        frame = sys._current_frames().get(threading.main_thread().ident)
        return (frame is not None and frame.f_code is code
                and linecache.getline(code.co_filename, frame.f_lineno).strip() == "work.wait()")

    wait_for(waiting, 60, "rank 0 to wait in the exchange", interval=0.01)
    store.set("exchanging", "1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer", choices=["die", "hang", "ok"], default="die")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # meeting may be slow on a loaded box
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout))  # the exchange's bound
    rank = dist.get_rank()
    detector = Detector(interval=5, threshold=0.7, group=group)
    detector.record([{"compute": 0.01, "forward": 0.004, "optimizer": 0.006}] * 5)
    detector.report(5)  # one good exchange first: the group works
    store = dist.distributed_c10d._get_default_store()
    if rank == 1 and args.peer != "ok":
        store.wait(["exchanging"])  # rank 0 waits in the second exchange
        if args.peer == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)
    if rank == 0:
        threading.Thread(target=say_when_waiting, args=(store,), daemon=True).start()
    t0 = time.perf_counter()
    try:
        detector.report(10)
        outcome = {"outcome": "ok"}
    except Exception as e:  # what a dead or hung peer does to the exchange
        outcome = {"outcome": "error", "error": f"{type(e).__name__}: {str(e)[:300]}"}
    if rank == 0:
        print(json.dumps({**outcome, "seconds": round(time.perf_counter() - t0, 3)}), flush=True)
    os._exit(0)  # no teardown with a dead peer


if __name__ == "__main__":
    main()
