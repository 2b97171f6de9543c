"""``local_run(manifests)``: the pods of an Indexed Job as local processes, with the shipped command lines.

:func:`~nvrx_lab.eks.local_plan.plan` maps each completion index to one local process (pod DNS
names, Service ports, GPUs and volume paths, see :mod:`nvrx_lab.eks.local_plan`); this module runs
them as the Job controller would: a failed pod is started again as a new attempt until
``backoffLimit`` failures, and ``podFailurePolicy`` exit-code rules (``FailJob``, ``Ignore``) hold.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from nvrx_lab.eks.local_plan import LocalPod, LocalRun, _one, plan


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


def local_run(manifests: list[dict], *, workdir: str | Path | None = None, max_procs_per_node: int = 1,
              timeout_s: float = 300.0, secrets: dict[tuple[str, str], str] | None = None, max_nodes: int = 4,
              extra_env: dict[str, str] | None = None, poll_s: float = 0.1) -> LocalRun:
    """Run the Indexed Job of ``manifests`` locally (see the module docstring); returns when it ends."""
    job = _one(manifests, "Job")
    if int(job["spec"]["completions"]) > max_nodes:
        raise ValueError(f"Job/{job['metadata']['name']}: {job['spec']['completions']} nodes > max_nodes={max_nodes}; "
                         "render with fewer nodes for a local run")
    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"local-{job['metadata']['name']}-"))
    run = plan(manifests, workdir, max_procs_per_node, secrets, extra_env)
    logdir = workdir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    backoff = int(job["spec"].get("backoffLimit", 6))

    def start(pod: LocalPod) -> None:
        path = logdir / f"{pod.hostname}-attempt{len(pod.logs)}.log"
        pod.logs.append(path)
        with path.open("wb") as out:
            pod.proc = subprocess.Popen(pod.argv, env=pod.env, cwd=workdir, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)

    t0 = time.monotonic()
    done: set[int] = set()
    try:
        for pod in run.pods:
            start(pod)
        while time.monotonic() - t0 < timeout_s:
            for pod in run.pods:
                if pod.index in done or pod.proc is None or (code := pod.proc.poll()) is None:
                    continue
                pod.returncodes.append(code)
                if code == 0:
                    done.add(pod.index)
                    continue
                action = _action(job, code)
                if action == "FailJob":
                    run.status = "Failed"
                elif action != "Ignore":
                    run.failures += 1
                    if run.failures > backoff:
                        run.status = "Failed"
                if run.status == "Failed":
                    break
                start(pod)
            if run.status == "Failed" or len(done) == len(run.pods):
                break
            time.sleep(poll_s)
        if run.status != "Failed":
            run.status = "Succeeded" if len(done) == len(run.pods) else "timeout"
    finally:
        for pod in run.pods:
            _kill(pod)
        run.wall_s = time.monotonic() - t0
    return run


__all__ = ["LocalPod", "LocalRun", "local_run", "plan"]
