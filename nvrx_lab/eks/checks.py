"""The checks a :class:`~nvrx_lab.eks.spec.JobSpec` passes when it is built, one group of fields each.

:func:`check` raises ``ValueError`` naming the first bad field and what it allows
(``JobSpec.nodes: must be an integer >= 1, got 0``), in the order the fields are declared.
The fault schedule is checked with the trainer's own grammar (:func:`nvrx_lab.faults.parse_schedule`),
so a spec accepts exactly what the trainer accepts.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from nvrx_lab.eks.instances import instance_type, pod_resources
from nvrx_lab.eks.modes import mode
from nvrx_lab.eks.sizing import check_model, save_seconds
from nvrx_lab.faults import parse_schedule

if TYPE_CHECKING:
    from nvrx_lab.eks.spec import JobSpec

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_RULE = "allowed: lower-case letters, digits and '-', starting {}ending with a letter or digit, at most 63 characters"
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SECRETISH = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_KEY|ACCESS_KEY|PRIVATE_KEY", re.I)
SECTION = re.compile(r"^[a-z][a-z0-9_]*$")
FSX_ID = re.compile(r"^fs-[0-9a-f]{8,17}$")
MANAGED_TRAIN_FLAGS = ("--model", "--data", "--steps", "--seed", "--global-batch", "--metrics", "--ckpt",
                       "--ckpt-interval", "--ckpt-dir", "--local-ckpt-interval", "--pg-timeout", "--restart", "--faults",
                       "--coordinator", "--replica-id", "--replicas")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
WORKLOADS = ("auto", "job", "jobset")
RESERVED_ENV = ("JOB_COMPLETION_INDEX", "NNODES", "NPROC_PER_NODE", "RANK0_HOST", "MASTER_PORT", "RDZV_PORT", "RUN_DIR",
                "LAUNCHER_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "COORDINATOR_HOST", "COORDINATOR_PORT",
                "STORE_PORT", "REPLICA_ID", "LISTEN_HOST")


def _fail(field_name: str, problem: str) -> None:
    raise ValueError(f"JobSpec.{field_name}: {problem}")


def check(s: JobSpec) -> None:
    """Raise ``ValueError`` naming the first bad field of ``s`` and what it allows."""
    _check_identity(s)
    _check_replicas(s)
    _check_node(s)
    _check_storage(s)
    check_model(s)
    _check_training(s)
    _check_launcher(s)
    _check_environment(s)
    _check_pod(s)


def _check_identity(s: JobSpec) -> None:
    """Names the objects and pods carry, the image and the mode."""
    if not isinstance(s.name, str) or len(s.name) > 63 or not DNS1035_LABEL.match(s.name):
        _fail("name", f"{s.name!r} is not a DNS-1035 label (it names the headless Service too); "
                      + LABEL_RULE.format("with a letter and "))
    if not isinstance(s.nodes, int) or isinstance(s.nodes, bool) or s.nodes < 1:
        _fail("nodes", f"must be an integer >= 1, got {s.nodes!r}")
    if s.workload not in WORKLOADS:
        _fail("workload", f"{s.workload!r}; allowed: auto (a JobSet from 4 nodes up), job (an Indexed Job) or jobset (a "
                          "JobSet: its controller must be installed)")
    _check_spares(s)
    extra = len(s.pod_hostname_prefix) - len(s.name)  # '-node-0' under a JobSet
    if len(f"{s.pod_hostname_prefix}-{s.pods - 1}") > 63:
        _fail("name", f"{s.name!r} is too long for {s.pods} pods: pod hostnames '{s.pod_hostname_prefix}-<index>' "
                      f"must fit 63 characters; allowed: at most {62 - extra - len(str(s.pods - 1))} characters")
    if not isinstance(s.namespace, str) or not DNS1123_LABEL.match(s.namespace) or len(s.namespace) > 63:
        _fail("namespace", f"{s.namespace!r} is not a DNS-1123 label; " + LABEL_RULE.format("and "))
    if not s.image or any(c.isspace() for c in s.image):
        _fail("image", f"{s.image!r}; allowed: a non-empty image reference without spaces")
    mode(s.mode)  # raises naming the modes there are
    if not isinstance(s.queue_name, str) or len(s.queue_name) > 63 or not LABEL_VALUE.match(s.queue_name):
        _fail("queue_name", f"{s.queue_name!r} is not a label value; allowed: '' (no Kueue) or a LocalQueue name of up to "
                            "63 letters, digits, '-', '_' and '.'")


def _world(s: JobSpec) -> str:
    """How the world size comes about, for messages: ``2 nodes x 8 GPUs`` (``x 3 replica groups``)."""
    return f"{s.nodes} nodes x {s.gpus} GPUs" + (f" x {s.groups} replica groups" if s.groups > 1 else "")


def _check_spares(s: JobSpec) -> None:
    """Hot spares wait in the launcher's c10d rendezvous: only the launcher modes have one to wait in."""
    if not isinstance(s.spare_nodes, int) or isinstance(s.spare_nodes, bool) or s.spare_nodes < 0:
        _fail("spare_nodes", f"must be an integer >= 0, got {s.spare_nodes!r}")
    if s.spare_nodes and (not s.mode_info.uses_launcher or s.mode_info.replicated):
        _fail("spare_nodes", f"{s.spare_nodes} with mode {s.mode!r}: spares wait in the launcher's rendezvous; allowed: 0 "
                             "here, or mode ft_launcher / ft_launcher+inprocess")


