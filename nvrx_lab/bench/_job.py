"""A local Indexed Job that a benchmark can hurt: the pods of :func:`nvrx_lab.eks.local_plan.plan` (the rendered
container script, ports and paths mapped to this machine) started as process trees, failed pods started again
as the Job controller does, and whole nodes lost on purpose (:meth:`NodeJob.lose_node`: the pod's agent and
everything under it SIGKILLed, then a replacement pod with the same completion index started).

:func:`nvrx_lab.eks.local.local_run` runs a Job to its end; this one hands control back between polls, so a
benchmark can watch the event stream and strike at a chosen step. Every process of the Job carries one
:mod:`nvrx_lab.bench._procs` tag; :meth:`NodeJob.close` kills what is left and names what survived.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from nvrx_lab.bench._procs import TAG_VAR, kill_tree, leftovers, new_tag
from nvrx_lab.eks.local_plan import LocalPod, plan


class JobFailed(RuntimeError):
    """More pod failures than the Job's ``backoffLimit``, or its time limit passed."""


class NodeJob:
    """The pods of ``manifests`` as local processes; use as a context manager (everything is killed on exit)."""

    def __init__(self, manifests: list[dict], workdir: str | Path, nproc: int, timeout_s: float, rdzv_conf: str = ""):
        """``rdzv_conf``: c10d settings put before the script's own ``--rdzv-conf`` values, e.g.
        ``keep_alive_interval=1`` (a dead node leaves the rendezvous after 3 s, not torch's 15 s: short tests)."""
        self.tag = new_tag("nodes")
        self.run = plan(manifests, workdir, max_procs_per_node=nproc, extra_env={TAG_VAR: self.tag})
        for pod in self.run.pods if rdzv_conf else ():
            if not any('--rdzv-conf="' in arg for arg in pod.argv):
                raise ValueError("rdzv_conf: the Job's script has no --rdzv-conf (a mode without the launcher)")
            pod.argv = [arg.replace('--rdzv-conf="', f'--rdzv-conf="{rdzv_conf},') for arg in pod.argv]
        job = next(m for m in manifests if m.get("kind") == "Job")
        self.backoff = int(job["spec"].get("backoffLimit", 6))
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.pod_failures = 0
        """Pods that failed by themselves (a lost node's kill is not counted) and were started again."""
        self.lost: list[tuple[int, float]] = []
        """(completion index, wall time) of every node lost on purpose."""
        self.left: list[str] = []
        (self.run.workdir / "logs").mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> NodeJob:
        for pod in self.run.pods:
            self._start(pod)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self, pod: LocalPod) -> None:
        path = self.run.workdir / "logs" / f"{pod.hostname}-attempt{len(pod.logs)}.log"
        pod.logs.append(path)
        with path.open("wb") as out:
            pod.proc = subprocess.Popen(pod.argv, env=pod.env, cwd=self.run.workdir, stdout=out,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def lose_node(self, index: int, memory: Path | None = None) -> float:
        """SIGKILL pod ``index`` (agent, workers, standby zygote: the whole tree at once), then start its
        replacement, as the Job controller replaces a pod whose node is gone; ``memory``, the node's memory
        folder (its ``/dev/shm``), goes with it. Returns the kill's wall time."""
        pod = self.run.pods[index]
        t = time.time()
        kill_tree(pod.proc.pid)
        pod.returncodes.append(pod.proc.wait(10))
        if memory is not None:
            shutil.rmtree(memory, ignore_errors=True)
        self.lost.append((index, t))
        self._start(pod)
        return t

    def poll(self) -> bool:
        """Start failed pods again (up to ``backoffLimit``); True once every pod exited 0.
        Raises :class:`JobFailed` past the backoff limit or the time limit."""
        for pod in self.run.pods:
            if len(pod.returncodes) == len(pod.logs) or (code := pod.proc.poll()) is None:
                continue
            pod.returncodes.append(code)
            if code != 0:
                self.pod_failures += 1
                if self.pod_failures > self.backoff:
                    raise JobFailed(f"{self.pod_failures} pod failures > backoffLimit {self.backoff}\n{self.tail(pod.index)}")
                self._start(pod)
        if time.monotonic() > self.deadline:
            raise JobFailed(f"the job ran past its {self.timeout_s:.0f} s limit\n{self.tail(0)}")
        return all(p.returncodes[-1:] == [0] and len(p.returncodes) == len(p.logs) for p in self.run.pods)

    def tail(self, index: int, chars: int = 3000) -> str:
        return f"--- {self.run.pods[index].hostname}, last attempt ---\n{self.run.log(index)[-chars:]}"

    def log_lines(self, *marks: str) -> list[str]:
        """Lines of every pod's logs containing one of ``marks``, as ``node I attempt J: LINE``."""
        return [f"node {pod.index} attempt {j}: {line}" for pod in self.run.pods for j, path in enumerate(pod.logs)
                for line in path.read_text(errors="replace").splitlines() if any(m in line for m in marks)]

    def close(self) -> list[str]:
        """Kill every pod still running and return what of the Job survived that (described)."""
        for pod in self.run.pods:
            if pod.proc is not None and pod.proc.poll() is None:
                kill_tree(pod.proc.pid)
                pod.proc.wait(10)
        self.left = leftovers(self.tag)
        return self.left
