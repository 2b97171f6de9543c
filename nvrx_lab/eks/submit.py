"""``submit(spec, cluster, region)``: render, validate, create or replace, watch, stream rank 0, report.

With ``dry_run=True`` (the default) nothing leaves the machine: the manifests are rendered and
validated and returned. Otherwise the objects are created in order (a Namespace, PersistentVolume
or claim that exists is left alone; a ConfigMap or Service is replaced; a Job, whose pod template
is immutable, is deleted and created again), the pods' phases are shown with a progress bar,
rank 0's log is streamed (following each replacement pod in the baseline modes) and the goodput
summary line is picked out of it. ``delete(spec, …)`` removes the Job, Service and ConfigMap.

The goodput summary is one log line of rank 0: ``GOODPUT {json}``, or a JSON event whose
``kind`` is ``goodput``. Every failure comes out as :class:`~nvrx_lab.eks.auth.EksError`.
"""

from __future__ import annotations

import collections
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import kubernetes.client
from kubernetes.client.rest import ApiException
from tqdm.auto import tqdm

from nvrx_lab.eks.auth import EksError, api_client, explain
from nvrx_lab.eks.render import CONTAINER, INDEX_ANNOTATION, render
from nvrx_lab.eks.spec import JobSpec
from nvrx_lab.eks.validate import validate

GOODPUT_PREFIX = "GOODPUT "


@dataclass
class SubmitResult:
    manifests: list[dict]
    """What was (or, in a dry run, would be) created."""
    status: str = "dry-run"
    """dry-run, submitted (not watched), Succeeded, Failed or timeout."""
    actions: list[str] = field(default_factory=list)
    """``created Job/x``, ``replaced Service/x``, ``exists Namespace/y`` …"""
    phases: dict[int, str] = field(default_factory=dict)
    """Last seen phase per completion index."""
    goodput: dict | None = None
    """The goodput summary rank 0 printed, if any."""
    log_tail: list[str] = field(default_factory=list)
    """The last lines of rank 0's log."""


def parse_goodput(line: str) -> dict | None:
    """The summary in ``line`` (``GOODPUT {json}`` or a ``{"kind": "goodput…", …}`` event), else ``None``."""
    text = line.strip()
    if text.startswith(GOODPUT_PREFIX):
        text = text[len(GOODPUT_PREFIX):]
    elif not (text.startswith("{") and '"goodput' in text):
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if isinstance(data, dict) and (line.strip().startswith(GOODPUT_PREFIX) or str(data.get("kind", "")).startswith("goodput")):
        return data
    return None


def _create_or_replace(api: kubernetes.client.ApiClient, m: dict, wait_s: float) -> str:
    core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
    kind, name, ns = m["kind"], m["metadata"]["name"], m["metadata"].get("namespace")
    create = {"Namespace": lambda: core.create_namespace(m),
              "PersistentVolume": lambda: core.create_persistent_volume(m),
              "PersistentVolumeClaim": lambda: core.create_namespaced_persistent_volume_claim(ns, m),
              "ConfigMap": lambda: core.create_namespaced_config_map(ns, m),
              "Service": lambda: core.create_namespaced_service(ns, m),
              "Job": lambda: batch.create_namespaced_job(ns, m)}[kind]
    try:
        create()
        return f"created {kind}/{name}"
    except ApiException as exc:
        if exc.status != 409:
            raise
    if kind in ("Namespace", "PersistentVolume", "PersistentVolumeClaim"):
        return f"exists {kind}/{name}"  # never replace storage that may hold checkpoints
    if kind == "ConfigMap":
        core.replace_namespaced_config_map(name, ns, m)
    elif kind == "Service":
        core.replace_namespaced_service(name, ns, m)
    else:  # a Job's template is immutable: delete it with its pods, wait until it is gone, create again
        _delete_job(batch, name, ns, wait_s)
        create()
    return f"replaced {kind}/{name}"


def _delete_job(batch: kubernetes.client.BatchV1Api, name: str, ns: str, wait_s: float) -> bool:
    try:
        batch.delete_namespaced_job(name, ns, propagation_policy="Foreground")
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            batch.read_namespaced_job(name, ns)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        time.sleep(min(1.0, wait_s / 20))
    raise EksError(f"Job {ns}/{name} still exists {wait_s:.0f} s after its deletion; try again later")