def _check_replicas(s: JobSpec) -> None:
    """The replica groups: their number, the quorum's minimum, names and ports that fit, and what the trainer refuses
    under ``--restart replicas``. Other modes leave these fields alone, so a spec never says what it does not do."""
    for f, default in (("replica_groups", 2), ("min_replicas", 1), ("coordinator_port", 29600)):
        value = getattr(s, f)
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(f, f"{value!r}; allowed: an integer")
        if not s.mode_info.replicated and value != default:
            _fail(f, f"{value} is for mode='replicas' (got mode {s.mode!r}); allowed: {default} (its default) here")
    if not s.mode_info.replicated:
        return
    if s.replica_groups < 2:
        _fail("replica_groups", f"{s.replica_groups}; allowed: >= 2 (a lone group has no live replica to heal from: use "
                                "mode='baseline' with checkpoints)")
    if not 1 <= s.min_replicas <= s.replica_groups:
        _fail("min_replicas", f"{s.min_replicas}; allowed: 1..{s.replica_groups} (replica_groups)")
    if s.workload == "jobset":
        _fail("workload", f"{s.workload!r}: a JobSet recreates every replica group when one fails, so the survivors would "
                          "stop; allowed with mode='replicas': job or auto (one Indexed Job per group)")
    longest = max(f"{s.name}-coordinator", f"{s.name}-g{s.replica_groups - 1}-{s.nodes - 1}", key=len)
    if len(longest) > 63:
        _fail("name", f"{s.name!r} is too long for {s.replica_groups} groups of {s.nodes} nodes: {longest!r} must fit 63 "
                      f"characters; allowed: at most {len(s.name) - len(longest) + 63} characters")
    if s.local_ckpt_interval:
        _fail("local_ckpt_interval", f"{s.local_ckpt_interval}: the trainer refuses local checkpoints under --restart "
                                     "replicas; allowed with mode='replicas': 0")
    used = {s.rdzv_port, s.master_port, s.master_port + 1}
    if not 1024 <= s.coordinator_port <= 65534 or {s.coordinator_port, s.coordinator_port + 1} & used:
        _fail("coordinator_port", f"{s.coordinator_port} (+1 for its TCPStore); allowed: 1024..65534, both apart from "
                                  f"rdzv_port {s.rdzv_port} and master_port {s.master_port} (+1)")


