"""``submit(spec, cluster, region)``: render, validate, create or replace, watch, stream rank 0, report.

``watch=Watch(timeout_s, poll_s)`` says how long and how often the Job is followed (``None``: not at all),
``access=Access(session, api_server)`` how the cluster's API is reached (boto3's default credentials and
the cluster's own endpoint unless given).

With ``dry_run=True`` (the default) nothing leaves the machine: the manifests are rendered and
validated and returned. Otherwise the objects are created in order. A Namespace, PersistentVolume
or claim is read first and created only when missing, never replaced; where access stops at the
namespace (403 on reading and creating a Namespace or PersistentVolume) it is taken to exist. A Job,
ConfigMap or Service of the same name is an error unless ``replace=True``: then the Job is deleted with
its pods (its template is immutable) and created again, resuming from its checkpoints, and the
ConfigMap and Service are replaced. A JobSet (``JobSpec.workload_kind``: from 4 nodes up by default) is
created, watched and deleted the same way (:mod:`.workload`); its controller makes the headless Service.
The pods' phases are shown with a progress bar, with the reason a pod waits (``Unschedulable: 0/4
nodes are available: 4 Insufficient nvidia.com/gpu``, ``ErrImagePull`` …), rank 0's log is streamed
(following each replacement pod) and the goodput summary line is picked out of it (:mod:`.watch`).
``delete(spec, …)`` removes the Job, Service and ConfigMap. Every failure comes out as
:class:`~nvrx_lab.eks.auth.EksError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import boto3
import kubernetes.client
from kubernetes.client.rest import ApiException

from nvrx_lab.eks import rbac
from nvrx_lab.eks.auth import EksError, api_client, explain
from nvrx_lab.eks.gate import gate_manifests, gate_spec
from nvrx_lab.eks.preflight import Finding
from nvrx_lab.eks.preflight import preflight as run_preflight
from nvrx_lab.eks.render import render
from nvrx_lab.eks.spec import JobSpec
from nvrx_lab.eks.validate import validate
from nvrx_lab.eks.watch import WATCH, Watch
from nvrx_lab.eks.watch import watch as follow
from nvrx_lab.eks.workload import Workload, body
from nvrx_lab.net import wait_for


@dataclass(frozen=True)
class Access:
    """How this machine reaches the cluster's Kubernetes API, and whether it checks the cluster before a submit."""

    session: boto3.session.Session | None = None
    """A ``boto3.session.Session`` (credentials, profile); ``None``: boto3's default chain."""
    api_server: str | None = None
    """An endpoint instead of the cluster's own: an SSH tunnel, a proxy to a private endpoint, a test's server."""
    preflight: bool = True
    """Run :func:`~nvrx_lab.eks.preflight.preflight` before a submit creates anything (False: skipped, and said so)."""
    gate: bool = False
    """Run the EFA gate (:mod:`nvrx_lab.eks.gate`: an NCCL all-reduce across two of the job's nodes) after the
    preflight; a failed gate stops the submit with its last line, before the job's own objects exist."""


@dataclass
class SubmitResult:
    manifests: list[dict]
    """What was (or, in a dry run, would be) created."""
    status: str = "dry-run"
    """dry-run, submitted (not watched), Succeeded, Failed, timeout, stuck, evicted or gone (deleted meanwhile)."""
    actions: list[str] = field(default_factory=list)
    """``created Job/x``, ``replaced Service/x``, ``exists Namespace/y`` …"""
    phases: dict[int, str] = field(default_factory=dict)
    """Last seen phase per completion index."""
    waiting: dict[int, str] = field(default_factory=dict)
    """Why each completion index last waited, while it did (``Unschedulable: …``, ``ImagePullBackOff: …``)."""
    goodput: dict | None = None
    """The goodput summary rank 0 printed, if any."""
    log_tail: list[str] = field(default_factory=list)
    """The last lines of rank 0's log."""


