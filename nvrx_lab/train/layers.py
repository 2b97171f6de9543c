"""How the trainer composes the layers from its flags; each layer stays unaware of the others.

* ``--ckpt sync|async`` → :class:`nvrx_lab.checkpoint.AsyncCheckpointer` on the CPU (gloo) group
* ``--faults``          → :class:`FaultHooks` around :class:`nvrx_lab.faults.FaultInjector`, fired faults
  kept next to the checkpoints
* ``--restart launcher`` → :class:`LauncherHooks`: :class:`nvrx_lab.launcher.RankMonitorClient` heartbeats
  and sections
* ``--restart inprocess`` → :func:`nvrx_lab.train.attempts.run_inprocess`, the attempt inside
  :class:`nvrx_lab.inprocess.Wrapper`
* ``--straggler-interval N`` → :class:`nvrx_lab.straggler.StragglerHooks` (its ``health_check`` joins the
  wrapper's, :func:`health_checks`)

:func:`check_flags` refuses what cannot work before any process group or file is touched;
:func:`make_hooks` gives the trainer its one :class:`~nvrx_lab.train.hooks.Hooks` object.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from nvrx_lab.cli import check_writable
from nvrx_lab.dist import DistContext
from nvrx_lab.faults import FaultInjector, parse_schedule
from nvrx_lab.observe.events import EventLog
from nvrx_lab.train import runs
from nvrx_lab.train.config import TrainConfig, check_config
from nvrx_lab.train.hooks import ComposeHooks, Hooks
from nvrx_lab.train.runs import FAULTS_FIRED, PROGRESS, RUN_FILE, fault_state_file


def check_flags(cfg: TrainConfig, world_size: int = 1) -> None:
    """Flag combinations that cannot work, rejected before any process group or file is touched."""
    check_config(cfg, world_size)
    if cfg.metrics:
        check_writable(cfg.metrics, "--metrics")  # run.json and the fired-faults file go beside it
    if cfg.ckpt != "none":
        if not cfg.ckpt_dir:
            raise ValueError(f"--ckpt {cfg.ckpt} needs --ckpt-dir DIR (a folder shared by all ranks)")
        if cfg.ckpt_interval < 1:
            raise ValueError(f"--ckpt-interval must be >= 1 step, got {cfg.ckpt_interval}")
        if cfg.ckpt_keep < 1:
            raise ValueError(f"--ckpt-keep must be >= 1, got {cfg.ckpt_keep}")
        path = Path(cfg.ckpt_dir)
        if path.exists() and not path.is_dir():
            raise ValueError(f"--ckpt-dir {path} is a file; pass a folder (it is created if missing)")
        check_ckpt_dir(path)
    check_local(cfg)
    from nvrx_lab.checkpoint.throttle import check_bandwidth
    check_bandwidth(cfg.ckpt_write_bandwidth, "--ckpt-write-bandwidth")  # 0 (the default) = no cap
    writer_priority(cfg)
    if not 0 < cfg.soft_timeout <= cfg.hard_timeout:
        raise ValueError(f"need 0 < --soft-timeout ({cfg.soft_timeout}) <= --hard-timeout ({cfg.hard_timeout})")
    if cfg.restart.endswith("inprocess") and uses_cuda(cfg) and cfg.pg_timeout <= cfg.hard_timeout:
        raise ValueError(f"--pg-timeout ({cfg.pg_timeout}) must exceed --hard-timeout ({cfg.hard_timeout}) under "
                         "in-process restart on GPUs: NCCL's watchdog would end a hung collective before the wrapper")
    if cfg.max_iterations < 1 or cfg.min_world_size < 1:
        raise ValueError("--max-iterations and --min-world-size must be >= 1")
    check_faults(cfg, world_size)
    if cfg.restart.startswith("launcher"):
        from nvrx_lab.launcher import RankMonitorClient

        if not RankMonitorClient.available():
            raise ValueError(f"--restart {cfg.restart} needs the workers to run under `python -m nvrx_lab.launcher` "
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
    """Each fault must be able to fire: a rank of this world, a step this run reaches."""
    for fault in parse_schedule(cfg.faults):  # raises naming a malformed entry
        if fault.rank >= world_size:
            raise ValueError(f"--faults entry {fault.id}: rank {fault.rank} is not in this world of {world_size} "
                             f"rank(s) (0..{world_size - 1}); it would never fire")
        if not 1 <= fault.step <= cfg.steps:
            raise ValueError(f"--faults entry {fault.id}: step {fault.step} is outside this run's steps 1..{cfg.steps} "
                             f"(--steps {cfg.steps}); it would never fire")


def check_local(cfg: TrainConfig) -> None:
    if cfg.local_ckpt_interval < 0:
        raise ValueError(f"--local-ckpt-interval must be >= 0 steps (0 = off), got {cfg.local_ckpt_interval}")
    if cfg.local_ckpt_interval and cfg.ckpt == "none":
        raise ValueError("--local-ckpt-interval needs --ckpt sync|async and --ckpt-dir: storage checkpoints stay "
                         "the durable fallback (and name the run the local copies belong to)")
    if cfg.local_ckpt_interval and Path(cfg.local_ckpt_dir).is_file():
        raise ValueError(f"--local-ckpt-dir {cfg.local_ckpt_dir} is a file; pass a folder in node memory "
                         "(e.g. /dev/shm/nvrx_lab_local; it is created if missing)")
    if cfg.local_ckpt_interval and "{node}" not in cfg.local_ckpt_dir:
        check_writable(Path(cfg.local_ckpt_dir), "--local-ckpt-dir", folder=True)


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


def writer_priority(cfg: TrainConfig):
    """The writer's :class:`~nvrx_lab.checkpoint.priority.WriterPriority` from the ``--ckpt-writer-*`` flags."""
    from nvrx_lab.checkpoint.priority import WriterPriority

    try:
        cpus = tuple(int(c) for c in cfg.ckpt_writer_cpus.split(",") if c.strip())
    except ValueError:
        raise ValueError(f"--ckpt-writer-cpus must be comma-separated core numbers such as 90,91; got "
                         f"{cfg.ckpt_writer_cpus!r}") from None
    try:
        return WriterPriority(cfg.ckpt_writer_nice, cfg.ckpt_writer_ionice, cpus, cfg.ckpt_writer_policy)
    except ValueError as e:
        raise ValueError(f"--ckpt-{e}") from None


