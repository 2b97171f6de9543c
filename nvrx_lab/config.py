"""The trainer's flags: one dataclass, one ``--flag`` per field (help from the docstring under it).

``TrainConfig`` extends the model's :class:`~nvrx_lab.model.ModelConfig` with the run's knobs; tiny
defaults train in seconds on 2 CPU cores. :func:`check_config` rejects what no process could train.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from nvrx_lab.model import ModelConfig


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
    resumes no checkpoint is a new run (nvrx_lab.runs)."""
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
    """Async: wait for the writer process (~2 s to import torch) before the first step. Without it no save
    ever waits; one taken while the writer starts is held, and a newer one replaces it."""
    ckpt_write_bandwidth: float = 0.0
    """Cap on each rank's write speed in bytes/s, a stand-in for a loaded shared filesystem (0 = no cap)."""
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
    load); each fires once."""


def model_config(cfg: TrainConfig) -> ModelConfig:
    return ModelConfig(**{f.name: getattr(cfg, f.name) for f in fields(ModelConfig)})


def check_config(cfg: TrainConfig, world_size: int) -> None:
    if cfg.steps < 0:
        raise ValueError(f"--steps must be >= 0, got {cfg.steps}")
    if cfg.global_batch % world_size:
        raise ValueError(f"--global-batch {cfg.global_batch} does not divide by the world size {world_size}")
    if cfg.dim % cfg.n_heads or (cfg.dim // cfg.n_heads) % 2:
        raise ValueError(f"--dim {cfg.dim} / --n-heads {cfg.n_heads} must give an even head size")
