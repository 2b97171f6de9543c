"""The trainer's flags: one settings object, composed of the components' own (as torchtitan's job config is).

:class:`TrainConfig` holds the run's knobs and one section per component, each defined once, in the
component that consumes it, and handed to it whole (no translation in between):

* ``model`` — :class:`~nvrx_lab.train.model.ModelConfig` (``--dim``, ``--n-layers``, ...);
* ``checkpoint`` — :class:`~nvrx_lab.checkpoint.CheckpointConfig` (``--ckpt``, ``--ckpt-interval``, ``--ckpt-dir``,
  ``--ckpt-writer-*``, ``--local-ckpt-*``), read by :class:`~nvrx_lab.checkpoint.CheckpointManager`;
* ``restart`` — :class:`RestartConfig` (``--restart``, and the in-process wrapper's ``--soft-timeout``, ...);
* ``straggler`` — :class:`~nvrx_lab.straggler.config.StragglerConfig` (``--straggler-*``);
* ``faults`` — :class:`~nvrx_lab.faults.FaultConfig` (``--faults``);
* ``replicas`` — :class:`~nvrx_lab.replicas.config.ReplicaConfig` (``--coordinator``, ``--replica-id``, ...).

Every field is one ``--flag`` (help from the docstring under it; a section's fields carry their flag names),
and the whole object loads alike from flags (``TrainConfig.from_args``), keyword arguments named after the
flags (``TrainConfig.from_kwargs(ckpt_interval=5)``) and a YAML file of the same keys. A section checks its
own values when it is built; :func:`check_config` rejects what no process could train at this world size.
Tiny defaults train in seconds on 2 CPU cores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from nvrx_lab.checkpoint.manager import CheckpointConfig
from nvrx_lab.cli import Settings
from nvrx_lab.faults import FaultConfig
from nvrx_lab.replicas.config import ReplicaConfig
from nvrx_lab.straggler.config import StragglerConfig
from nvrx_lab.train.model import ModelConfig


@dataclass
class RestartConfig(Settings):
    """Recovery: which restart layers join the run, and the in-process wrapper's limits (``Wrapper``'s names)."""

    mode: Literal["none", "inprocess", "launcher", "launcher+inprocess", "replicas"] = field(
        default="none", metadata={"flag": "restart"})
    """Recovery: inprocess (restart the training function in the same processes), launcher (heartbeats to
    nvrx_lab.launcher, which replaces dead or hung workers), both, or replicas (this torchrun job is one replica
    group of several: a failed group leaves the step's quorum and the others go on; nvrx_lab.replicas)."""
    soft_timeout: float = 30.0
    """In-process restart: seconds without progress before a rank is interrupted and restarted."""
    hard_timeout: float = 60.0
    """In-process restart: seconds without progress before a rank is killed and the others go on."""
    max_iterations: int = 10
    """In-process restart: restarts allowed before the job gives up."""
    min_world_size: int = 1
    """In-process restart: fewest ranks to go on with after a rank is lost."""
    max_no_progress_cycles: int = 3
    """In-process restart: restarts in a row that resume from no newer checkpoint before the job stops with exit 4
    instead of restarting again (the launcher's setting of this name; 0: never)."""

    def __post_init__(self):
        if not 0 < self.soft_timeout <= self.hard_timeout:
            raise ValueError(f"need 0 < --soft-timeout ({self.soft_timeout}) <= --hard-timeout ({self.hard_timeout})")
        if self.max_iterations < 1 or self.min_world_size < 1:
            raise ValueError("--max-iterations and --min-world-size must be >= 1")
        if self.max_no_progress_cycles < 0:
            raise ValueError(f"--max-no-progress-cycles must be >= 0 (0: never stop), got {self.max_no_progress_cycles}")

    @property
    def inprocess(self) -> bool:
        return self.mode.endswith("inprocess")

    @property
    def launcher(self) -> bool:
        return self.mode.startswith("launcher")


@dataclass
class TrainConfig(Settings):
    """Every flag of ``python -m nvrx_lab.train``: the run's, then each component's section."""

    steps: int = 20
    """Optimizer steps to run in total (a resumed run stops at the same step)."""
    seed: int = 0
    """Seed of the model initialisation and of the token stream."""
    global_batch: int = 8
    """Sequences per step across all ranks; must divide by the world size."""
    data: str = ""
    """Token file to train on (nvrx_lab.data: PREFIX of Megatron's .bin/.idx, or FILE.bin:uint16 of nanoGPT's;
    python -m nvrx_lab.data prepare makes one from text); empty: synthetic tokens."""
    lr: float = 3e-3
    """AdamW learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    step_sleep: float = 0.0
    """Extra seconds per step that stand in for a bigger model's compute (benchmarks, notebook 09); in replica groups
    in proportion to the rows a rank computes (a redo's extra rows cost more)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: this rank's GPU when CUDA is available (NCCL), else the CPU (gloo)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute precision: bf16 computes in bf16 and reduces gradients in fp32 (FSDP2's MixedPrecisionPolicy; the
    parameters, the optimizer and the checkpoints stay fp32); auto: bf16 on a GPU, fp32 on the CPU."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward (less memory, about a third more compute)."""
    compile: bool = False
    """torch.compile each block (the first steps pay the compilation)."""
    threads: int = 0
    """Intra-op CPU threads per rank; 0 = cores / local ranks."""
    replicate: int = 1
    """HSDP: shard the model over groups of world/N ranks and replicate it N times (FSDP2 on a 2-D mesh; a p5 job
    shards within a node and replicates across nodes); 1: FSDP over every rank."""
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
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model's shape (nvrx_lab.train.model)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints: storage and local (nvrx_lab.checkpoint.manager)."""
    restart: RestartConfig = field(default_factory=RestartConfig)
    """Recovery from faults: in-process restart and the launcher."""
    straggler: StragglerConfig = field(default_factory=StragglerConfig, metadata={"flag_prefix": "straggler-"})
    """Straggler detection (nvrx_lab.straggler)."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    """Injected faults (nvrx_lab.faults)."""
    replicas: ReplicaConfig = field(default_factory=ReplicaConfig)
    """Replica groups (--restart replicas; nvrx_lab.replicas)."""

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"--steps must be >= 0, got {self.steps}")
        if self.replicate < 1:
            raise ValueError(f"--replicate must be >= 1 (1: FSDP over every rank), got {self.replicate}")
        if self.straggler.action == "restart" and not self.restart.inprocess:
            raise ValueError(f"--straggler-action restart needs --restart inprocess or launcher+inprocess (got --restart "
                             f"{self.restart.mode}): the straggler leaves at an in-process restart")
        if self.restart.mode == "replicas":
            if not self.replicas.coordinator:
                raise ValueError("--restart replicas needs --coordinator HOST:PORT "
                                 "(python -m nvrx_lab.replicas.coordinator)")
            if self.checkpoint.local_interval:
                raise ValueError("--restart replicas keeps the state in the live replicas (a replacement heals from "
                                 "one): no --local-ckpt-interval (storage checkpoints, --ckpt, are allowed)")
            if self.straggler.interval:
                raise ValueError("--restart replicas has no straggler detection (yet): leave --straggler-interval 0")
            if self.replicate != 1:
                raise ValueError("--restart replicas replicates across its groups already (each group one FSDP copy): "
                                 "leave --replicate 1")
        elif self.replicas.coordinator:
            raise ValueError(f"--coordinator is for --restart replicas (got --restart {self.restart.mode})")


def check_config(cfg: TrainConfig, world_size: int) -> None:
    """What no process could train at ``world_size`` ranks (the rest each section checked when it was built)."""
    # replica groups share any batch among their ranks (a rank with no rows computes a stand-in row weighted zero)
    if cfg.global_batch % world_size and cfg.restart.mode != "replicas":
        raise ValueError(f"--global-batch {cfg.global_batch} does not divide by the world size {world_size}")
    if world_size % cfg.replicate:
        raise ValueError(f"--replicate {cfg.replicate} does not divide the world size {world_size}: HSDP shards over "
                         f"world/N ranks; pass a divisor of {world_size}")
