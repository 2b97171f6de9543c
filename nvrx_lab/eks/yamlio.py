"""YAML with comments: the rendered dicts stay plain for the API; files get the reasons inline.

``to_yaml`` dumps with block scalars for the container script (whose flags carry their own
comments) and writes a comment line above each key in :data:`KEY_WHY` and above each environment
variable whose reason the renderer knows (``Kind.key`` entries first, so a claim's storage request
is not explained as a pod's resources). ``write_manifests`` regenerates ``manifests/``.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from nvrx_lab.eks.gate import gate_manifests, gate_spec
from nvrx_lab.eks.kueue import kueue_objects
from nvrx_lab.eks.modes import MODES
from nvrx_lab.eks.render import env_vars, fsx_storage, namespace, render
from nvrx_lab.eks.replicas import SECRET_KEY, coordinator_env, secret_command, secret_name
from nvrx_lab.eks.spec import JobSpec
from nvrx_lab.net import SECRET_ENV

KEY_WHY = {
    "completionMode": "Indexed: pod i gets hostname <job>-i and JOB_COMPLETION_INDEX=i (its node rank)",
    "backoffLimit": "failed pods before the Job fails: a group failure fails every pod, so nodes x the group failures allowed",
    "JobSet.backoffLimit": "0: a counted pod failure fails this child Job, and the JobSet recreates every pod at once",
    "failurePolicy": "a failed child Job restarts the whole group at once, maxRestarts times; a usage error (exit 2: "
                     "reason PodFailurePolicy) fails the JobSet",
    "network": "the JobSet controller's headless Service <name>: pod DNS <name>-node-0-i.<name>, before readiness",
    "replicatedJobs": "one Indexed Job of `nodes` pods: the pods of job-<mode>.yaml",
    "Namespace.labels": "Pod Security: IPC_LOCK (EFA) needs privileged; warn and audit report anything beyond baseline",
    "podFailurePolicy": "evictions/preemptions (DisruptionTarget) are not counted; exit 2 (usage error) fails at once",
    "ttlSecondsAfterFinished": "keep the finished Job and its pods' logs this long",
    "subdomain": "with the headless Service of the same name: pod DNS <job>-i.<job>",
    "restartPolicy": "Never: a failed pod is replaced by the Job controller (podFailurePolicy needs it)",
    "automountServiceAccountToken": "training never talks to the API server; only a launcher whose node fails a "
                                    "health check does, to mark it (nvrx_lab.eks.rbac)",
    "serviceAccountName": "the node marker's account: it may get and patch nodes, nothing else",
    "nodeAffinity": "never a node a failed health check labelled (nvrx_lab.health.mark)",
    "Job.successPolicy": "done once `nodes` pods succeeded: the hot spares still waiting are stopped",
    "ClusterRole.rules": "get and patch nodes: label and taint the node whose health check failed",
    "enableServiceLinks": "no <SERVICE>_PORT variables that could shadow MASTER_PORT and friends",
    "terminationGracePeriodSeconds": "SIGTERM to SIGKILL on eviction: time to finish an in-flight checkpoint",
    "nodeSelector": "the instance type the resources were sized for",
    "tolerations": "GPU/EFA node groups are tainted so only jobs that ask land there; a not-ready or unreachable "
                   "node's pod is evicted and replaced after tolerationSeconds, not Kubernetes' 300 s",
    "affinity": "one pod per node",
    "securityContext": "IPC_LOCK only (EFA pins memory); never privileged",
    "Job.resources": "limits = requests for memory, GPUs and EFA; CPU has no limit (a CFS quota would throttle "
                     "NCCL, dataloader and checkpoint threads)",
    "JobSet.resources": "limits = requests for memory, GPUs and EFA; CPU has no limit (a CFS quota would throttle "
                        "NCCL, dataloader and checkpoint threads)",
    "PersistentVolumeClaim.resources": "binds to a volume at least this large; FSx is not limited by it",
    "args": "args, not command: the image's entrypoint (CUDA compat set-up) runs first, then execs this",
    "publishNotReadyAddresses": "pod DNS records exist as soon as pods have IPs, before readiness",
    "clusterIP": "headless: DNS names for each pod, no load balancing",
    "claimRef": "pre-bound: no other claim can take this volume",
    "persistentVolumeReclaimPolicy": "Retain: deleting the claim never deletes checkpoints",
    "StatefulSet.replicas": "one coordinator, never two: a replacement starts only once the old pod object is gone "
                            "(two would split the groups between two quorums)",
    "StatefulSet.serviceName": "the coordinator's ClusterIP Service: the address the ranks reconnect to after a restart",
    "StatefulSet.podManagementPolicy": "OrderedReady (the default, spelled out): pods one at a time, never in parallel",
    "StatefulSet.annotations": "karpenter.sh/do-not-disrupt: Karpenter never consolidates the coordinator's node",
    "StatefulSet.automountServiceAccountToken": "the coordinator never talks to the API server",
    "StatefulSet.tolerations": "no GPU/EFA taints tolerated: the coordinator belongs on a CPU node; on a not-ready or "
                               "unreachable node its pod is evicted after tolerationSeconds, not Kubernetes' 300 s",
    "readinessProbe": "the Service sends the groups to the coordinator once it listens",
    "StatefulSet.resources": "CPU and memory only: one message in and out per rank and step, and the groups' TCPStore",
    "StatefulSet.securityContext": "no capabilities at all; never privileged",
    "PodDisruptionBudget.minAvailable": "1 of 1: no drain or consolidation evicts the coordinator voluntarily",
    "Service.type": "ClusterIP: one stable virtual IP for the coordinator, whichever pod runs it",
}


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def comments_for(spec: JobSpec) -> dict[str, str]:
    """Environment variable name -> reason, for :func:`to_yaml`."""
    coordinator = ({name: why for name, _, why in coordinator_env(spec)} | {
        SECRET_ENV: f"from Secret {secret_name(spec)}/{SECRET_KEY}: never rendered, the header says how to make it"}
        if spec.mode_info.replicated else {})
    return coordinator | {name: why for name, _, why in env_vars(spec)} | {
        "JOB_COMPLETION_INDEX": "node rank, from the pod's completion-index annotation (downward API)",
        "NODE_NAME": "the node this pod runs on (downward API): the one a failed health check marks",
        "POD_IP": "this pod's IP (downward API): where its launcher's round store listens when it is group rank 0",
        **{var: f"from Secret {ref} (never inline)" for var, ref in spec.secret_env.items()},
    }


def _annotate(doc: str, kind: str, env_why: dict[str, str]) -> str:
    out, seen = [], set()
    for line in doc.splitlines():
        m = re.match(r"^(\s*)(- )?([A-Za-z][\w]*):", line)
        why = (KEY_WHY.get(f"{kind}.{m.group(3)}") or KEY_WHY.get(m.group(3))) if m else None
        if m and why and m.group(3) not in seen and not m.group(2):
            seen.add(m.group(3))
            out.append(f"{m.group(1)}# {why}")
        e = re.match(r"^(\s*)- name: ([A-Z_][A-Z0-9_]*)$", line)
        if e and e.group(2) in env_why:
            out.append(f"{e.group(1)}# {env_why[e.group(2)]}")
        out.append(line)
    return "\n".join(out) + "\n"


def to_yaml(manifests: list[dict], env_why: dict[str, str] | None = None, header: str = "") -> str:
    """Multi-document YAML of ``manifests`` with reasons as comments (``yaml.safe_load_all`` reads it back)."""
    docs = [_annotate(yaml.dump(m, Dumper=_Dumper, sort_keys=False, width=200), str(m.get("kind")), env_why or {})
            for m in manifests]
    head = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return head + "---\n".join(docs)


def mode_slug(mode: str) -> str:
    return mode.replace("+", "-").replace("_", "-")


EXAMPLE = dict(image="123456789012.dkr.ecr.us-west-2.amazonaws.com/nvrx-lab:0.1.0",
               fsx_volume_handle="fs-0123456789abcdef0", fsx_dns_name="fs-0123456789abcdef0.fsx.us-west-2.amazonaws.com",
               fsx_mount_name="abcdefgh")
REGEN = "python -m nvrx_lab.eks render --out manifests/"


REAL_JOB: dict[str, Any] = dict(  # JobSpec's fields (dataclasses.replace checks the names)
    name="llama3-8b", model="llama3.1-8b", nodes=16, spare_nodes=1, mode="ft_launcher", ckpt="async", ckpt_interval=200,
    local_ckpt_interval=20, data="/fsx/data/llama3", steps=10000, train_extra=("--activation-checkpointing", "true"),
    fsx_volume_handle="", fsx_dns_name="", fsx_mount_name="")
"""The Llama 3.1 8B job on 16 p5 nodes and one hot spare that :func:`manifest_files` renders beside the modes'
examples: the launcher's in-pod restarts, async checkpoints to FSx every 200 steps and local ones every 20, two
sequences of 8,192 tokens a GPU (2 M tokens a step), activation checkpointing."""


def manifest_files(nodes: int = 2, **overrides) -> dict[str, str]:
    """File name -> YAML text of ``namespace.yaml``, ``fsx-storage.yaml``, and per mode ``job-<mode>.yaml`` (Indexed
    Job) and ``jobset-<mode>.yaml`` (the same pods as a JobSet). The replicas mode has a ``job-replicas.yaml`` only
    (three groups and their coordinator; a JobSet would restart the survivors)."""
    base = JobSpec(name="nvrx-lab", nodes=nodes, create_namespace=False, **(EXAMPLE | overrides))
    stamp = f"Generated by `{REGEN}` (nodes={nodes}); do not edit, re-render."
    files = {"namespace.yaml": to_yaml([namespace(base)], header=stamp),
             "fsx-storage.yaml": to_yaml(fsx_storage(base), header=stamp + "\nReplace the FSx id, DNS name and mount name "
                                         "with yours: render --fsx-id --fsx-dns --fsx-mount-name.")}
    for workload, prefix, what in (("job", "job", "an Indexed Job"), ("jobset", "jobset", "a JobSet (needs the JobSet "
                                                                                         "controller)")):
        for name in MODES:
            if workload == "jobset" and MODES[name].replicated:
                continue
            replicated = MODES[name].replicated
            spec = dataclasses.replace(base, name=f"nvrx-{mode_slug(name)}", mode=name, workload=workload,
                                       fsx_volume_handle="", fsx_dns_name="", fsx_mount_name="",
                                       replica_groups=3 if replicated else base.replica_groups,
                                       min_replicas=2 if replicated else base.min_replicas)
            head = f"{stamp}\nmode {name} as {what}: {spec.mode_info.summary}."
            if spec.mode_info.replicated:
                head += f"\nOnce, before the first apply (the coordinator's and every rank's key):\n  {secret_command(spec)}"
            files[f"{prefix}-{mode_slug(name)}.yaml"] = to_yaml(render(spec), comments_for(spec), header=head)
    real = dataclasses.replace(base, **REAL_JOB)
    head = (f"Generated by `{REGEN}`; do not edit, re-render.\nThe job this project exists for: {real.model} on {real.nodes} "
            f"{real.instance_type} nodes ({real.world} GPUs) and {real.spare_nodes} hot spare node (its pod waits in the "
            f"rendezvous and takes a lost node's place), mode {real.mode}: {real.mode_info.summary}.\n"
            f"{real.sizing.line(real.model, real.world)}.\n/dev/shm {real.shm} GiB a pod (async staging "
            f"{real.staging_gib} GiB, local checkpoints {real.local_copies_gib} GiB).\nThe tokens, once, on FSx: "
            f"python -m nvrx_lab.data prepare TEXT... --tokenizer MODULE:CALLABLE --vocab-size 128256 --out {real.data}")
    if real.workload_kind == "jobset":
        head += ("\nA JobSet (from 4 nodes up; the JobSet controller must be installed): a failure recreates every pod "
                 "at once, the old group gone first (BlockingRecreate), without the Job controller's per-pod back-off.")
    files[f"{real.workload_kind}-{real.model}-{real.nodes}-nodes.yaml"] = to_yaml(render(real), comments_for(real),
                                                                                  header=head)
    queued = dataclasses.replace(real, queue_name=real.queue_name or "p5")
    pod = next(m for m in render(queued) if m["kind"] == "JobSet")["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"]["spec"]
    files["kueue.yaml"] = to_yaml(kueue_objects(queued, pod), header=(
        f"Generated by `{REGEN}`; do not edit, re-render.\nKueue's queue for {real.name} ({real.pods} {real.instance_type} "
        f"pods, the spare's included): the ClusterQueue covers every resource a pod requests, with quota for all "
        f"{real.pods} at once; the job "
        f"joins it with render/submit --queue-name {queued.queue_name}.\nNot schema-checked here (Kueue's CRDs are not "
        "vendored): kubectl apply --dry-run=server -f kueue.yaml checks it on the cluster."))
    gate = [m for m in gate_manifests(real) if m["kind"] in ("Service", "Job")]
    files["efa-gate.yaml"] = to_yaml(gate, header=(
        f"Generated by `{REGEN}`; do not edit, re-render.\nThe EFA gate of {real.name}: an NCCL all-reduce across two "
        f"of its {real.instance_type} nodes, before the job takes {real.nodes} (python -m nvrx_lab.eks submit --gate "
        f"runs it first).\nkubectl apply -f efa-gate.yaml; kubectl -n {real.namespace} logs -f job/{gate_spec(real).name}: "
        "its last line is gate: passed or gate: FAILED, naming the check."))
    return files



def write_files(out: str | Path, files: dict[str, str]) -> list[Path]:
    """Write ``files`` into directory ``out`` (created if missing): all of them or, on an error, none."""
    out = Path(out)
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"output directory {str(out)!r}: {str(existing)!r} is a file; allowed: a directory "
                         "(created if missing)")
    out.mkdir(parents=True, exist_ok=True)
    staged: list[tuple[Path, Path]] = []
    try:
        for fname, text in files.items():  # every file first under a temporary name, then all renamed
            staged.append((out / f".{fname}.tmp", out / fname))
            staged[-1][0].write_text(text)
        for tmp, path in staged:
            tmp.replace(path)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
    return [path for _, path in staged]


def write_manifests(out: str | Path, nodes: int = 2, **overrides) -> list[Path]:
    """Write :func:`manifest_files` into ``out``; returns the paths. A bad spec or ``out`` writes nothing."""
    return write_files(out, manifest_files(nodes, **overrides))
