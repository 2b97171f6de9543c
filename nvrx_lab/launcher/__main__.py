"""``python -m nvrx_lab.launcher`` / ``nvrx-lab-launch``: torchrun with heartbeats (see :mod:`nvrx_lab.launcher`).

Builds torchrun's own launch configuration from its own parser (``config_from_args``), then runs
our :class:`~nvrx_lab.launcher.agent.HeartbeatAgent` instead of torchrun's agent. Exit code 0 when
the workers succeeded, 1 when they failed with no restarts left, 2 for bad flags or config, and 2
(at once, no restart) when a worker exited 2, the code of a usage error.

The launcher's own environment is read here, once (``$NVRX_LAB_METRICS``), and the values passed on;
what it writes to the environment are torch's settings for this process (its rendezvous and signal
handling read them), never a channel to our own modules.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import uuid
from typing import TYPE_CHECKING, NoReturn

from nvrx_lab.exit_codes import NO_PROGRESS, RENDEZVOUS_CLOSED, UNHEALTHY
from nvrx_lab.launcher.cli import ConfigError, parse, trace_dump_prefix
from nvrx_lab.launcher.rejoin import store_lost, wait_for_store

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.launcher.api import LaunchConfig

    from nvrx_lab.launcher.config import LauncherConfig
    from nvrx_lab.launcher.policy import RestartPolicy
    from nvrx_lab.launcher.restart_log import RestartLog


def main(argv: list[str] | None = None) -> int:
    try:
        args, settings = parse(argv, environ=os.environ)  # the launcher's environment: read here, and only here
        settings.trace_dump_prefix = trace_dump_prefix(settings, os.environ)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from torch.distributed.run import config_from_args

    from nvrx_lab.launcher.policy import make_policy
    from nvrx_lab.sizing import timing

    if args.standalone:  # as torchrun does
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    try:
        config, cmd, cmd_args = config_from_args(args)
        timing(config.rdzv_configs)
        policy = make_policy(settings.restart_policy, config.nproc_per_node, settings.min_healthy)
    except (ValueError, AssertionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not config.run_id or config.run_id == "none":
        config.run_id = str(uuid.uuid4().int)
    return _launch(config, cmd, cmd_args, settings, policy)


def own_entry(cmd_args: list[str]) -> list[str]:
    """The entry module's ``main`` when the workers run one of ours (``-m nvrx_lab.train``): the standby imports it
    (never runs it), so a restarted worker starts at its first line. A user's script is never imported here."""
    flags = [a for a in cmd_args[:2] if a.startswith("-")]  # torchrun's: "-u", then "-m" for a module
    if "-m" not in flags or len(cmd_args) <= len(flags):
        return []
    module = cmd_args[len(flags)]
    if not module.startswith("nvrx_lab."):
        return []
    import importlib.util

    try:
        return [f"{module}.main"] if importlib.util.find_spec(f"{module}.main") is not None else []
    except ModuleNotFoundError:  # a module, not a package
        return []


