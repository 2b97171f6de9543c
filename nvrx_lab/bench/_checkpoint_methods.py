"""The rows of ``python -m nvrx_lab.bench checkpoint``: one way to save (and load) each, peers at their best."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from nvrx_lab.demo.state import zeros_like

METHODS = ["memcpy", "nvrx_async", "nvrx_sync", "torch.save", "dcp.save", "dcp.async_save[thread]",
           "dcp.async_save[process]", "dcp.async_save[process,shm]", "nvrx_peer.TorchAsyncCheckpoint"]
"""DCP's async rows run as its documentation recommends: one ``DefaultStager`` reused for every save (its
staging buffers allocated once), staging in the background (the loop may mutate the state once
``staging_completion`` is done: that is the blocking time), the thread or the process executor, and for the
process executor with or without shared memory (``StagingOptions.use_shared_memory``: the staged buffers
reach DCP's daemon without a copy). Pinned memory and non-blocking copies only where CUDA is."""


class Method:
    """One way to save: ``save(step) -> wait``, where ``wait()`` blocks until durable; ``load(target)``."""

    def __init__(self, name: str, state: dict, root: Path):
        self.name, self.state, self.root = name, state, root
        self.last, self.older = None, None
        self.ckpt = self.stager = None
        if name.startswith("nvrx_"):
            from nvrx_lab.checkpoint import AsyncCheckpointer
            self.ckpt = AsyncCheckpointer(root, keep_last=1).start()  # a job pays the start-up once
            if name == "nvrx_async":  # as the trainer does before its first save: staging memory and plan made now
                self.ckpt.prepare(state, plan=True)
        if name.startswith("dcp.async_save"):
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
            self.kind = AsyncCheckpointerType.PROCESS if "process" in name else AsyncCheckpointerType.THREAD
            cuda = torch.cuda.is_available()
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory="shm" in name,
                                                       use_async_staging=True, use_non_blocking_copy=cuda))
        if name == "memcpy":
            self.dst = zeros_like(state)

    def save(self, step: int):
        import torch.distributed.checkpoint as dcp
        n = self.name
        if n == "memcpy":
            for k, v in self.state.items():
                if isinstance(v, torch.Tensor):
                    self.dst[k].copy_(v)
            return lambda: None
        if n == "nvrx_async":
            self.ckpt.async_save(self.state, step=step)
            return lambda: self.ckpt.finalize_async_save(blocking=True)
        if n == "nvrx_sync":
            self.ckpt.save(self.state, step=step)
            return lambda: None
        path = self.root / f"s{step}"
        self.older, self.last = self.last, path
        if n == "torch.save":
            with open(path, "wb") as f:
                torch.save(self.state, f)
                f.flush()
                os.fsync(f.fileno())
            return lambda: None
        if n == "dcp.save":
            dcp.save(self.state, checkpoint_id=path)
            return lambda: None
        res = dcp.async_save(self.state, checkpoint_id=path, async_checkpointer_type=self.kind,
                             async_stager=self.stager, no_dist=True)
        if hasattr(res, "staging_completion"):  # torch's AsyncSaveResponse (with a stager; else a Future): the state
            # may change once it is staged, so the loop waits that long
            res.staging_completion.result()
            res = res.upload_completion
        return res.result  # the next save reuses the staging buffers: it waits for this upload first

    def drop_older(self) -> None:
        """Delete the checkpoint before the last one, outside the timed save (as the writer does for
        ``keep_last``): deleting 256 MiB is no part of what a save blocks."""
        if self.older is not None:
            shutil.rmtree(self.older, ignore_errors=True) if self.older.is_dir() else self.older.unlink(missing_ok=True)
            self.older = None

    def load(self, target: dict) -> None:
        import torch.distributed.checkpoint as dcp
        if self.name.startswith("nvrx_"):
            self.ckpt.load(target)
        elif self.name == "torch.save":
            loaded = torch.load(self.last, weights_only=True)
            for k, v in loaded.items():
                target[k].copy_(v) if isinstance(v, torch.Tensor) else target.__setitem__(k, v)
        else:
            dcp.load(target, checkpoint_id=self.last)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
        if self.stager is not None:
            self.stager.close()
            stop_dcp_daemon()


def stop_dcp_daemon() -> None:
    """End DCP's process executor's daemon (torch keeps it in a module global, with no public close), so
    it exits now and its peak RSS counts in ``RUSAGE_CHILDREN``."""
    import torch.distributed.checkpoint._async_process_executor as executor
    # a torch private: probed, as a torch without it has no daemon to stop
    daemon, executor._CHECKPOINT_PROCESS = getattr(executor, "_CHECKPOINT_PROCESS", None), None
    if daemon is not None:
        daemon.__del__()  # sends TERMINATE, joins (SIGTERM after 5 s)