def _check_node(s: JobSpec) -> None:
    """What one pod takes of its instance type, and where."""
    t = instance_type(s.instance_type)
    if s.zone and not re.match(r"^[a-z]{2}(-[a-z]+)+-\d[a-z]$", s.zone):
        _fail("zone", f"{s.zone!r}; allowed: an Availability Zone name like us-west-2b, or '' (the first pod's)")
    if s.gpus_per_node is not None and not (1 <= s.gpus_per_node <= t.gpus):
        _fail("gpus_per_node", f"{s.gpus_per_node} GPUs do not fit a {t.name} ({t.gpus} x {t.gpu}); allowed: 1..{t.gpus}")
    if s.efa_per_node is not None and not (0 <= s.efa_per_node <= t.efa):
        _fail("efa_per_node", f"{s.efa_per_node} EFA interfaces do not fit a {t.name}; allowed: 0..{t.efa}")
    _, mem = pod_resources(t)
    if not (0 <= s.shm_gib <= mem // 2):
        _fail("shm_gib", f"{s.shm_gib} GiB; allowed: 0 (auto) or 1..{mem // 2} (half the pod's {mem} GiB on a {t.name})")
    if s.hugepages_2mi < 0 or s.hugepages_2mi % 2 or s.hugepages_2mi > mem * 1024 // 4:
        _fail("hugepages_2mi", f"{s.hugepages_2mi} MiB; allowed: 0 or an even number of MiB up to a quarter of the pod's memory")


def _check_storage(s: JobSpec) -> None:
    """The FSx volume and where it is mounted."""
    if not DNS1123_SUBDOMAIN.match(s.fsx_claim or ""):
        _fail("fsx_claim", f"{s.fsx_claim!r} is not a DNS-1123 name")
    if s.fsx_volume_handle:
        if not FSX_ID.match(s.fsx_volume_handle):
            _fail("fsx_volume_handle", f"{s.fsx_volume_handle!r}; allowed: an FSx file system id like fs-0123456789abcdef0")
        if not s.fsx_dns_name or not s.fsx_mount_name:
            _fail("fsx_dns_name" if not s.fsx_dns_name else "fsx_mount_name", "required when fsx_volume_handle is set")
    if s.fsx_capacity_gib < 1200:
        _fail("fsx_capacity_gib", f"{s.fsx_capacity_gib}; allowed: >= 1200 (the smallest FSx for Lustre file system)")
    if isinstance(s.fsx_mbps_per_tib, bool) or not isinstance(s.fsx_mbps_per_tib, int) or not 50 <= s.fsx_mbps_per_tib <= 1000:
        _fail("fsx_mbps_per_tib", f"{s.fsx_mbps_per_tib!r}; allowed: the file system's MB/s per TiB, 50..1000 "
                                  "(PERSISTENT_2: 125, 250, 500, 1000)")
    if not s.mount_path.startswith("/") or s.mount_path.rstrip("/") in ("", "/dev", "/proc", "/sys", "/etc", "/dev/shm") \
            or s.mount_path.startswith(("/dev/", "/proc/", "/sys/", "/etc/")):
        _fail("mount_path", f"{s.mount_path!r}; allowed: an absolute path outside /, /dev, /proc, /sys and /etc")


def _check_local(s: JobSpec) -> None:
    """Local checkpoints and the ``/dev/shm`` they and the async staging add up to."""
    if s.local_ckpt_interval < 0:
        _fail("local_ckpt_interval", f"{s.local_ckpt_interval}; allowed: 0 (off) or >= 1 steps")
    if s.local_ckpt_interval and s.ckpt_mode == "none":
        _fail("local_ckpt_interval", "needs ckpt sync or async: checkpoints on FSx stay the durable fallback")
    if s.local_ckpt_gib < 0:
        _fail("local_ckpt_gib", f"{s.local_ckpt_gib}; allowed: 0 (from the model) or GiB >= 1")
    if s.local_ckpt_on_nvme and not s.local_ckpt_interval:
        _fail("local_ckpt_on_nvme", "needs local_ckpt_interval >= 1: no local checkpoints to put on NVMe")
    mem = pod_resources(instance_type(s.instance_type))[1]
    if s.shm > mem // 2:
        _fail("local_ckpt_gib" if s.local_ckpt_gib else "model",
              f"{s.model} over {s.shards} GPUs: /dev/shm would take {s.shm} GiB of the pod's {mem} GiB ({s.staging_gib} "
              f"staging, {s.local_copies_gib} local checkpoints: {s.state_gib_per_gpu:.3g} GiB a GPU); allowed: up to "
              "half of it: more nodes, or local_ckpt_on_nvme=True to move the local checkpoints to disk")


def _check_training(s: JobSpec) -> None:
    """The trainer's flags: steps, batch, checkpoints, faults, extra flags and module."""
    if s.steps < 1:
        _fail("steps", f"must be >= 1, got {s.steps}")
    world = s.world
    if s.global_batch < 0 or (s.global_batch and s.global_batch % world and s.mode != "replicas"):
        _fail("global_batch", f"{s.global_batch} does not divide by the world size {world} ({_world(s)}); "
                              "allowed: 0 (two per GPU) or a multiple of the world size (any batch in the replicas mode)")
    if s.ckpt not in ("", "none", "sync", "async"):
        _fail("ckpt", f"{s.ckpt!r}; allowed: '' (the mode's default: {s.mode_info.ckpt}), none, sync, async")
    if s.ckpt_interval < 0 or (s.ckpt_interval == 0 and s.ckpt_mode != "none"):
        _fail("ckpt_interval", f"{s.ckpt_interval}; allowed: >= 1 (or ckpt='none')")
    _check_local(s)
    _check_faults(s, world)
    if s.pg_timeout is not None and (isinstance(s.pg_timeout, bool) or not isinstance(s.pg_timeout, (int, float))
                                     or not s.pg_timeout > 0):
        _fail("pg_timeout", f"{s.pg_timeout!r}; allowed: seconds > 0, or None (per mode)")
    managed = MANAGED_TRAIN_FLAGS + (("--local-ckpt-dir",) if s.local_ckpt_on_nvme else ())
    for flag in s.train_extra:
        if flag.split("=")[0] in managed:
            _fail("train_extra", f"{flag!r} is set by a JobSpec field; "
                                 f"allowed: flags other than {', '.join(managed)}")
    if not re.match(r"^[A-Za-z_][\w.]*$", s.train_module):
        _fail("train_module", f"{s.train_module!r}; allowed: a dotted Python module name")


def _check_faults(s: JobSpec, world: int) -> None:
    """The trainer's own grammar (``RANK:STEP:KIND[:PHASE]``), then ranks and steps that exist in this job."""
    try:
        faults = parse_schedule(s.faults)
    except ValueError as exc:
        _fail("faults", f"{exc}; allowed e.g. '1:50:exception,3:120:sigkill:save'")
    for f in faults:
        if f.rank >= world:
            _fail("faults", f"{f.id!r}: rank {f.rank} does not exist; allowed: ranks 0..{world - 1} "
                            f"(world size {world} = {_world(s)})")
        if not 1 <= f.step <= s.steps:
            _fail("faults", f"{f.id!r}: step {f.step} never runs; allowed: steps 1..{s.steps} (JobSpec.steps)")


def _check_launcher(s: JobSpec) -> None:
    """What a pod asks more of the launcher's settings than the launcher does (which checks each value itself), and
    the Job's own limits."""
    c = s.launcher
    if c.monitor_interval >= c.heartbeat_timeout:
        _fail("launcher.monitor_interval", f"{c.monitor_interval:g} s must be shorter than heartbeat_timeout "
                                           f"({c.heartbeat_timeout:g} s)")
    for name, seconds in c.section_timeouts.items():
        if not SECTION.match(name):
            _fail("launcher.section_timeouts", f"{name!r}: {seconds!r}; allowed: lower-case section names")
    if c.metrics_file is not None:
        _fail("launcher.metrics_file", f"{c.metrics_file!r}; allowed: None (restart events join the run's "
                                       "<mount_path>/<name>/metrics.jsonl)")
    longest = max(s.rendered_launcher.section_timeouts.values(), default=0.0)
    if s.mode_info.uses_launcher and s.collective_timeout < longest:
        _fail("pg_timeout", f"{s.collective_timeout:g} s is shorter than the longest section timeout ({longest:g} s): a "
                            "collective would time out while the launcher still waits; allowed: >= the section timeouts"
                            + ("" if "checkpoint" in c.section_timeouts else f" (a save of {s.model} on this FSx takes "
                               f"{save_seconds(s):,.0f} s: fsx_mbps_per_tib or fsx_capacity_gib make it shorter)"))
    for f in ("rdzv_join_timeout", "rdzv_read_timeout", "rdzv_rejoin_read_timeout"):
        if isinstance(getattr(s, f), bool) or not isinstance(getattr(s, f), int) or getattr(s, f) < 1:
            _fail(f, f"{getattr(s, f)!r}; allowed: whole seconds >= 1")
    if s.rdzv_rejoin_read_timeout > s.rdzv_read_timeout:
        _fail("rdzv_rejoin_read_timeout", f"{s.rdzv_rejoin_read_timeout} s is longer than rdzv_read_timeout "
                                          f"({s.rdzv_read_timeout} s); allowed: 1..{s.rdzv_read_timeout}")
    _check_rendezvous(s)
    if s.backoff_limit is not None and s.backoff_limit < 0:
        _fail("backoff_limit", f"must be >= 0 or None, got {s.backoff_limit}")
    if s.ttl_after_finished_s < 0 or s.termination_grace_s < 0:
        _fail("ttl_after_finished_s" if s.ttl_after_finished_s < 0 else "termination_grace_s", "must be >= 0")


def _check_rendezvous(s: JobSpec) -> None:
    """The keep-alive and the poll: numbers the launcher takes, within what index 0's store carries."""
    from nvrx_lab.sizing import problem

    for f in ("rdzv_keep_alive_s", "rdzv_poll_s"):
        value = getattr(s, f)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            _fail(f, f"{value!r}; allowed: seconds, or None (chosen from the job's size)")
    if (found := problem(s.nodes + s.spare_nodes, *s.rdzv_timing)) is not None:
        _fail(*found)


def _check_environment(s: JobSpec) -> None:
    """Plain variables (never secrets, never the ones the manifests set) and secret references."""
    for var, value in s.env.items():
        if not ENV_NAME.match(var) or var in RESERVED_ENV:
            _fail("env", f"{var!r}; allowed: a C identifier other than {', '.join(RESERVED_ENV)}")
        if SECRETISH.search(var):
            _fail("env", f"{var!r} looks like a secret; never inline secrets: use secret_env={{'{var}': 'secret-name/key'}}")
        if not isinstance(value, str):
            _fail("env", f"{var}={value!r}; allowed: string values")
    for var, ref in s.secret_env.items():
        secret, _, key = ref.partition("/")
        if not ENV_NAME.match(var) or not DNS1123_SUBDOMAIN.match(secret) or not re.match(r"^[-._a-zA-Z0-9]+$", key):
            _fail("secret_env", f"{var}={ref!r}; allowed: VAR='secret-name/key'")


def _check_pod(s: JobSpec) -> None:
    """Ports, NCCL logging, image pulls and scheduling priority."""
    ports = (s.rdzv_port, s.master_port, s.master_port + 1)
    if not all(1024 <= p <= 65535 for p in ports) or len(set(ports)) != 3:
        _fail("rdzv_port" if not 1024 <= s.rdzv_port <= 65535 else "master_port",
              f"rdzv {s.rdzv_port}, master {s.master_port} (+1 for the in-process store); allowed: distinct ports 1024..65535")
    if s.nccl_debug not in ("VERSION", "WARN", "INFO", "TRACE"):
        _fail("nccl_debug", f"{s.nccl_debug!r}; allowed: VERSION, WARN, INFO, TRACE")
    if s.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
        _fail("image_pull_policy", f"{s.image_pull_policy!r}; allowed: Always, IfNotPresent, Never")
    if isinstance(s.node_lost_toleration_s, bool) or not isinstance(s.node_lost_toleration_s, int) \
            or not 0 <= s.node_lost_toleration_s <= 300:
        _fail("node_lost_toleration_s", f"{s.node_lost_toleration_s!r}; allowed: whole seconds 0..300 (Kubernetes' "
                                        "default is 300)")
    if isinstance(s.nccl_trace_buffer, bool) or not isinstance(s.nccl_trace_buffer, int) or s.nccl_trace_buffer < 0:
        _fail("nccl_trace_buffer", f"{s.nccl_trace_buffer!r}; allowed: 0 (off) or entries >= 1")
    if s.priority_class and not DNS1123_SUBDOMAIN.match(s.priority_class):
        _fail("priority_class", f"{s.priority_class!r} is not a DNS-1123 name")