def _rendezvous(config: LaunchConfig) -> tuple[RendezvousParameters, str, int]:
    """torchrun's rendezvous parameters for ``config``, and the workers' master address and port."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.launcher.api import _get_addr_and_port

    params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
                                  min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                                  local_addr=config.local_addr, **config.rdzv_configs)
    master_addr, master_port = _get_addr_and_port(params)
    return params, master_addr, master_port


def _launch(config: LaunchConfig, cmd: str, cmd_args: list[str], settings: LauncherConfig,
            policy: RestartPolicy) -> int:
    """Monitors (and the standby zygote) in a private directory, then our agent until the workers are done."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    from nvrx_lab.launcher import rounds
    from nvrx_lab.launcher.agent import HeartbeatAgent
    from nvrx_lab.launcher.monitor import MonitorServer
    from nvrx_lab.launcher.progress import ProgressTracker
    from nvrx_lab.launcher.rejoin import rejoin_timeout, shorten_after_rendezvous
    from nvrx_lab.launcher.restart_log import NodeUnhealthy, RestartLog
    from nvrx_lab.launcher.standby import Zygote

    directory = tempfile.mkdtemp(prefix="nvrx-lab-launch-")  # 0700: monitors and zygote sockets
    monitors = MonitorServer(config.nproc_per_node, settings.timeouts(), directory)
    preload = [*settings.standby_preload, *own_entry(cmd_args)]
    zygote = Zygote(directory, config.nproc_per_node, preload) if settings.standby else None
    if zygote is not None:
        cmd, cmd_args = zygote.wrap(cmd, cmd_args)
    restart_log = RestartLog(settings.metrics_file, config.max_restarts)
    params, master_addr, master_port = _rendezvous(config)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle  # torch's, read in this process
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "0"  # torch's rendezvous: workers are clients of our stores
    result = agent = rdzv_handler = None
    progress = ProgressTracker(settings.metrics_file, settings.max_no_progress_cycles)  # one count across rejoins
    checks = _health(settings)
    try:
        for rejoin in range(config.max_restarts + 1):
            rdzv_handler = rounds.handler(params)
            if (short := rejoin_timeout(params.config)) is not None:
                shorten_after_rendezvous(rdzv_handler, short)
            spec = WorkerSpec(role=config.role, local_world_size=config.nproc_per_node, entrypoint=cmd,
                              args=tuple(cmd_args), rdzv_handler=rdzv_handler, max_restarts=config.max_restarts,
                              monitor_interval=config.monitor_interval, master_addr=master_addr,
                              master_port=master_port, local_addr=config.local_addr)
            agent = HeartbeatAgent(spec, config.logs_specs, monitors, restart_log, policy, zygote,
                                   start_method=config.start_method, shutdown_timeout=config.shutdown_timeout)
            agent.trace_dump_prefix, agent.progress = settings.trace_dump_prefix, progress
            agent.health = checks
            try:
                result = agent.run()
                break
            except RendezvousClosedError:  # while this node waited on torch's wait list: as after a graceful exit
                result = None
                break
            except Exception as e:  # noqa: BLE001 - only the store's host lost is handled here
                if not _rejoin(e, params, restart_log, rejoin, config.max_restarts):
                    raise
    except SignalException as e:
        restart_log.say(f"launcher got {e.sigval.name}: workers stopped")
        return 128 + int(e.sigval)
    except NodeUnhealthy:
        return _unhealthy(settings, checks, restart_log)
    finally:
        _close(agent, result, rdzv_handler, monitors, zygote, directory)
    return exit_status(result, agent, restart_log, config.max_restarts)


def _close(agent, result, rdzv_handler, monitors, zygote, directory: str) -> None:
    """The launcher's way out: whether a node the rendezvous closed on was a spare, the rendezvous closed by a node that
    trained to an outcome, monitors, the zygote and the private directory gone."""
    from nvrx_lab.launcher.rounds import left_out

    if agent is not None and result is None:
        agent.spare = not agent.admitted or left_out(rdzv_handler)
    if rdzv_handler is not None and result is not None:
        rdzv_handler.shutdown()
    monitors.close()
    if zygote is not None:
        zygote.close()
    shutil.rmtree(directory, ignore_errors=True)


class _Checks:
    """The node's health checks as the launcher runs them; ``last``: the latest verdicts (a failure marks the node)."""

    def __init__(self, settings: LauncherConfig):
        from nvrx_lab.health.checks import HealthSettings

        folder = os.path.dirname(os.path.abspath(settings.metrics_file)) if settings.metrics_file else None
        self.settings, self.last = HealthSettings(folder=folder, sysfs=settings.health_sysfs), []

    def __call__(self) -> list:
        from nvrx_lab.health.checks import run_all

        self.last = run_all(self.settings)
        return self.last


