"""The trainer's flags: one dataclass, one ``--flag`` per field (help from the docstring under it).

``TrainConfig`` extends the model's :class:`~nvrx_lab.train.model.ModelConfig` with the run's knobs; tiny
defaults train in seconds on 2 CPU cores. :func:`check_config` rejects what no process could train.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from nvrx_lab.train.model import ModelConfig


@dataclass
class TrainConfig(ModelConfig):
    """Every flag of ``python -m nvrx_lab.train``: the model's (:class:`ModelConfig`), then the run's."""

    steps: int = 20
    """Optimizer steps to run in total (a resumed run stops at the same step)."""
    seed: int = 0
    """Seed of the model initialisation and of the token stream."""
    global_batch: int = 8
    """Sequences per step across all ranks; must divide by the world size."""
    lr: float = 3e-3
    """AdamW learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    step_sleep: float = 0.0
    """Extra seconds per step that stand in for a bigger model's compute (benchmarks)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: this rank's GPU when CUDA is available (NCCL), else the CPU (gloo)."""
    threads: int = 0
    """Intra-op CPU threads per rank; 0 = cores / local ranks."""
    pg_timeout: float = 90.0
    """Seconds before a collective gives up; under in-process restart on GPUs it must exceed --hard-timeout
    (the wrapper, not NCCL's watchdog, decides about a hang)."""
    run_id: str = ""
    """Names the run: a launch with the run id of the run recorded beside the checkpoints (or metrics)
    continues it even before its first checkpoint (a Kubernetes pod restart); empty: a launch that
    resumes no checkpoint is a new run (nvrx_lab.train.runs)."""
    fresh: bool = False
    """Start a new run even where --ckpt-dir holds a run's checkpoints: they are removed first, and its faults fire
    again (this launch only: the launcher's restarts continue the run it starts). Without it a launch onto a
    folder with committed checkpoints continues that run (nvrx_lab.train.runs)."""
    metrics: str = ""
    """Event stream (JSON lines: steps, saves, faults, restarts); empty = none."""
    log_every: int = 5
    """Print a progress line every N steps on rank 0 (0 = never)."""
    ckpt: Literal["none", "sync", "async"] = "none"
    """Checkpointing: none, sync (blocks every rank on storage) or async (stage, return, write in the background)."""
    ckpt_interval: int = 10
    """Save every N steps."""
    ckpt_dir: str = ""
    """Folder of the checkpoints (shared by all ranks); a run resumes from its newest committed checkpoint."""
    ckpt_keep: int = 3
    """Committed checkpoints to keep."""
    ckpt_wait_writer: bool = False
    """Async: wait for the writer process (~2 s to import torch) before the first step of a run that starts
    from scratch (a resumed attempt trains at once, as a real job's would: its writer is up long before the next
    interval ends). Without it no save ever waits; one taken while the writer starts is held, and a newer one
    replaces it."""
    ckpt_write_bandwidth: float = 0.0
    """Cap on each rank's write speed in bytes/s, a stand-in for a loaded shared filesystem (0 = no cap)."""
    ckpt_writer_nice: int = 0
    """Async: niceness the writer process adds to the trainer's, 0..19 (0 = training's CPU priority; 10 yields
    the cores to the ranks: nvrx_lab.checkpoint.priority)."""
    ckpt_writer_ionice: str = "none"
    """Async: the writer's I/O class: best-effort:0 .. best-effort:7 (lowest), idle, or none (inherit)."""
    ckpt_writer_cpus: str = ""
    """Async: cores the writer processes run on, e.g. 90,91 (empty = the trainer's)."""
    ckpt_writer_policy: str = "batch"
    """Async: the writer's scheduling policy: batch (its wake-ups never preempt a rank), normal, or idle."""
    local_ckpt_interval: int = 0
    """Local checkpoints every N steps (0 = off): each rank's state in node memory, replicated to the same local
    rank of the next node, restored from the nearest copy after a fault (nvrx_lab.checkpoint.local). Needs
    --ckpt sync|async: storage checkpoints stay the durable fallback."""
    local_ckpt_dir: str = "/dev/shm/nvrx_lab_local"
    """Node-local, memory-backed folder of the local checkpoints (one subfolder per checkpoint folder)."""
    restart: Literal["none", "inprocess", "launcher", "launcher+inprocess"] = "none"
    """Recovery: inprocess (restart the training function in the same processes), launcher (heartbeats to
    nvrx_lab.launcher, which replaces dead or hung workers), or both."""
    soft_timeout: float = 30.0
    """In-process restart: seconds without progress before a rank is interrupted and restarted."""
    hard_timeout: float = 60.0
    """In-process restart: seconds without progress before a rank is killed and the others go on."""
    max_iterations: int = 10
    """In-process restart: restarts allowed before the job gives up."""
    min_world_size: int = 1
    """In-process restart: fewest ranks to go on with after a rank is lost."""
    faults: str = ""
    """Deterministic faults RANK:STEP:KIND[:PHASE],... (kinds: exception, hang, sigkill, oom; phases: step, save,
    load) or RANK:STEP:slow:FACTOR (the rank computes FACTOR times slower from then on); each fires once."""
    straggler_interval: int = 0
    """Straggler detection: every N steps the ranks exchange their compute times and score each other
    (nvrx_lab.straggler); 0 = off."""
    straggler_threshold: float = 0.8
    """Straggler detection: a rank whose speed relative to the fastest rank (1.0 = fastest) is below this is
    reported; in (0, 1]."""
    straggler_action: Literal["report", "restart"] = "report"
    """Straggler detection: report (an event and a console line), or restart (a rank reported twice in a row
    leaves the job at an in-process restart; needs --restart inprocess)."""


def model_config(cfg: TrainConfig) -> ModelConfig:
    return ModelConfig(**{f.name: getattr(cfg, f.name) for f in fields(ModelConfig)})


def check_config(cfg: TrainConfig, world_size: int) -> None:
    if cfg.steps < 0:
        raise ValueError(f"--steps must be >= 0, got {cfg.steps}")
    if cfg.global_batch % world_size:
        raise ValueError(f"--global-batch {cfg.global_batch} does not divide by the world size {world_size}")
    if cfg.dim % cfg.n_heads or (cfg.dim // cfg.n_heads) % 2:
        raise ValueError(f"--dim {cfg.dim} / --n-heads {cfg.n_heads} must give an even head size")
    check_straggler(cfg)


def check_straggler(cfg: TrainConfig) -> None:
    if cfg.straggler_interval < 0:
        raise ValueError(f"--straggler-interval {cfg.straggler_interval} must be >= 0 steps (0 = off)")
    if not 0.0 < cfg.straggler_threshold <= 1.0:
        raise ValueError(f"--straggler-threshold {cfg.straggler_threshold} must be in (0, 1] (a rank's speed "
                         "relative to the fastest rank's, below which it is reported)")
    if cfg.straggler_action not in ("report", "restart"):
        raise ValueError(f"--straggler-action {cfg.straggler_action!r} must be report or restart")
    if cfg.straggler_action == "restart" and not cfg.restart.endswith("inprocess"):
        raise ValueError(f"--straggler-action restart needs --restart inprocess or launcher+inprocess (got --restart "
                         f"{cfg.restart}): the straggler leaves at an in-process restart")
    if cfg.straggler_action == "restart" and not cfg.straggler_interval:
        raise ValueError("--straggler-action restart needs --straggler-interval N > 0 (detection is off)")
