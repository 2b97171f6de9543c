"""How the trainer composes the layers from its flags; each layer stays unaware of the others.

Each layer gets its own section of :class:`~nvrx_lab.train.config.TrainConfig`, whole:

* ``checkpoint`` (``--ckpt``, ``--local-ckpt-interval``, ...) → :class:`nvrx_lab.checkpoint.CheckpointManager`,
  which owns the intervals and both tiers (:func:`make_checkpointer`);
* ``faults`` (``--faults``) → :class:`FaultHooks` around :class:`nvrx_lab.faults.FaultInjector`, fired faults kept
  beside the checkpoints;
* ``restart`` launcher → :class:`~nvrx_lab.train.launcher_hooks.LauncherHooks` (heartbeats and sections);
  inprocess → :func:`nvrx_lab.train.attempts.run_inprocess`, the attempt inside :class:`nvrx_lab.inprocess.Wrapper`;
* ``straggler`` (``--straggler-interval N``) → :class:`nvrx_lab.straggler.StragglerHooks` (its health check is
  a hook like any other: :meth:`~nvrx_lab.train.hooks.Hooks.health_check`).

:func:`check_flags` refuses what cannot work before any process group or file is touched;
:func:`make_hooks` gives the trainer its one :class:`~nvrx_lab.train.hooks.Hooks` object.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from nvrx_lab.checkpoint import CheckpointManager, Placement
from nvrx_lab.cli import check_writable
from nvrx_lab.dist import DistContext
from nvrx_lab.faults import FaultInjector
from nvrx_lab.observe.events import EventLog
from nvrx_lab.train import runs
from nvrx_lab.train.config import TrainConfig, check_config
from nvrx_lab.train.hooks import ComposeHooks, Hooks
from nvrx_lab.train.launcher_hooks import LauncherHooks
from nvrx_lab.train.runs import FAULTS_FIRED, PROGRESS, RUN_FILE, fault_state_file


def check_flags(cfg: TrainConfig, world_size: int = 1) -> None:
    """Flag combinations that cannot work at ``world_size`` ranks, rejected before any process group or file is
    touched (what each section can tell alone, it told when it was built)."""
    check_config(cfg, world_size)
    if cfg.metrics:
        check_writable(cfg.metrics, "--metrics")  # run.json and the fired-faults file go beside it
    ckpt = cfg.checkpoint
    if ckpt.enabled:
        path = Path(ckpt.storage.directory)
        if path.exists() and not path.is_dir():
            raise ValueError(f"--ckpt-dir {path} is a file; pass a folder (it is created if missing)")
        check_ckpt_dir(path)
    if ckpt.local_interval and "{node}" not in ckpt.local_dir:
        check_writable(Path(ckpt.local_dir), "--local-ckpt-dir", folder=True)
    if cfg.restart.inprocess and uses_cuda(cfg) and cfg.pg_timeout <= cfg.restart.hard_timeout:
        raise ValueError(f"--pg-timeout ({cfg.pg_timeout}) must exceed --hard-timeout ({cfg.restart.hard_timeout}) under "
                         "in-process restart on GPUs: NCCL's watchdog would end a hung collective before the wrapper")
    check_faults(cfg, world_size)
    if cfg.data:
        from nvrx_lab.train.data import token_source

        token_source(cfg)  # the file is there, whole, and holds a sample of --seq-len (it is only mapped)
    if cfg.restart.launcher:
        from nvrx_lab.launcher import RankMonitorClient

        if not RankMonitorClient.available():
            raise ValueError(f"--restart {cfg.restart.mode} needs the workers to run under `python -m nvrx_lab.launcher` "
                             "(no rank monitor found in the environment); use --restart none or inprocess under torchrun")


INPROCESS_NCCL_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # on an error the watchdog aborts the communicator, the process lives
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",  # nor does it rethrow CUDA errors from its thread
    "NCCL_NVLS_ENABLE": "0",  # NVLS multicast buffers are not released by an abort
}
"""What in-process restart needs from NCCL (as ``nvrx_lab.eks.modes`` sets in the manifests)."""


def uses_cuda(cfg: TrainConfig) -> bool:
    import torch

    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def check_faults(cfg: TrainConfig, world_size: int) -> None:
    """Each fault must be able to fire: a rank of this world, a step this run reaches. Under ``--restart replicas`` a
    fault's rank counts across the replica groups (replica id x group size + rank)."""
    replicas = cfg.replicas.replicas if cfg.restart.mode == "replicas" else 1
    world = world_size * replicas
    for fault in cfg.faults.faults:
        if fault.rank >= world:
            across = f" across {replicas} replica groups of {world_size}" if replicas > 1 else ""
            raise ValueError(f"--faults entry {fault.id}: rank {fault.rank} is not in this world of {world} "
                             f"rank(s){across} (0..{world - 1}); it would never fire")
        if not 1 <= fault.step <= cfg.steps:
            raise ValueError(f"--faults entry {fault.id}: step {fault.step} is outside this run's steps 1..{cfg.steps} "
                             f"(--steps {cfg.steps}); it would never fire")


