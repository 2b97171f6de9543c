"""``preflight(spec, …)``: what would leave a job's nodes idle, checked before a pod exists.

A 16-node p5 job that cannot pull its image, mount its volume or find its nodes costs an hour of 128 GPUs before
anyone reads an Event. Each check here is one :class:`Finding` naming the field and what to do:

* **example values** — the workbook's placeholders (AWS's documentation account ``123456789012`` in the image, the
  example FSx id) are never submitted;
* **the image** — an ECR image's tag or digest exists in its repository (boto3 ``describe_images``); an image of
  another registry is said to be unchecked;
* **the volume** — the FSx claim is ``Bound`` (unless this submit creates the volume and claim itself);
* **the nodes** — enough Ready, schedulable nodes of the instance type with the GPUs and EFA interfaces a pod asks
  for; with a Kueue queue, Kueue admits the job when its quota frees, so the count is said, not required;
* **Pod Security** — the namespace's ``enforce`` level admits the pods (``IPC_LOCK`` is beyond ``baseline``);
* **the JobSet controller** — for a JobSet, its CustomResourceDefinition is installed.

``submit`` runs it first (``Access(preflight=False)`` skips it, and says so; ``--no-preflight``);
``python -m nvrx_lab.eks preflight`` runs it alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import boto3
import kubernetes.client
from botocore.exceptions import BotoCoreError, ClientError
from kubernetes.client.exceptions import ApiException

from nvrx_lab.eks.auth import EksError
from nvrx_lab.eks.spec import JobSpec
from nvrx_lab.eks.workload import CRD
from nvrx_lab.eks.yamlio import EXAMPLE

EXAMPLE_ACCOUNT = "123456789012"
"""AWS's documentation account, the workbook's image placeholder."""
ECR_IMAGE = re.compile(r"^(?P<account>\d{12})\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(\.cn)?/"
                       r"(?P<repo>[^:@]+)(:(?P<tag>[^@]+))?(@(?P<digest>sha256:[0-9a-f]{64}))?$")
ADMITTED = {None, "privileged"}
"""``pod-security.kubernetes.io/enforce`` levels that admit the pods (``IPC_LOCK`` for EFA's registered memory)."""


@dataclass(frozen=True)
class Finding:
    check: str
    ok: bool
    line: str
    """What was found; for a failure ``JobSpec.<field>: <problem>; <what to do>``."""
    value: str = ""
    """What the check learnt that a submit uses: the image's digest (``sha256:…``)."""


class PreflightFailed(EksError):
    """Preflight found something that would leave the nodes idle; ``findings`` holds every check's line."""

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        super().__init__("; ".join(f.line for f in findings if not f.ok))


def example_values(spec: JobSpec) -> list[Finding]:
    """The placeholders of ``manifests/`` and notebook 06, which no real job has."""
    out = []
    if spec.image.startswith(f"{EXAMPLE_ACCOUNT}."):
        out.append(Finding("example", False, f"JobSpec.image: {spec.image} is the workbook's example (account "
                                             f"{EXAMPLE_ACCOUNT}); build manifests/Dockerfile, push it to your ECR "
                                             "and pass its URI"))
    if EXAMPLE["fsx_volume_handle"] in (spec.fsx_volume_handle, spec.fsx_dns_name):
        out.append(Finding("example", False, f"JobSpec.fsx_volume_handle: {EXAMPLE['fsx_volume_handle']} is the "
                                             "example FSx id; pass yours (aws fsx describe-file-systems)"))
    return out or [Finding("example", True, "no example values")]


def image(spec: JobSpec, session: boto3.session.Session) -> Finding:
    """The image's tag or digest in its ECR repository."""
    m = ECR_IMAGE.match(spec.image)
    if m is None:
        return Finding("image", True, f"image {spec.image}: not in ECR, not checked (the nodes must be able to pull it)")
    ref = {"imageDigest": m["digest"]} if m["digest"] else {"imageTag": m["tag"] or "latest"}
    try:
        found = session.client("ecr", region_name=m["region"]).describe_images(
            registryId=m["account"], repositoryName=m["repo"], imageIds=[ref])
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        what = {"ImageNotFoundException": "no such tag or digest in the repository",
                "RepositoryNotFoundException": f"no repository {m['repo']} in account {m['account']}"}.get(code, code)
        return Finding("image", False, f"JobSpec.image: {spec.image}: {what} ({m['region']}); push the image "
                                       "(manifests/Dockerfile) or pass one that exists")
    except BotoCoreError as exc:
        return Finding("image", False, f"JobSpec.image: {spec.image}: ECR could not be asked ({exc}); check the "
                                       "credentials and the region")
    digest = found["imageDetails"][0]["imageDigest"]
    return Finding("image", True, f"image {spec.image}: in ECR, {digest[:19]}…", value=digest)


def volume(spec: JobSpec, core: kubernetes.client.CoreV1Api) -> Finding:
    """The FSx claim, Bound."""
    if spec.fsx_volume_handle:
        return Finding("volume", True, f"volume: this submit creates the FSx volume and claim {spec.fsx_claim}")
    try:
        status = core.read_namespaced_persistent_volume_claim(spec.fsx_claim, spec.namespace).status
        phase = status.phase if status is not None else None
    except ApiException as exc:
        if exc.status != 404:
            raise
        return Finding("volume", False, f"JobSpec.fsx_claim: no PersistentVolumeClaim {spec.fsx_claim} in namespace "
                                        f"{spec.namespace}; apply manifests/fsx-storage.yaml with your FSx values, or "
                                        "pass fsx_id, fsx_dns and fsx_mount_name")
    if phase != "Bound":
        return Finding("volume", False, f"JobSpec.fsx_claim: {spec.fsx_claim} is {phase}, not Bound: its "
                                        "PersistentVolume is missing or does not match (kubectl describe pvc)")
    return Finding("volume", True, f"volume: {spec.fsx_claim} Bound")


def nodes(spec: JobSpec, core: kubernetes.client.CoreV1Api) -> Finding:
    """Ready, schedulable nodes of the type with a pod's GPUs and EFA interfaces free to allocate."""
    try:
        listed = core.list_node(label_selector=f"node.kubernetes.io/instance-type={spec.instance_type}").items
    except ApiException as exc:
        if exc.status != 403:
            raise
        return Finding("nodes", True, "nodes: not checked (this identity may not list nodes: a namespace-scoped access "
                                      "entry)")
    fit = [n for n in listed if _ready(n) and _allocatable(n, "nvidia.com/gpu") >= spec.gpus
           and _allocatable(n, "vpc.amazonaws.com/efa") >= spec.efa]
    need = spec.pods * spec.groups
    said = f"{len(fit)} of {len(listed)} {spec.instance_type} nodes ready with {spec.gpus} GPUs and {spec.efa} EFA"
    if spec.queue_name:
        return Finding("nodes", True, f"nodes: {said}; Kueue queue {spec.queue_name} admits the {need} pods when "
                                      "their quota frees")
    if len(fit) < need:
        field = "JobSpec.nodes + spare_nodes" if spec.spare_nodes else "JobSpec.nodes"
        return Finding("nodes", False, f"{field}: {need} wanted, {said}; scale the node group, lower nodes, or "
                                       "pass queue_name to wait in Kueue")
    return Finding("nodes", True, f"nodes: {said}, {need} wanted")


def pod_security(spec: JobSpec, core: kubernetes.client.CoreV1Api) -> Finding:
    """The namespace's enforced Pod Security level admits ``IPC_LOCK``."""
    try:
        meta = core.read_namespace(spec.namespace).metadata
        labels = (meta.labels if meta is not None else None) or {}
    except ApiException as exc:
        if exc.status == 403:
            return Finding("pod security", True, f"namespace {spec.namespace}: its Pod Security level not checked (this "
                                                 "identity may not read namespaces)")
        if exc.status != 404:
            raise
        return Finding("pod security", spec.create_namespace, f"namespace {spec.namespace}: created by this submit "
                       "(enforce privileged)" if spec.create_namespace else f"JobSpec.namespace: {spec.namespace} does "
                       "not exist and create_namespace is False; create it or set create_namespace=True")
    level = labels.get("pod-security.kubernetes.io/enforce")
    if level not in ADMITTED:
        return Finding("pod security", False, f"JobSpec.namespace: {spec.namespace} enforces Pod Security {level!r}, "
                                              "which refuses the pods' IPC_LOCK (EFA); label it enforce=privileged "
                                              "(manifests/namespace.yaml) or use another namespace")
    return Finding("pod security", True, f"namespace {spec.namespace}: enforce {level or 'unset'}")


def controller(spec: JobSpec, api: kubernetes.client.ApiClient) -> Finding:
    """A JobSet needs its controller: the CustomResourceDefinition ``jobsets.jobset.x-k8s.io``."""
    if spec.workload_kind != "jobset":
        return Finding("controller", True, "controller: the Job controller (an Indexed Job)")
    try:
        kubernetes.client.ApiextensionsV1Api(api).read_custom_resource_definition(CRD)
    except ApiException as exc:
        if exc.status == 403:
            return Finding("controller", True, f"controller: {CRD} not checked (this identity may not read "
                                               "CustomResourceDefinitions)")
        if exc.status != 404:
            raise
        return Finding("controller", False, f"JobSpec.workload: a JobSet ({spec.workload!r}, {spec.nodes} nodes) "
                                            f"needs {CRD}, which is not installed; install the JobSet controller "
                                            "(jobset.sigs.k8s.io: kubectl apply --server-side -f its release's "
                                            "manifests.yaml) or pass workload='job'")
    return Finding("controller", True, f"controller: {CRD} installed")


def preflight(spec: JobSpec, api: kubernetes.client.ApiClient, session: boto3.session.Session) -> list[Finding]:
    """Every check's finding; raises :class:`PreflightFailed` when one failed."""
    core = kubernetes.client.CoreV1Api(api)
    examples = example_values(spec)
    pulled = [] if any(f.line.startswith("JobSpec.image") for f in examples) else [image(spec, session)]
    findings = [*examples, *pulled, volume(spec, core), nodes(spec, core), pod_security(spec, core),
                controller(spec, api)]
    if not all(f.ok for f in findings):
        raise PreflightFailed(findings)
    return findings


def _ready(node) -> bool:
    ready = any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))
    return ready and not node.spec.unschedulable


def _allocatable(node, resource: str) -> int:
    value = (node.status.allocatable or {}).get(resource, "0")
    return int(value) if str(value).isdigit() else 0
