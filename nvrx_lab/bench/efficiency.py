"""Checkpoint efficiency: the trainer on 2 ranks with sync vs async saves at several intervals.

    python -m nvrx_lab.bench efficiency [--intervals 5 10 20] [--steps 60] [--quick]

Efficiency = training throughput with saves / throughput without, from the wall-clock times of the
trainer's ``step`` events (so the time a save blocks is counted wherever the trainer pays it). The
write is capped (``--ckpt-write-bandwidth``) so that one checkpoint takes about as long as the
shortest interval's compute — the regime of the seeds (a ~275 s FSx write every 100 steps). By
default the cap is calibrated: a short probe run measures the bytes a rank writes, a baseline run
the step time. Expected shape: async ≥ 99.5 % where the interval's compute exceeds the write, async
≥ 2× sync where they are comparable.

Each run is ``python -m torch.distributed.run --nproc-per-node 2 -m nvrx_lab.train --steps N --ckpt
{none,sync,async} --ckpt-interval K --ckpt-dir D --ckpt-write-bandwidth B --metrics M.jsonl``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from nvrx_lab.bench._table import median, report
from nvrx_lab.events import read_events
from nvrx_lab.net import free_port


def run_trainer(workdir: Path, name: str, nproc: int, steps: int, mode: str, interval: int, bandwidth: float | None,
                extra: list[str], timeout: float) -> list[dict]:
    """One trainer run; returns its events (steps, saves, commits)."""
    metrics = workdir / f"{name}.jsonl"
    ckpt_dir = workdir / f"{name}_ckpt"
    metrics.unlink(missing_ok=True)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "nvrx_lab.train", "--steps", str(steps), "--ckpt", mode,
           "--ckpt-interval", str(interval), "--ckpt-dir", str(ckpt_dir), "--metrics", str(metrics), *extra]
    if bandwidth:
        cmd += ["--ckpt-write-bandwidth", str(int(bandwidth))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise RuntimeError(f"{name}: trainer timed out after {timeout} s:\n{out[-3000:]}")
    if proc.returncode:
        hint = ("\n(the trainer does not accept the --ckpt flags yet?)" if "unrecognized arguments" in out else "")
        raise RuntimeError(f"{name}: trainer failed (exit {proc.returncode}): {' '.join(cmd)}\n{out[-3000:]}{hint}")
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return read_events(metrics)


def throughput(events: list[dict], warmup: int) -> tuple[float, float]:
    """(steps per second, median step_time) from rank 0's step events after the warm-up.

    The warm-up lasts ``warmup`` steps and at least until the first checkpoint is committed: before
    that, the writer processes may still be importing torch next to the training ranks, which is
    start-up, not the steady state this benchmark compares.
    """
    steps = sorted((e for e in events if e["kind"] == "step" and e.get("rank", 0) == 0), key=lambda e: e["step"])
    commits = [e["t"] for e in events if e["kind"] == "ckpt_commit"]
    if commits:
        warmup = max(warmup, sum(e["t"] < min(commits) for e in steps))
    steps = steps[warmup:]
    if len(steps) < 3:
        raise RuntimeError(f"only {len(steps)} step events after warm-up; raise --steps")
    return (len(steps) - 1) / (steps[-1]["t"] - steps[0]["t"]), median([e["step_time"] for e in steps])


def expected_efficiency(step_s: float, write_s: float, interval: int, mode: str, block_s: float = 0.0) -> float:
    """First-order model of throughput with saves / without, for one save every ``interval`` steps.

    sync: the loop stops for the whole write, ``τ / (τ + w)`` with ``τ = interval · step_s``.
    async: the loop pays the staging ``block_s``, plus ``w − τ`` when a write outlasts the interval
    (the next save waits for the writer): ``τ / (τ + b + max(0, w − τ))``.
    """
    tau = interval * step_s
    if mode == "sync":
        return tau / (tau + write_s)
    if mode == "async":
        return tau / (tau + block_s + max(0.0, write_s - tau))
    raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")


def loop_efficiency(ckpt, state: dict, mode: str, interval: int, steps: int, step_s: float) -> dict:
    """In one process: a loop of ``time.sleep(step_s)`` "steps" saving with ``ckpt`` every ``interval`` steps.

    A quick stand-in for the trainer runs (notebook smoke mode): the same checkpointer and throttle
    (``ckpt.config.write_bandwidth``). Returns ``{"seconds", "save_block_s"}``; efficiency =
    seconds(none) / seconds(mode). The last write is finished (outside the timing) before returning.
    """
    import time

    blocks: list[float] = []
    emit, ckpt.emit = ckpt.emit, lambda kind, **f: blocks.append(f["blocking_s"]) if kind == "ckpt_save" else None
    try:
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            time.sleep(step_s)
            for v in state.values():  # the "optimizer" updates the state in place
                if hasattr(v, "add_"):
                    v.add_(1)
            ckpt.finalize_async_save()
            if mode != "none" and step % interval == 0:
                (ckpt.save if mode == "sync" else ckpt.async_save)(state, step=step)
        seconds = time.perf_counter() - t0
        ckpt.finalize_async_save(blocking=True)
    finally:
        ckpt.emit = emit
    return {"seconds": seconds, "save_block_s": median(blocks) if blocks else 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nvrx_lab.bench efficiency", description=__doc__.split("\n")[0])
    ap.add_argument("--intervals", type=int, nargs="+", default=[5, 10, 20], help="checkpoint intervals (steps)")
    ap.add_argument("--steps", type=int, default=100, help="steps per run")
    ap.add_argument("--warmup", type=int, default=20,
                    help="first steps left out of the throughput (start-up: compilation of the first steps, "
                         "the writer process importing torch next to the training ranks)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc-per-node)")
    ap.add_argument("--write-bandwidth", type=float, default=None,
                    help="bytes/s per rank; default: calibrated so a write takes 0.9x the shortest interval's compute")
    ap.add_argument("--step-sleep", type=float, default=0.05, help="trainer --step-sleep: stand-in compute per step (s)")
    ap.add_argument("--train-args", nargs=argparse.REMAINDER, default=[], help="more trainer flags (last)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per trainer run")
    ap.add_argument("--quick", action="store_true", help="intervals 4 8, 44 steps, warm-up 12 (CI smoke)")
    ap.add_argument("--out", default="build/bench/efficiency.json", help="JSON output")
    args = ap.parse_args(argv)
    if args.quick:
        args.intervals, args.steps, args.warmup = [4, 8], 44, 12
    extra = ["--step-sleep", str(args.step_sleep), *args.train_args]
    work = Path(tempfile.mkdtemp(prefix="nvrx_bench_eff_"))
    run = lambda name, mode, k, bw: run_trainer(work, name, args.nproc, args.steps if mode != "probe" else 4,  # noqa: E731
                                                 "sync" if mode == "probe" else mode, k, bw, extra, args.timeout)
    base_tp, step_time = throughput(run("none", "none", 0, None), args.warmup)
    bandwidth = args.write_bandwidth
    probe = [e for e in run("probe", "probe", 2, None) if e["kind"] == "ckpt_commit"]
    if not probe:
        raise RuntimeError("the probe run committed no checkpoint (no ckpt_commit event in the metrics)")
    bytes_per_rank = probe[0]["bytes"] / args.nproc
    if not bandwidth:
        bandwidth = bytes_per_rank / (0.9 * min(args.intervals) * step_time)
    write_s = bytes_per_rank / bandwidth
    rows = [{"mode": "none", "interval": 0, "interval_compute_s": float("nan"), "write_s": 0.0,
             "steps_per_s": base_tp, "efficiency": 1.0, "save_block_med_s": 0.0, "commits": 0}]
    for k in args.intervals:
        for mode in ("sync", "async"):
            events = run(f"{mode}_{k}", mode, k, bandwidth)
            tp, _ = throughput(events, args.warmup)
            saves = [e["blocking_s"] for e in events if e["kind"] == "ckpt_save" and e.get("rank", 0) == 0]
            rows.append({"mode": mode, "interval": k, "interval_compute_s": k * step_time, "write_s": write_s,
                         "steps_per_s": tp, "efficiency": tp / base_tp, "save_block_med_s": median(saves),
                         "commits": sum(e["kind"] == "ckpt_commit" for e in events)})
            print(f"  {mode:5s} every {k:3d}: efficiency {tp / base_tp:.3f}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    by = {(r["mode"], r["interval"]): r["efficiency"] for r in rows}
    checks = []
    for k in args.intervals:
        if k * step_time > write_s:
            checks.append(f"interval {k}: compute {k * step_time:.2f} s > write {write_s:.2f} s: async "
                          f"{by[('async', k)]:.3f} (target >= 0.995)")
        elif k * step_time > 0.5 * write_s:
            checks.append(f"interval {k}: compute ~ write: async/sync = {by[('async', k)] / by[('sync', k)]:.2f} "
                          f"(target >= 2)")
    command = "python -m nvrx_lab.bench efficiency " + " ".join(argv if argv is not None else sys.argv[1:])
    report("efficiency", rows, args.out, command,
           extra={"bandwidth_bytes_per_s": bandwidth, "bytes_per_rank": bytes_per_rank, "step_time_s": step_time,
                  "checks": checks})
    print(f"\nstate per rank {bytes_per_rank / 2**20:.2f} MiB, write cap {bandwidth / 2**20:.2f} MiB/s "
          f"-> a write takes {write_s:.2f} s; step {step_time * 1e3:.1f} ms")
    for line in checks:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
