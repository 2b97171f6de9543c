"""The scale model's checkpoint commit: every rank's shard and post, rank 0's finalize, with the file system's
metadata operations counted (:class:`FsCounter`) and the store's (the ranks' counted clients)."""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import uuid
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata

from nvrx_lab.bench._scale_model import Ranks
from nvrx_lab.checkpoint import commit as cm
from nvrx_lab.checkpoint.checksum import KEY, crc32c
from nvrx_lab.checkpoint.completion import StoreBoard, done_entry
from nvrx_lab.checkpoint.integrity import VERIFY_CHUNK

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


def measure_commit(ranks: Ranks, root, timeout: float, shard_bytes: int = 4096) -> dict:
    """One save of N ranks through :func:`nvrx_lab.checkpoint.commit.commit_ready` and the completion
    board: rank 0 makes the folder while planning, a finalize runs while the save is pending (an idle
    training step), every rank's writer writes its shard file and posts, then rank 0 commits. The shard
    is a stub (``shard_bytes`` of zeros, its CRC32C computed in memory as the writer's metered stream does)."""
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
