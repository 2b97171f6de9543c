"""``render(spec)``: the Kubernetes objects of one training job, as plain dicts for the API or YAML.

In order: the Namespace (optional), the FSx for Lustre static PersistentVolume and its claim
(when ``spec.fsx_volume_handle`` is set), the launcher's ConfigMap (launcher modes), the headless
Service and the Indexed Job. The pod template is where the modes meet the hardware:

* **Identity** — ``completionMode: Indexed`` gives pod *i* the hostname ``<job>-i`` and
  ``JOB_COMPLETION_INDEX=i``; ``subdomain: <job>`` with the headless Service ``<job>`` gives it the
  DNS name ``<job>-i.<job>``. Rank 0 is ``<job>-0.<job>`` for 2 nodes or 128.
* **Devices** — ``nvidia.com/gpu`` and ``vpc.amazonaws.com/efa`` and memory with limits = requests; CPU
  is requested without a limit (a limit is a CFS quota that throttles bursts, ``JobSpec.cpu_limit``);
  one pod per node (pod anti-affinity) and all in one zone (EFA does not cross zones), ``/dev/shm`` as a memory
  emptyDir sized from the training state (staging + local copies, :attr:`JobSpec.shm`), local checkpoints on NVMe
  when asked.
* **Node loss** — ``not-ready``/``unreachable`` tolerated for ``node_lost_toleration_s`` (60 s), not
  Kubernetes' 300 s: a lost node's pod is replaced 4 minutes sooner.
* **Privileges** — capability ``IPC_LOCK`` (EFA pins memory) and nothing else: never
  ``privileged``, no privilege escalation, no service-account token; secrets only by reference.
  ``IPC_LOCK`` is beyond Pod Security's ``baseline``: the Namespace enforces ``privileged`` and
  warns and audits at ``baseline``, so anything else beyond it is still reported.
* **Entrypoint** — the script is the container's ``args``, so the image's entrypoint (CUDA forward
  compatibility, see ``manifests/Dockerfile``) runs first and then execs it.
* **Restarts** — ``restartPolicy: Never`` with a ``podFailurePolicy``: evictions and preemptions do
  not count against ``backoffLimit``, a usage error (exit 2) fails the Job at once. A failure of the
  whole group (every pod) is what ``backoffLimit`` counts in: ``nodes`` x the group failures allowed.
"""

from __future__ import annotations

from nvrx_lab.eks import commands, rbac, replicas
from nvrx_lab.eks.jobset import jobset
from nvrx_lab.eks.modes import flight_recorder_env, nccl_env
from nvrx_lab.eks.spec import JobSpec

CONTAINER = "trainer"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
NODE_LOST_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
POD_SECURITY = {"enforce": "privileged", "warn": "baseline", "audit": "baseline"}
"""Pod Security Admission levels of the Namespace: ``IPC_LOCK`` needs ``privileged``; the rest is held to ``baseline``."""
NVME_OVERHEAD_GIB = 20
"""ephemeral-storage on top of the local checkpoints: container logs and the writable layer."""


def labels(s: JobSpec) -> dict[str, str]:
    return {"app.kubernetes.io/name": "nvrx-lab", "app.kubernetes.io/instance": s.name,
            "app.kubernetes.io/component": "training", "nvrx-lab/mode": s.mode.replace("+", ".")}


def workload_labels(s: JobSpec) -> dict[str, str]:
    """The Job's (or JobSet's) labels: Kueue reads its queue here."""
    return labels(s) | ({QUEUE_LABEL: s.queue_name} if s.queue_name else {})


def _meta(s: JobSpec, name: str) -> dict:
    return {"name": name, "namespace": s.namespace, "labels": labels(s)}


def namespace(s: JobSpec) -> dict:
    psa = {f"pod-security.kubernetes.io/{mode}": level for mode, level in POD_SECURITY.items()}
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": s.namespace, "labels": {"app.kubernetes.io/part-of": "nvrx-lab", **psa}}}


def pv_name(s: JobSpec) -> str:
    return f"{s.namespace}-{s.fsx_claim}"[:253]


