"""The container's command line: the launcher's and the trainer's flags, each with the reason it is set.

The pod runs ``bash -c SCRIPT`` as the container's ``args`` (the image's entrypoint, which sets up CUDA
forward compatibility, runs first); the script is short, readable in ``kubectl get job -o yaml``, and
carries one comment per flag inside bash arrays (comments are legal there)::

    launcher_args=(
      --node-rank="${JOB_COMPLETION_INDEX}"   # node rank = the pod's completion index ...
    )
    exec python -m nvrx_lab.eks.torchrun "${launcher_args[@]}" -m nvrx_lab.train "${trainer_args[@]}"

The flags come from the same structured commands every local run uses (:mod:`nvrx_lab.runner`):
:func:`launch_head` is a :class:`~nvrx_lab.runner.Torchrun` or :class:`~nvrx_lab.runner.Launcher`,
:func:`train_worker` a :class:`~nvrx_lab.runner.Worker`; this module adds the reasons and the shell quoting.

Everything that differs between pods or between a cluster and a laptop comes from environment
variables the manifest sets (``NNODES``, ``NPROC_PER_NODE``, ``RANK0_HOST``, ``MASTER_PORT``,
``RDZV_PORT``, ``RUN_DIR``, ``LAUNCHER_CONFIG``) and from ``JOB_COMPLETION_INDEX``, which the Indexed Job gives each pod: it is
the node rank in every mode (torchrun's ``--node-rank``; the launcher's ``--local-addr`` sort key).
No ``getent``, no sleeps: rank 0 is ``<job>-0.<job>`` by construction, and the stores' clients
retry their connection until rank 0's pod is up, for 2 nodes or 128. A local run
(:mod:`nvrx_lab.eks.local`) maps those values, and runs the script as written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from dataclasses import dataclass
from typing import ClassVar

from nvrx_lab.cli import field_docs
from nvrx_lab.eks import rbac
from nvrx_lab.eks.spec import JobSpec
from nvrx_lab.runner import Launcher, LauncherConfig, Torchrun, Worker

CONFIG_DIR = "/etc/nvrx_lab"
CONFIG_FILE = "launcher.yaml"
NVME_DIR = "/local-ckpt"
"""Where a pod mounts its disk-backed emptyDir for local checkpoints (``JobSpec.local_ckpt_on_nvme``)."""
COMMAND_LINE = ("max_restarts", "monitor_interval")
"""The launcher settings on the pod's command line (torchrun's own flags); the others are in the ConfigMap."""


@dataclass(frozen=True)
class PodTorchrun(Torchrun):
    """torchrun's flags, run by :mod:`nvrx_lab.eks.torchrun`: a worker's usage error (exit 2) stays exit 2."""

    module: ClassVar[str] = "nvrx_lab.eks.torchrun"


@dataclass(frozen=True)
class Flag:
    flag: str
    """The flag, e.g. ``--nnodes``."""
    value: str | None
    """Its value as the shell sees it (may reference ``${VAR}``); ``None`` for a bare switch."""
    why: str
    """The comment written next to it."""

    def shell(self) -> str:
        if self.value is None:
            return self.flag
        quoted = f'"{self.value}"' if "$" in self.value else shlex.quote(self.value)
        return f"{self.flag}={quoted}"


def launch_head(s: JobSpec) -> PodTorchrun | Launcher:
    """The pod's launcher as a structured command: torchrun (static store on rank 0) or ``nvrx_lab.launcher``
    (c10d rendezvous, in-job restarts). Values are the pod's ``${VAR}`` references."""
    nnodes, nproc = "${NNODES}", "${NPROC_PER_NODE}"
    if s.mode_info.replicated:  # the group's own c10d rendezvous: torchrun replaces its workers in the pod
        conf = (f"is_host=${{IS_RDZV_HOST}},join_timeout={s.rdzv_join_timeout},read_timeout={s.rdzv_read_timeout},"
                f"keep_alive_interval={math.ceil(s.rdzv_timing[0])}")  # torchrun's parser: whole seconds
        return PodTorchrun(nnodes=nnodes, nproc_per_node=nproc, rdzv_backend="c10d",
                           rdzv_endpoint="${RANK0_HOST}:${RDZV_PORT}", rdzv_id=s.name, rdzv_conf=conf,
                           max_restarts=s.launcher.max_restarts, monitor_interval=s.launcher.monitor_interval)
    if not s.mode_info.uses_launcher:
        return PodTorchrun(nnodes=nnodes, nproc_per_node=nproc, node_rank="${JOB_COMPLETION_INDEX}",
                           master_addr="${RANK0_HOST}", master_port="${MASTER_PORT}",
                           rdzv_conf=f"timeout={s.rdzv_join_timeout}", max_restarts=0)
    conf = (f"is_host=${{IS_RDZV_HOST}},join_timeout={s.rdzv_join_timeout},read_timeout={s.rdzv_read_timeout},"
            f"rejoin_read_timeout={s.rdzv_rejoin_read_timeout},keep_alive_interval={s.rdzv_timing[0]:g},"
            f"poll_interval={s.rdzv_timing[1]:g}")
    on_line = {name: getattr(s.launcher, name) for name in COMMAND_LINE}
    return Launcher(nnodes=nnodes, nproc_per_node=nproc, rdzv_backend="c10d", rdzv_endpoint="${RANK0_HOST}:${RDZV_PORT}",
                    rdzv_id=s.name, rdzv_conf=conf, local_addr="${NODE_ADDR}",
                    settings=LauncherConfig(**on_line, metrics_file="${RUN_DIR}/metrics.jsonl",
                                            mark_node="${NODE_NAME}" if rbac.marks_nodes(s) else ""),
                    config="${LAUNCHER_CONFIG}")


