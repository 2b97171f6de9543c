"""``LocalJob``: the pods of an Indexed Job (or a JobSet) as local processes, under the Job controller's rules.

:func:`~nvrx_lab.eks.local_plan.plan` maps each completion index to one local process (pod DNS
names, Service ports, GPUs and volume paths, see :mod:`nvrx_lab.eks.local_plan`); :class:`LocalJob` runs
them as the controllers would:

* **Job** — a failed pod is started again as a new attempt until ``backoffLimit`` failures;
  ``podFailurePolicy`` exit-code rules hold (``FailJob`` ends the Job, ``Ignore`` does not count).
* **JobSet** — its child Job has ``backoffLimit: 0``: a counted failure fails it, and the JobSet recreates
  every pod at once (a new attempt each, once every old one has stopped: ``BlockingRecreate``, event ``stopped``) up
  to ``failurePolicy.maxRestarts``; a child Job failed by its
  ``podFailurePolicy`` meets the JobSet's rules (``FailJobSet`` on ``PodFailurePolicy`` ends it).
* **A lost node** (:meth:`LocalJob.lose_node`) — the pod's whole process tree SIGKILLed at once, the node's
  own folders wiped, and the pod judged as one whose node is gone (the condition ``DisruptionTarget``: the
  rendered policy ``Ignore``s it, so a replacement starts at the same index and no failure is counted).

:func:`~nvrx_lab.eks.local.local_run` runs the Job to its end. A :class:`LocalJob` hands control back after each pass of the
controller (:meth:`LocalJob.poll`), so a benchmark can watch the event stream and strike at a chosen step;
every start, exit and lost node is a :class:`~nvrx_lab.eks.local_pods.PodEvent` in ``run.events``.
The settings are one :class:`LocalOptions`; ``start_after_s`` delays the first attempt of some indexes, as pods
of a real job start minutes apart (image pulls): ``{0: 90}`` starts index 0 ninety seconds after the others.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from nvrx_lab.eks.jobset import failure_action, max_restarts
from nvrx_lab.eks.local_plan import plan, workload
from nvrx_lab.eks.local_pods import LocalPod, LocalRun, PodEvent

OVER = ("Succeeded", "Failed")


@dataclass(frozen=True)
class LocalOptions:
    """How this machine runs a Job's pods: :func:`local_run`'s settings, small by default."""

    workdir: str | Path | None = None
    """The pods' volumes, logs and ``python`` shim; ``None``: a new temporary folder."""
    max_procs_per_node: int = 1
    """CPU worker processes that a pod's GPUs become (``NPROC_PER_NODE``)."""
    secrets: Mapping[tuple[str, str], str] = field(default_factory=dict)
    """``(Secret, key) -> value`` for the pods' ``secretKeyRef`` variables; none of this machine's are passed."""
    extra_env: Mapping[str, str] = field(default_factory=dict)
    """Variables set in every pod, over the manifest's (a benchmark's process tag)."""
    host_env: Mapping[str, str] = field(default_factory=dict)
    """This machine's variables every pod starts with, under the image's and the manifest's; none by default, as a
    pod gets none of its node's (pass this process's environment where its interpreter needs some of it to start)."""
    max_nodes: int = 4
    """More completions than this are refused: render with fewer nodes for a local run."""
    timeout_s: float = 300.0
    """:func:`local_run` stops the pods after this long (status ``timeout``)."""
    poll_s: float = 0.1
    """Seconds between two passes of the controller."""
    start_after_s: Mapping[int, float] = field(default_factory=dict)
    """Completion index -> seconds its first attempt starts after the others'."""
    grace_s: float = 5.0
    """A pod's time between SIGTERM and SIGKILL when the Job ends or a JobSet recreates it."""
    pod_env: Mapping[int, Mapping[str, str]] = field(default_factory=dict)
    """Completion index -> variables of that pod alone, over the manifest's: what differs between nodes (a node's own
    ``$NVRX_LAB_HEALTH_SYSFS`` tree, as each EKS node has its own ``/sys``)."""
    replace_after_s: float = 0.0
    """Seconds before the pod that replaces one whose node was lost starts (on EKS: placed on another node, the
    image pulled or cached, the container started: tens of seconds to minutes); 0: at once."""