def fsx_storage(s: JobSpec) -> list[dict]:
    """The static PersistentVolume of an existing FSx for Lustre file system, pre-bound to its claim."""
    size = f"{s.fsx_capacity_gib}Gi"
    pv = {"apiVersion": "v1", "kind": "PersistentVolume",
          "metadata": {"name": pv_name(s), "labels": {"app.kubernetes.io/part-of": "nvrx-lab"}},
          "spec": {"capacity": {"storage": size}, "volumeMode": "Filesystem", "accessModes": ["ReadWriteMany"],
                   "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                   "claimRef": {"namespace": s.namespace, "name": s.fsx_claim},
                   "mountOptions": ["flock"],
                   "csi": {"driver": "fsx.csi.aws.com", "volumeHandle": s.fsx_volume_handle,
                           "volumeAttributes": {"dnsname": s.fsx_dns_name, "mountname": s.fsx_mount_name}}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
           "metadata": {"name": s.fsx_claim, "namespace": s.namespace, "labels": {"app.kubernetes.io/part-of": "nvrx-lab"}},
           "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": pv_name(s),
                    "resources": {"requests": {"storage": size}}}}
    return [pv, pvc]


def config_map(s: JobSpec) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(s, f"{s.name}-launcher"),
            "data": {commands.CONFIG_FILE: commands.launcher_config(s)}}


def ports(s: JobSpec) -> list[tuple[str, int]]:
    if s.mode_info.replicated:  # the group's c10d rendezvous only: the cross-replica store is the coordinator's
        return [("rdzv", s.rdzv_port)]
    return [("rdzv", s.rdzv_port), ("store", s.master_port), ("inproc-store", s.master_port + 1)]


def service(s: JobSpec) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(s, s.name),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {"app.kubernetes.io/name": "nvrx-lab", "app.kubernetes.io/instance": s.name},
                     "ports": [{"name": n, "port": p, "targetPort": p, "protocol": "TCP"} for n, p in ports(s)]}}


def env_vars(s: JobSpec) -> list[tuple[str, str, str]]:
    """(name, value, why) of the plain variables; ``JOB_COMPLETION_INDEX`` and secrets come by reference."""
    return [
        ("NNODES", str(s.nodes), f"nodes that train (--nnodes); the Indexed Job's completions: {s.pods}, with "
                                 f"{s.spare_nodes} hot spare(s) waiting in the rendezvous" if s.spare_nodes else
         "nodes in the job = the Indexed Job's completions"),
        ("NPROC_PER_NODE", str(s.gpus), "workers per pod = nvidia.com/gpu"),
        ("RANK0_HOST", s.rank0_host, "completion index 0's DNS name under the headless Service"),
        *([] if s.mode_info.replicated else
          [("MASTER_PORT", str(s.master_port), "torchrun's store on rank 0 (the in-process store uses the next port)")]),
        ("RDZV_PORT", str(s.rdzv_port), "the group's c10d rendezvous store on its index 0" if s.mode_info.replicated
         else "the c10d rendezvous store on rank 0 (launcher modes)"),
        ("RUN_DIR", s.run_dir, "this job's directory on FSx: metrics and checkpoints"),
        *(replicas.group_env(s) if s.mode_info.replicated else []),
        *([("LAUNCHER_CONFIG", f"{commands.CONFIG_DIR}/{commands.CONFIG_FILE}", "the launcher's config file (ConfigMap mount)")]
          if s.mode_info.uses_launcher else []),
        *([("LOCAL_CKPT_DIR", commands.NVME_DIR, "local checkpoints on the node's NVMe (disk-backed emptyDir)")]
          if s.local_ckpt_on_nvme else []),
        *nccl_env(s.mode_info, s.efa, s.instance.efa_rdma, s.hugepages_2mi > 0, s.nccl_debug),
        *flight_recorder_env(s.nccl_trace_buffer),
        *[(k, v, "JobSpec.env") for k, v in s.env.items()],
    ]