KEEP = ("Namespace", "PersistentVolume", "PersistentVolumeClaim", "ServiceAccount", "ClusterRole", "ClusterRoleBinding")
"""Created when missing, never replaced: a namespace may be someone else's, storage may hold checkpoints, the node
marker's ClusterRole is shared by every job (:mod:`nvrx_lab.eks.rbac`)."""


def _ensure(core: kubernetes.client.CoreV1Api, m: dict) -> str:
    """Read first, create only when missing; a 403 on both for a cluster-scoped object means 'not ours to see'."""
    kind, name, ns = m["kind"], m["metadata"]["name"], m["metadata"].get("namespace")
    rbac = kubernetes.client.RbacAuthorizationV1Api(core.api_client)
    read, create = {"Namespace": (lambda: core.read_namespace(name), lambda: core.create_namespace(body(m))),
                    "ServiceAccount": (lambda: core.read_namespaced_service_account(name, ns),
                                       lambda: core.create_namespaced_service_account(ns, body(m))),
                    "ClusterRole": (lambda: rbac.read_cluster_role(name), lambda: rbac.create_cluster_role(body(m))),
                    "ClusterRoleBinding": (lambda: rbac.read_cluster_role_binding(name),
                                           lambda: rbac.create_cluster_role_binding(body(m))),
                    "PersistentVolume": (lambda: core.read_persistent_volume(name),
                                         lambda: core.create_persistent_volume(body(m))),
                    "PersistentVolumeClaim": (lambda: core.read_namespaced_persistent_volume_claim(name, ns),
                                              lambda: core.create_namespaced_persistent_volume_claim(ns, body(m)))}[kind]
    try:
        read()
        return f"exists {kind}/{name}"
    except ApiException as exc:
        if exc.status not in (403, 404):
            raise
        forbidden = exc.status == 403
    try:
        create()
        return f"created {kind}/{name}"
    except ApiException as exc:
        if exc.status == 409:
            return f"exists {kind}/{name}"
        if exc.status == 403 and forbidden and kind not in ("PersistentVolumeClaim", "ServiceAccount"):
            return f"assumed {kind}/{name} (403 on read and create: access stops at the namespace)"
        raise


def _existing(core: kubernetes.client.CoreV1Api, manifests: list[dict]) -> list[str]:
    """``Kind/name`` of the ConfigMaps and Services of ``manifests`` that already exist (read before creating
    anything, so a refused submission leaves nothing behind)."""
    read = {"ConfigMap": core.read_namespaced_config_map, "Service": core.read_namespaced_service}
    found = []
    for m in manifests:
        if m["kind"] in read:
            try:
                read[m["kind"]](m["metadata"]["name"], m["metadata"]["namespace"])
            except ApiException as exc:
                if exc.status in (403, 404):
                    continue
                raise
            found.append(f"{m['kind']}/{m['metadata']['name']}")
    return found


def _create_or_replace(api: kubernetes.client.ApiClient, m: dict, top: Workload, wait_s: float, replace: bool) -> str:
    core = kubernetes.client.CoreV1Api(api)
    kind, name, ns = m["kind"], m["metadata"]["name"], m["metadata"].get("namespace")
    if kind in KEEP:
        return _ensure(core, m)
    create = {"ConfigMap": lambda: core.create_namespaced_config_map(ns, body(m)),
              "Service": lambda: core.create_namespaced_service(ns, body(m)),
              top.kind: lambda: top.create(m)}[kind]
    try:
        create()
        return f"created {kind}/{name}"
    except ApiException as exc:
        if exc.status != 409:
            raise
    if not replace:  # left by an earlier job of this name (a Job's TTL removes only the Job), or someone else's
        raise EksError(f"{kind} {ns}/{name} already exists (from an earlier job of this name?): pass replace=True "
                       "(CLI: --replace) to replace it, or choose another name")
    if kind == "ConfigMap":
        core.replace_namespaced_config_map(name, ns, body(m))
    elif kind == "Service":
        core.replace_namespaced_service(name, ns, body(m))
    else:  # a Job's (a JobSet's) template is immutable: delete it with its pods, wait until it is gone, create again
        _delete(top, wait_s)
        create()
    return f"replaced {kind}/{name}"