def train_worker(s: JobSpec) -> Worker:
    """What every worker of the pod runs: ``-m <train_module>`` with the JobSpec's flags, then ``train_extra``."""
    if s.mode_info.replicated:  # the state lives in the live groups (storage checkpoints, if any, for losing all)
        stored = s.ckpt_mode != "none"
        return Worker.of(s.train_module, *s.train_extra, model=s.model, data=s.data or None, steps=s.steps,
                         seed=s.seed, global_batch=s.batch, metrics="${RUN_DIR}/replica${REPLICA_ID}.jsonl",
                         run_id=f"{s.name}-g${{REPLICA_ID}}",
                         ckpt=s.ckpt_mode, ckpt_interval=s.ckpt_interval if stored else None,
                         ckpt_dir="${RUN_DIR}/ckpt" if stored else None, pg_timeout=f"{s.collective_timeout:g}",
                         restart="replicas",
                         coordinator="${COORDINATOR_HOST}:${COORDINATOR_PORT}", replica_id="${REPLICA_ID}",
                         replicas=s.replica_groups, faults=s.faults or None)
    return Worker.of(s.train_module, *s.train_extra, model=s.model, data=s.data or None, steps=s.steps, seed=s.seed,
                     global_batch=s.batch, metrics="${RUN_DIR}/metrics.jsonl", run_id=s.name, ckpt=s.ckpt_mode,
                     ckpt_interval=s.ckpt_interval,
                     ckpt_dir="${RUN_DIR}/ckpt", local_ckpt_interval=s.local_ckpt_interval or None,
                     local_ckpt_dir="${LOCAL_CKPT_DIR}" if s.local_ckpt_on_nvme else None,
                     pg_timeout=f"{s.collective_timeout:g}", restart=s.mode_info.restart, faults=s.faults or None)


def _launcher_why(s: JobSpec) -> dict[str, str]:
    m = s.mode_info
    if m.replicated:
        return {
            "--nnodes": "the group's pods; the group's Indexed Job's parallelism",
            "--nproc-per-node": "one worker per GPU the pod was given (nvidia.com/gpu)",
            "--rdzv-backend": "c10d: a replaced worker (or pod) re-forms the group with the others",
            "--rdzv-endpoint": "the store runs in the group's completion index 0: <group>-0.<group>",
            "--rdzv-id": "one rendezvous per group (each group's index 0 hosts its own store)",
            "--rdzv-conf": "index 0 hosts the store (no hostname guessing); join and read timeouts: pods start minutes "
                           "apart (image pulls); a lost node leaves the rendezvous after 3 keep-alive intervals",
            "--max-restarts": "torchrun replaces the group's failed workers in the pod; they heal from a live group "
                              "while the other groups train on; then the pod fails (backoffLimit)",
            "--monitor-interval": "seconds between checks of the workers",
        }
    if not m.uses_launcher:
        return {
            "--nnodes": "one pod per node; the Job's parallelism",
            "--nproc-per-node": "one worker per GPU the pod was given (nvidia.com/gpu)",
            "--node-rank": "node rank = completion index: stable across pod replacements",
            "--master-addr": "rank 0's pod through the headless Service: <job>-0.<job>",
            "--master-port": "torchrun's store on rank 0; clients retry until it listens",
            "--rdzv-conf": "the store's timeout: how long a pod waits for index 0 and the others (image pulls minutes "
                           "apart)",
            "--max-restarts": "a dead worker fails the pod; Kubernetes replaces it (backoffLimit)"
                              + ("; exceptions are handled in-process first" if m.inprocess else ""),
        }
    return {
        "--nnodes": "one pod per node; the Job's parallelism",
        "--nproc-per-node": "one worker per GPU the pod was given (nvidia.com/gpu)",
        "--rdzv-backend": "rendezvous over a TCP store: every restart re-forms the group with fresh state",
        "--rdzv-endpoint": "the store runs in completion index 0's launcher",
        "--rdzv-id": "one rendezvous per Job",
        "--rdzv-conf": "index 0 hosts the store (no hostname guessing); join and read timeouts: pods start minutes apart "
                       "(image pulls), and torch's 60 s read timeout would give up on a late index 0; once joined, the "
                       "short rejoin timeout: a vanished index 0 is waited for that long, then the others wait for its "
                       "replacement and rejoin in their pods; a lost node leaves the rendezvous after 3 keep-alive "
                       "intervals (torch's 15 s), and a waiting node reads the round every poll_interval (torch's 1 s): "
                       "a hot spare's takeover",
        "--local-addr": "sorts like the completion index (c10d numbers nodes in this order): node rank = index; pods "
                        "beyond --nnodes (hot spares) wait in the rendezvous and take a lost node's place",
        "--mark-node": "this pod's node (downward API): labelled and tainted if a health check fails, so the "
                       "replacement pod lands elsewhere",
        "--max-restarts": "in-pod group restarts after a failure here; then every pod fails (backoffLimit)",
        "--monitor-interval": "seconds between checks of worker exits and heartbeats",
        "--metrics-file": "restart events join the trainer's event stream",
        "--config": "heartbeat, section timeouts and restart policy (ConfigMap)",
    }