def resources(s: JobSpec) -> dict:
    """Requests and limits: equal for everything but CPU, which has no limit unless ``cpu_limit``."""
    cpu, mem = s.cpu_memory
    res: dict = {"cpu": str(cpu), "memory": f"{mem}Gi", "nvidia.com/gpu": str(s.gpus)}
    if s.efa:
        res["vpc.amazonaws.com/efa"] = str(s.efa)
    if s.hugepages_2mi:
        res["hugepages-2Mi"] = f"{s.hugepages_2mi}Mi"
    if s.local_ckpt_on_nvme:
        res["ephemeral-storage"] = f"{s.local_copies_gib + NVME_OVERHEAD_GIB}Gi"
    limits = dict(res) if s.cpu_limit else {k: v for k, v in res.items() if k != "cpu"}
    return {"requests": res, "limits": limits}


def container(s: JobSpec) -> dict:
    env = [{"name": "JOB_COMPLETION_INDEX",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}}]
    if s.mode_info.uses_launcher and not s.mode_info.replicated:  # where this pod's round store listens (NODE_ADDR)
        env.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    if rbac.marks_nodes(s):  # the node a failed health check marks (nvrx_lab.health.mark)
        env.append({"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    env += [{"name": k, "value": v} for k, v, _ in env_vars(s)]
    env += [{"name": var, "valueFrom": {"secretKeyRef": {"name": ref.partition("/")[0], "key": ref.partition("/")[2],
                                                         "optional": True}}} for var, ref in s.secret_env.items()]
    mounts: list[dict[str, str | bool]] = [{"name": "fsx", "mountPath": s.mount_path}, {"name": "shm", "mountPath": "/dev/shm"}]
    if s.mode_info.uses_launcher:
        mounts.append({"name": "launcher-config", "mountPath": commands.CONFIG_DIR, "readOnly": True})
    if s.hugepages_2mi:
        mounts.append({"name": "hugepages", "mountPath": "/dev/hugepages"})
    if s.local_ckpt_on_nvme:
        mounts.append({"name": "local-ckpt", "mountPath": commands.NVME_DIR})
    return {
        "name": CONTAINER, "image": s.image, "imagePullPolicy": s.image_pull_policy,
        "args": ["/bin/bash", "-c", commands.container_script(s)],  # args, not command: the image's entrypoint runs first
        "env": env,
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports(s)],
        "resources": resources(s),
        "securityContext": {"privileged": False, "allowPrivilegeEscalation": False,
                            "capabilities": {"add": ["IPC_LOCK"]}},
        "volumeMounts": mounts,
    }


def volumes(s: JobSpec) -> list[dict]:
    vols = [{"name": "fsx", "persistentVolumeClaim": {"claimName": s.fsx_claim}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{s.shm}Gi"}}]
    if s.mode_info.uses_launcher:
        vols.append({"name": "launcher-config", "configMap": {"name": f"{s.name}-launcher"}})
    if s.hugepages_2mi:
        vols.append({"name": "hugepages", "emptyDir": {"medium": "HugePages-2Mi"}})
    if s.local_ckpt_on_nvme:
        vols.append({"name": "local-ckpt", "emptyDir": {"sizeLimit": f"{s.local_copies_gib}Gi"}})
    return vols


def pod_failure_policy() -> dict:
    """FailJob on exit 2 (a usage error) and 4 (the launcher's no-progress stop: nvrx_lab.launcher.progress), not
    retried; a lost node (``DisruptionTarget``) costs no retry."""
    return {"rules": [
        {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": [2, 4]}},
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]}


def tolerations(s: JobSpec) -> list[dict]:
    """The node group's taints, and a lost node's pod evicted after ``node_lost_toleration_s`` instead of 300 s."""
    return [*({"key": k, "operator": "Exists", "effect": "NoSchedule"} for k in s.tolerations),
            *({"key": k, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": s.node_lost_toleration_s}
              for k in NODE_LOST_TAINTS)]


def affinity(s: JobSpec) -> dict:
    """One pod per node, and every pod in one Availability Zone (EFA does not cross zones): the zone of ``s.zone``, or
    else the zone the job's first pod landed in (a pod may match its own affinity term, so the first one schedules)."""
    job_pods = {"matchLabels": {"app.kubernetes.io/instance": s.name}}
    out = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": job_pods, "topologyKey": "kubernetes.io/hostname"}]}}
    if not s.zone and s.efa:
        out["podAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": job_pods, "topologyKey": "topology.kubernetes.io/zone"}]}
    return out


RUN_AS = 1000
"""The image's user (``manifests/Dockerfile``): the training container never runs as root."""


def run_dir_init(s: JobSpec) -> dict:
    """The one root step: this job's folder on FSx made and given to :data:`RUN_AS` (FSx's root folder is root's), with
    nothing but ``CHOWN``; then the trainer, as that user, writes its checkpoints and metrics there."""
    return {"name": "run-dir", "image": s.image, "imagePullPolicy": s.image_pull_policy,
            "command": ["/bin/sh", "-c", f'mkdir -p "$RUN_DIR" && chown {RUN_AS}:{RUN_AS} "$RUN_DIR"'],
            "env": [{"name": "RUN_DIR", "value": s.run_dir}],
            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "64Mi"}},
            "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}},
            "volumeMounts": [{"name": "fsx", "mountPath": s.mount_path}]}


def pod_template(s: JobSpec) -> dict:
    """The pod of every completion index (also the JobSet's child Job's)."""
    pod_spec: dict = {
        "subdomain": s.name,
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": s.termination_grace_s,
        "nodeSelector": {"node.kubernetes.io/instance-type": s.instance_type,
                         **({"topology.kubernetes.io/zone": s.zone} if s.zone else {})},
        "tolerations": tolerations(s),
        "affinity": affinity(s),
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS},
        "initContainers": [run_dir_init(s)],
        "containers": [container(s)],
        "volumes": volumes(s),
    }
    if s.priority_class:
        pod_spec["priorityClassName"] = s.priority_class
    if rbac.marks_nodes(s):  # its token may get and patch nodes, nothing else (nvrx_lab.eks.rbac)
        pod_spec.update(serviceAccountName=rbac.account(s), automountServiceAccountToken=True)
        pod_spec["affinity"]["nodeAffinity"] = rbac.node_affinity()
    return {"metadata": {"labels": labels(s)}, "spec": pod_spec}