def _delete(top: Workload, wait_s: float) -> bool:
    """Delete the Job (JobSet) with its pods and wait until it is gone; False when there was none."""
    if not top.delete():
        return False
    try:
        return wait_for(top.gone, wait_s, f"{top} to be deleted", interval=min(1.0, wait_s / 20))
    except TimeoutError:
        raise EksError(f"{top} still exists {wait_s:.0f} s after its deletion; try again later") from None


def submit(spec: JobSpec, cluster: str, region: str, dry_run: bool = True, *, replace: bool = False,
           watch: Watch | None = WATCH, echo: Callable[[str], None] = print,
           access: Access | None = None) -> SubmitResult:
    """Render and validate ``spec``; unless ``dry_run``, run :func:`~nvrx_lab.eks.preflight.preflight` (unless
    ``access.preflight`` is False: said to ``echo``), create it on ``cluster`` and follow it as ``watch`` says
    (``None``: return once it is submitted), its findings and rank 0's log lines to ``echo``. An existing Job of the
    same name is an error unless ``replace`` (it is deleted, and resumes from its checkpoints)."""
    manifests = render(spec)
    validate(manifests)
    result = SubmitResult(manifests)
    if dry_run:
        return result
    if spec.mode_info.replicated:
        raise EksError("submit: mode 'replicas' is several Jobs and a StatefulSet, which submit does not follow yet; apply "
                       "them with kubectl apply -f (python -m nvrx_lab.eks render writes job-replicas.yaml)")
    timeout_s = watch.timeout_s if watch else WATCH.timeout_s
    access = access or Access()
    with _cluster_api(cluster, region, spec.namespace, access) as api:
        if access.preflight:
            findings = run_preflight(spec, api, access.session or boto3.session.Session())
            for finding in findings:
                echo(f"preflight: {finding.line}")
            spec, manifests = _pinned(spec, findings, manifests, echo)
            result.manifests = manifests
        else:
            echo("preflight: skipped (Access(preflight=False)): the image, the volume, the nodes and Pod Security are not "
                 "checked")
        if access.gate:
            run_gate(api, spec, watch or WATCH, echo)
        top = Workload(api, spec)
        if not replace and (what := top.describe()):
            raise EksError(f"{top} already exists ({what}): pass replace=True (CLI: --replace) "
                           "to delete it and its pods and start again from its checkpoints, or choose another name")
        if not replace and (left := _existing(kubernetes.client.CoreV1Api(api), manifests)):
            raise EksError(f"{' and '.join(left)} already exist in namespace {spec.namespace} (from an earlier job of this "
                           "name?): pass replace=True (CLI: --replace) to replace them, or choose another name")
        for m in manifests:
            result.actions.append(_create_or_replace(api, m, top, wait_s=min(300.0, timeout_s), replace=replace))
        result.status = "submitted"
        if watch is not None:
            result.status, result.phases, log = follow(api, spec, watch, echo, result.waiting)
            result.goodput, result.log_tail = log.goodput, list(log.tail)
    return result


def _pinned(spec: JobSpec, findings: list[Finding], manifests: list[dict], echo) -> tuple[JobSpec, list[dict]]:
    """``spec`` with its image pinned to the digest preflight found (a tag moves: a pod replaced an hour later would
    pull another image than its peers), and its manifests rendered again; as given when it has a digest already."""
    digest = next((f.value for f in findings if f.check == "image" and f.value), "")
    if not digest or "@" in spec.image:
        return spec, manifests
    pinned = dataclasses.replace(spec, image=f"{spec.image}@{digest}")
    echo(f"image: {spec.image} pinned to {digest} (every pod, replacements too, runs this image)")
    manifests = render(pinned)
    validate(manifests)
    return pinned, manifests


