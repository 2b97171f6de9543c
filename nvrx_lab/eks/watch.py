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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import kubernetes.client
from tqdm.auto import tqdm

from nvrx_lab.eks.render import CONTAINER, INDEX_ANNOTATION
from nvrx_lab.eks.spec import JobSpec
from nvrx_lab.eks.workload import Workload
from nvrx_lab.net import wait_for

if TYPE_CHECKING:
    from urllib3 import BaseHTTPResponse

GOODPUT_PREFIX = "GOODPUT "


@dataclass(frozen=True)
class Watch:
    """Following a submitted Job (JobSet) to its end."""

    timeout_s: float = 6 * 3600
    """Stop watching after this many seconds (status ``timeout``; the Job runs on)."""
    poll_s: float = 5.0
    """Seconds between two looks at the pods and the Job."""
    stuck_s: float = 600.0
    """A pod held back this long by a cause that does not clear by itself (an image that does not pull, a volume that
    does not mount, a pod that does not schedule: :data:`STUCK`) ends the run: the Job is deleted so its nodes are
    released (status ``stuck``)."""
    max_evictions: int = 3
    """Pods the kubelet may evict (memory, ``/dev/shm`` or ephemeral storage over a limit) before the run ends (status
    ``evicted``): the rendered ``podFailurePolicy`` ignores ``DisruptionTarget`` so a lost node costs no retry, which
    also makes an eviction free, and a pod that outgrows its limit would be evicted and recreated forever."""


WATCH = Watch()
"""The default: up to 6 hours, a look every 5 s."""


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
            # kubernetes annotates "-> str"; with _preload_content=False it returns urllib3's response, unread
            resp = cast("BaseHTTPResponse", self.core.read_namespaced_pod_log(pod, self.ns, container=CONTAINER, follow=True,
                                                                              _preload_content=False))
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


def _report_waiting(pods: dict[int, Any], waiting: dict[int, str], say: Callable[[str], None], core=None,
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


def _look(core, top: Workload, spec: JobSpec, seen: _Seen, log: _Rank0Log, bar) -> str | None:
    """One look at the pods (phases, why they wait, evictions, rank 0's log) and the Job or JobSet: ``Succeeded`` or
    ``Failed`` once it ended."""
    pods = core.list_namespaced_pod(spec.namespace, label_selector=f"app.kubernetes.io/instance={spec.name}").items
    latest = {}
    for pod in sorted(pods, key=lambda p: str(p.metadata.creation_timestamp or "")):
        index = int((pod.metadata.annotations or {}).get(INDEX_ANNOTATION, -1))
        seen.phases[index], latest[index] = pod.status.phase or "Pending", pod
        if index == 0 and seen.phases[0] in ("Running", "Succeeded", "Failed"):
            log.follow(pod.metadata.name)
        seen.eviction(index, pod)
    _report_waiting(latest, seen.waiting, tqdm.write, core, spec.namespace)
    bar.n = sum(p in ("Running", "Succeeded") for i, p in seen.phases.items() if i >= 0)
    bar.set_postfix_str(" ".join(f"{i}:{p}" for i, p in sorted(seen.phases.items())), refresh=True)
    return top.ended()


def evicted(pod) -> str:
    """Why the kubelet evicted ``pod`` (``The node was low on resource: ephemeral-storage. …``), or '' if it did not:
    phase Failed with reason ``Evicted``, or the condition ``DisruptionTarget`` with reason ``TerminationByKubelet``."""
    st = pod.status
    if st.reason == "Evicted":
        return st.message or "Evicted"
    for c in st.conditions or []:
        if c.type == "DisruptionTarget" and c.status == "True" and c.reason == "TerminationByKubelet":
            return c.message or c.reason
    return ""


class _Seen:
    """What the watch has seen: each index's phase and why it waits, since when a :data:`STUCK` reason holds it back,
    and the pods the kubelet evicted (each said once). Once an index has been stuck for ``stuck_s``, or more than
    ``max_evictions`` pods were evicted, :meth:`verdict` ends the run."""

    def __init__(self, settings: Watch, waiting: dict[int, str], echo: Callable[[str], None]):
        self.settings, self.waiting, self.echo = settings, waiting, echo
        self.phases: dict[int, str] = {}
        self.since: dict[int, float] = {}
        self.evictions: dict[str, str] = {}

    def eviction(self, index: int, pod) -> None:
        if pod.metadata.name not in self.evictions and (why := evicted(pod)):
            self.evictions[pod.metadata.name] = why
            self.echo(f"evicted (index {index}, pod {pod.metadata.name}, {len(self.evictions)} of at most "
                      f"{self.settings.max_evictions}): {why}")

    def verdict(self) -> str | None:
        if len(self.evictions) > self.settings.max_evictions:
            return (f"evicted: {len(self.evictions)} pods evicted by the kubelet (more than Watch.max_evictions="
                    f"{self.settings.max_evictions}; the last: {list(self.evictions.values())[-1]})")
        now = time.monotonic()
        stuck = {i: r for i, r in self.waiting.items() if r.split(":")[0] in STUCK}
        self.since = {i: self.since.get(i, now) for i in stuck}
        late = sorted(i for i, t in self.since.items() if now - t >= self.settings.stuck_s)
        return f"stuck: index {late[0]}: {stuck[late[0]]} for {self.settings.stuck_s:g} s" if late else None


def watch(api: kubernetes.client.ApiClient, spec: JobSpec, settings: Watch, echo: Callable[[str], None],
          waiting: dict[int, str] | None = None) -> tuple[str, dict[int, str], _Rank0Log]:
    """Follow the Job (JobSet) of ``spec`` as ``settings`` say until it ends (status ``timeout`` when it has not):
    (its status, each index's phase, rank 0's log). A pod held back by a :data:`STUCK` reason for too long (status
    ``stuck``), or too many evictions (status ``evicted``), end it: the Job is deleted, so the nodes it holds are
    released, and one line says why."""
    core, top = kubernetes.client.CoreV1Api(api), Workload(api, spec)
    log = _Rank0Log(core, spec.namespace, echo)
    seen = _Seen(settings, {} if waiting is None else waiting, echo)
    deadline = time.monotonic() + settings.timeout_s
    why: list[str] = []  # what verdict() said, when it ended the run

    def look() -> str:
        """How the run ended (``Succeeded``, ``Failed``, ``stuck``, ``evicted``), or '' while it has not."""
        if (ended := _look(core, top, spec, seen, log, bar)) is None and (cause := seen.verdict()):
            why.append(cause)
            return cause.split(":")[0]
        return ended or ""

    with tqdm(total=spec.pods, desc=f"{spec.name} pods running", unit="pod") as bar:
        try:
            status = wait_for(look, settings.timeout_s, f"{top} to end", interval=settings.poll_s)
        except TimeoutError:
            status = "timeout"
    if status in ("stuck", "evicted"):
        top.delete("Background")
        echo(f"{why[0]}; deleted {top.kind}/{spec.name} and its pods so the nodes are released (fix the cause and submit "
             "again)")
    log.join(timeout=max(1.0, min(30.0, deadline - time.monotonic())))
    return status, seen.phases, log
