"""How the trainer composes the layers from its flags; each layer stays unaware of the others.

* ``--ckpt sync|async`` → :class:`nvrx_lab.checkpoint.AsyncCheckpointer` on the CPU (gloo) group
* ``--faults``          → :class:`nvrx_lab.faults.FaultInjector`, fired faults kept next to the checkpoints
* ``--restart launcher`` → :class:`nvrx_lab.launcher.RankMonitorClient` heartbeats and sections
* ``--restart inprocess`` → :class:`nvrx_lab.inprocess.Wrapper` around one training attempt
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from nvrx_lab.dist import DistContext, env_rank, pick_device
from nvrx_lab.events import EventLog
from nvrx_lab.faults import FaultInjector, parse_schedule
from nvrx_lab.runs import RUN_FILE

if TYPE_CHECKING:
    from nvrx_lab.train import TrainConfig


def check_flags(cfg: "TrainConfig", world_size: int = 1) -> None:
    """Flag combinations that cannot work, rejected before any process group or file is touched."""
    from nvrx_lab.train import check_config

    check_config(cfg, world_size)
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
    if cfg.ckpt_write_bandwidth < 0:
        raise ValueError(f"--ckpt-write-bandwidth must be >= 0 bytes/s (0 = no cap), got {cfg.ckpt_write_bandwidth}")
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


def uses_cuda(cfg: "TrainConfig") -> bool:
    import torch

    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def check_faults(cfg: "TrainConfig", world_size: int) -> None:
    """Each fault must be able to fire: a rank of this world, a step this run reaches."""
    for fault in parse_schedule(cfg.faults):  # raises naming a malformed entry
        if fault.rank >= world_size:
            raise ValueError(f"--faults entry {fault.id}: rank {fault.rank} is not in this world of {world_size} "
                             f"rank(s) (0..{world_size - 1}); it would never fire")
        if not 1 <= fault.step <= cfg.steps:
            raise ValueError(f"--faults entry {fault.id}: step {fault.step} is outside this run's steps 1..{cfg.steps} "
                             f"(--steps {cfg.steps}); it would never fire")


def check_ckpt_dir(path: Path) -> None:
    """Refuse a folder that holds something else than our checkpoints: saving into it would mix them
    (a missing or empty folder starts a new run; one with committed steps resumes). A ``step_*``
    folder without our manifest is not ours either (e.g. a plain ``dcp.save``): a commit of that step
    would replace it."""
    from nvrx_lab.checkpoint.commit import STEP_RE, committed_steps, foreign_entries

    if not path.is_dir() or committed_steps(path):
        return
    ours = {FAULTS_FIRED, RUN_FILE}
    foreign = [name for name in foreign_entries(path) if name not in ours]
    foreign += sorted(f"{p.name}/ (not committed: no nvrx_commit.json)" for p in path.iterdir() if STEP_RE.match(p.name))
    if foreign:
        raise ValueError(f"--ckpt-dir {path} is not a folder this trainer saved to: it holds {foreign[:5]} and no "
                         "committed checkpoint; pass a new or empty folder, or one this trainer saved to")


def make_checkpointer(cfg: "TrainConfig", ctx: "DistContext", events: EventLog):
    if cfg.ckpt == "none":
        return None
    from nvrx_lab.checkpoint import AsyncCheckpointer

    # The writer process is spawned now (async only), so its start-up overlaps building the model.
    return AsyncCheckpointer(cfg.ckpt_dir, keep_last=cfg.ckpt_keep, write_bandwidth=cfg.ckpt_write_bandwidth or None,
                             process_group=ctx.cpu_group, emit=events.emit, start_writer=cfg.ckpt == "async")


FAULTS_FIRED = "faults_fired.jsonl"


def fault_state_file(cfg: "TrainConfig") -> Path | None:
    """Where fired faults are remembered across restarts: beside the checkpoints, else beside the metrics."""
    if cfg.ckpt_dir:
        return Path(cfg.ckpt_dir) / FAULTS_FIRED
    if cfg.metrics:
        return Path(cfg.metrics).with_suffix(".faults.jsonl")
    return None


def make_fault_injector(cfg: "TrainConfig", rank: int, events: EventLog) -> FaultInjector | None:
    faults = parse_schedule(cfg.faults)
    return FaultInjector(faults, rank, state_file=fault_state_file(cfg), emit=events.emit) if faults else None


class Monitor:
    """The trainer's side of the launcher: heartbeats, a section around checkpoint I/O, and timeouts
    computed from observed intervals and carried in the checkpoint (``state_dict``)."""

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

    def heartbeat(self, step: int) -> None:
        self.client.send_heartbeat()

    def section(self, name: str):
        return _Section(self.client, name)

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


def run_inprocess(cfg: "TrainConfig", events: EventLog, injector, monitor) -> dict:
    """Training attempts inside :class:`nvrx_lab.inprocess.Wrapper`: a fault anywhere interrupts every
    rank, the group is torn down and the function is re-entered, resuming from the newest checkpoint.

    The process group comes from the wrapper (its sockets are what an abort cuts); rank and world size
    come from the wrapper too, since they change when a rank is lost. On GPUs one group serves both
    devices (``cpu:gloo,cuda:nccl``), so the abort reaches the CPU-side collectives as well."""
    from nvrx_lab.inprocess import CallWrapper, Wrapper, default_health_check
    from nvrx_lab.train import train

    _, _, local_rank = env_rank()
    device = pick_device(cfg.device, local_rank)
    persistent: dict = {}  # the checkpointer outlives attempts: one writer process, rebound to each new group

    @Wrapper(soft_timeout=cfg.soft_timeout, hard_timeout=cfg.hard_timeout, max_iterations=cfg.max_iterations,
             min_world_size=cfg.min_world_size, pg_timeout=cfg.pg_timeout, emit=events.emit,
             health_check=default_health_check(device))  # a poisoned CUDA context leaves instead of retrying
    def attempt(cw: CallWrapper) -> dict:
        if device.type == "cuda":
            cw.init_process_group(backend="cpu:gloo,cuda:nccl", device_id=device)
        else:
            cw.init_process_group(backend="gloo")
        cw.ping()  # joining the group is progress: the soft timeout counts from here
        ctx = DistContext(cw.rank, cw.world_size, local_rank, device, dist.group.WORLD)
        if "ckpt" not in persistent:
            persistent["ckpt"] = make_checkpointer(cfg, ctx, events)
        elif persistent["ckpt"] is not None:
            persistent["ckpt"].rebind(ctx.cpu_group)
        if monitor is not None:
            monitor.start()

        @contextlib.contextmanager
        def io_section(name: str):
            # the per-step commit poll is quick and frequent: atomic, but no launcher section of its own
            timed = monitor is not None and name != "checkpoint_commit"
            with cw.atomic(), (monitor.section(name) if timed else contextlib.nullcontext()):
                yield

        summary = train(cfg, ctx, events, persistent["ckpt"], monitor, before_step=(injector,) if injector else (),
                        io_section=io_section, on_resume=lambda load_s: cw.record("reload_s", load_s), progress=cw.ping,
                        during=injector.during if injector else None)
        cw.ping()
        return summary

    try:
        return attempt()
    finally:
        if monitor is not None:
            monitor.close()
        if persistent.get("ckpt") is not None:
            persistent["ckpt"].close()


def launcher_restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
