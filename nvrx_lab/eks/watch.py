"""``watch(api, spec, …)``: a submitted job's pods to the end, why they wait, rank 0's log and its goodput.

The pods' phases drive a progress bar; a pod that waits says why once per new reason (its false
condition, e.g. ``Unschedulable: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu``, or its
container's waiting reason, e.g. ``ErrImagePull``). Rank 0's log is followed in a thread, pod after pod
(a replaced pod has a new name), and the goodput summary is picked out of it: one log line
``GOODPUT {json}``, or a JSON event whose ``kind`` is ``goodput``.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable

import kubernetes.client
from tqdm.auto import tqdm

from nvrx_lab.eks.render import CONTAINER, INDEX_ANNOTATION
from nvrx_lab.eks.spec import JobSpec
from nvrx_lab.net import wait_for

GOODPUT_PREFIX = "GOODPUT "


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


def waiting_reason(pod) -> str:
    """Why a pod is not running yet: the scheduler's verdict (``PodScheduled`` false: ``Unschedulable: …``) or a
    container's waiting reason (``ErrImagePull``, ``CreateContainerConfigError`` …); '' when it says nothing."""
    st = pod.status
    for c in st.conditions or []:
        if c.type == "PodScheduled" and c.status == "False":
            return f"{c.reason or 'NotScheduled'}: {c.message}" if c.message else (c.reason or "NotScheduled")
    for cs in [*(st.init_container_statuses or []), *(st.container_statuses or [])]:
        w = cs.state.waiting if cs.state else None
        if w and w.reason:
            return f"{w.reason}: {w.message}" if w.message else w.reason
    return ""


STUCK = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError", "CreateContainerError",
         "Unschedulable", "FailedMount", "FailedAttachVolume", "FailedScheduling")
"""Reasons a pod waits that do not clear by themselves: after :attr:`~nvrx_lab.eks.submit.Watch.stuck_s` the run ends."""
EVENT_REASONS = ("FailedMount", "FailedAttachVolume", "FailedScheduling")
"""Why a pod is held back that only its Events say (a pod in ``ContainerCreating`` whose volume does not mount)."""


def event_reason(core, namespace: str, pod) -> str:
    """The newest Warning Event of ``pod`` among :data:`EVENT_REASONS` (``FailedMount: …``), or ''."""
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod.metadata.name}")
    warned = [e for e in events.items if e.type == "Warning" and e.reason in EVENT_REASONS
              and e.involved_object.name == pod.metadata.name]
    newest = max(warned, key=lambda e: str(e.last_timestamp or e.event_time or ""), default=None)
    return f"{newest.reason}: {newest.message}" if newest else ""


def _report_waiting(pods: dict[int, object], waiting: dict[int, str], say: Callable[[str], None], core=None,
                    namespace: str = "") -> None:
    """Update ``waiting`` from pending ``pods``; say each new reason once, with the indexes it holds back."""
    fresh: dict[str, list[int]] = {}
    for index, pod in sorted(pods.items()):
        pending = pod.status.phase in (None, "Pending")
        reason = waiting_reason(pod) if pending else ""
        if pending and core is not None and (not reason or reason.startswith("ContainerCreating")):
            reason = event_reason(core, namespace, pod) or reason
        if reason and waiting.get(index) != reason:
            fresh.setdefault(reason, []).append(index)
        if reason:
            waiting[index] = reason
        else:
            waiting.pop(index, None)
    for reason, indexes in fresh.items():
        say(f"pending (index {', '.join(map(str, indexes))}): {reason}")


def _look(core, batch, spec: JobSpec, phases: dict[int, str], waiting: dict[int, str], log: _Rank0Log, bar) -> str | None:
    """One look at the pods (phases, why they wait, rank 0's log) and the Job: ``Succeeded``/``Failed`` once it ended."""
    pods = core.list_namespaced_pod(spec.namespace, label_selector=f"app.kubernetes.io/instance={spec.name}").items
    latest = {}
    for pod in sorted(pods, key=lambda p: str(p.metadata.creation_timestamp or "")):
        index = int((pod.metadata.annotations or {}).get(INDEX_ANNOTATION, -1))
        phases[index], latest[index] = pod.status.phase or "Pending", pod
        if index == 0 and phases[0] in ("Running", "Succeeded", "Failed"):
            log.follow(pod.metadata.name)
    _report_waiting(latest, waiting, tqdm.write, core, spec.namespace)
    bar.n = sum(p in ("Running", "Succeeded") for i, p in phases.items() if i >= 0)
    bar.set_postfix_str(" ".join(f"{i}:{p}" for i, p in sorted(phases.items())), refresh=True)
    st = batch.read_namespaced_job_status(spec.name, spec.namespace).status
    conds = {c.type: c.status for c in (st.conditions or [])}
    if conds.get("Complete") == "True" or (st.succeeded or 0) >= spec.nodes:
        return "Succeeded"
    return "Failed" if conds.get("Failed") == "True" else None


class _Stuck:
    """Since when each index has waited for a :data:`STUCK` reason; once one has for ``stuck_s``, the run is stuck."""

    def __init__(self, stuck_s: float):
        self.stuck_s, self.since = stuck_s, {}

    def verdict(self, waiting: dict[int, str]) -> str | None:
        now = time.monotonic()
        stuck = {i: r for i, r in waiting.items() if r.split(":")[0] in STUCK}
        self.since = {i: self.since.get(i, now) for i in stuck}
        late = sorted(i for i, t in self.since.items() if now - t >= self.stuck_s)
        return f"index {late[0]}: {stuck[late[0]]}" if late else None


def watch(api: kubernetes.client.ApiClient, spec: JobSpec, timeout_s: float, poll_s: float,
          echo: Callable[[str], None], waiting: dict[int, str] | None = None,
          stuck_s: float = float("inf")) -> tuple[str, dict[int, str], _Rank0Log]:
    """Follow the Job of ``spec`` until it ends or ``timeout_s`` passes (status ``timeout``), a look every ``poll_s``:
    (its status, each index's phase, rank 0's log). A pod held back for ``stuck_s`` by a :data:`STUCK` reason ends
    it (status ``stuck``): the Job is deleted, so the nodes it holds are released, and one line says why."""
    core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
    log = _Rank0Log(core, spec.namespace, echo)
    phases: dict[int, str] = {}
    waiting = {} if waiting is None else waiting
    deadline, stuck, why = time.monotonic() + timeout_s, _Stuck(stuck_s), []

    def look() -> str | None:
        if (ended := _look(core, batch, spec, phases, waiting, log, bar)) is None and (cause := stuck.verdict(waiting)):
            why.append(cause)
            return "stuck"
        return ended

    with tqdm(total=spec.nodes, desc=f"{spec.name} pods running", unit="pod") as bar:
        try:
            status = wait_for(look, timeout_s, f"Job/{spec.name} to end", interval=poll_s)
        except TimeoutError:
            status = "timeout"
    if status == "stuck":
        batch.delete_namespaced_job(spec.name, spec.namespace, propagation_policy="Background")
        echo(f"stuck: {why[0]} for {stuck_s:g} s; deleted Job/{spec.name} and its pods so the nodes are released "
             "(fix the cause and submit again)")
    log.join(timeout=max(1.0, min(30.0, deadline - time.monotonic())))
    return status, phases, log
