"""``JobSpec``: everything that differs between two training jobs on EKS, checked before rendering.

A spec is validated when it is built (:mod:`nvrx_lab.eks.checks`): a bad field raises ``ValueError``
that names the field and what would be allowed (``JobSpec.nodes: must be >= 1, got 0``). Defaults
describe a p5.48xlarge job using the whole node; only ``name`` and ``image`` are required::

    JobSpec(name="llama-ft", image="123456789012.dkr.ecr.us-west-2.amazonaws.com/nvrx-lab:0.1", nodes=16)

The launcher's settings are the launcher's own :class:`~nvrx_lab.launcher.config.LauncherConfig`
(``JobSpec(..., launcher=pod_launcher(heartbeat_timeout=60))``), not fields of their own here.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

from nvrx_lab.eks.checks import check
from nvrx_lab.eks.instances import InstanceType, instance_type
from nvrx_lab.eks.launcher_settings import launcher_for, pod_launcher
from nvrx_lab.eks.modes import Mode, mode
from nvrx_lab.eks.spec_sizes import Sizes
from nvrx_lab.runner import LauncherConfig

JOBSET_FROM_NODES = 4  # workload='auto' renders a JobSet from this many nodes up


@dataclass
class JobSpec(Sizes):
    name: str
    """Job name; also the headless Service's, so a DNS-1035 label (starts with a letter): rank 0 is ``<name>-0.<name>``."""
    image: str
    """Training image (see ``manifests/Dockerfile``), ideally an immutable tag or digest."""
    nodes: int = 2
    """Nodes that train: one pod each, ``--nnodes`` of the rendezvous."""
    spare_nodes: int = 0
    """Hot spares (launcher modes): :attr:`pods` is ``nodes + spare_nodes``; the rendezvous admits ``nodes`` and holds
    the rest warm (torch's redundancy list, torch imported), so a spare takes a lost node's place in seconds."""
    mode: str = "ft_launcher"
    """baseline, async_ckpt, inprocess, ft_launcher, ft_launcher+inprocess or replicas (see :mod:`nvrx_lab.eks.modes`)."""
    replica_groups: int = 2
    """``mode='replicas'``: replica groups, each a whole copy of the model trained by its own Indexed Job of ``nodes``
    pods (FSDP inside a group); at least 2, since a lone group has nobody to heal from. Other modes: leave it."""
    min_replicas: int = 1
    """``mode='replicas'``: fewest groups a new step starts with (1..replica_groups). With fewer alive the survivors
    wait at the step for a replacement: 1 never waits; more keeps that much of the job's throughput."""
    coordinator_port: int = 29600
    """``mode='replicas'``: the coordinator's quorum port on its Service ``<name>-coordinator``; its TCPStore (the
    address book of the groups' cross-replica rings) listens on the next port."""
    workload: str = "auto"
    """``job``: an Indexed Job and its headless Service, plain Kubernetes; ``jobset``: a JobSet (its controller must be
    installed) whose one replicated Job restarts as a whole group, at once (:mod:`nvrx_lab.eks.jobset`); ``auto``: a
    JobSet from :data:`JOBSET_FROM_NODES` nodes up (a Job's per-pod back-off idles every node for minutes after each
    failure), a Job below and for ``mode='replicas'`` (:attr:`workload_kind`)."""
    queue_name: str = ""
    """Kueue LocalQueue (label ``kueue.x-k8s.io/queue-name``): Kueue admits the job only when quota for all of its pods
    is free, all or nothing, and queues it until then (empty: no Kueue)."""
    namespace: str = "nvrx-lab"
    """Namespace of every namespaced object."""
    create_namespace: bool = True
    """Render a Namespace object too (``submit`` skips it when it exists)."""
    instance_type: str = "p5.48xlarge"
    """EC2 type of the nodes (node selector); sizes GPUs, EFA, CPU and memory from :mod:`~nvrx_lab.eks.instances`."""
    gpus_per_node: int | None = None
    """GPUs per pod = worker processes per node; ``None``: all of the instance type's."""
    zone: str = ""
    """Availability Zone of every pod (node selector ``topology.kubernetes.io/zone``, e.g. ``us-west-2b``, where the
    capacity reservation is); empty: the zone the job's first pod lands in (pod affinity), since EFA does not cross
    zones."""
    efa_per_node: int | None = None
    """EFA interfaces per pod; ``None``: all of the instance type's (0 disables the EFA settings)."""
    shm_gib: int = 0
    """Room in the memory-backed ``/dev/shm`` for NCCL and dataloader workers, counted against pod memory;
    0: a quarter of the pod's memory, at most 64 GiB. The checkpoint staging and local copies come on top."""
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
    fsx_mbps_per_tib: int = 250
    """The FSx file system's throughput, MB/s per TiB (PERSISTENT_2: 125, 250, 500, 1000): how fast a save writes."""
    mount_path: str = "/fsx"
    """Where the FSx volume is mounted; the run writes under ``<mount_path>/<name>/``."""
    model: str = "tiny"
    """Trainer ``--model`` (tiny, llama3.2-1b, llama3.1-8b, llama3.1-70b): sizes ``/dev/shm`` and is checked against
    the GPUs' memory (:mod:`nvrx_lab.eks.sizing`)."""
    data: str = ""
    """Trainer ``--data``: a token file every pod reads, on FSx (``/fsx/data/PREFIX`` of Megatron's ``.bin``/``.idx``,
    or ``FILE.bin:uint16``); empty: synthetic tokens."""
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
    local_ckpt_interval: int = 0
    """Trainer ``--local-ckpt-interval``: every N steps each rank's state in ``/dev/shm``, replicated to the same GPU of
    the next node, so a fault rolls back at most N steps (0 = off; needs checkpoints on FSx as the fallback)."""
    local_ckpt_gib: int = 0
    """GiB of the local checkpoints of one pod: 4 x each GPU's shard of the training state (two own copies and two
    replica slots) x GPUs per pod; 0: computed from the model (:attr:`state_gib_per_gpu`)."""
    local_ckpt_on_nvme: bool = False
    """Local checkpoints in a disk-backed emptyDir instead of ``/dev/shm``: for node groups whose instance-store NVMe
    drives back the kubelet's ephemeral storage (EKS AL2023 ``nodeadm`` ``localStorage: RAID0``, Bottlerocket's
    ephemeral storage); the pod then requests that much ``ephemeral-storage``, and ``/dev/shm`` stays small."""
    pg_timeout: float | None = None
    """Trainer ``--pg-timeout``: seconds before a collective gives up, so how long a hang holds every node. ``None``: per
    mode (:func:`nvrx_lab.eks.sizing.collective_timeout`): under the launcher its longest section timeout, with
    blocking saves twice a save, else 300 s (NCCL's start-up at 16+ nodes takes well under it)."""
    faults: str = ""
    """Trainer ``--faults`` schedule ``RANK:STEP:KIND[:PHASE],…`` (:func:`nvrx_lab.faults.parse_schedule`); each
    RANK below nodes x GPUs, each STEP in 1..steps (empty: no injected faults)."""
    train_extra: tuple[str, ...] = ()
    """More trainer flags, verbatim (``("--dim", "1024")``); never the ones the fields above set."""
    train_module: str = "nvrx_lab.train"
    """Python module every worker runs (``python -m``)."""
    rdzv_join_timeout: int = 1800
    """Seconds a pod waits for all the others to join (pods of a large job pull a ~28 GB image minutes apart):
    the launcher's c10d ``join_timeout``, torchrun's static store ``timeout``."""
    rdzv_read_timeout: int = 600
    """Launcher modes: the c10d store's ``read_timeout`` (torch's 60 s) at a first start: pods dial index 0 for that long."""
    rdzv_rejoin_read_timeout: int = 60
    """The same once a rendezvous completed: a vanished index 0 is waited for that long, then its replacement's store,
    and the others rejoin in their pods (:mod:`nvrx_lab.launcher.rejoin`); at most ``rdzv_read_timeout``."""
    rdzv_keep_alive_s: float | None = None
    """Launcher modes: c10d's ``keep_alive_interval``: a lost node leaves the rendezvous 3 of them after its last beat
    (torch's 5 s: 15 s of every lost node's recovery), most of a hot spare's takeover. None: 0.5 s, longer above 620
    nodes (:mod:`nvrx_lab.sizing`: every beat moves the whole state through index 0's store). Mode
    ``replicas`` (torchrun's parser): whole seconds, rounded up."""
    rdzv_poll_s: float | None = None
    """Launcher modes: how often a node reads the rendezvous state while a round forms (torch's 1 s;
    :func:`nvrx_lab.launcher.rounds.poll_every`): a spare's takeover waits for two reads. None: 0.2 s, longer above
    392 nodes."""
    launcher: LauncherConfig = field(default_factory=pod_launcher)
    """The launcher's settings in the launcher modes (:class:`~nvrx_lab.launcher.config.LauncherConfig`, the one the
    launcher's own CLI reads), :func:`pod_launcher`'s by default; its ``restart_policy`` is the mode's. Rendered as
    the pod's ``--max-restarts`` and ``--monitor-interval`` and the ConfigMap's ``launcher.yaml`` (the rest)."""
    max_restarts: InitVar[int | None] = None
    """Shorthand for ``launcher.max_restarts``, as are the four below (``JobSpec(..., heartbeat_timeout=60)`` is
    ``launcher=pod_launcher(heartbeat_timeout=60)``). Read them from ``spec.launcher``."""
    heartbeat_timeout: InitVar[float | None] = None
    initial_heartbeat_timeout: InitVar[float | None] = None
    monitor_interval: InitVar[float | None] = None
    section_timeouts: InitVar[dict[str, float] | None] = None
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
    node_lost_toleration_s: int = 60
    """Seconds a pod stays bound to a ``not-ready`` or ``unreachable`` node before it is evicted and replaced
    (Kubernetes' default: 300 s; every other pod of the job waits that long)."""
    cpu_limit: bool = False
    """Set a CPU limit (= request, Guaranteed QoS). Off: the limit becomes a CFS quota that throttles the bursts of
    NCCL proxy, dataloader and checkpoint threads on a 192-vCPU node; memory keeps its limit."""
    nccl_trace_buffer: int = 2000
    """NCCL flight recorder: collectives kept per rank (``TORCH_FR_BUFFER_SIZE``) and dumped to ``<run_dir>/nccl-trace/``
    when a collective times out; 0 = off."""
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
    mark_unhealthy_nodes: bool = True
    """Launcher modes with health checks: a node that fails one is labelled and tainted through the API before its
    launcher exits 5, and the pods avoid such nodes (:mod:`nvrx_lab.eks.rbac`: a ServiceAccount that may patch
    nodes). False: no cluster-wide RBAC; the exit code alone keeps the node out of the next round."""

    def __post_init__(self, max_restarts, heartbeat_timeout, initial_heartbeat_timeout, monitor_interval,
                      section_timeouts) -> None:
        shorthand = dict(max_restarts=max_restarts, heartbeat_timeout=heartbeat_timeout, monitor_interval=monitor_interval,
                         initial_heartbeat_timeout=initial_heartbeat_timeout, section_timeouts=section_timeouts)
        self.launcher = launcher_for(self.launcher, self.mode, {k: v for k, v in shorthand.items() if v is not None})
        self.env, self.secret_env = dict(self.env), dict(self.secret_env)
        self.train_extra, self.tolerations = tuple(self.train_extra), tuple(self.tolerations)
        check(self)

    # Derived values: the renderer reads these, never the raw optional fields.
    @property
    def instance(self) -> InstanceType:
        return instance_type(self.instance_type)

    @property
    def rdzv_timing(self) -> tuple[float, float]:
        """The rendezvous keep-alive and poll, seconds (:func:`nvrx_lab.sizing.for_nodes`)."""
        from nvrx_lab.sizing import for_nodes

        return for_nodes(self.nodes + self.spare_nodes, self.rdzv_keep_alive_s, self.rdzv_poll_s)

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
    def groups(self) -> int:
        """Replica groups: ``replica_groups`` in the replicas mode, else the one group that is the whole job."""
        return self.replica_groups if self.mode_info.replicated else 1

    @property
    def world(self) -> int:
        """Ranks of the whole job: every GPU of every pod of every group (faults count ranks across the groups)."""
        return self.groups * self.nodes * self.gpus

    @property
    def batch(self) -> int:
        return self.global_batch or 2 * self.world

    @property
    def backoff(self) -> int:
        if self.backoff_limit is not None:
            return self.backoff_limit
        return (10 if self.mode_info.kubernetes_restarts else 3) * self.nodes

    @property
    def workload_kind(self) -> str:
        """``job`` or ``jobset``: :attr:`workload`, with ``auto`` decided by the number of nodes and the mode."""
        if self.workload != "auto":
            return self.workload
        return "jobset" if self.nodes >= JOBSET_FROM_NODES and not self.mode_info.replicated else "job"

    @property
    def pods(self) -> int:
        """Pods = completion indexes: the nodes that train and the hot spares."""
        return self.nodes + self.spare_nodes

    @property
    def pod_hostname_prefix(self) -> str:
        """Pod ``i``'s hostname: ``<prefix>-<i>``, the Job's name or ``<jobset>-node-0`` (JobSet's child Job)."""
        return f"{self.name}-node-0" if self.workload_kind == "jobset" else self.name

    @property
    def rank0_host(self) -> str:
        """Rank 0's DNS name: pod ``<job>-0`` (``<jobset>-node-0-0``) under the headless Service ``<name>``."""
        return f"{self.pod_hostname_prefix}-0.{self.name}"

    @property
    def run_dir(self) -> str:
        return f"{self.mount_path.rstrip('/')}/{self.name}"
