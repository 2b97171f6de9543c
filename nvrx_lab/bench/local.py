"""``python -m nvrx_lab.bench local``: what local checkpoints cost and what they buy.

Two tables, peers side by side in the same run:

1. **restore** — one process, a state of ``--mib`` MiB (float32 tensors of 4 MiB): the time to restore
   it from this process's memory, from the node's shared memory (a new ``LocalCheckpointer`` on the
   folder, as a replaced worker does: manifest, CRC32C, copy), and from the storage checkpoint of the
   same state (``AsyncCheckpointer.restore``: newest step, verification, ``dcp.load``), interleaved
   round by round; medians, and the ratio storage / local.
2. **step** — the trainer on 2 simulated nodes of one rank each (torchrun ``--nnodes 2``, gloo), without
   and with ``--local-ckpt-interval 1`` (each snapshot replicated to the other node), alternated run by
   run; the median step period of each (one step event to the next, so the snapshot's cost is in it; the
   first steps left out) and their ratio. ``--step-sleep S`` adds S seconds of idle time to every step, a
   stand-in for GPU compute: on p5 the host's cores are mostly idle while the GPUs compute, and the snapshot's
   background work (checksum, replication) runs there; without it, each rank's one core is busy all step and
   every background cycle lengthens the step.
"""

from __future__ import annotations

import shlex
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from nvrx_lab.checkpoint import AsyncCheckpointer, integrity
from nvrx_lab.checkpoint.local import LocalCheckpointer
from nvrx_lab.cli import Parser
from nvrx_lab.net import free_port_pair
from nvrx_lab.observe.table import report
from nvrx_lab.observe.timeline import step_periods
from nvrx_lab.runner import Torchrun, run, trainer


class Blob:
    """A ``Stateful`` of ``mib`` MiB in 4 MiB float32 tensors, plus a step."""

    def __init__(self, mib: int, fill: float):
        self.sd = {"t": {f"{i}": torch.full((1 << 20,), fill) for i in range(max(1, mib // 4))}, "step": 1}

    def state_dict(self) -> dict:
        return self.sd

    def load_state_dict(self, sd: dict) -> None:
        self.sd = sd


def restore_rows(mib: int, rounds: int, work: Path) -> list[dict]:
    src = Blob(mib, 1.0)
    storage = AsyncCheckpointer(work / "storage", start_writer=False)
    storage.save(src.state_dict(), 1)
    times: dict[str, list[float]] = {"memory": [], "local": [], "storage": []}
    for i in range(rounds):
        mine = LocalCheckpointer(work / f"node{i}", run="bench")
        mine.save(src.state_dict(), 1)
        mine.wait()
        for source in times:
            dst = Blob(mib, 0.0)
            t0 = time.perf_counter()
            if source == "memory":
                got = mine.restore(dst, None)
            elif source == "local":  # a new process's view of the node's folder
                got = LocalCheckpointer(work / f"node{i}", run="bench").restore(dst, None)
            else:
                integrity._verified.clear()  # a new process verifies every file it has not verified itself
                got = storage.restore(dst)
            times[source].append(time.perf_counter() - t0)
            check(got, dst, source)
        mine.close()
    storage.close()
    best_local = statistics.median(times["local"])
    return [{"source": s, "state_mib": mib, "rounds": rounds, "restore_s": statistics.median(t),
             "vs_local": statistics.median(t) / best_local} for s, t in times.items()]


def check(restored, dst: Blob, source: str) -> None:
    if restored is None or restored.source != source or float(dst.sd["t"]["0"][0]) != 1.0:
        raise RuntimeError(f"restore from {source} failed: {restored}")


def two_nodes(worker) -> list:
    """One rank on each of two simulated nodes (torchrun --nnodes 2, a static store): replication is on."""
    port = free_port_pair()
    heads = [Torchrun(nnodes=2, node_rank=n, nproc_per_node=1, master_addr="127.0.0.1", master_port=port) for n in (0, 1)]
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda head: run(head.argv(worker), timeout=300), heads))


def step_rows(steps: int, runs: int, work: Path, skip: int = 5, step_sleep: float = 0.0) -> list[dict]:
    """Median step time without and with a local checkpoint every step (2 nodes of 1 rank: each snapshot is
    replicated to the other node), alternated run by run."""
    times: dict[int, list[float]] = {0: [], 1: []}
    for i in range(runs):
        for interval in (0, 1):
            metrics = work / f"steps-{interval}-{i}.jsonl"
            flags = dict(steps=steps, metrics=metrics, ckpt="async", ckpt_interval=steps, ckpt_dir=work / f"ck-{interval}-{i}",
                         local_ckpt_interval=interval, local_ckpt_dir=work / "shm{node}", log_every=0,
                         ckpt_wait_writer=True, threads=1,  # two "nodes" on one 2-core box: a core each, not two
                         step_sleep=step_sleep or None)
            for res in two_nodes(trainer(**flags)):
                if res.returncode != 0:
                    raise RuntimeError(f"trainer failed (local interval {interval}):\n{res.output[-3000:]}")
            times[interval] += step_periods(metrics, after=skip)
    base = statistics.median(times[0])
    return [{"local_ckpt_interval": k, "step_sleep_s": step_sleep, "steps_timed": len(v), "step_ms": 1e3 * statistics.median(v),
             "vs_without": statistics.median(v) / base} for k, v in times.items()]


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m nvrx_lab.bench local", description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="state size for the restore table")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60, help="steps of each trainer run (step table)")
    p.add_argument("--runs", type=int, default=3, help="trainer runs per setting (step table)")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="idle seconds in every step (step table): a stand-in for GPU compute, the host's cores free")
    p.add_argument("--quick", action="store_true", help="64 MiB, 3 rounds, 2 runs of 30 steps")
    p.add_argument("--out", default="build/bench/local.json")
    args = p.parse_args(argv)
    if args.quick:
        args.mib, args.rounds, args.runs, args.steps = 64, 3, 2, 30
    work = Path(tempfile.mkdtemp(prefix="nvrx-bench-local-"))
    try:
        rows = restore_rows(args.mib, args.rounds, work)
        command = "python -m nvrx_lab.bench local " + shlex.join(argv if argv is not None else sys.argv[1:])
        result = report("local: restore", rows, args.out, command)
        steps = step_rows(args.steps, args.runs, work, step_sleep=args.step_sleep)
        print()
        report("local: step time", steps, Path(args.out).with_name("local_steps.json"), command)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if result["rows"] else 1
