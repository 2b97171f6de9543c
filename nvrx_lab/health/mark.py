"""Mark a node that failed a health check on Kubernetes, so no pod of the job lands on it again.

A launcher that fails its checks exits 5 (:data:`~nvrx_lab.exit_codes.UNHEALTHY`) and the Job controller replaces the
pod; without a mark the scheduler may well put the replacement back on the same node (it still has free GPUs), and
the job loses another round to the same bad GPU or EFA port. Before it exits, the launcher marks its node through
the API (the pod's service account; RBAC rendered by :mod:`nvrx_lab.eks.rbac`):

* the label ``nvrx-lab/health=failed``, which the job's pods avoid (their node affinity: ``DoesNotExist``);
* the annotation ``nvrx-lab/health-failed``: the failed checks' evidence, for the operator who looks;
* the taint ``nvrx-lab/unhealthy:NoSchedule``: other GPU jobs stay off it too, until someone repairs the node and
  removes it (``kubectl taint node NODE nvrx-lab/unhealthy-``; ``kubectl label node NODE nvrx-lab/health-``).

Marking is best effort: a node that cannot be marked (no API, no permission) is said in one line and the launcher
still exits 5.
"""

from __future__ import annotations

from collections.abc import Sequence

LABEL = "nvrx-lab/health"
"""Set to ``failed`` on a node that failed a check; the pods' node affinity requires it absent."""
ANNOTATION = "nvrx-lab/health-failed"
TAINT = "nvrx-lab/unhealthy"


def api_client():
    """A client for the cluster this process runs in: the pod's service account, else ``$KUBECONFIG`` (tests)."""
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


def mark(node: str, failures: Sequence, client=None) -> str:
    """Label, annotate and taint ``node`` for ``failures`` (the failed :class:`~nvrx_lab.health.Verdict` s); returns
    the line to say, whether it worked or not."""
    try:
        import kubernetes

        core = kubernetes.client.CoreV1Api(client or api_client())
        spec = core.read_node(node).spec
        taints = (spec.taints if spec is not None else None) or []
        evidence = "; ".join(v.line() for v in failures)[:1000]
        body: dict = {"metadata": {"labels": {LABEL: "failed"}, "annotations": {ANNOTATION: evidence}}}
        if not any(t.key == TAINT for t in taints):
            body["spec"] = {"taints": [*(core.api_client.sanitize_for_serialization(t) for t in taints),
                                       {"key": TAINT, "value": "health-check", "effect": "NoSchedule"}]}
        core.patch_node(node, body)
    except Exception as exc:  # noqa: BLE001 - best effort: the exit code still takes the node out
        reason = getattr(exc, "reason", None) or str(exc).splitlines()[0][:200]
        return (f"health: could not mark node {node} ({type(exc).__name__}: {reason}): a replacement pod may land on it "
                "again; the pod's service account needs get and patch on nodes (rendered by nvrx_lab.eks)")
    return (f"health: marked node {node}: label {LABEL}=failed (this job's pods avoid it), taint {TAINT}:NoSchedule; "
            f"after repair: kubectl taint node {node} {TAINT}- && kubectl label node {node} {LABEL}-")