def _unhealthy(settings: LauncherConfig, checks: _Checks, restart_log: RestartLog) -> int:
    """This node failed a check: marked on Kubernetes when ``--mark-node`` names it (:mod:`nvrx_lab.health.mark`)."""
    if settings.mark_node:
        from nvrx_lab.health.mark import mark

        restart_log.say(mark(settings.mark_node, [v for v in checks.last if v.failed]))
    return UNHEALTHY


def _health(settings: LauncherConfig) -> _Checks | None:
    """The node's health checks, or None when they are off."""
    return _Checks(settings) if settings.health_checks else None


def _rejoin(error: BaseException, params: RendezvousParameters, restart_log: RestartLog, rejoin: int,
            max_rejoins: int) -> bool:
    """Whether to rejoin after ``error`` (a launcher that does not host the store, which stopped answering): then its
    replacement's store is waited for (the first-start read timeout at most) and True returned."""
    if params.get_as_bool("is_host") is not False or not store_lost(error) or rejoin >= max_rejoins:
        return False
    first = float(params.config.get("read_timeout", 60))
    restart_log.say(f"RENDEZVOUS the store at {params.endpoint} stopped answering ({type(error).__name__}): its node is "
                    f"gone; waiting up to {first:g} s for the replacement's store, then rejoining "
                    f"({rejoin + 1} of {max_rejoins})")
    try:
        took = wait_for_store(params.endpoint, first)
    except TimeoutError as exc:
        restart_log.say(f"RENDEZVOUS {exc}: not rejoining")
        return False
    restart_log.say(f"RENDEZVOUS the store at {params.endpoint} answers again after {took:.1f} s: rejoining")
    return True


# RENDEZVOUS_CLOSED (3): a launcher whose rendezvous another node closed before this one finished: not a success (on
# Kubernetes an index that exits 0 is Succeeded for good), not a usage error (2).


def exit_status(result, agent, restart_log, max_restarts: int) -> int:
    """The launcher's exit status from torch's agent's ``result``: 0 when the workers succeeded; a usage error's own;
    0 for a hot spare no round admitted (the rendezvous closed while it waited); :data:`RENDEZVOUS_CLOSED` when
    torch's agent returned nothing to a node that trained (the rendezvous was closed by another node, which finished
    or gave up, before this one trained to the end: said in one line); ``NO_PROGRESS`` (4) when restarts committed
    nothing new (``agent.no_progress``, the line that says so); 1 when the workers failed."""
    if result is None and agent is not None and agent.spare:
        restart_log.say("this node was waiting as a hot spare (the round was full without it) when the rendezvous "
                        "closed: the job ended without needing it; exit 0")
        return 0
    if result is None:
        restart_log.say(f"the rendezvous was closed by another node (it finished or gave up) before this node's workers "
                        f"finished: exit {RENDEZVOUS_CLOSED}, not 0, so this node is not counted as done")
        return RENDEZVOUS_CLOSED
    if result.state.name not in ("FAILED", "UNHEALTHY"):
        return 0
    if agent is not None and agent.usage_error is not None:
        return agent.usage_error.exit_code
    if agent is not None and agent.no_progress is not None:
        restart_log.say(agent.no_progress)
        return NO_PROGRESS
    restart_log.say(f"workers failed after {max_restarts} restart(s); giving up")
    return 1


def run() -> NoReturn:
    """The process's way out (``python -m nvrx_lab.launcher``, ``nvrx-lab-launch``): :func:`main`'s code, without the
    interpreter's teardown. A node that leaves on a failed health check (exit 5) still has torch's rendezvous
    keep-alive thread and store clients alive; tearing the interpreter down under them aborted it (SIGABRT, 4 runs in
    20 beside two busy loops), so the pod ended -6, not 5: its ``podFailurePolicy`` rule did not match and the pod was
    retried on the same bad node. What the launcher owns is closed by then (:func:`_close`); streams and logging are
    flushed here."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