def kill_tree(root: int | psutil.Process) -> list[psutil.Process]:
    """SIGKILL ``root`` and all its descendants at once (snapshot first, so none escapes by reparenting)."""
    try:
        proc = root if isinstance(root, psutil.Process) else psutil.Process(root)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    return procs


def _signal_group(proc: subprocess.Popen, sig: int) -> bool:
    try:
        os.killpg(proc.pid, sig)
        return True
    except ProcessLookupError:
        return False


def _stop(proc: subprocess.Popen, grace_s: float) -> int | None:
    """End a pod's attempt: SIGTERM to its process group, SIGKILL after ``grace_s``; ``0``: its node is gone, every
    process under it and in its group SIGKILLed at once. Returns its exit code (``None``: still there after 10 s)."""
    if proc.poll() is not None:
        return proc.returncode
    if grace_s > 0 and _signal_group(proc, signal.SIGTERM):
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(grace_s)
    if grace_s == 0:
        kill_tree(proc.pid)
    _signal_group(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        return proc.wait(10)
    return None


def _action(job: dict, code: int, conditions: Iterable[str] = ()) -> str:
    """The ``podFailurePolicy`` action for a pod that failed with ``code`` and ``conditions``: the first rule that
    matches either, else ``Count``."""
    conditions = set(conditions)
    for rule in (job["spec"].get("podFailurePolicy") or {}).get("rules", []):
        on = rule.get("onExitCodes")
        if on and ((on["operator"] == "In") == (code in on["values"])):
            return rule["action"]
        if any(c["type"] in conditions and c.get("status", "True") == "True" for c in rule.get("onPodConditions", [])):
            return rule["action"]
    return "Count"


class LocalJob:
    """The pods of ``manifests`` under the Job (and JobSet) controller's rules, one :meth:`poll` at a time; a context
    manager: entering starts the pods, leaving stops whatever still runs. ``services``: other Services its pods dial,
    name -> {port: local port} (the replicas mode's coordinator), see :func:`~nvrx_lab.eks.local_plan.plan`."""

    def __init__(self, manifests: list[dict], options: LocalOptions | None = None, *,
                 services: Mapping[str, Mapping[int, int]] | None = None):
        self.options = o = options or LocalOptions()
        self.job, self.jobset = workload(manifests)
        self.name = self.job["metadata"]["name"]
        if int(self.job["spec"]["completions"]) > o.max_nodes:
            raise ValueError(f"Job/{self.name}: {self.job['spec']['completions']} nodes > max_nodes={o.max_nodes}; "
                             "render with fewer nodes for a local run")
        workdir = Path(o.workdir or tempfile.mkdtemp(prefix=f"local-{self.name}-"))
        self.run: LocalRun = plan(manifests, workdir, o.max_procs_per_node, o.secrets, o.extra_env, o.host_env, services)
        for pod in self.run.pods:
            pod.env.update(o.pod_env.get(pod.index, {}))
        self.logdir = workdir / "logs"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.backoff = 0 if self.jobset is not None else int(self.job["spec"].get("backoffLimit", 6))
        rules = (self.job["spec"].get("successPolicy") or {}).get("rules") or [{}]
        self.succeeded_count = int(rules[0].get("succeededCount", len(self.run.pods)))
        """Indexes that must succeed (``successPolicy``'s ``succeededCount``, else all): then the Job has succeeded."""
        self.done: set[int] = set()
        """Indexes whose last attempt exited 0."""
        self.pending: dict[int, float] = {}
        """Index -> monotonic time its first attempt is due."""
        self.t0 = time.monotonic()
        self.closed = False

    def __enter__(self) -> LocalJob:
        self.t0 = time.monotonic()
        self.pending = {p.index: self.t0 + self.options.start_after_s.get(p.index, 0.0) for p in self.run.pods}
        self.poll()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def poll(self) -> bool:
        """One pass: start the pods that are due, judge those that exited; True once the Job is over
        (``run.status`` ``Succeeded`` or ``Failed``)."""
        run = self.run
        for pod in run.pods:
            if run.status in OVER:
                break
            if pod.index in self.pending and time.monotonic() >= self.pending[pod.index]:
                del self.pending[pod.index]
                self._start(pod)
            if pod.index in self.done or pod.proc is None or (code := pod.proc.poll()) is None:
                continue
            pod.returncodes.append(code)
            self._event(pod, "exit", code)
            if code == 0:
                self.done.add(pod.index)
            else:
                self._failed(pod, code)
        if run.status not in OVER and len(self.done) >= self.succeeded_count:
            run.status = "Succeeded"
            for pod in run.pods:  # successPolicy met: the pods still running (hot spares) are stopped
                if pod.index not in self.done and pod.proc is not None and pod.proc.poll() is None:
                    self._event(pod, "stopped", _stop(pod.proc, self.options.grace_s))
        return run.status in OVER

    def lose_node(self, index: int, wipe: Iterable[str | Path] = ()) -> float:
        """Lose the node of pod ``index``: its process tree SIGKILLed at once, the node's folders ``wipe`` (its
        memory) removed, then the pod judged as one whose node is gone (see the module docs). Returns the kill's
        wall time. A pod that is done, or not started yet, loses nothing."""
        pod, t = self.run.pods[index], time.time()
        if pod.proc is None or index in self.done or self.run.status in OVER:
            return t
        code = _stop(pod.proc, grace_s=0)
        for path in wipe:
            shutil.rmtree(path, ignore_errors=True)
        pod.returncodes.append(-signal.SIGKILL if code is None else code)
        self._event(pod, "node-lost", pod.returncodes[-1], t)
        self._failed(pod, pod.returncodes[-1], conditions=("DisruptionTarget",))
        return t

    def close(self, grace_s: float | None = None) -> LocalRun:
        """Stop every pod still running (``grace_s``: the options' by default, ``0`` kills each whole process tree at
        once); a Job not over by then has status ``timeout``. Returns the run."""
        if not self.closed:
            self.closed = True
            for pod in self.run.pods:
                if pod.proc is not None:
                    _stop(pod.proc, self.options.grace_s if grace_s is None else grace_s)
            if self.run.status not in OVER:
                self.run.status = "timeout"
            self.run.wall_s = time.monotonic() - self.t0
        return self.run

    def _event(self, pod: LocalPod, kind: str, code: int | None = None, t: float | None = None) -> None:
        self.run.events.append(PodEvent(time.time() if t is None else t, pod.index, kind, len(pod.logs) - 1, code))

    def _start(self, pod: LocalPod) -> None:
        path = self.logdir / f"{pod.hostname}-attempt{len(pod.logs)}.log"
        pod.logs.append(path)
        with path.open("wb") as out:
            pod.proc = subprocess.Popen(pod.argv, env=pod.env, cwd=self.run.workdir, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        self._event(pod, "start")

    def _failed(self, pod: LocalPod, code: int, conditions: Iterable[str] = ()) -> None:
        """Apply the rules to ``pod``'s failure: start it again, recreate the group, or fail the Job."""
        run, action = self.run, _action(self.job, code, conditions)
        if action == "Ignore":
            if "DisruptionTarget" in conditions and self.options.replace_after_s > 0:  # placed on another node first
                pod.proc, self.pending[pod.index] = None, time.monotonic() + self.options.replace_after_s
                return
            self._start(pod)
            return
        if action != "FailJob":
            run.failures += 1
            if run.failures <= self.backoff:
                self._start(pod)
                return
        reason = "PodFailurePolicy" if action == "FailJob" else "BackoffLimitExceeded"
        if self.jobset is None:
            run.status, run.reason = "Failed", reason
            return
        if failure_action(self.jobset, reason) == "FailJobSet":
            run.status, run.reason = "Failed", f"FailJobSet on {reason}"
            return
        if run.group_restarts >= max_restarts(self.jobset):
            run.status, run.reason = "Failed", f"MaxRestarts after {reason}"
            return
        run.group_restarts += 1  # BlockingRecreate: every pod of the child Job is gone before any comes back
        for other in run.pods:
            if other.proc is not None and other.proc.poll() is None:
                self._event(other, "stopped", _stop(other.proc, self.options.grace_s))
        self.done.clear()
        self.pending.clear()
        for other in run.pods:
            self._start(other)


__all__ = ["OVER", "LocalJob", "LocalOptions", "kill_tree"]