def launcher_flags(s: JobSpec, head: Torchrun | Launcher | None = None) -> list[Flag]:
    """The flags of ``head`` (default :func:`launch_head`), each with the reason it is set."""
    why = _launcher_why(s)
    return [Flag(flag, value, why[flag]) for flag, value in (head or launch_head(s)).flags()]


def trainer_flags(s: JobSpec) -> list[Flag]:
    m = s.mode_info
    why = {
        "--model": f"the model's shape ({s.sizing.parameters / 1e9:.3g} B parameters; sized /dev/shm and the GPU check)",
        "--data": "the token file every pod reads (its position is in the checkpoint)",
        "--steps": "total optimizer steps; a resumed run stops at the same step",
        "--seed": "model init and token stream",
        "--global-batch": f"sequences per step across all {s.nodes * s.gpus} GPUs",
        "--metrics": "the event stream (steps, saves, faults, restarts) on FSx",
        "--run-id": "a restarted pod continues this run (its events, its fired faults)",
        "--ckpt": {"none": "no checkpoints", "sync": "blocking saves", "async": "saves overlap training"}[s.ckpt_mode],
        "--ckpt-interval": "steps between checkpoints",
        "--ckpt-dir": "shared by all nodes (FSx), so any pod can resume",
        "--local-ckpt-interval": "a snapshot in /dev/shm every N steps, replicated to the next node: a fault rolls back "
                                 "at most N steps",
        "--local-ckpt-dir": "the node's NVMe (a disk-backed emptyDir), not /dev/shm",
        "--pg-timeout": "seconds before a collective gives up: longer than the longest section (a blocking save) and "
                        "NCCL's start-up at scale",
        "--restart": m.summary,
        "--faults": "injected faults RANK:STEP:KIND[:PHASE], each fires once"
                    + (" (RANK counts across the groups: replica id x ranks + rank)" if m.replicated else ""),
        "--coordinator": "the coordinator's Service: a quorum per step, the failed groups dropped",
        "--replica-id": "this Job's replica group",
        "--replicas": "replica groups of the job; the global batch is shared by those in each step's quorum",
    }
    if m.replicated:
        why |= {"--ckpt": ("none: a replacement heals from a live group" if s.ckpt_mode == "none" else
                           f"{s.ckpt_mode}: a replacement heals from a live group; the lowest live group saves, for a "
                           "job whose every group failed to go on from"),
                "--metrics": "this group's event stream on FSx, beside coordinator.jsonl (the data ledger reads both)",
                "--run-id": "a restarted pod continues this group's run (its events, its fired faults)",
                "--global-batch": f"sequences per step across all {s.world} GPUs of the {s.groups} groups"}
    return [Flag(flag, value, why[flag]) for flag, value in train_worker(s).pairs()]


