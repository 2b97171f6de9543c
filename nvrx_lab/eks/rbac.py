"""What lets a pod mark its own node unhealthy (:mod:`nvrx_lab.health.mark`), and what keeps the job off such nodes.

A launcher whose node fails a health check labels and taints that node through the API before it exits 5; the Job
controller's replacement pod must then land elsewhere. Rendered when the launcher runs its checks
(``JobSpec.mark_unhealthy_nodes``, launcher modes):

* a ServiceAccount for the job's pods, its token mounted (the pods mount none otherwise);
* a ClusterRole that may ``get`` and ``patch`` nodes, nothing else (nodes are cluster-scoped: a Role cannot grant
  them), bound to that account alone;
* the pods' ``NODE_NAME`` (the downward API's ``spec.nodeName``): the node the launcher marks;
* a node affinity term: never a node labelled ``nvrx-lab/health`` (the taint keeps other jobs off it too).

Patching nodes is a cluster-wide permission: a cluster that does not grant it (a namespace-scoped access entry)
leaves ``mark_unhealthy_nodes=False``, and the exit code alone takes the node out of the next round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nvrx_lab.health.mark import LABEL

if TYPE_CHECKING:
    from nvrx_lab.eks.spec import JobSpec

ROLE = "nvrx-lab-node-marker"
"""The ClusterRole, one per cluster, shared by every job."""


def marks_nodes(s: JobSpec) -> bool:
    return s.mark_unhealthy_nodes and s.mode_info.uses_launcher and not s.mode_info.replicated \
        and s.launcher.health_checks


def account(s: JobSpec) -> str:
    return f"{s.name}-pods"


def binding_name(s: JobSpec) -> str:
    return f"{ROLE}-{s.namespace}-{s.name}"


def objects(s: JobSpec, meta: dict) -> list[dict]:
    """The ServiceAccount (``meta``: the job's namespaced metadata), the ClusterRole and this job's binding."""
    binding = binding_name(s)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {**meta, "name": account(s)}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": ROLE, "labels": {"app.kubernetes.io/name": "nvrx-lab"}},
         "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": binding, "labels": meta.get("labels", {})},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ROLE},
         "subjects": [{"kind": "ServiceAccount", "name": account(s), "namespace": s.namespace}]},
    ]


def node_affinity() -> dict:
    """Never a node that failed a check (:data:`~nvrx_lab.health.mark.LABEL` present)."""
    return {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": LABEL, "operator": "DoesNotExist"}]}]}}
