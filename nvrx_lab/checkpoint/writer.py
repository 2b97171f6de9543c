"""The writer: one persistent background process per rank, started once and reused.

A thread would share the GIL with training and stall its Python work for the length of the write;
a process per save would pay ``import torch`` (~1.5 s) every time. So each rank spawns one writer
when the :class:`~nvrx_lab.checkpoint.AsyncCheckpointer` is created and talks to it over two queues:

* request: step, temporary folder, the rank's final DCP plan, the staging region's path and the
  :class:`~.staging.Slot` of each tensor item, the serialised non-tensor values, the bandwidth cap.
  No tensor ever crosses the queue (see :mod:`.staging` for why);
* response: ``("done", step, info)`` or ``("error", step, info)`` with the path and errno.

The writer maps the staging region (once per region), builds exact-size tensor views over it,
writes with :func:`~.shards.write_shards` and drops its done (or error) marker for the commit.
Once mapped, the region's name is removed, so a trainer killed mid-write leaves nothing in
``/dev/shm`` (one killed while staging, before the writer mapped the region, still does).
It exits the moment its parent is gone, mid-write too (a thread waits on the parent's sentinel):
only the trainer commits, so the rest of an orphaned write is of no use, and it would hold the
staging memory and the storage bandwidth of the restarted job. It ignores
``SIGXFSZ`` so a file-size limit surfaces as ``EFBIG`` instead of killing it. If it dies anyway
(SIGKILL, OOM), :meth:`WriterProcess.poll` reports ``("died", ...)`` and the checkpointer starts a
new one at the next save.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from pathlib import Path

from .commit import write_rank_done, write_rank_error
from .errors import CheckpointWriteError
from .shards import write_shards
from .staging import open_region, slot_view


def _serve(msg: dict, regions: dict) -> dict:
    step, tmp, rank = msg["step"], Path(msg["tmp"]), msg["rank"]
    if msg["region"] not in regions:
        for old in list(regions):
            regions.pop(old).close()
        regions[msg["region"]] = open_region(msg["region"])
        try:  # the trainer unlinks it too once this save is collected: too late if it is killed before
            os.unlink(msg["region"])
        except OSError:  # gone already, or not ours to remove: the trainer's unlink stays the fallback
            pass
    mm = regions[msg["region"]]
    data = {item.index: slot_view(mm, slot) for item, slot in zip(msg["tensor_items"], msg["slots"])}
    data.update(msg["byte_items"])
    try:
        results, files, write_s = write_shards(tmp, rank, msg["plan"], data, msg["bandwidth"], step)
    finally:
        data.clear()
    try:
        write_rank_done(tmp, rank, results, files, write_s)
    except OSError as e:
        raise CheckpointWriteError(f"step {step}: rank {rank} could not write its done marker in {tmp}: "
                                   f"{e.strerror or e}", step=step, path=str(tmp), errno=e.errno) from e
    return {"bytes": sum(f["size"] for f in files.values()), "write_s": write_s}


def _exit_with(parent) -> None:
    """Watch thread: wait for the trainer's death, then exit at once, even in the middle of a write."""
    parent.join()
    os._exit(1)


def _writer_main(requests, responses) -> None:
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent,), daemon=True, name="nvrx-ckpt-parent-watch").start()
    regions: dict = {}
    responses.put(("ready", None, {"pid": os.getpid()}))
    while True:
        try:
            msg = requests.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return
            continue
        if msg is None:
            break
        try:
            responses.put(("done", msg["step"], _serve(msg, regions)))
        except Exception as e:  # noqa: BLE001 - reported to the trainer, the writer lives on
            info = {"step": msg["step"], "rank": msg["rank"], "path": getattr(e, "path", None) or msg["tmp"],
                    "errno": getattr(e, "errno", None), "error": f"{type(e).__name__}: {e}"}
            write_rank_error(Path(msg["tmp"]), msg["rank"], info)
            responses.put(("error", msg["step"], info))
    for mm in regions.values():
        mm.close()


class WriterProcess:
    """Trainer side of one rank's writer: submit a request, poll for its outcome."""

    def __init__(self, rank: int = 0):
        ctx = mp.get_context("spawn")
        self.rank = rank
        self.requests = ctx.Queue()
        self.responses = ctx.Queue()
        self.process = ctx.Process(target=_writer_main, args=(self.requests, self.responses), daemon=True,
                                   name=f"nvrx-ckpt-writer-{rank}")
        self.process.start()
        self.in_flight: dict | None = None

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the writer has imported torch and is listening (its first message)."""
        if getattr(self, "_ready", False):
            return
        if self.in_flight is not None:
            raise RuntimeError("wait_ready() must come before the first request")
        try:
            kind, _, _ = self.responses.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"writer of rank {self.rank} not ready after {timeout} s "
                               f"(alive: {self.alive()})") from None
        self._ready = kind == "ready"

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.is_alive()

    def submit(self, msg: dict) -> None:
        if self.in_flight is not None:
            raise RuntimeError(f"writer of rank {self.rank} is busy with step {self.in_flight['step']}")
        self.in_flight = {"step": msg["step"], "tmp": msg["tmp"]}
        self.requests.put(msg)

    def poll(self, timeout: float = 0.0) -> tuple[str, int, dict] | None:
        """Outcome of the request in flight: ("done"|"error"|"died", step, info), or None if still busy."""
        if self.in_flight is None:
            return None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:  # a non-blocking poll (once a training step) must not wait at all
                got = self.responses.get(timeout=min(0.05, left)) if left > 0 else self.responses.get_nowait()
                kind, step, info = got
            except queue.Empty:
                if not self.alive():
                    try:  # a response may have landed just before the exit
                        kind, step, info = self.responses.get(timeout=0.1)
                    except queue.Empty:
                        lost, self.in_flight = self.in_flight, None
                        return ("died", lost["step"], {"exitcode": self.process.exitcode, "tmp": lost["tmp"]})
                elif time.monotonic() >= deadline:
                    return None
                else:
                    continue
            if kind == "ready":
                continue
            self.in_flight = None
            return kind, step, info

    def close(self, timeout: float = 10.0) -> None:
        if self.alive():
            try:
                self.requests.put(None)
            except (OSError, ValueError):
                pass
            self.process.join(timeout)
        if self.alive():
            self.process.kill()
            self.process.join(5)
        for q in (self.requests, self.responses):
            q.close()
            q.cancel_join_thread()