def check_ckpt_dir(path: Path) -> None:
    """Refuse a folder this user cannot write or create (rank 0 writes ``run.json`` there before the first
    save), and one that holds something else than our checkpoints: saving into it would mix them
    (a missing or empty folder starts a new run; one with committed steps resumes). A ``step_*``
    folder without our manifest is not ours either (e.g. a plain ``dcp.save``): a commit of that step
    would replace it."""
    from nvrx_lab.checkpoint.commit import STEP_RE, committed_steps, foreign_entries

    check_writable(path, "--ckpt-dir", folder=True)
    if not path.is_dir() or committed_steps(path):
        return
    ours = {FAULTS_FIRED, RUN_FILE, PROGRESS}
    foreign = [name for name in foreign_entries(path) if name not in ours]
    foreign += sorted(f"{p.name}/ (not committed: no nvrx_commit.json)" for p in path.iterdir() if STEP_RE.match(p.name))
    if foreign:
        raise ValueError(f"--ckpt-dir {path} is not a folder this trainer saved to: it holds {foreign[:5]} and no "
                         "committed checkpoint; pass a new or empty folder, or one this trainer saved to")


def make_checkpointer(cfg: TrainConfig, ctx: DistContext, events: EventLog) -> CheckpointManager | None:
    """The checkpoint manager the ``checkpoint`` section asks for; its writer starts now (async), so its start-up
    overlaps building the model."""
    if not cfg.checkpoint.enabled:
        return None
    placement = Placement(local_ckpt_dir(cfg, ctx.launch.node), run=runs.recorded(cfg).get("nonce", ""),
                          local_world=ctx.launch.local_world_size)
    return CheckpointManager(cfg.checkpoint, ctx.cpu_group, events.emit, placement)


def local_ckpt_dir(cfg: TrainConfig, node: int) -> Path:
    """This run's folder of local checkpoints: one per checkpoint folder (its path's hash), in node memory.
    ``{node}`` in ``--local-ckpt-dir`` becomes the node's index: nodes simulated on one machine keep separate
    memories."""
    key = hashlib.sha1(str(Path(cfg.checkpoint.storage.directory).resolve()).encode()).hexdigest()[:12]
    return Path(cfg.checkpoint.local_dir.replace("{node}", str(node))) / key


class FaultHooks(Hooks):
    """Fault injection joins the attempt before each step and inside checkpoint I/O."""

    def __init__(self, injector: FaultInjector):
        self.injector = injector

    def before_step(self, step: int) -> None:
        self.injector(step)

    def during(self, phase: str, step: int) -> None:
        self.injector.during(phase, step)


def make_hooks(cfg: TrainConfig, rank: int, events: EventLog) -> Hooks:
    """The layers' hooks the flags ask for, as one (the in-process wrapper adds its own per attempt)."""
    faults = cfg.faults.faults
    injector = FaultInjector(faults, rank, state_file=fault_state_file(cfg), emit=events.emit) if faults else None
    return ComposeHooks(LauncherHooks() if cfg.restart.launcher else None,
                        make_straggler_hooks(cfg, events),  # its timer, installed at start, wraps a slow fault
                        FaultHooks(injector) if injector else None)


def make_straggler_hooks(cfg: TrainConfig, events: EventLog) -> Hooks | None:
    if not cfg.straggler.interval:
        return None
    import torch

    from nvrx_lab.straggler import StragglerHooks

    return StragglerHooks.from_config(cfg.straggler, emit=events.emit,
                                      device=torch.device("cuda") if uses_cuda(cfg) else None)
