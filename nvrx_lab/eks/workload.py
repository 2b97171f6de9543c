"""The job's top object through the Kubernetes API: an Indexed Job (``batch/v1``) or a JobSet (``jobset.x-k8s.io``).

``submit``, the watch and ``delete`` handle either the same way: :class:`Workload` creates it, reads whether it
ended, describes what it is doing and deletes it with its pods. A JobSet is a custom resource (the
``CustomObjectsApi``); its status says ``Completed`` where a Job's says ``Complete``, and counts its group
``restarts``.
"""

from __future__ import annotations

from typing import Any

import kubernetes.client
from kubernetes.client.rest import ApiException

from nvrx_lab.eks.spec import JobSpec

GROUP, VERSION, PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
CRD = f"{PLURAL}.{GROUP}"


def body(manifest: dict) -> Any:
    """``manifest`` as a request's body: every client since 30 takes an object's dict form, though 37's annotations
    name only its model (``V1Job``), which older clients cannot build from a dict (no ``model_validate``)."""
    return manifest


class Workload:
    """The Job or JobSet named like ``spec`` in its namespace (``kind``: ``Job`` or ``JobSet``, else ``spec``'s)."""

    def __init__(self, api: kubernetes.client.ApiClient, spec: JobSpec, kind: str | None = None):
        self.api, self.name, self.ns, self.nodes = api, spec.name, spec.namespace, spec.nodes
        self.kind = kind or ("JobSet" if spec.workload_kind == "jobset" else "Job")
        self.batch, self.custom = kubernetes.client.BatchV1Api(api), kubernetes.client.CustomObjectsApi(api)

    def create(self, manifest: dict) -> None:
        if self.kind == "Job":
            self.batch.create_namespaced_job(self.ns, body(manifest))
        else:
            self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, manifest)

    def status(self) -> dict | None:
        """Its ``status`` as a plain dict (camelCase keys), ``None`` when it does not exist or may not be read."""
        try:
            if self.kind == "Job":
                obj = self.batch.read_namespaced_job_status(self.name, self.ns)
                return self.api.sanitize_for_serialization(obj).get("status") or {}
            found = self.custom.get_namespaced_custom_object_status(GROUP, VERSION, self.ns, PLURAL, self.name)
            if not isinstance(found, dict):  # kubernetes annotates it "object": the API's JSON object
                raise TypeError(f"{self}: the API returned {type(found).__name__}, not a JSON object")
            return found.get("status") or {}
        except ApiException as exc:
            if exc.status in (403, 404):
                return None
            raise

    def ended(self) -> str | None:
        """``Succeeded`` or ``Failed`` once it ended, ``gone`` when it no longer exists (deleted by someone, or not
        readable), else ``None``."""
        st = self.status()
        if st is None:
            return "gone"
        conds = {c.get("type"): c.get("status") for c in st.get("conditions") or []}
        if conds.get("Complete") == "True" or conds.get("Completed") == "True" or (
                self.kind == "Job" and (st.get("succeeded") or 0) >= self.nodes):
            return "Succeeded"
        return "Failed" if conds.get("Failed") == "True" else None

    def describe(self) -> str:
        """What it is doing, for a message (``2 pods active, 0 succeeded, 1 failed``; a JobSet: ``1 group restart``);
        '' when it does not exist."""
        st = self.status()
        if st is None:
            return ""
        if self.kind == "Job":
            return f"{st.get('active') or 0} pods active, {st.get('succeeded') or 0} succeeded, {st.get('failed') or 0} failed"
        jobs = st.get("replicatedJobsStatus") or [{}]
        return (f"{jobs[0].get('active') or 0} child Jobs active, {st.get('restarts') or 0} group restarts")

    def delete(self, propagation: str = "Foreground") -> bool:
        """Delete it and (through ``propagation``) its pods; False when it was not there."""
        try:
            if self.kind == "Job":
                self.batch.delete_namespaced_job(self.name, self.ns, propagation_policy=propagation)
            else:
                self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.name,
                                                            propagation_policy=propagation)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def gone(self) -> bool:
        """Whether it no longer exists (404 on read)."""
        try:
            if self.kind == "Job":
                self.batch.read_namespaced_job(self.name, self.ns)
            else:
                self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.name)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    def __str__(self) -> str:
        return f"{self.kind} {self.ns}/{self.name}"