def launcher_config(s: JobSpec) -> str:
    """The launcher's YAML config file (keys = its flags' names), one comment per key: the settings of
    ``s.launcher`` that are not on the command line (:data:`COMMAND_LINE`), the four below always, any other where
    it differs from the launcher's default (its docstring as the comment)."""
    c = s.rendered_launcher
    lines = [
        "# nvrx_lab.launcher config: keys are the flags' names (--heartbeat-timeout -> heartbeat_timeout).",
        "# Seconds without a heartbeat, once a rank has sent its first one, before it counts as hung.",
        f"heartbeat_timeout: {c.flag_text('heartbeat_timeout')}",
        "# Seconds until the first heartbeat: imports, model build and checkpoint load from FSx.",
        f"initial_heartbeat_timeout: {c.flag_text('initial_heartbeat_timeout')}",
        "# Per-section timeouts: a long save inside 'checkpoint' is not mistaken for a hang"
        + ("." if "checkpoint" in s.launcher.section_timeouts else
           f" (twice a blocking save of {s.model}, {s.sizing.checkpoint / 1e9:.3g} GB at {s.fsx_mbps_per_tib} MB/s per TiB "
           f"of {s.fsx_capacity_gib} GiB; 600 s at least)."),
        "section_timeouts: " + (c.flag_text("section_timeouts") or "''"),
        "# " + {"any-failed": "any-failed: restart the whole group when any rank fails.",
                "min-healthy": "min-healthy: exceptions stay in-process; restart only when a rank died or hung.",
                }[c.restart_policy],
        f"restart_policy: {c.restart_policy}",
    ]
    written = {"heartbeat_timeout", "initial_heartbeat_timeout", "section_timeouts", "restart_policy", *COMMAND_LINE}
    default, docs = LauncherConfig(), field_docs(LauncherConfig)
    for f in dataclasses.fields(c):
        value = getattr(c, f.name)
        if f.name not in written and value != getattr(default, f.name):
            lines += [f"# {docs[f.name]}", f"{f.name}: {json.dumps(value)}"]  # JSON is YAML
    return "\n".join(lines) + "\n"


def flag_array(name: str, flags: list[Flag]) -> list[str]:
    """A bash array of ``flags``, one a line, each with its reason as a comment."""
    width = max(len(f.shell()) for f in flags) + 2
    return [f"{name}=("] + [f"  {f.shell():<{width}}# {f.why}" for f in flags] + [")"]


def container_script(s: JobSpec) -> str:
    """The ``bash -c`` script of the training container."""
    m = s.mode_info
    head = launch_head(s)
    worker = train_worker(s)
    lines = [
        f"# nvrx_lab mode {m.name}: {m.summary}.",
        "# Rendered by `python -m nvrx_lab.eks render`; edit the JobSpec, not this script.",
        "set -euo pipefail",
        "# The Indexed Job gives each pod its completion index 0..NNODES-1: that is its node rank.",
        ': "${JOB_COMPLETION_INDEX:?set by the Indexed Job}"',
        'mkdir -p "${RUN_DIR}"' + (' "${RUN_DIR}/nccl-trace"  # the flight recorder dumps here' if s.nccl_trace_buffer
                                    else ""),
    ]
    if m.replicated:
        lines += ["# Completion index 0 hosts the group's rendezvous store; the others connect to it.",
                  "IS_RDZV_HOST=$(( JOB_COMPLETION_INDEX == 0 ? 1 : 0 ))"]
    if m.uses_launcher:
        lines += ["# Completion index 0 hosts the rendezvous store; the others connect to it.",
                  "IS_RDZV_HOST=$(( JOB_COMPLETION_INDEX == 0 ? 1 : 0 ))",
                  "# c10d numbers nodes in the string order of their addresses ('<job>-10' before '<job>-2'): the",
                  "# others get a zero-padded key after index 0's, and after '@' the pod's IP, where its launcher's",
                  "# round store listens when it is group rank 0 (index 0 waiting as a spare).",
                  'NODE_ADDR="${RANK0_HOST}"',
                  "(( JOB_COMPLETION_INDEX == 0 )) || "
                  'NODE_ADDR=$(printf "%s/node-%05d@%s" "${RANK0_HOST}" "${JOB_COMPLETION_INDEX}" "${POD_IP}")']
    lines += flag_array("launcher_args", launcher_flags(s, head))
    lines += flag_array("trainer_args", trainer_flags(s))
    if worker.extra:
        lines.append(f"trainer_args+=({shlex.join(worker.extra)})  # JobSpec.train_extra")
    lines += [
        'echo "node ${JOB_COMPLETION_INDEX} of ${NNODES}: ${NPROC_PER_NODE} workers, rank 0 at ${RANK0_HOST}"',
        f'exec python -m {head.module} "${{launcher_args[@]}}" -m {worker.target} "${{trainer_args[@]}}"',
    ]
    return "\n".join(lines) + "\n"


def argv(flags: list[Flag], env: dict[str, str]) -> list[str]:
    """Plain argv of ``flags`` with ``${VAR}`` expanded from ``env`` (for tests and people)."""
    out = []
    for f in flags:
        value = f.value
        if value is not None:
            for k, v in env.items():
                value = value.replace("${" + k + "}", v)
        out.append(f.flag if value is None else f"{f.flag}={value}")
    return out
