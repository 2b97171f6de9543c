"""Checkpoint benchmark: nvrx_lab async/sync against torch.save, DCP and NVRx, side by side.

    python -m nvrx_lab.bench checkpoint [--sizes-mib 256 1024] [--repeats 10] [--quick]

Every method runs in its own subprocess (clean peak RSS) on a state of N MiB (16 float32 tensors,
a bf16 tensor and an int), ``--repeats`` timed saves after one warm-up save. Columns:

* ``block_med_s`` / ``block_p95_s`` — how long the training loop is blocked by one save;
* ``durable_med_s`` — from the call until the checkpoint is on disk (fsynced / committed);
* ``peak_rss_x`` — (peak RSS of the trainer process during the timed saves − RSS before the state
  existed) / state size; the state itself counts 1, so a staging copy makes 2;
  ``child_rss_mib`` — peak RSS of helper processes (writer, DCP's process executor);
* ``load_s`` — loading the last checkpoint into preallocated tensors (nvrx_lab: including the CRC
  verification of every shard; ``load_sizes_only_s`` is the same load with ``verify="size"``);
* ``consistent`` — the state is mutated in place right after the save returns, then loaded back and
  compared with the values of the moment of the call.

The ``memcpy`` row is the floor: ``copy_`` of the same tensors into preallocated memory. NVRx's
``TorchAsyncCheckpoint`` is a row only when ``nvidia-resiliency-ext`` (the ``peers`` extra) imports.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from nvrx_lab.demo_state import equal, make_state, mutate, zeros_like
from nvrx_lab.table import exit_status, median, p95, report

METHODS = ["memcpy", "nvrx_async", "nvrx_sync", "torch.save", "dcp.save", "dcp.async_save[thread]",
           "dcp.async_save[process]", "dcp.async_save[process,shm]", "nvrx_peer.TorchAsyncCheckpoint"]
"""DCP's async rows run as its documentation recommends: one ``DefaultStager`` reused for every save (its
staging buffers allocated once), staging in the background (the loop may mutate the state once
``staging_completion`` is done: that is the blocking time), the thread or the process executor, and for the
process executor with or without shared memory (``StagingOptions.use_shared_memory``: the staged buffers
reach DCP's daemon without a copy). Pinned memory and non-blocking copies only where CUDA is."""


def _rss_mib(who=resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024


class Method:
    """One way to save: ``save(step) -> wait``, where ``wait()`` blocks until durable; ``load(target)``."""

    def __init__(self, name: str, state: dict, root: Path):
        self.name, self.state, self.root = name, state, root
        self.last, self.older = None, None
        if name.startswith("nvrx_"):
            from nvrx_lab.checkpoint import AsyncCheckpointer
            self.ckpt = AsyncCheckpointer(root, keep_last=1).start()  # a job pays the start-up once
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
        if hasattr(res, "staging_completion"):  # the state may change once it is staged: the loop waits that long
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
        if hasattr(self, "ckpt"):
            self.ckpt.close()
        if hasattr(self, "stager"):
            self.stager.close()
            stop_dcp_daemon()


def stop_dcp_daemon() -> None:
    """End DCP's process executor's daemon (torch keeps it in a module global, with no public close), so
    it exits now and its peak RSS counts in ``RUSAGE_CHILDREN``."""
    import torch.distributed.checkpoint._async_process_executor as executor
    daemon, executor._CHECKPOINT_PROCESS = getattr(executor, "_CHECKPOINT_PROCESS", None), None
    if daemon is not None:
        daemon.__del__()  # sends TERMINATE, joins (SIGTERM after 5 s)


def run_one(name: str, mib: float, repeats: int, root: Path) -> dict:
    """Measure one method in this process (called in a fresh subprocess)."""
    import torch.distributed as dist

    from nvrx_lab.net import free_port
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)  # DCP's process executor wants a group
    base = _rss_mib()
    state = make_state(mib)
    state_mib = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor)) / (1 << 20)
    m = Method(name, state, root)
    blocking, durable = [], []
    for step in range(repeats + 1):  # step 0 warms up (allocations, writer start, page faults)
        state["step"] = step
        t0 = time.perf_counter()
        wait = m.save(step)
        t1 = time.perf_counter()
        wait()
        t2 = time.perf_counter()
        m.drop_older()
        if step:
            blocking.append(t1 - t0)
            durable.append(t2 - t0)
    peak_x = (_rss_mib() - base) / state_mib  # before the consistency check allocates copies of the state
    row = {"method": name, "size_mib": round(state_mib), "block_med_s": median(blocking), "block_p95_s": p95(blocking),
           "durable_med_s": median(durable) if name != "memcpy" else float("nan")}
    consistent, load_s = "yes", float("nan")
    if name != "memcpy":
        state["step"] = repeats + 1
        expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        wait = m.save(repeats + 1)
        mutate(state)  # training goes on right after the save returns
        wait()
        target = zeros_like(state)
        t0 = time.perf_counter()
        m.load(target)
        load_s = time.perf_counter() - t0
        consistent = "yes" if equal(target, expected) else "NO"
        if name.startswith("nvrx_"):  # the same load with sizes-only verification (no CRC pass)
            m.ckpt.config.verify = "size"
            t0 = time.perf_counter()
            m.load(target)
            row["load_sizes_only_s"] = time.perf_counter() - t0
    m.close()
    row.update(peak_rss_x=peak_x, child_rss_mib=_rss_mib(resource.RUSAGE_CHILDREN), load_s=load_s,
               consistent=consistent)
    dist.destroy_process_group()
    return row