def job_spec(s: JobSpec, backoff_limit: int) -> dict:
    """The Indexed Job's ``spec``: one pod per completion index, the restart rules."""
    spec = {"completionMode": "Indexed", "completions": s.pods, "parallelism": s.pods,
            "backoffLimit": backoff_limit, "podFailurePolicy": pod_failure_policy(), "template": pod_template(s)}
    if s.spare_nodes:  # done once the nodes that train finished: the spares still waiting are stopped (Kubernetes 1.31+)
        spec["successPolicy"] = {"rules": [{"succeededCount": s.nodes}]}
    return spec


def job(s: JobSpec) -> dict:
    meta = _meta(s, s.name) | {"labels": workload_labels(s), "annotations": {"nvrx-lab/mode": s.mode}}
    spec = job_spec(s, s.backoff)
    spec["ttlSecondsAfterFinished"] = s.ttl_after_finished_s
    spec["template"] = spec.pop("template")  # last, as people read it
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": spec}


def render(spec: JobSpec) -> list[dict]:
    """All objects of ``spec``'s job, in the order they must be created: for a JobSet (``JobSpec.workload_kind``) the JobSet
    (:mod:`nvrx_lab.eks.jobset`: its controller makes the headless Service) instead of the Service and the Job; for
    ``mode='replicas'`` the coordinator's Service, StatefulSet and PodDisruptionBudget, then each group's
    Service and Job (:mod:`nvrx_lab.eks.replicas`)."""
    out: list[dict] = [namespace(spec)] if spec.create_namespace else []
    if spec.fsx_volume_handle:
        out += fsx_storage(spec)
    if spec.mode_info.uses_launcher:
        out.append(config_map(spec))
    if rbac.marks_nodes(spec):
        out += rbac.objects(spec, _meta(spec, spec.name))
    if spec.workload_kind == "jobset":
        meta = _meta(spec, spec.name) | {"labels": workload_labels(spec), "annotations": {"nvrx-lab/mode": spec.mode}}
        return [*out, jobset(spec, meta, job_spec(spec, backoff_limit=0), labels(spec))]
    if spec.mode_info.replicated:
        return [*out, *replicas.replica_objects(spec, service(spec), job(spec))]
    return [*out, service(spec), job(spec)]


def find(manifests: list[dict], kind: str) -> list[dict]:
    return [m for m in manifests if m.get("kind") == kind]
