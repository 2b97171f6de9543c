"""``render(spec)``: the Kubernetes objects of one training job, as plain dicts for the API or YAML.

In order: the Namespace (optional), the FSx for Lustre static PersistentVolume and its claim
(when ``spec.fsx_volume_handle`` is set), the launcher's ConfigMap (launcher modes), the headless
Service and the Indexed Job. The pod template is where the modes meet the hardware:

* **Identity** — ``completionMode: Indexed`` gives pod *i* the hostname ``<job>-i`` and
  ``JOB_COMPLETION_INDEX=i``; ``subdomain: <job>`` with the headless Service ``<job>`` gives it the
  DNS name ``<job>-i.<job>``. Rank 0 is ``<job>-0.<job>`` for 2 nodes or 128.
* **Devices** — ``nvidia.com/gpu`` and ``vpc.amazonaws.com/efa`` with limits = requests, and CPU
  and memory too, so the pod is in the Guaranteed QoS class (evicted last); one pod per node
  (pod anti-affinity), ``/dev/shm`` as a memory emptyDir with a size limit (never the host's).
* **Privileges** — capability ``IPC_LOCK`` (EFA pins memory) and nothing else: never
  ``privileged``, no privilege escalation, no service-account token; secrets only by reference.
* **Entrypoint** — the script is the container's ``args``, so the image's entrypoint (CUDA forward
  compatibility, see ``manifests/Dockerfile``) runs first and then execs it.
* **Restarts** — ``restartPolicy: Never`` with a ``podFailurePolicy``: evictions and preemptions do
  not count against ``backoffLimit``, a usage error (exit 2) fails the Job at once. A failure of the
  whole group (every pod) is what ``backoffLimit`` counts in: ``nodes`` x the group failures allowed.
"""

from __future__ import annotations

from nvrx_lab.eks import commands
from nvrx_lab.eks.modes import nccl_env
from nvrx_lab.eks.spec import JobSpec

CONTAINER = "trainer"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


def labels(s: JobSpec) -> dict[str, str]:
    return {"app.kubernetes.io/name": "nvrx-lab", "app.kubernetes.io/instance": s.name,
            "app.kubernetes.io/component": "training", "nvrx-lab/mode": s.mode.replace("+", ".")}


def _meta(s: JobSpec, name: str) -> dict:
    return {"name": name, "namespace": s.namespace, "labels": labels(s)}


def namespace(s: JobSpec) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": s.namespace, "labels": {"app.kubernetes.io/part-of": "nvrx-lab"}}}


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
    return [("rdzv", s.rdzv_port), ("store", s.master_port), ("inproc-store", s.master_port + 1)]


def service(s: JobSpec) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(s, s.name),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {"app.kubernetes.io/name": "nvrx-lab", "app.kubernetes.io/instance": s.name},
                     "ports": [{"name": n, "port": p, "targetPort": p, "protocol": "TCP"} for n, p in ports(s)]}}


def env_vars(s: JobSpec) -> list[tuple[str, str, str]]:
    """(name, value, why) of the plain variables; ``JOB_COMPLETION_INDEX`` and secrets come by reference."""
    return [
        ("NNODES", str(s.nodes), "nodes in the job = the Indexed Job's completions"),
        ("NPROC_PER_NODE", str(s.gpus), "workers per pod = nvidia.com/gpu"),
        ("RANK0_HOST", s.rank0_host, "completion index 0's DNS name under the headless Service"),
        ("MASTER_PORT", str(s.master_port), "torchrun's store on rank 0 (the in-process store uses the next port)"),
        ("RDZV_PORT", str(s.rdzv_port), "the c10d rendezvous store on rank 0 (launcher modes)"),
        ("RUN_DIR", s.run_dir, "this job's directory on FSx: metrics and checkpoints"),
        *([("LAUNCHER_CONFIG", f"{commands.CONFIG_DIR}/{commands.CONFIG_FILE}", "the launcher's config file (ConfigMap mount)")]
          if s.mode_info.uses_launcher else []),
        *nccl_env(s.mode_info, s.efa, s.instance.efa_rdma, s.hugepages_2mi > 0, s.nccl_debug),
        *[(k, v, "JobSpec.env") for k, v in s.env.items()],
    ]


def container(s: JobSpec) -> dict:
    cpu, mem = s.cpu_memory
    res: dict = {"cpu": str(cpu), "memory": f"{mem}Gi", "nvidia.com/gpu": str(s.gpus)}
    if s.efa:
        res["vpc.amazonaws.com/efa"] = str(s.efa)
    if s.hugepages_2mi:
        res["hugepages-2Mi"] = f"{s.hugepages_2mi}Mi"
    env = [{"name": "JOB_COMPLETION_INDEX",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}}]
    env += [{"name": k, "value": v} for k, v, _ in env_vars(s)]
    env += [{"name": var, "valueFrom": {"secretKeyRef": {"name": ref.partition("/")[0], "key": ref.partition("/")[2],
                                                         "optional": True}}} for var, ref in s.secret_env.items()]
    mounts = [{"name": "fsx", "mountPath": s.mount_path}, {"name": "shm", "mountPath": "/dev/shm"}]
    if s.mode_info.uses_launcher:
        mounts.append({"name": "launcher-config", "mountPath": commands.CONFIG_DIR, "readOnly": True})
    if s.hugepages_2mi:
        mounts.append({"name": "hugepages", "mountPath": "/dev/hugepages"})
    return {
        "name": CONTAINER, "image": s.image, "imagePullPolicy": s.image_pull_policy,
        "args": ["/bin/bash", "-c", commands.container_script(s)],  # args, not command: the image's entrypoint runs first
        "env": env,
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports(s)],
        "resources": {"requests": dict(res), "limits": dict(res)},
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
    return vols


def pod_failure_policy() -> dict:
    return {"rules": [
        {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": [2]}},
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]}


def job(s: JobSpec) -> dict:
    pod_spec: dict = {
        "subdomain": s.name,
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": s.termination_grace_s,
        "nodeSelector": {"node.kubernetes.io/instance-type": s.instance_type},
        "tolerations": [{"key": k, "operator": "Exists", "effect": "NoSchedule"} for k in s.tolerations],
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {"app.kubernetes.io/instance": s.name}},
             "topologyKey": "kubernetes.io/hostname"}]}},
        "containers": [container(s)],
        "volumes": volumes(s),
    }
    if s.priority_class:
        pod_spec["priorityClassName"] = s.priority_class
    meta = _meta(s, s.name)
    meta["annotations"] = {"nvrx-lab/mode": s.mode}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"completionMode": "Indexed", "completions": s.nodes, "parallelism": s.nodes,
                     "backoffLimit": s.backoff, "podFailurePolicy": pod_failure_policy(),
                     "ttlSecondsAfterFinished": s.ttl_after_finished_s,
                     "template": {"metadata": {"labels": labels(s)}, "spec": pod_spec}}}


def render(spec: JobSpec) -> list[dict]:
    """All objects of ``spec``'s job, in the order they must be created."""
    out: list[dict] = [namespace(spec)] if spec.create_namespace else []
    if spec.fsx_volume_handle:
        out += fsx_storage(spec)
    if spec.mode_info.uses_launcher:
        out.append(config_map(spec))
    return out + [service(spec), job(spec)]


def find(manifests: list[dict], kind: str) -> list[dict]:
    return [m for m in manifests if m.get("kind") == kind]