CPU_ONLY = ("skipped: NVRx's TorchAsyncCheckpoint snapshots by copying device tensors to the host (a CPU tensor "
            "is not copied, so the save would not be a snapshot) and synchronizes CUDA: a row for GPU states only")


def peer_available() -> str | None:
    try:
        import nvidia_resiliency_ext.checkpointing.async_ckpt  # noqa: F401
        return None
    except ImportError:
        return "skipped: not installed (pip install -e .[peers])"


def positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nvrx_lab.bench checkpoint", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", type=positive(float), nargs="+", default=[256, 1024], help="state sizes per rank (MiB)")
    ap.add_argument("--repeats", type=positive(int), default=10, help="timed saves per method (after one warm-up)")
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS, help="which rows to run")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="16 MiB, 3 repeats (CI smoke)")
    ap.add_argument("--out", default="build/bench/checkpoint.json", help="JSON output")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes_mib, args.repeats = [16], 3
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.sizes_mib[0], args.repeats, Path(args.dir))), flush=True)
        return 0
    rows, notes, failed = [], [], []
    base = Path(args.dir or tempfile.mkdtemp(prefix="nvrx_bench_ckpt_"))
    for mib in args.sizes_mib:
        for name in args.methods:
            if name.startswith("nvrx_peer"):
                why = peer_available() or CPU_ONLY
                notes.append(f"{name}: {why}")
                print(f"{name}: {why}")
                continue
            root = base / f"{name.replace('[', '_').replace(']', '').replace(',', '_')}_{int(mib)}"
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            cmd = [sys.executable, "-m", "nvrx_lab.bench.checkpoint", "--one", name, "--sizes-mib", str(mib),
                   "--repeats", str(args.repeats), "--dir", str(root)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode or line is None:  # an error with its output, never a row of nan
                tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
                failed.append(f"{name} @ {mib:g} MiB failed (exit {proc.returncode}):\n{tail}")
                print(failed[-1], file=sys.stderr, flush=True)
            else:
                rows.append(json.loads(line[7:]))
                print(f"  done: {name} @ {mib:g} MiB", flush=True)
            shutil.rmtree(root, ignore_errors=True)
    for mib in {r["size_mib"] for r in rows}:
        sized = [r for r in rows if r["size_mib"] == mib and "block_med_s" in r]
        floor = next((r["block_med_s"] for r in sized if r["method"] == "memcpy"), None)
        dcp_load = next((r["load_s"] for r in sized if r["method"] == "dcp.save"), None)
        for r in sized:
            r["block_x_floor"] = r["block_med_s"] / floor if floor else float("nan")
            r["load_x_dcp"] = r["load_s"] / dcp_load if dcp_load else float("nan")
    columns = ["method", "size_mib", "block_med_s", "block_p95_s", "block_x_floor", "durable_med_s", "peak_rss_x",
               "child_rss_mib", "load_s", "load_sizes_only_s", "load_x_dcp", "consistent"]
    command = "python -m nvrx_lab.bench checkpoint " + " ".join(argv if argv is not None else sys.argv[1:])
    report("checkpoint", rows, args.out, command, extra={"notes": notes, "failed": failed,
           "targets": "nvrx_async block <= 1.25x memcpy and <= best consistent peer; peak RSS <= 2x; load <= 1.1x dcp"},
           columns=columns)
    for note in notes:
        print(note)
    print_vs_best_peer(rows)
    return exit_status([f.split(" failed")[0] for f in failed])


def print_vs_best_peer(rows: list[dict]) -> None:
    for mib in sorted({r["size_mib"] for r in rows}):
        ours = next((r for r in rows if r["size_mib"] == mib and r["method"] == "nvrx_async"), None)
        peers = [r for r in rows if r["size_mib"] == mib and is_async_peer(r["method"]) and r["consistent"] == "yes"]
        if ours and peers:
            best = min(peers, key=lambda r: r["block_med_s"])
            print(f"{mib} MiB: nvrx_async blocks {ours['block_med_s'] * 1e3:.1f} ms, "
                  f"{ours['block_med_s'] / best['block_med_s']:.2f}x the best peer "
                  f"({best['method']}, {best['block_med_s'] * 1e3:.1f} ms)")


def is_async_peer(method: str) -> bool:
    return method.startswith(("dcp.async_save", "nvrx_peer"))


if __name__ == "__main__":
    sys.exit(main())