class _Rank0Log:
    """Follows rank 0's log in a thread, pod after pod (a replaced pod has a new name)."""

    def __init__(self, core: kubernetes.client.CoreV1Api, ns: str, echo: Callable[[str], None]):
        self.core, self.ns, self.echo = core, ns, echo
        self.tail: collections.deque[str] = collections.deque(maxlen=200)
        self.goodput: dict | None = None
        self.followed: set[str] = set()
        self.threads: list[threading.Thread] = []

    def follow(self, pod: str) -> None:
        if pod in self.followed:
            return
        self.followed.add(pod)
        t = threading.Thread(target=self._run, args=(pod,), daemon=True, name=f"log-{pod}")
        t.start()
        self.threads.append(t)

    def _run(self, pod: str) -> None:
        try:
            resp = self.core.read_namespaced_pod_log(pod, self.ns, container=CONTAINER, follow=True, _preload_content=False)
            buf = b""
            for chunk in resp.stream(4096):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for raw in lines:
                    self._line(raw.decode(errors="replace"))
            if buf:
                self._line(buf.decode(errors="replace"))
        except Exception as exc:  # noqa: BLE001 - a lost log stream must not end the watch
            self.tail.append(f"[log stream of {pod} ended: {type(exc).__name__}]")

    def _line(self, line: str) -> None:
        self.tail.append(line)
        self.echo(line)
        if (g := parse_goodput(line)) is not None:
            self.goodput = g

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)


def watch(api: kubernetes.client.ApiClient, spec: JobSpec, timeout_s: float, poll_s: float,
          echo: Callable[[str], None]) -> tuple[str, dict[int, str], _Rank0Log]:
    core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
    log = _Rank0Log(core, spec.namespace, echo)
    phases: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    status = "timeout"
    with tqdm(total=spec.nodes, desc=f"{spec.name} pods running", unit="pod") as bar:
        while time.monotonic() < deadline:
            pods = core.list_namespaced_pod(spec.namespace, label_selector=f"app.kubernetes.io/instance={spec.name}").items
            for pod in sorted(pods, key=lambda p: str(p.metadata.creation_timestamp or "")):
                index = int((pod.metadata.annotations or {}).get(INDEX_ANNOTATION, -1))
                phases[index] = pod.status.phase or "Pending"
                if index == 0 and phases[0] in ("Running", "Succeeded", "Failed"):
                    log.follow(pod.metadata.name)
            bar.n = sum(p in ("Running", "Succeeded") for i, p in phases.items() if i >= 0)
            bar.set_postfix_str(" ".join(f"{i}:{p}" for i, p in sorted(phases.items())), refresh=True)
            st = batch.read_namespaced_job_status(spec.name, spec.namespace).status
            conds = {c.type: c.status for c in (st.conditions or [])}
            if conds.get("Complete") == "True" or (st.succeeded or 0) >= spec.nodes:
                status = "Succeeded"
                break
            if conds.get("Failed") == "True":
                status = "Failed"
                break
            time.sleep(poll_s)
    log.join(timeout=max(1.0, min(30.0, deadline - time.monotonic())))
    return status, phases, log


def submit(spec: JobSpec, cluster: str, region: str, dry_run: bool = True, *, watch_job: bool = True,
           timeout_s: float = 6 * 3600, poll_s: float = 5.0, session=None, api_server: str | None = None,
           echo: Callable[[str], None] = print) -> SubmitResult:
    """Render and validate ``spec``; unless ``dry_run``, create it on ``cluster`` and watch it to the end."""
    manifests = render(spec)
    validate(manifests)
    result = SubmitResult(manifests)
    if dry_run:
        return result
    with _cluster_api(cluster, region, spec.namespace, session, api_server) as api:
        for m in manifests:
            result.actions.append(_create_or_replace(api, m, wait_s=min(300.0, timeout_s)))
        result.status = "submitted"
        if watch_job:
            result.status, result.phases, log = watch(api, spec, timeout_s, poll_s, echo)
            result.goodput, result.log_tail = log.goodput, list(log.tail)
    return result


@contextlib.contextmanager
def _cluster_api(cluster: str, region: str, namespace: str, session, api_server: str | None):
    """A Kubernetes API client for the cluster; any failure inside comes out as one clear EksError."""
    api = api_client(cluster, region, session=session, api_server=api_server)
    try:
        yield api
    except EksError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise explain(exc, cluster, region, namespace) from None
    finally:
        api.close()


def delete(spec: JobSpec, cluster: str, region: str, *, session=None, api_server: str | None = None,
           wait_s: float = 120.0) -> list[str]:
    """Delete the Job (with its pods), its Service and ConfigMap; storage and namespace stay."""
    done = []
    with _cluster_api(cluster, region, spec.namespace, session, api_server) as api:
        core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
        if _delete_job(batch, spec.name, spec.namespace, wait_s):
            done.append(f"deleted Job/{spec.name}")
        for kind, fn, name in (("Service", core.delete_namespaced_service, spec.name),
                               ("ConfigMap", core.delete_namespaced_config_map, f"{spec.name}-launcher")):
            try:
                fn(name, spec.namespace)
                done.append(f"deleted {kind}/{name}")
            except ApiException as exc:
                if exc.status != 404:
                    raise
    return done