def make_checkpointer(cfg: TrainConfig, ctx: DistContext, events: EventLog):
    if cfg.ckpt == "none":
        return None
    from nvrx_lab.checkpoint import AsyncCheckpointer

    # The writer process is spawned now (async only), so its start-up overlaps building the model.
    storage = AsyncCheckpointer(cfg.ckpt_dir, keep_last=cfg.ckpt_keep, write_bandwidth=cfg.ckpt_write_bandwidth,
                                process_group=ctx.cpu_group, emit=events.emit, start_writer=cfg.ckpt == "async",
                                announce=False,  # the trainer says where it resumed (nvrx_lab.train.resume)
                                writer_priority=writer_priority(cfg))
    if not cfg.local_ckpt_interval:
        return storage
    from nvrx_lab.checkpoint.local import LocalCheckpointer
    from nvrx_lab.checkpoint.tiered import Tiered

    local = LocalCheckpointer(local_ckpt_dir(cfg), run=runs.recorded(cfg).get("nonce", ""), rank=storage.rank,
                              world=storage.world, local_world=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                              group=storage.group, emit=events.emit)
    return Tiered(storage, local)


def local_ckpt_dir(cfg: TrainConfig) -> Path:
    """This run's folder of local checkpoints: one per checkpoint folder (its path's hash), in node memory.
    ``{node}`` in ``--local-ckpt-dir`` becomes the node's index (torchrun's ``GROUP_RANK``): nodes simulated on
    one machine then keep separate memories."""
    key = hashlib.sha1(str(Path(cfg.ckpt_dir).resolve()).encode()).hexdigest()[:12]
    return Path(cfg.local_ckpt_dir.replace("{node}", os.environ.get("GROUP_RANK", "0"))) / key


