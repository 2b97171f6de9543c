"""The GPU workers of :mod:`nvrx_lab.gpucheck`, each a fresh process that prints one JSON line.

* Check d: a device-side assert poisons the CUDA context, with and without
  :class:`~nvrx_lab.inprocess.CudaHealthCheck`. Without it, in-process restart retries the poisoned rank until
  ``max_iterations``; with it, the rank leaves after the first attempt. Runs under torchrun on one GPU:
  ``python -m torch.distributed.run --nproc-per-node 1 -m nvrx_lab.gpucheck.device [--health-check]``.
* Check e: the NCCL abort path of in-process restart (:func:`nvrx_lab.inprocess.abort.abort_nccl`, what
  ``AbortTorchDistributed`` calls): an NCCL group on the GPU all-reduces, is aborted (``ncclCommAbort``), refuses
  work afterwards, and a new group on the same GPU all-reduces again: ``python -m nvrx_lab.gpucheck.device --abort``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from nvrx_lab.runner import torchrun


def device_assert_worker(health: bool) -> int:
    """Run under torchrun (one rank): attempt 0 triggers a device-side assert; prints one JSON line."""
    import torch.distributed as dist

    from nvrx_lab.dist import LaunchEnv, export_env
    from nvrx_lab.inprocess import HealthCheckError, RestartLimitError, Wrapper, default_health_check
    from nvrx_lab.train.layers import INPROCESS_NCCL_ENV

    export_env(INPROCESS_NCCL_ENV)
    device = torch.device("cuda", LaunchEnv.read().local_rank)
    torch.cuda.set_device(device)
    attempts: list[int] = []

    @Wrapper(soft_timeout=20, hard_timeout=40, pg_timeout=60, max_iterations=3, barrier_timeout=60,
             health_check=default_health_check(device) if health else None)
    def attempt(cw) -> str:
        attempts.append(cw.iteration)
        cw.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
        x = torch.ones(1024, device=device)
        dist.all_reduce(x)
        if cw.iteration == 0:
            x[torch.tensor([1 << 20], device=device)] = 0.0  # out of bounds: a device-side assert
        torch.cuda.synchronize()
        return "trained"

    t0 = time.monotonic()
    try:
        outcome = attempt()
    except HealthCheckError as e:
        outcome = f"left: {str(e)[:160]}"
    except RestartLimitError as e:
        outcome = f"gave up: {str(e).splitlines()[0][:160]}"
    print(json.dumps({"gpucheck_worker": "device-assert", "attempts": attempts, "outcome": outcome,
                      "seconds": round(time.monotonic() - t0, 1)}), flush=True)
    return 0


def nccl_abort_worker() -> int:
    """Check e's worker (one process, one GPU, a world of one over a FileStore); prints one JSON line."""
    import tempfile

    import torch.distributed as dist

    from nvrx_lab.inprocess.abort import abort_nccl

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    row: dict = {"gpucheck_worker": "nccl-abort", "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    with tempfile.TemporaryDirectory() as d:
        for attempt in (0, 1):
            dist.init_process_group("nccl", store=dist.FileStore(f"{d}/store{attempt}", 1), rank=0, world_size=1,
                                    device_id=device)
            x = torch.full((1024,), 2.0, device=device)
            dist.all_reduce(x)
            torch.cuda.synchronize()
            row[f"all_reduce_{attempt}"] = float(x[0])
            if attempt == 0:
                t0 = time.monotonic()
                row["aborted_groups"] = abort_nccl()
                row["abort_s"] = round(time.monotonic() - t0, 3)
                try:
                    dist.all_reduce(x)
                    torch.cuda.synchronize()
                    row["after_abort"] = "accepted work"
                except Exception as e:  # what an aborted communicator must do: refuse, not hang
                    row["after_abort"] = f"refused: {type(e).__name__}"
            try:
                dist.destroy_process_group()
            except Exception as e:  # reported: in-process restart destroys the aborted group the same way
                row[f"destroy_{attempt}"] = f"{type(e).__name__}: {str(e)[:120]}"
    print(json.dumps(row), flush=True)
    return 0


def check_nccl_abort(timeout: float) -> tuple[bool, str, str, list[str]]:
    """(ok, figures, problems, output lines) of check e's worker."""
    import subprocess

    try:
        res = subprocess.run([sys.executable, "-m", "nvrx_lab.gpucheck.device", "--abort"], capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, "", f"the worker did not finish in {timeout:.0f} s (an abort that hangs?)", []
    rows = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith('{"gpucheck_worker"')]
    if not rows:
        return False, "", f"no result (exit {res.returncode})", [(res.stdout + res.stderr)[-1500:].strip()]
    row = rows[0]
    figures = (f"NCCL {row['nccl']}: abort path ran on {row['aborted_groups']} group(s) in {row['abort_s']} s; "
               f"after it: {row['after_abort']}; new group all-reduce {row.get('all_reduce_1')}")
    problems = [msg for bad, msg in ((row["aborted_groups"] < 1, "abort_nccl() aborted no NCCL group"),
                                     (row.get("all_reduce_1") != 2.0, "a new group after the abort did not all-reduce"))
                if bad]
    return not problems, figures, "; ".join(problems), []


def check_device_assert(timeout: float) -> tuple[bool, str, str, list[str]]:
    """(ok, figures, problems, output lines) of the worker run without and with the health check."""
    figures, problems, lines = [], [], []
    for health in (False, True):
        flags = ["--health-check"] if health else []
        res = torchrun(1, "-m", "nvrx_lab.gpucheck.device", *flags, timeout=timeout)
        rows = [json.loads(ln) for ln in res.output.splitlines() if ln.startswith('{"gpucheck_worker"')]
        label = "with CudaHealthCheck" if health else "without"
        if not rows:
            figures.append(f"{label}: no result (exit {res.returncode}, {res.wall_s:.0f} s)")
            lines.append(f"--- {label}\n{res.output[-1500:].strip()}")
            if health:
                problems.append(f"{label}: the rank did not report")
            continue
        row = rows[0]
        figures.append(f"{label}: attempts {row['attempts']}, {row['seconds']} s")
        if health and not (row["outcome"].startswith("left") and row["attempts"] == [0]):
            problems.append(f"{label}: expected to leave after attempt 0, got {row['outcome']}")
        if not health and row["outcome"] == "trained":
            problems.append(f"{label}: a poisoned context trained on?")
        lines.append(f"{label}: {row['outcome']}")
    return not problems, "; ".join(figures), "; ".join(problems), lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nvrx_lab.gpucheck.device", description=__doc__.split("\n")[0])
    ap.add_argument("--health-check", action="store_true", help="with CudaHealthCheck")
    ap.add_argument("--abort", action="store_true", help="check e: the NCCL abort path (no torchrun)")
    a = ap.parse_args(argv)
    return nccl_abort_worker() if a.abort else device_assert_worker(a.health_check)


if __name__ == "__main__":
    sys.exit(main())
