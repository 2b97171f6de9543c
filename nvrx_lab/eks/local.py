"""``local_run(manifests)``: the pods of an Indexed Job (or a JobSet) as local processes, with the shipped command lines.

:func:`~nvrx_lab.eks.local_plan.plan` maps each completion index to one local process (pod DNS
names, Service ports, GPUs and volume paths, see :mod:`nvrx_lab.eks.local_plan`); this module runs
them as the controllers would:

* **Job** — a failed pod is started again as a new attempt until ``backoffLimit`` failures;
  ``podFailurePolicy`` exit-code rules hold (``FailJob`` ends the Job, ``Ignore`` does not count).
* **JobSet** — its child Job has ``backoffLimit: 0``: a counted failure fails it, and the JobSet recreates
  every pod at once (a new attempt each) up to ``failurePolicy.maxRestarts``; a child Job failed by its
  ``podFailurePolicy`` meets the JobSet's rules (``FailJobSet`` on ``PodFailurePolicy`` ends it).

``start_after_s`` delays the first attempt of some indexes, as pods of a real job start minutes apart
(image pulls): ``{0: 90}`` starts index 0 ninety seconds after the others.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from nvrx_lab.eks.jobset import failure_action, max_restarts
from nvrx_lab.eks.local_plan import LocalPod, LocalRun, plan, workload


def _action(job: dict, code: int) -> str:
    for rule in (job["spec"].get("podFailurePolicy") or {}).get("rules", []):
        on = rule.get("onExitCodes")
        if on and ((on["operator"] == "In") == (code in on["values"])):
            return rule["action"]
    return "Count"


def _kill(pod: LocalPod, grace_s: float = 5.0) -> None:
    if pod.proc is None or pod.proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pod.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            pod.proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


class _Controller:
    """The Job (and JobSet) controller's decisions about one failed pod, and the starts they lead to."""

    def __init__(self, run: LocalRun, job: dict, jobset: dict | None, logdir: Path):
        self.run, self.job, self.jobset, self.logdir = run, job, jobset, logdir
        self.backoff = 0 if jobset is not None else int(job["spec"].get("backoffLimit", 6))
        self.done: set[int] = set()

    def start(self, pod: LocalPod) -> None:
        path = self.logdir / f"{pod.hostname}-attempt{len(pod.logs)}.log"
        pod.logs.append(path)
        with path.open("wb") as out:
            pod.proc = subprocess.Popen(pod.argv, env=pod.env, cwd=self.run.workdir, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)

    def failed(self, pod: LocalPod, code: int) -> None:
        """Apply the rules to ``pod``'s exit ``code`` (non-zero): restart it, restart the group, or fail."""
        action = _action(self.job, code)
        if action == "Ignore":
            self.start(pod)
            return
        if action != "FailJob":
            self.run.failures += 1
            if self.run.failures <= self.backoff:
                self.start(pod)
                return
        if self.jobset is None:
            self.run.status = "Failed"
            return
        reason = "PodFailurePolicy" if action == "FailJob" else "BackoffLimitExceeded"
        if failure_action(self.jobset, reason) == "FailJobSet" or self.run.group_restarts >= max_restarts(self.jobset):
            self.run.status = "Failed"
            return
        self.run.group_restarts += 1  # Recreate: every pod of the child Job goes, then all come back
        for other in self.run.pods:
            _kill(other)
        self.done.clear()
        for other in self.run.pods:
            self.start(other)


def local_run(manifests: list[dict], *, workdir: str | Path | None = None, max_procs_per_node: int = 1,
              timeout_s: float = 300.0, secrets: dict[tuple[str, str], str] | None = None, max_nodes: int = 4,
              extra_env: dict[str, str] | None = None, poll_s: float = 0.1,
              start_after_s: dict[int, float] | None = None) -> LocalRun:
    """Run the Indexed Job (or JobSet) of ``manifests`` locally (see the module docstring); returns when it ends."""
    job, jobset = workload(manifests)
    if int(job["spec"]["completions"]) > max_nodes:
        raise ValueError(f"Job/{job['metadata']['name']}: {job['spec']['completions']} nodes > max_nodes={max_nodes}; "
                         "render with fewer nodes for a local run")
    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"local-{job['metadata']['name']}-"))
    run = plan(manifests, workdir, max_procs_per_node, secrets, extra_env)
    logdir = workdir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    ctl = _Controller(run, job, jobset, logdir)
    t0 = time.monotonic()
    pending = {p.index: t0 + (start_after_s or {}).get(p.index, 0.0) for p in run.pods}
    try:
        while time.monotonic() - t0 < timeout_s:
            for pod in run.pods:
                if pod.index in pending and time.monotonic() >= pending[pod.index]:
                    del pending[pod.index]
                    ctl.start(pod)
                if pod.index in ctl.done or pod.proc is None or (code := pod.proc.poll()) is None:
                    continue
                pod.returncodes.append(code)
                if code == 0:
                    ctl.done.add(pod.index)
                else:
                    ctl.failed(pod, code)
                if run.status == "Failed":
                    break
            if run.status == "Failed" or len(ctl.done) == len(run.pods):
                break
            time.sleep(poll_s)
        if run.status != "Failed":
            run.status = "Succeeded" if len(ctl.done) == len(run.pods) else "timeout"
    finally:
        for pod in run.pods:
            _kill(pod)
        run.wall_s = time.monotonic() - t0
    return run


__all__ = ["LocalPod", "LocalRun", "local_run", "plan"]