class FaultHooks(Hooks):
    """Fault injection joins the attempt before each step and inside checkpoint I/O."""

    def __init__(self, injector: FaultInjector):
        self.injector = injector

    def before_step(self, step: int) -> None:
        self.injector(step)

    def during(self, phase: str, step: int) -> None:
        self.injector.during(phase, step)


class LauncherHooks(Hooks):
    """The trainer's side of the launcher: heartbeats, a section around checkpoint I/O, and timeouts
    computed from observed intervals and carried in the checkpoint (``state_dict``, key ``monitor``)."""

    name = "monitor"

    def __init__(self):
        from nvrx_lab.launcher import RankMonitorClient

        self.client = RankMonitorClient()
        self.started = False
        self.calculated = False
        self.saves = 0

    def start(self) -> None:
        """After the process group exists; re-entrant across in-process restarts."""
        if not self.started:
            self.client.init_workload_monitoring()
            self.started = True

    def after_step(self, step: int) -> None:
        self.client.send_heartbeat()

    def section(self, name: str):
        # the per-step commit poll and a local snapshot are quick and frequent: no section of their own
        quick = name in ("checkpoint_commit", "checkpoint_local")
        return contextlib.nullcontext() if quick else _Section(self.client, name)

    def after_save(self) -> None:
        """After the second save, set timeouts from what was observed (a collective on all ranks).

        Not after the first: only the second ``async_save`` can wait for a write still in flight, the
        longest legitimate stay in the ``checkpoint`` section. A floor of 3 s keeps a noisy shared CPU
        from reading a slow step as a hang; on GPUs with steady step times the factor 5 dominates."""
        self.saves += 1
        if not self.calculated and self.saves >= 2:
            self.client.calculate_timeouts(safety_factor=5.0, floor=3.0)
            self.calculated = True

    def state_dict(self) -> str:
        return json.dumps(self.client.state_dict())

    def load_state_dict(self, text: str) -> None:
        state = json.loads(text)
        self.client.load_state_dict(state)
        self.calculated = bool(state.get("timeouts"))

    def close(self) -> None:
        if self.started:
            self.client.shutdown_workload_monitoring()
            self.started = False


class _Section:
    def __init__(self, client, name: str):
        self.client, self.name = client, name

    def __enter__(self):
        self.client.start_section(self.name)

    def __exit__(self, *exc):
        self.client.end_section(self.name)


def make_hooks(cfg: TrainConfig, rank: int, events: EventLog) -> Hooks:
    """The layers' hooks the flags ask for, as one (the in-process wrapper adds its own per attempt)."""
    faults = parse_schedule(cfg.faults)
    injector = FaultInjector(faults, rank, state_file=fault_state_file(cfg), emit=events.emit) if faults else None
    return ComposeHooks(LauncherHooks() if cfg.restart.startswith("launcher") else None,
                        make_straggler_hooks(cfg, events),  # its timer, installed at start, wraps a slow fault
                        FaultHooks(injector) if injector else None)


def make_straggler_hooks(cfg: TrainConfig, events: EventLog) -> Hooks | None:
    if not cfg.straggler_interval:
        return None
    import torch

    from nvrx_lab.straggler import StragglerHooks

    return StragglerHooks(cfg.straggler_interval, cfg.straggler_threshold, cfg.straggler_action, emit=events.emit,
                          device=torch.device("cuda") if uses_cuda(cfg) else None)


def health_checks(hooks: Hooks) -> list:
    """The health checks the layers' hooks bring to the in-process wrapper (a straggler's, for one)."""
    found = hooks.hooks if isinstance(hooks, ComposeHooks) else [hooks]
    return [h.health_check for h in found if callable(getattr(h, "health_check", None))]


def launcher_restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def launcher_recovering():
    """The failure the launcher restarted these workers for (:meth:`RankMonitorClient.last_failure`), if any."""
    if launcher_restart_count() == 0:
        return None
    from nvrx_lab.launcher import RankMonitorClient
    from nvrx_lab.train.resume import Recovering

    failure = RankMonitorClient.last_failure()
    return Recovering(failure["t"], failure["rank"], failure["cause"]) if failure else None