GATE_TIMEOUT_S = 1800.0
"""The gate's watch at most: two pods' image pulls and NCCL's start-up take minutes, the sums seconds."""


def run_gate(api: kubernetes.client.ApiClient, spec: JobSpec, watch: Watch, echo: Callable[[str], None]) -> str:
    """Create the EFA gate of ``spec``, follow it to its end and return its verdict line (``gate: passed …``); a gate
    that did not pass raises :class:`EksError` with its verdict (the failed Job stays for ``kubectl logs``)."""
    g = gate_spec(spec)
    top = Workload(api, g)
    for m in gate_manifests(spec):
        echo(f"gate: {_create_or_replace(api, m, top, wait_s=min(300.0, watch.timeout_s), replace=True)}")
    status, _, log = follow(api, g, dataclasses.replace(watch, timeout_s=min(watch.timeout_s, GATE_TIMEOUT_S)), echo)
    verdict = next((line for line in reversed(log.tail) if line.startswith(("gate: passed", "gate: FAILED"))), "")
    if status != "Succeeded" or not verdict.startswith("gate: passed"):
        raise EksError(f"EFA gate {status}: {verdict or 'no verdict in rank 0 log'}; {spec.name} was not submitted "
                       f"(kubectl -n {spec.namespace} logs job/{g.name}; python -m nvrx_lab.gpucheck.allreduce's docs)")
    _delete(top, min(300.0, watch.timeout_s))
    with contextlib.suppress(ApiException):
        kubernetes.client.CoreV1Api(api).delete_namespaced_service(g.name, g.namespace)
    echo(f"{verdict} (Job/{g.name} deleted)")
    return verdict


@contextlib.contextmanager
def _cluster_api(cluster: str, region: str, namespace: str, access: Access):
    """A Kubernetes API client for the cluster; any failure inside comes out as one clear EksError."""
    api = api_client(cluster, region, session=access.session, api_server=access.api_server)
    try:
        yield api
    except EksError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise explain(exc, cluster, region, namespace) from None
    finally:
        api.close()


def check_cluster(spec: JobSpec, cluster: str, region: str, *, access: Access | None = None) -> list[Finding]:
    """:func:`~nvrx_lab.eks.preflight.preflight` of ``spec`` on ``cluster`` alone (``PreflightFailed`` if one failed)."""
    access = access or Access()
    with _cluster_api(cluster, region, spec.namespace, access) as api:
        return run_preflight(spec, api, access.session or boto3.session.Session())


def delete(spec: JobSpec, cluster: str, region: str, *, access: Access | None = None, wait_s: float = 120.0) -> list[str]:
    """Delete the Job or JobSet of ``spec``'s name (either: a name is one job), with its pods, its Service, ConfigMap,
    ServiceAccount and role binding; storage, namespace and the shared ClusterRole stay."""
    done = []
    with _cluster_api(cluster, region, spec.namespace, access or Access()) as api:
        core, roles = kubernetes.client.CoreV1Api(api), kubernetes.client.RbacAuthorizationV1Api(api)
        for kind in ("JobSet", "Job"):
            if _delete(Workload(api, spec, kind), wait_s):
                done.append(f"deleted {kind}/{spec.name}")
        binding = rbac.binding_name(spec)
        for kind, fn, name in (("Service", core.delete_namespaced_service, spec.name),
                               ("ConfigMap", core.delete_namespaced_config_map, f"{spec.name}-launcher"),
                               ("ServiceAccount", core.delete_namespaced_service_account, rbac.account(spec)),
                               ("ClusterRoleBinding", lambda n, _: roles.delete_cluster_role_binding(n), binding)):
            try:
                fn(name, spec.namespace)
                done.append(f"deleted {kind}/{name}")
            except ApiException as exc:
                if exc.status != 404:
                    raise
    return done
