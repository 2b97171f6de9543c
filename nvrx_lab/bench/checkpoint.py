"""Checkpoint benchmark: nvrx_lab async/sync against torch.save, DCP and NVRx, side by side.

    python -m nvrx_lab.bench checkpoint [--sizes-mib 256 1024] [--repeats 10] [--quick]

Every method runs in its own subprocess (clean peak RSS) on a state of N MiB (16 float32 tensors,
a bf16 tensor and an int), ``--repeats`` timed saves after one warm-up save. Columns:

* ``block_med_s`` / ``block_p95_s`` — how long the training loop is blocked by one save;
* ``block_x_floor`` — blocking over the floor, paired: ``--repeats`` more rounds in the same process, each a
  ``copy_`` of the state into preallocated memory, then a save; the median of the rounds' ratios (this
  box's speed drifts between processes and minutes, so a floor from another process is not a floor);
* ``first2_block_s`` — the longer of a new checkpointer's first two saves (each restart meets them; the warm-up
  save is not in the medians), ``first2_ok`` whether it is within 2 × the floor + 20 ms;
* ``durable_med_s`` — from the call until the checkpoint is on disk (fsynced / committed);
* ``peak_rss_x`` — (peak RSS of the trainer process during the timed saves − RSS before the state
  existed, every row's modules imported: DCP's import alone is 46 MiB, mostly sympy) / state size; the
  state itself counts 1, so a staging copy makes 2;
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
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from nvrx_lab.bench._checkpoint_methods import METHODS, Method
from nvrx_lab.cli import Parser
from nvrx_lab.demo.state import equal, make_state, mutate, zeros_like
from nvrx_lab.observe.table import exit_status, median, p95, report
from nvrx_lab.runner import LOOPBACK, run


def _rss_mib(who=resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024


def run_one(name: str, mib: float, repeats: int, root: Path) -> dict:
    """Measure one method in this process (called in a fresh subprocess)."""
    import torch.distributed as dist

    # DCP's process executor wants a group (its daemon's store listens on $MASTER_ADDR, set by main for this process)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    import torch.distributed.checkpoint as _dcp  # noqa: F401 - before the baseline: imports are no part of a save's memory

    import nvrx_lab.checkpoint  # noqa: F401
    base = _rss_mib()
    state = make_state(mib)
    state_mib = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor)) / (1 << 20)
    m = Method(name, state, root)
    blocking, durable, first = [], [], []
    for step in range(repeats + 1):  # step 0 warms up (allocations, writer start, page faults)
        state["step"] = step
        t0 = time.perf_counter()
        wait = m.save(step)
        t1 = time.perf_counter()
        wait()
        t2 = time.perf_counter()
        m.drop_older()
        if step < 2:
            first.append(t1 - t0)
        if step:
            blocking.append(t1 - t0)
            durable.append(t2 - t0)
    peak_x = (_rss_mib() - base) / state_mib  # before the consistency check allocates copies of the state
    row = {"method": name, "size_mib": round(state_mib), "block_med_s": median(blocking), "block_p95_s": p95(blocking),
           "durable_med_s": median(durable) if name != "memcpy" else float("nan"), "block_x_floor": 1.0}
    consistent, load_s = "yes", float("nan")
    if name != "memcpy":
        row["floor_here_s"], row["block_x_floor"] = paired_floor(m, state, first_step=repeats + 1, rounds=repeats)
        row["first2_block_s"] = max(first)  # a new checkpointer's first two saves: what a restarted job meets
        row["first2_ok"] = "yes" if max(first) <= 2 * row["floor_here_s"] + 0.02 else "no"
        state["step"] = last = 2 * repeats + 1
        expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        wait = m.save(last)
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


def paired_floor(m: Method, state: dict, first_step: int, rounds: int) -> tuple[float, float]:
    """``rounds`` rounds of (the floor row's copy into preallocated memory, then a save): the floor's median
    and the median of the rounds' blocking ÷ floor."""
    floor, floors, ratios = Method("memcpy", state, m.root), [], []
    for step in range(first_step, first_step + rounds):
        state["step"] = step
        t0 = time.perf_counter()
        floor.save(step)
        t1 = time.perf_counter()
        wait = m.save(step)
        t2 = time.perf_counter()
        wait()
        m.drop_older()
        floors.append(t1 - t0)
        ratios.append((t2 - t1) / (t1 - t0))
    return median(floors), median(ratios)


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
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="python -m nvrx_lab.bench checkpoint", description=__doc__.split("\n")[0])
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
            # as many threads as this process has (runner.run's default is one), DCP's daemon on the loopback
            res = run(cmd, timeout=1800, env={"OMP_NUM_THREADS": str(torch.get_num_threads()), "MASTER_ADDR": LOOPBACK})
            line = next((ln for ln in res.output.splitlines() if ln.startswith("RESULT ")), None)
            if res.returncode or line is None:  # an error with its output, never a row of nan
                tail = "\n".join(res.output.strip().splitlines()[-15:])
                failed.append(f"{name} @ {mib:g} MiB failed (exit {res.returncode}):\n{tail}")
                print(failed[-1], file=sys.stderr, flush=True)
            else:
                rows.append(json.loads(line[7:]))
                print(f"  done: {name} @ {mib:g} MiB", flush=True)
            shutil.rmtree(root, ignore_errors=True)
    for mib in {r["size_mib"] for r in rows}:
        sized = [r for r in rows if r["size_mib"] == mib and "block_med_s" in r]
        dcp_load = next((r["load_s"] for r in sized if r["method"] == "dcp.save"), None)
        for r in sized:
            r["load_x_dcp"] = r["load_s"] / dcp_load if dcp_load else float("nan")
    columns = ["method", "size_mib", "block_med_s", "block_p95_s", "block_x_floor", "floor_here_s", "first2_block_s", "first2_ok",
               "durable_med_s", "peak_rss_x", "child_rss_mib", "load_s", "load_sizes_only_s", "load_x_dcp", "consistent"]
    command = "python -m nvrx_lab.bench checkpoint " + " ".join(argv if argv is not None else sys.argv[1:])
    report("checkpoint", rows, args.out, command, extra={"notes": notes, "failed": failed,
           "targets": "nvrx_async block <= 1.10x the floor and below the best consistent peer; its first two saves "
                      "<= 2x the floor + 20 ms; peak RSS <= 2x; "
                      "load <= 1.0x dcp.load"},
           columns=columns)
    for note in notes:
        print(note)
    print_vs_best_peer(rows)
    return exit_status([f.split(" failed")[0] for f in failed])


def print_vs_best_peer(rows: list[dict]) -> None:
    for mib in sorted({r["size_mib"] for r in rows}):
        ours = next((r for r in rows if r["size_mib"] == mib and r["method"] == "nvrx_async"), None)
        peers = [r for r in rows if r["size_mib"] == mib and is_async_peer(r["method"]) and r["consistent"] == "yes"]
        if ours and peers:  # by the paired ratios: each row's blocking over a floor measured beside it
            best = min(peers, key=lambda r: r["block_x_floor"])
            print(f"{mib} MiB: nvrx_async blocks {ours['block_x_floor']:.3f}x the floor copy, the best peer "
                  f"{best['block_x_floor']:.3f}x ({best['method']}): {ours['block_x_floor'] / best['block_x_floor']:.2f}x")


def is_async_peer(method: str) -> bool:
    return method.startswith(("dcp.async_save", "nvrx_peer"))


if __name__ == "__main__":
    sys.exit(main())
