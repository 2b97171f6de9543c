"""Kueue's queue for a job: a ResourceFlavor, a ClusterQueue that covers every resource the pods ask for, a LocalQueue.

Kueue admits a workload only when its ClusterQueue covers *every* resource its pods request; one it does not cover
(EFA interfaces, hugepages, the ephemeral storage of local checkpoints on NVMe) leaves the job pending for good with
the Event "resource … unavailable in ClusterQueue". :func:`kueue_objects` reads the resources from the rendered pod
itself, so the queue and the job cannot drift apart, with quota for ``nodes`` pods: the whole job admitted at once or
not at all. Kueue's CRDs are not vendored here: these objects are checked for shape, not against a schema.
"""

from __future__ import annotations

import re

from nvrx_lab.eks.spec import JobSpec

API = "kueue.x-k8s.io/v1beta1"
ORDER = ("cpu", "memory", "nvidia.com/gpu", "vpc.amazonaws.com/efa", "hugepages-2Mi", "ephemeral-storage")
UNITS = {"": 1, "m": 1e-3, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(value: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m|Mi|Gi|Ti)?", str(value))
    if m is None:
        raise ValueError(f"not a Kubernetes quantity this module reads: {value!r}")
    return float(m.group(1)) * UNITS[m.group(2) or ""]


def _total(value: str, nodes: int) -> str:
    """``value`` x ``nodes`` in ``value``'s unit."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m|Mi|Gi|Ti)?", str(value))
    if m is None:
        raise ValueError(f"not a Kubernetes quantity this module reads: {value!r}")
    number = float(m.group(1)) * nodes
    return f"{number:g}{m.group(2) or ''}"


def pod_requests(pod_spec: dict) -> dict[str, str]:
    """What Kueue counts for one pod: the containers' requests summed, or an init container's where larger (the init
    containers run one at a time, before)."""
    total: dict[str, float] = {}
    shown: dict[str, str] = {}
    for c in pod_spec["containers"]:
        for name, value in c.get("resources", {}).get("requests", {}).items():
            total[name] = total.get(name, 0.0) + quantity(value)
            shown[name] = value
    for c in pod_spec.get("initContainers", []):
        for name, value in c.get("resources", {}).get("requests", {}).items():
            if quantity(value) > total.get(name, 0.0):
                total[name], shown[name] = quantity(value), value
    return {name: shown[name] for name in sorted(shown, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))}


def kueue_objects(spec: JobSpec, pod_spec: dict, flavor: str = "p5") -> list[dict]:
    """The ResourceFlavor (the instance type's nodes), the ClusterQueue with quota for ``spec.nodes`` pods of
    ``pod_spec`` (x the replica groups), and the LocalQueue ``spec.queue_name`` in the job's namespace."""
    pods = spec.pods * spec.groups
    requests = pod_requests(pod_spec)
    cluster_queue = f"{spec.queue_name}-cluster"
    return [
        {"apiVersion": API, "kind": "ResourceFlavor", "metadata": {"name": flavor},
         "spec": {"nodeLabels": {"node.kubernetes.io/instance-type": spec.instance_type}}},
        {"apiVersion": API, "kind": "ClusterQueue", "metadata": {"name": cluster_queue},
         "spec": {"namespaceSelector": {}, "queueingStrategy": "BestEffortFIFO",
                  "resourceGroups": [{"coveredResources": list(requests), "flavors": [
                      {"name": flavor, "resources": [{"name": name, "nominalQuota": _total(value, pods)}
                                                     for name, value in requests.items()]}]}]}},
        {"apiVersion": API, "kind": "LocalQueue", "metadata": {"name": spec.queue_name, "namespace": spec.namespace},
         "spec": {"clusterQueue": cluster_queue}},
    ]
