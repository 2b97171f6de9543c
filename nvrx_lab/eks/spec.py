"""``JobSpec``: everything that differs between two training jobs on EKS, checked before rendering.

A spec is validated when it is built: a bad field raises ``ValueError`` that names the field and
what would be allowed (``JobSpec.nodes: must be >= 1, got 0``). Defaults describe a p5.48xlarge
job using the whole node; only ``name`` and ``image`` are required::

    JobSpec(name="llama-ft", image="123456789012.dkr.ecr.us-west-2.amazonaws.com/nvrx-lab:0.1", nodes=16)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from nvrx_lab.eks.instances import InstanceType, instance_type, pod_resources
from nvrx_lab.eks.modes import Mode, mode
from nvrx_lab.faults import parse_schedule

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_RULE = "allowed: lower-case letters, digits and '-', starting {}ending with a letter or digit, at most 63 characters"
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SECRETISH = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_KEY|ACCESS_KEY|PRIVATE_KEY", re.I)
SECTION = re.compile(r"^[a-z][a-z0-9_]*$")
FSX_ID = re.compile(r"^fs-[0-9a-f]{8,17}$")
MANAGED_TRAIN_FLAGS = ("--steps", "--seed", "--global-batch", "--metrics", "--ckpt", "--ckpt-interval", "--ckpt-dir",
                       "--restart", "--faults")
RESERVED_ENV = ("JOB_COMPLETION_INDEX", "NNODES", "NPROC_PER_NODE", "RANK0_HOST", "MASTER_PORT", "RDZV_PORT", "RUN_DIR",
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


@dataclass
class JobSpec:
    name: str
    """Job name; also the headless Service's, so a DNS-1035 label (starts with a letter): rank 0 is ``<name>-0.<name>``."""
    image: str
    """Training image (see ``manifests/Dockerfile``), ideally an immutable tag or digest."""
    nodes: int = 2
    """Nodes = pods = completion indexes of the Indexed Job (one pod per node)."""
    mode: str = "ft_launcher"
    """baseline, async_ckpt, inprocess, ft_launcher or ft_launcher+inprocess (see :mod:`nvrx_lab.eks.modes`)."""
    namespace: str = "nvrx-lab"
    """Namespace of every namespaced object."""
    create_namespace: bool = True
    """Render a Namespace object too (``submit`` skips it when it exists)."""
    instance_type: str = "p5.48xlarge"
    """EC2 type of the nodes (node selector); sizes GPUs, EFA, CPU and memory from :mod:`~nvrx_lab.eks.instances`."""
    gpus_per_node: int | None = None
    """GPUs per pod = worker processes per node; ``None``: all of the instance type's."""
    efa_per_node: int | None = None
    """EFA interfaces per pod; ``None``: all of the instance type's (0 disables the EFA settings)."""
    shm_gib: int = 0
    """Size limit of the memory-backed ``/dev/shm`` (NCCL, dataloader workers), counted against pod memory;
    0: a quarter of the pod's memory, at most 64 GiB."""
    hugepages_2mi: int = 0
    """MiB of 2 MiB hugepages for libfabric (a multiple of 2; 0 = none, the node must pre-allocate them)."""
    fsx_claim: str = "fsx-claim"
    """PersistentVolumeClaim of the FSx for Lustre volume mounted for checkpoints and metrics."""
    fsx_volume_handle: str = ""
    """FSx file system id (``fs-…``); when set, the static PersistentVolume and its claim are rendered too."""
    fsx_dns_name: str = ""
    """FSx DNS name (``fs-….fsx.<region>.amazonaws.com``); required with ``fsx_volume_handle``."""
    fsx_mount_name: str = ""
    """FSx Lustre mount name (``aws fsx describe-file-systems``); required with ``fsx_volume_handle``."""
    fsx_capacity_gib: int = 1200
    """Capacity written on the PersistentVolume and claim (FSx for Lustre: 1200 GiB or more)."""
    mount_path: str = "/fsx"
    """Where the FSx volume is mounted; the run writes under ``<mount_path>/<name>/``."""
    steps: int = 1000
    """Trainer ``--steps``."""
    seed: int = 0
    """Trainer ``--seed``."""
    global_batch: int = 0
    """Trainer ``--global-batch``; 0: two sequences per GPU. Must divide by nodes x GPUs."""
    ckpt: str = ""
    """Trainer ``--ckpt`` (none, sync, async); empty: the mode's default."""
    ckpt_interval: int = 100
    """Trainer ``--ckpt-interval`` (steps between checkpoints)."""
    faults: str = ""
    """Trainer ``--faults`` schedule ``RANK:STEP:KIND[:PHASE],…`` (:func:`nvrx_lab.faults.parse_schedule`); each
    RANK below nodes x GPUs, each STEP in 1..steps (empty: no injected faults)."""
    train_extra: tuple[str, ...] = ()
    """More trainer flags, verbatim (``("--dim", "1024")``); never the ones the fields above set."""
    train_module: str = "nvrx_lab.train"
    """Python module every worker runs (``python -m``)."""
    max_restarts: int = 10
    """Launcher ``--max-restarts``: restarts of the worker group after a failure on this node before its launcher
    gives up (and closes the rendezvous, which fails every pod: see ``backoff_limit``)."""
    heartbeat_timeout: float = 300.0
    """Launcher: seconds without a heartbeat before a rank counts as hung (after its first heartbeat)."""
    initial_heartbeat_timeout: float = 900.0
    """Launcher: seconds allowed until the first heartbeat (imports, model build, checkpoint load)."""
    monitor_interval: float = 1.0
    """Launcher ``--monitor-interval``: seconds between checks of worker processes and heartbeats."""
    section_timeouts: dict[str, float] = field(default_factory=lambda: {"checkpoint": 600.0})
    """Launcher: per-section timeouts in seconds (a long save inside ``checkpoint`` is not a hang)."""
    backoff_limit: int | None = None
    """Job ``backoffLimit``: failed pods before the Job fails. A group failure fails every pod (a fault under
    Kubernetes restarts; a launcher out of restarts, or the loss of index 0's store, under the launcher), so
    ``None`` allows whole-group failures: 10 x nodes under Kubernetes restarts, 3 x nodes under the launcher."""
    ttl_after_finished_s: int = 86400
    """Seconds a finished Job (and its pods' logs) is kept."""
    termination_grace_s: int = 120
    """Seconds between SIGTERM and SIGKILL on eviction: time to finish an in-flight checkpoint."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra plain environment variables; secrets are refused here (use ``secret_env``)."""
    secret_env: dict[str, str] = field(default_factory=lambda: {"HF_TOKEN": "hf-token/token"})
    """Environment from Kubernetes Secrets, ``{"VAR": "secret-name/key"}`` (optional: the pod starts without them)."""
    tolerations: tuple[str, ...] = ("nvidia.com/gpu", "vpc.amazonaws.com/efa")
    """Taint keys tolerated (operator Exists, effect NoSchedule): GPU and EFA node groups are usually tainted."""
    rdzv_port: int = 29400
    """Port of the c10d rendezvous store on rank 0's pod (launcher modes)."""
    master_port: int = 29500
    """Port of torchrun's static store on rank 0's pod; the in-process restart store uses the next one."""
    nccl_debug: str = "WARN"
    """``NCCL_DEBUG`` (VERSION, WARN, INFO, TRACE)."""
    image_pull_policy: str = "IfNotPresent"
    """IfNotPresent: a replaced pod on a node that has the image starts in seconds, not minutes."""
    priority_class: str = ""
    """PriorityClass of the pods (empty: the cluster default)."""

    def __post_init__(self) -> None:
        self.section_timeouts = dict(self.section_timeouts)
        self.env, self.secret_env = dict(self.env), dict(self.secret_env)
        self.train_extra, self.tolerations = tuple(self.train_extra), tuple(self.tolerations)
        check(self)

    # Derived values: the renderer reads these, never the raw optional fields.
    @property
    def instance(self) -> InstanceType:
        return instance_type(self.instance_type)

    @property
    def mode_info(self) -> Mode:
        return mode(self.mode)

    @property
    def gpus(self) -> int:
        return self.instance.gpus if self.gpus_per_node is None else self.gpus_per_node

    @property
    def efa(self) -> int:
        return self.instance.efa if self.efa_per_node is None else self.efa_per_node

    @property
    def ckpt_mode(self) -> str:
        return self.ckpt or self.mode_info.ckpt

    @property
    def batch(self) -> int:
        return self.global_batch or 2 * self.nodes * self.gpus

    @property
    def backoff(self) -> int:
        if self.backoff_limit is not None:
            return self.backoff_limit
        return (10 if self.mode_info.kubernetes_restarts else 3) * self.nodes

    @property
    def shm(self) -> int:
        return self.shm_gib or max(1, min(64, self.cpu_memory[1] // 4))

    @property
    def rank0_host(self) -> str:
        """Rank 0's stable DNS name: pod hostname ``<job>-0`` under the headless Service ``<job>``."""
        return f"{self.name}-0.{self.name}"

    @property
    def run_dir(self) -> str:
        return f"{self.mount_path.rstrip('/')}/{self.name}"

    @property
    def cpu_memory(self) -> tuple[int, int]:
        return pod_resources(self.instance)


def _fail(field_name: str, problem: str) -> None:
    raise ValueError(f"JobSpec.{field_name}: {problem}")


def _check_faults(s: JobSpec, world: int) -> None:
    """The trainer's own grammar (``RANK:STEP:KIND[:PHASE]``), then ranks and steps that exist in this job."""
    try:
        faults = parse_schedule(s.faults)
    except ValueError as exc:
        _fail("faults", f"{exc}; allowed e.g. '1:50:exception,3:120:sigkill:save'")
    for f in faults:
        if f.rank >= world:
            _fail("faults", f"{f.id!r}: rank {f.rank} does not exist; allowed: ranks 0..{world - 1} "
                            f"(world size {world} = {s.nodes} nodes x {s.gpus} GPUs)")
        if not 1 <= f.step <= s.steps:
            _fail("faults", f"{f.id!r}: step {f.step} never runs; allowed: steps 1..{s.steps} (JobSpec.steps)")


def check(s: JobSpec) -> None:
    """Raise ``ValueError`` naming the first bad field of ``s`` and what it allows."""
    if not isinstance(s.name, str) or len(s.name) > 63 or not DNS1035_LABEL.match(s.name):
        _fail("name", f"{s.name!r} is not a DNS-1035 label (it names the headless Service too); "
                      + LABEL_RULE.format("with a letter and "))
    if not isinstance(s.nodes, int) or isinstance(s.nodes, bool) or s.nodes < 1:
        _fail("nodes", f"must be an integer >= 1, got {s.nodes!r}")
    if len(f"{s.name}-{s.nodes - 1}") > 63:
        _fail("name", f"{s.name!r} is too long for {s.nodes} nodes: pod hostnames '<name>-<index>' must fit 63 "
                      f"characters; allowed: at most {62 - len(str(s.nodes - 1))} characters")
    if not isinstance(s.namespace, str) or not DNS1123_LABEL.match(s.namespace) or len(s.namespace) > 63:
        _fail("namespace", f"{s.namespace!r} is not a DNS-1123 label; " + LABEL_RULE.format("and "))
    if not s.image or any(c.isspace() for c in s.image):
        _fail("image", f"{s.image!r}; allowed: a non-empty image reference without spaces")
    m = mode(s.mode)
    t = instance_type(s.instance_type)
    if s.gpus_per_node is not None and not (1 <= s.gpus_per_node <= t.gpus):
        _fail("gpus_per_node", f"{s.gpus_per_node} GPUs do not fit a {t.name} ({t.gpus} x {t.gpu}); allowed: 1..{t.gpus}")
    if s.efa_per_node is not None and not (0 <= s.efa_per_node <= t.efa):
        _fail("efa_per_node", f"{s.efa_per_node} EFA interfaces do not fit a {t.name}; allowed: 0..{t.efa}")
    _, mem = pod_resources(t)
    if not (0 <= s.shm_gib <= mem // 2):
        _fail("shm_gib", f"{s.shm_gib} GiB; allowed: 0 (auto) or 1..{mem // 2} (half the pod's {mem} GiB on a {t.name})")
    if s.hugepages_2mi < 0 or s.hugepages_2mi % 2 or s.hugepages_2mi > mem * 1024 // 4:
        _fail("hugepages_2mi", f"{s.hugepages_2mi} MiB; allowed: 0 or an even number of MiB up to a quarter of the pod's memory")
    if not DNS1123_SUBDOMAIN.match(s.fsx_claim or ""):
        _fail("fsx_claim", f"{s.fsx_claim!r} is not a DNS-1123 name")
    if s.fsx_volume_handle:
        if not FSX_ID.match(s.fsx_volume_handle):
            _fail("fsx_volume_handle", f"{s.fsx_volume_handle!r}; allowed: an FSx file system id like fs-0123456789abcdef0")
        if not s.fsx_dns_name or not s.fsx_mount_name:
            _fail("fsx_dns_name" if not s.fsx_dns_name else "fsx_mount_name", "required when fsx_volume_handle is set")
    if s.fsx_capacity_gib < 1200:
        _fail("fsx_capacity_gib", f"{s.fsx_capacity_gib}; allowed: >= 1200 (the smallest FSx for Lustre file system)")
    if not s.mount_path.startswith("/") or s.mount_path.rstrip("/") in ("", "/dev", "/proc", "/sys", "/etc", "/dev/shm") \
            or s.mount_path.startswith(("/dev/", "/proc/", "/sys/", "/etc/")):
        _fail("mount_path", f"{s.mount_path!r}; allowed: an absolute path outside /, /dev, /proc, /sys and /etc")
    if s.steps < 1:
        _fail("steps", f"must be >= 1, got {s.steps}")
    world = s.nodes * s.gpus
    if s.global_batch < 0 or (s.global_batch and s.global_batch % world):
        _fail("global_batch", f"{s.global_batch} does not divide by the world size {world} ({s.nodes} nodes x {s.gpus} GPUs); "
                              "allowed: 0 (two per GPU) or a multiple of the world size")
    if s.ckpt not in ("", "none", "sync", "async"):
        _fail("ckpt", f"{s.ckpt!r}; allowed: '' (the mode's default: {m.ckpt}), none, sync, async")
    if s.ckpt_interval < 0 or (s.ckpt_interval == 0 and s.ckpt_mode != "none"):
        _fail("ckpt_interval", f"{s.ckpt_interval}; allowed: >= 1 (or ckpt='none')")
    _check_faults(s, world)
    for flag in s.train_extra:
        if flag.split("=")[0] in MANAGED_TRAIN_FLAGS:
            _fail("train_extra", f"{flag!r} is set by a JobSpec field; allowed: flags other than {', '.join(MANAGED_TRAIN_FLAGS)}")
    if not re.match(r"^[A-Za-z_][\w.]*$", s.train_module):
        _fail("train_module", f"{s.train_module!r}; allowed: a dotted Python module name")
    if s.max_restarts < 0:
        _fail("max_restarts", f"must be >= 0, got {s.max_restarts}")
    for f in ("heartbeat_timeout", "initial_heartbeat_timeout", "monitor_interval"):
        if not getattr(s, f) > 0:
            _fail(f, f"must be > 0 seconds, got {getattr(s, f)}")
    if s.monitor_interval >= s.heartbeat_timeout:
        _fail("monitor_interval", f"{s.monitor_interval} s must be shorter than heartbeat_timeout ({s.heartbeat_timeout} s)")
    for name, seconds in s.section_timeouts.items():
        if not SECTION.match(name) or not float(seconds) > 0:
            _fail("section_timeouts", f"{name!r}: {seconds!r}; allowed: lower-case section names with seconds > 0")
    if s.backoff_limit is not None and s.backoff_limit < 0:
        _fail("backoff_limit", f"must be >= 0 or None, got {s.backoff_limit}")
    if s.ttl_after_finished_s < 0 or s.termination_grace_s < 0:
        _fail("ttl_after_finished_s" if s.ttl_after_finished_s < 0 else "termination_grace_s", "must be >= 0")
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
    ports = (s.rdzv_port, s.master_port, s.master_port + 1)
    if not all(1024 <= p <= 65535 for p in ports) or len(set(ports)) != 3:
        _fail("rdzv_port" if not 1024 <= s.rdzv_port <= 65535 else "master_port",
              f"rdzv {s.rdzv_port}, master {s.master_port} (+1 for the in-process store); allowed: distinct ports 1024..65535")
    if s.nccl_debug not in ("VERSION", "WARN", "INFO", "TRACE"):
        _fail("nccl_debug", f"{s.nccl_debug!r}; allowed: VERSION, WARN, INFO, TRACE")
    if s.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
        _fail("image_pull_policy", f"{s.image_pull_policy!r}; allowed: Always, IfNotPresent, Never")
    if s.priority_class and not DNS1123_SUBDOMAIN.match(s.priority_class):
        _fail("priority_class", f"{s.priority_class!r} is not a DNS-1123 name")
