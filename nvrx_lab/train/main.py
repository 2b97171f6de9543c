"""The trainer: a small Llama-style decoder sharded with FSDP2, on synthetic deterministic data.

Single process (a world of one)::

    python -m nvrx_lab.train --steps 20 --metrics build/metrics.jsonl

Two ranks on CPU (gloo), or eight GPUs of a p5 node (NCCL) with the very same command::

    python -m torch.distributed.run --nproc-per-node 2 -m nvrx_lab.train --steps 20

Multi-node: torchrun's ``--nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT``, or
``python -m nvrx_lab.launcher`` (in-job restarts). Every flag comes from :class:`TrainConfig`.

:func:`main` reads what the launcher said (:class:`~nvrx_lab.dist.LaunchEnv`, once), checks the flags (a usage
error is one ``error:`` line and exit 2, which no launcher retries), begins or continues the run, and hands the
attempt (:func:`nvrx_lab.train.loop.train`) to :mod:`nvrx_lab.train.attempts`. A peer lost, a rank sent away or
a Ctrl-C is one line too.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import resource
import socket
import sys

import torch

from nvrx_lab.checkpoint import CheckpointError
from nvrx_lab.cli import parse_dataclass
from nvrx_lab.dist import LaunchEnv, deterministic, export_env, peer_lost
from nvrx_lab.exit_codes import NO_PROGRESS
from nvrx_lab.inprocess.progress import NoProgress
from nvrx_lab.observe.events import EventLog, last_launch, read_events
from nvrx_lab.observe.goodput import analyze, json_safe
from nvrx_lab.train import attempts, layers, runs
from nvrx_lab.train.config import TrainConfig
from nvrx_lab.train.loop import train
from nvrx_lab.train.resume import PREFIX, done_line


def crash_fields(error: BaseException) -> dict:
    """The ``crash`` event of an exception that ends this process: its type, message (300 characters), the step the
    attempt was at (from the traceback's :func:`~nvrx_lab.train.loop.train` frame; ``None`` outside it), and whether it
    is a peer's fault seen from here (a collective broken by a lost peer) rather than this rank's own."""
    step, tb = None, error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is train.__code__:
            step = tb.tb_frame.f_locals.get("step")
        tb = tb.tb_next
    return {"error": type(error).__name__, "message": str(error)[:300], "step": step,
            "peer_lost": peer_lost(error) is not None}


def logged(run, cfg: TrainConfig, launch: LaunchEnv, events: EventLog, hooks, body) -> dict:
    """``run(...)``'s summary; an exception that leaves the training is a ``crash`` event first, then raised as before
    (a no-progress stop is a decision, not a fault: no event)."""
    try:
        return run(cfg, launch, events, hooks, body)
    except NoProgress:
        raise
    except Exception as e:
        events.emit("crash", **crash_fields(e))
        raise


def finished(cfg: TrainConfig, launch: LaunchEnv, step: int) -> int:
    """A launch onto a run whose ``--steps`` are committed: rank 0 says DONE, every rank records the launch (``start``,
    ``end``: the pause before it is idle, not downtime) and exits 0, before the model is built."""
    events = EventLog(cfg.metrics or None, rank=launch.rank)
    events.emit("start", world_size=launch.world_size, restart_count=launch.restart_count, new_run=False,
                pid=os.getpid(), ckpt=cfg.checkpoint.mode, node=launch.node, host=socket.gethostname())
    if launch.rank == 0:
        print(f"{PREFIX} {done_line(step, str(runs.ckpt_dir(cfg)))}", flush=True)
    events.emit("end", steps=step, cuda_peak_bytes=None, rss_peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return 0


def said_once(launch: LaunchEnv):
    """Around the command line's parsing: a usage error (argparse's one line, exit 2) is said by the node's local
    rank 0 alone, the same line from every rank being noise; ``--help`` is printed by every rank as before."""
    return contextlib.nullcontext() if launch.local_rank == 0 else contextlib.redirect_stderr(io.StringIO())


def configure_threads(cfg: TrainConfig, launch: LaunchEnv) -> None:
    """``--threads``, else ``OMP_NUM_THREADS``, else the node's cores shared by its ranks. The launcher's setting
    counts: three replica groups of one rank on 2 cores, each taking both, stepped 10x slower than with one each."""
    torch.set_num_threads(cfg.threads or launch.omp_threads or max(1, (os.cpu_count() or 1) // launch.local_world_size))


def left_job(error: BaseException) -> str | None:
    """The line of a rank the in-process restart sent away (its health check failed: a straggler, a poisoned GPU),
    or whose survivors it handed to the launcher (fewer ranks left than the launcher goes on with)."""
    from nvrx_lab.inprocess import HealthCheckError, RestartLimitError

    if isinstance(error, HealthCheckError):
        return f"left the job at the in-process restart ({error}); the other ranks go on without it"
    if isinstance(error, RestartLimitError) and "min_world_size" in error.reason:  # the launcher's turn
        return f"in-process restart stops here ({error.reason}); the launcher restarts the group"
    return None


def main(argv: list[str] | None = None) -> int:
    launch = LaunchEnv.read()
    rank = launch.rank
    with said_once(launch):  # every rank of a node has the same flags: its local rank 0 says their error
        cfg = parse_dataclass(TrainConfig, argv, prog="python -m nvrx_lab.train", description=__doc__.split("\n\n")[0])
    try:
        layers.check_flags(cfg, launch.world_size)
        new_run = runs.begin(cfg, rank, launch.restart_count, [runs.fault_state_file(cfg), runs.progress_file(cfg)])
    except ValueError as e:  # exit 2: a usage error, which no restart mends (the launcher does not retry it)
        if launch.local_rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    if not new_run and (done := runs.done_step(cfg)) is not None:
        return finished(cfg, launch, done)
    if cfg.restart.inprocess:  # torch reads these at its first NCCL group; torchrun sets =1, whose watchdog kills
        export_env(layers.INPROCESS_NCCL_ENV)
    configure_threads(cfg, launch)
    export_env({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, keep_set=True)  # deterministic cuBLAS; else CUDA matmuls raise
    deterministic()
    # FSDP2's first fully_shard imports dynamo (and inductor): seconds on a busy box, before the first step could
    # say it lives. Imported here, before any restart layer's timeout is armed (an in-process soft timeout of 3 s
    # fired inside that import, left torch._dynamo half-initialised, and every restart failed on it)
    importlib.import_module("torch._dynamo")
    events = EventLog(cfg.metrics or None, rank=rank)
    events.emit("start", world_size=launch.world_size, restart_count=launch.restart_count, new_run=new_run,
                pid=os.getpid(), ckpt=cfg.checkpoint.mode,  # the launcher's no-progress stop counts only where it is on
                node=launch.node, host=socket.gethostname())  # where each rank runs (nvrx_lab.observe.attribute)
    hooks = layers.make_hooks(cfg, rank, events)
    run = attempts.run_inprocess if cfg.restart.inprocess else attempts.run_plain
    body = lambda attempt, ckpt, h: train(cfg, attempt, ckpt, h)  # noqa: E731
    if cfg.restart.mode == "replicas":
        from nvrx_lab.train.replicas import train_replica

        body = lambda attempt, ckpt, h: train_replica(cfg, attempt, ckpt)  # noqa: E731
    try:
        summary = logged(run, cfg, launch, events, hooks, body)
    except NoProgress as e:  # in-process restarts that resumed from the same step: every rank, the same line
        print(f"[rank {rank}] {e}", file=sys.stderr, flush=True)
        return NO_PROGRESS
    except CheckpointError as e:  # e.g. another model's checkpoint: no restart mends it
        print(f"[rank {rank}] error: {e}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:  # a peer's fault seen from here, or this rank sent away: one line, not a traceback
        if (line := peer_lost(e) or left_job(e)) is None:
            raise
        print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        # a save in flight has said what became of it (its own line, above); this one claims nothing about one
        print(f"[rank {rank}] interrupted (Ctrl-C): training stopped; the committed checkpoints"
              f"{f' in {folder}' if (folder := runs.ckpt_dir(cfg)) else ''} are intact", file=sys.stderr, flush=True)
        return 130
    events.emit("end", steps=summary["steps"],  # the last attempt's peak (gpucheck c); earlier ones: restart events
                cuda_peak_bytes=torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None,
                rss_peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # every attempt of this process
    if rank == 0 and cfg.metrics and summary["losses"]:  # one line a job log collector (nvrx_lab.eks.submit) picks up
        row = json_safe(analyze(last_launch(read_events(cfg.metrics))).row())  # no faults: null, never NaN
        print("GOODPUT " + json.dumps(row, allow_nan=False), flush=True)
    return 0
