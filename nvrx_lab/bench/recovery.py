"""Recovery benchmark: fault -> every rank back at its next training step
=======================================================================

``python -m nvrx_lab.bench recovery [--ranks 2 4] [--faults-per-kind 10] [--quick]``

Deterministic faults on rank 1 (exception, hang, SIGKILL) in a small gloo training loop (one
``all_reduce`` + ``--step-time`` sleep a step), each mode side by side in the same run:

* ``nvrx_lab-inprocess`` — :class:`nvrx_lab.inprocess.Wrapper` under
  ``nvrx_lab.inprocess.spawn`` (survivors keep running); many faults in one job, one job per
  SIGKILL (a dead rank is not replaced in process);
* ``nvrx-inprocess`` — NVRx's ``inprocess.Wrapper``: run only if importable (``pip install
  .[peers]``), else reported as skipped;
* ``torchrun`` — ``torchrun --max-restarts N`` (c10d rendezvous), default and with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``;
* ``full-restart`` — the whole job torn down and started again by this script (what a Kubernetes
  pod restart does, without the pod-start delay).

Hangs: the in-process wrapper interrupts after ``soft_timeout``; the other modes only notice
when the peer's gloo collective times out, set to the same value here (default 30 min!).
Each fault is timed from the ``fault`` event (written just before it is injected) to the last
first-step-of-the-next-attempt among the ranks that train again; ``recovered`` counts faults after
which every such rank trained. The worker is this module: ``python -m nvrx_lab.bench.recovery
worker ...``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nvrx_lab.bench._table import median, p95, report
from nvrx_lab.events import EventLog, read_events
from nvrx_lab.net import free_port_pair

KINDS = ("exception", "hang", "sigkill")


# -- the worker ----------------------------------------------------------------------------------
def worker(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="recovery worker")
    ap.add_argument("--mode", choices=["inprocess", "nvrx", "plain"], required=True)
    ap.add_argument("--kind", choices=KINDS, required=True)
    ap.add_argument("--faults", type=int, default=1, help="fault in attempts 0..faults-1")
    ap.add_argument("--fault-step", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=2.0, help="soft timeout / gloo timeout (s)")
    ap.add_argument("--events", required=True)
    a = ap.parse_args(argv)
    import datetime

    import torch
    import torch.distributed as dist

    rank0 = int(os.environ["RANK"])
    log = EventLog(a.events, rank0)
    base_attempt = int(os.environ.get("NVRX_BENCH_ATTEMPT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

    def loop(attempt: int, ping, world_size: int):
        for step in range(a.steps):
            if rank0 == 1 and attempt < a.faults and step == a.fault_step:
                log.emit("fault", attempt=attempt, step=step, fault_kind=a.kind)
                if a.kind == "exception":
                    raise RuntimeError("injected exception")
                if a.kind == "hang":  # plain runs: long enough for the peer's gloo timeout, then gone
                    time.sleep(3600 if a.mode != "plain" else a.timeout + 10)
                os.kill(os.getpid(), signal.SIGKILL)
            t = torch.ones(4)
            dist.all_reduce(t)
            time.sleep(a.step_time)
            ping()
            log.emit("step", attempt=attempt, step=step, world_size=world_size)

    if a.mode == "plain":
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout))
        loop(base_attempt, lambda: None, dist.get_world_size())
        dist.destroy_process_group()
        return 0
    if a.mode == "nvrx":  # NVRx's own wrapper, used as its examples/inprocess/basic_example.py does (only if installed)
        import nvidia_resiliency_ext.inprocess as nvrx

        @nvrx.Wrapper(store_kwargs={"port": int(os.environ["MASTER_PORT"]) + 1},
                      soft_timeout=datetime.timedelta(seconds=a.timeout),
                      hard_timeout=datetime.timedelta(seconds=a.timeout + 3))
        def train(call_wrapper: nvrx.CallWrapper | None = None):
            rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 2 + call_wrapper.iteration,
                                  ws, rank == 0, timeout=datetime.timedelta(seconds=60))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=ws,
                                    timeout=datetime.timedelta(seconds=a.timeout))
            loop(call_wrapper.iteration, call_wrapper.ping, ws)
            dist.destroy_process_group()

        train()
        return 0

    from nvrx_lab.inprocess import Wrapper

    @Wrapper(soft_timeout=a.timeout, hard_timeout=a.timeout + 3, max_iterations=a.faults + 2,
             heartbeat_interval=0.2, heartbeat_timeout=2.0, emit=log.emit)
    def train(cw):
        cw.init_process_group("gloo")
        loop(cw.iteration, cw.ping, cw.world_size)

    train()
    return 0


# -- launching ------------------------------------------------------------------------------------
def _run(cmd: list[str], env: dict, timeout: float) -> int:
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return -999
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _worker_cmd(mode: str, kind: str, faults: int, events: Path, a) -> list[str]:
    return ["-m", "nvrx_lab.bench.recovery", "worker", "--mode", mode, "--kind", kind, "--faults", str(faults),
            "--steps", str(a.steps), "--step-time", str(a.step_time), "--timeout", str(a.timeout),
            "--events", str(events)]


def run_mode(mode: str, kind: str, ranks: int, n: int, tmp: Path, a) -> tuple[list[float], int]:
    """Inject ``n`` faults of ``kind``; returns (recovery seconds of recovered faults, injected)."""
    py, env = sys.executable, dict(os.environ)
    events = tmp / f"{mode}-{kind}-{ranks}.jsonl"
    limit = 60 + n * (a.timeout + 30)
    if mode in ("nvrx_lab-inprocess", "nvrx-inprocess"):
        wmode = "inprocess" if mode == "nvrx_lab-inprocess" else "nvrx"
        jobs = [(1, i) for i in range(n)] if kind == "sigkill" else [(n, 0)]
        for faults, _ in jobs:
            _run([py, "-m", "nvrx_lab.inprocess.spawn", "--nproc", str(ranks), "--", py,
                  *_worker_cmd(wmode, kind, faults, events, a)], env, limit)
    elif mode.startswith("torchrun"):
        if mode == "torchrun-noshare":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        port = free_port_pair()
        _run([py, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--max-restarts", str(n),
              "--monitor-interval", "0.1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
              *_worker_cmd("plain", kind, n, events, a)], env, limit)
    elif mode == "full-restart":
        for attempt in range(n + 1):
            port = free_port_pair()
            _run([py, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--max-restarts", "0",
                  "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                  *_worker_cmd("plain", kind, n, events, a)], {**env, "NVRX_BENCH_ATTEMPT": str(attempt)},
                 60 + a.timeout + 30)
    return recovery_times(events)


def recovery_times(events: Path) -> tuple[list[float], int]:
    """Fault -> max over ranks training in the next attempt of their first step after the fault."""
    faults = read_events(events, "fault")
    steps = read_events(events, "step")
    out = []
    for f in faults:
        nxt = [s for s in steps if s["attempt"] == f["attempt"] + 1 and s["t"] > f["t"]]
        if not nxt:
            continue
        first = {}
        for s in nxt:
            first[s["rank"]] = min(first.get(s["rank"], s["t"]), s["t"])
        out.append(max(first.values()) - f["t"])
    return out, len(faults)


def _nvrx_available() -> bool:
    try:
        import nvidia_resiliency_ext.inprocess  # noqa: F401
        return True
    except Exception:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m nvrx_lab.bench recovery", description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2], help="world sizes to run (e.g. 2 4)")
    ap.add_argument("--faults-per-kind", type=int, default=10, help="faults injected per kind and mode")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    modes = ["nvrx_lab-inprocess", "nvrx-inprocess", "torchrun", "torchrun-noshare", "full-restart"]
    ap.add_argument("--modes", nargs="+", default=modes, choices=modes)
    ap.add_argument("--timeout", type=float, default=2.0, help="soft timeout (in-process) = gloo timeout (others), s")
    ap.add_argument("--steps", type=int, default=6, help="steps per attempt")
    ap.add_argument("--step-time", type=float, default=0.05, help="sleep per step (s)")
    ap.add_argument("--quick", action="store_true", help="2 faults per kind")
    ap.add_argument("--out", default="build/bench/recovery.json")
    a = ap.parse_args(argv)
    n = 2 if a.quick else a.faults_per_kind
    rows = []
    with tempfile.TemporaryDirectory(prefix="nvrx_recovery_") as tmp:
        for ranks in a.ranks:
            for kind in a.kinds:
                for mode in a.modes:
                    if mode == "nvrx-inprocess" and not _nvrx_available():
                        print(f"[recovery] {mode}: skipped (nvidia_resiliency_ext not importable; pip install .[peers])")
                        rows.append({"ranks": ranks, "kind": kind, "mode": mode, "recovered": "skipped"})
                        continue
                    t0 = time.monotonic()
                    times, injected = run_mode(mode, kind, ranks, n, Path(tmp), a)
                    rows.append({"ranks": ranks, "kind": kind, "mode": mode, "median_s": median(times),
                                 "p95_s": p95(times), "recovered": f"{len(times)}/{injected}",
                                 "wall_s": time.monotonic() - t0})
                    print(f"[recovery] {ranks} ranks {kind:9s} {mode:20s} median {median(times):.3f} s "
                          f"({len(times)}/{injected})", flush=True)
    for r in rows:  # ratios against nvrx_lab in-process, same ranks and kind
        base = next((b for b in rows if b["ranks"] == r["ranks"] and b["kind"] == r["kind"]
                     and b["mode"] == "nvrx_lab-inprocess"), None)
        if base and "median_s" in r and base.get("median_s", 0) > 0:
            r["x_vs_nvrx_lab"] = r["median_s"] / base["median_s"]
    command = "python -m nvrx_lab.bench recovery " + shlex.join(argv)
    report("recovery", rows, a.out, command, extra={"faults_per_kind": n, "timeout_s": a.timeout},
           columns=["ranks", "kind", "mode", "median_s", "p95_s", "x_vs_nvrx_lab", "recovered", "wall_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
