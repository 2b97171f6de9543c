"""Checkpoint efficiency: the trainer on 2 ranks with sync vs async saves at several intervals.

    python -m nvrx_lab.bench efficiency [--intervals 5 10 20] [--steps 60] [--quick]

Efficiency = training throughput with saves / throughput without, from the wall-clock times of the
trainer's ``step`` events (so the time a save blocks is counted wherever the trainer pays it). The
write is capped (``--ckpt-write-bandwidth``) so that one checkpoint takes about as long as the
shortest interval's compute — the regime of the seeds (a ~275 s FSx write every 100 steps). The async
saves run twice: with the writer at the ranks' priority (the default) and yielding to them
(``async-writer-yields``: nice 10, the lowest best-effort I/O class). By
default the cap is calibrated: a short probe run measures the bytes a rank writes, a baseline run
the step time. Expected shape: async ≥ 99.5 % where the interval's compute exceeds the write, async
≥ 2× sync where they are comparable.

Each run is ``python -m torch.distributed.run --nproc-per-node 2 -m nvrx_lab.train --steps N --ckpt
{none,sync,async} --ckpt-interval K --ckpt-dir D --ckpt-write-bandwidth B --metrics M.jsonl``.
The first-order model of these figures is :func:`nvrx_lab.observe.advisor.checkpoint_efficiency`; a
one-process stand-in for the runs (notebook 01) is :func:`nvrx_lab.demo.state.loop_efficiency`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from nvrx_lab.cli import Parser
from nvrx_lab.observe.events import read_events
from nvrx_lab.observe.table import median, report
from nvrx_lab.runner import Torchrun, Value, run, trainer

YIELDING = "async-writer-yields"
"""The async row with a writer that yields to training (nice 10, best-effort:7), against the default."""


def run_trainer(workdir: Path, name: str, nproc: int, timeout: float, extra: Sequence[str] = (), **flags: Value) -> list[dict]:
    """One trainer run on ``nproc`` ranks with ``flags`` (then the verbatim ``extra``), its own ``--metrics`` and
    ``--ckpt-dir`` under ``workdir``; returns its events (steps, saves, commits)."""
    metrics = workdir / f"{name}.jsonl"
    ckpt_dir = workdir / f"{name}_ckpt"
    metrics.unlink(missing_ok=True)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    res = run(Torchrun.local(nproc).argv(trainer(*extra, **flags, ckpt_dir=ckpt_dir, metrics=metrics)), timeout)
    if res.timed_out:
        raise RuntimeError(f"{name}: trainer timed out after {timeout} s:\n{res.output[-3000:]}")
    if res.returncode:
        hint = ("\n(the trainer does not accept the --ckpt flags yet?)" if "unrecognized arguments" in res.output else "")
        raise RuntimeError(f"{name}: trainer failed (exit {res.returncode}): {' '.join(res.cmd)}\n{res.output[-3000:]}{hint}")
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = Parser(prog="python -m nvrx_lab.bench efficiency", description=__doc__.split("\n")[0])
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
    ap.add_argument("--yielding-writer", action=argparse.BooleanOptionalAction, default=True,
                    help=f"also run async with a writer that yields ({YIELDING}: --ckpt-writer-nice 10 "
                         "--ckpt-writer-ionice best-effort:7) beside the default, the writer at training's priority")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every mode and interval, interleaved with a run without saves; medians")
    ap.add_argument("--quick", action="store_true", help="intervals 4 8, 44 steps, warm-up 12 (CI smoke)")
    ap.add_argument("--out", default="build/bench/efficiency.json", help="JSON output")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.quick:
        args.intervals, args.steps, args.warmup = [4, 8], 44, 12
    return args


def targets(intervals: list[int], step_time: float, write_s: float, by: dict[tuple[str, int], float]) -> list[str]:
    """The expected shape, checked per interval: async >= 99.5 % where the compute outlasts the write,
    async >= 2x sync where they are comparable."""
    checks = []
    for k in intervals:
        if k * step_time > write_s:
            checks.append(f"interval {k}: compute {k * step_time:.2f} s > write {write_s:.2f} s: async "
                          f"{by[('async', k)]:.3f} (target >= 0.995)")
        elif k * step_time > 0.5 * write_s:
            checks.append(f"interval {k}: compute ~ write: async/sync = {by[('async', k)] / by[('sync', k)]:.2f} "
                          f"(target >= 2)")
    return checks


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="nvrx_bench_eff_"))

    def one_run(name: str, mode: str, k: int, bw: float | None) -> list[dict]:  # the probe: 4 steps, sync saves
        yields = {"ckpt_writer_nice": 10, "ckpt_writer_ionice": "best-effort:7"} if mode == YIELDING else {}
        return run_trainer(work, name, args.nproc, args.timeout, args.train_args,
                           steps=4 if mode == "probe" else args.steps,
                           ckpt={"probe": "sync", YIELDING: "async"}.get(mode, mode), ckpt_interval=k,
                           step_sleep=args.step_sleep, ckpt_write_bandwidth=int(bw) if bw else None, **yields)

    base_tp, step_time = throughput(one_run("none", "none", 0, None), args.warmup)
    bandwidth = args.write_bandwidth
    probe = [e for e in one_run("probe", "probe", 2, None) if e["kind"] == "ckpt_commit"]
    if not probe:
        raise RuntimeError("the probe run committed no checkpoint (no ckpt_commit event in the metrics)")
    bytes_per_rank = probe[0]["bytes"] / args.nproc
    if not bandwidth:
        bandwidth = bytes_per_rank / (0.9 * min(args.intervals) * step_time)
    write_s = bytes_per_rank / bandwidth
    modes = ("sync", "async", *([YIELDING] if args.yielding_writer else []))
    runs: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.repeats):  # interleaved: a slow minute of a shared box hits every mode alike
        base = base_tp if r == 0 else throughput(one_run("none", "none", 0, None), args.warmup)[0]
        for k in args.intervals:
            for mode in modes:
                events = one_run(f"{mode}_{k}", mode, k, bandwidth)
                tp, _ = throughput(events, args.warmup)
                saves = [e["blocking_s"] for e in events if e["kind"] == "ckpt_save" and e.get("rank", 0) == 0]
                runs.setdefault((mode, k), []).append({"tp": tp, "eff": tp / base, "block": median(saves),
                                                       "commits": sum(e["kind"] == "ckpt_commit" for e in events)})
                print(f"  {mode} every {k:3d}: efficiency {tp / base:.3f}", flush=True)
    rows = [{"mode": "none", "interval": 0, "interval_compute_s": float("nan"), "write_s": 0.0,
             "steps_per_s": base_tp, "efficiency": 1.0, "save_block_med_s": 0.0, "commits": 0}]
    rows += [{"mode": mode, "interval": k, "interval_compute_s": k * step_time, "write_s": write_s,
              "steps_per_s": median([x["tp"] for x in got]), "efficiency": median([x["eff"] for x in got]),
              "save_block_med_s": median([x["block"] for x in got]), "commits": got[0]["commits"], "runs": len(got)}
             for (mode, k), got in runs.items()]
    shutil.rmtree(work, ignore_errors=True)
    checks = targets(args.intervals, step_time, write_s, {(r["mode"], r["interval"]): r["efficiency"] for r in rows})
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
