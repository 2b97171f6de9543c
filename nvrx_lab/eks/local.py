"""``local_run(manifests)``: the pods of an Indexed Job as local processes, with the shipped command lines.

Each completion index becomes one process running the container's exact ``command``/``args`` (with
``args`` alone, as rendered, the image's entrypoint is skipped: a laptop needs no CUDA compat set-up)
with the environment Kubernetes would give it: the manifest's variables (``$(VAR)`` expanded),
the downward API (``JOB_COMPLETION_INDEX`` from the index annotation, pod name, namespace, IPs),
``HOSTNAME=<job>-<i>``, and Secrets only if passed in ``secrets``. What a laptop does not have
is mapped, and only that:

* pod DNS names ``<job>-<i>.<service>[.<ns>[.svc[.cluster.local]]]`` -> ``127.0.0.1``;
* the Service's ports -> free local ports (``MASTER_PORT``, ``RDZV_PORT`` …);
* GPUs -> CPU worker processes: ``NPROC_PER_NODE`` capped at ``max_procs_per_node``;
* volume mount paths -> directories under ``workdir`` (a PersistentVolumeClaim is shared by all
  pods like FSx, a ConfigMap's data becomes files, ``/dev/shm`` stays ``/dev/shm``).

The Job controller's rules apply: a failed pod is started again as a new attempt until
``backoffLimit`` failures, and ``podFailurePolicy`` exit-code rules (``FailJob``, ``Ignore``) hold.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from nvrx_lab.net import free_port_pair

SECRETISH = re.compile(r"^AWS_|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.I)
INDEX_KEY = "batch.kubernetes.io/job-completion-index"


@dataclass
class LocalPod:
    index: int
    """Completion index = node rank."""
    hostname: str
    """``<job>-<index>``, as the Indexed Job names the pod's host."""
    argv: list[str]
    """The container's command + args after mapping."""
    env: dict[str, str]
    """The container's environment after mapping (host variables underneath)."""
    logs: list[Path] = field(default_factory=list)
    """One log file per attempt."""
    returncodes: list[int] = field(default_factory=list)
    """Exit code of each attempt."""
    proc: subprocess.Popen | None = None


@dataclass
class LocalRun:
    pods: list[LocalPod]
    workdir: Path
    mounts: dict[str, Path]
    """Mount path in the pod -> local directory."""
    ports: dict[int, int]
    """Service port -> local port."""
    status: str = "pending"
    """Succeeded, Failed (backoffLimit or a FailJob rule) or timeout."""
    failures: int = 0
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "Succeeded"

    def local_path(self, pod_path: str) -> Path:
        """Where a path inside the pod (e.g. ``/fsx/job/metrics.jsonl``) lives on this machine."""
        for mount, local in sorted(self.mounts.items(), key=lambda kv: -len(kv[0])):
            if pod_path == mount or pod_path.startswith(mount.rstrip("/") + "/"):
                return local / pod_path[len(mount):].lstrip("/")
        raise ValueError(f"{pod_path!r} is not under any volume mount ({', '.join(self.mounts)})")

    def log(self, index: int = 0, attempt: int = -1) -> str:
        return self.pods[index].logs[attempt].read_text(errors="replace") if self.pods[index].logs else ""


def _one(manifests: list[dict], kind: str) -> dict:
    found = [m for m in manifests if m.get("kind") == kind]
    if len(found) != 1:
        raise ValueError(f"manifests: expected exactly one {kind}, found {len(found)}")
    return found[0]


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion (``$$(`` escapes; unknown variables stay as written)."""
    return re.sub(r"\$\$\(|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$(" if m.group(0) == "$$(" else env.get(m.group(1), m.group(0)), text)


def _field_ref(path: str, job: str, ns: str, index: int) -> str:
    if path in (f"metadata.annotations['{INDEX_KEY}']", f"metadata.labels['{INDEX_KEY}']"):
        return str(index)
    values = {"metadata.name": f"{job}-{index}-local", "metadata.namespace": ns, "metadata.uid": str(uuid.uuid4()),
              "status.podIP": "127.0.0.1", "status.hostIP": "127.0.0.1", "spec.nodeName": "localhost",
              "spec.serviceAccountName": "default"}
    if path not in values:
        raise ValueError(f"env fieldRef {path!r} has no local equivalent; supported: {', '.join(values)}, the completion index")
    return values[path]


def plan(manifests: list[dict], workdir: str | Path, max_procs_per_node: int = 1,
         secrets: dict[tuple[str, str], str] | None = None, extra_env: dict[str, str] | None = None) -> LocalRun:
    """The processes :func:`local_run` would start, with their argv and env; starts nothing."""
    job = _one(manifests, "Job")
    workdir = Path(workdir)
    name, ns = job["metadata"]["name"], job["metadata"].get("namespace", "default")
    jspec, pspec = job["spec"], job["spec"]["template"]["spec"]
    if jspec.get("completionMode") != "Indexed":
        raise ValueError(f"Job/{name}: spec.completionMode must be Indexed for local_run")
    nodes = int(jspec["completions"])
    svc_name = pspec.get("subdomain", name)
    services = [m for m in manifests if m.get("kind") == "Service" and m["metadata"]["name"] == svc_name]
    cont = pspec["containers"][0]
    configmaps = {m["metadata"]["name"]: m.get("data", {}) for m in manifests if m.get("kind") == "ConfigMap"}
    # Ports: every port the Service (or the container) declares gets a free local port.
    declared = [p["port"] for s in services for p in s["spec"].get("ports", [])] or \
               [p["containerPort"] for p in cont.get("ports", [])]
    ports: dict[int, int] = {}
    for p in declared:
        while p not in ports:
            q = free_port_pair()
            if q not in ports.values() and q + 1 not in ports.values():
                ports[p] = q
    # Volumes: shared PVC directories, ConfigMap files, per-pod scratch.
    vols = {v["name"]: v for v in pspec.get("volumes", [])}
    shared: dict[str, Path] = {}
    for mount in cont.get("volumeMounts", []):
        v = vols[mount["name"]]
        if "persistentVolumeClaim" in v:
            shared[mount["mountPath"]] = workdir / "pvc" / v["persistentVolumeClaim"]["claimName"]
        elif "configMap" in v:
            d = workdir / "configmap" / v["configMap"]["name"]
            d.mkdir(parents=True, exist_ok=True)
            for fname, text in configmaps.get(v["configMap"]["name"], {}).items():
                (d / fname).write_text(text)
            shared[mount["mountPath"]] = d
    gpus = int((cont.get("resources", {}).get("limits", {}) or {}).get("nvidia.com/gpu", 1))
    nproc = max(1, min(gpus, max_procs_per_node))
    dns = re.compile(rf"\b{re.escape(name)}-\d+\.{re.escape(svc_name)}(\.{re.escape(ns)}(\.svc(\.cluster\.local)?)?)?\b")
    shim = workdir / "bin"
    shim.mkdir(parents=True, exist_ok=True)
    for exe in ("python", "python3"):  # a script, not a symlink: a venv's python finds its venv by its own path
        (shim / exe).write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (shim / exe).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not SECRETISH.search(k)}
    pkg_root = str(Path(__file__).resolve().parents[2])
    base.update(PATH=f"{shim}{os.pathsep}{base.get('PATH', '')}", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(filter(None, [pkg_root, base.get("PYTHONPATH")])))
    pods = []
    for i in range(nodes):
        mounts = dict(shared)
        for mount in cont.get("volumeMounts", []):
            if mount["mountPath"] not in mounts and mount["mountPath"] != "/dev/shm":
                mounts[mount["mountPath"]] = workdir / f"pod{i}" / mount["name"]
        for d in mounts.values():
            d.mkdir(parents=True, exist_ok=True)

        def local(text: str) -> str:
            text = dns.sub("127.0.0.1", text)
            for mp, d in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
                text = re.sub(rf"(?<![\w.-]){re.escape(mp.rstrip('/'))}(?=/|$|[\s\"':;,)])", str(d), text)
            text = re.sub(r"(--nproc[-_]per[-_]node[= ])(\d+)", lambda m: m.group(1) + str(nproc), text)
            return text

        env = dict(base)
        pod_env: dict[str, str] = {}
        for e in cont.get("env", []):
            if "value" in e:
                value = _expand(e["value"], pod_env)
            elif "fieldRef" in e.get("valueFrom", {}):
                value = _field_ref(e["valueFrom"]["fieldRef"]["fieldPath"], name, ns, i)
            elif "secretKeyRef" in e.get("valueFrom", {}):
                ref = e["valueFrom"]["secretKeyRef"]
                if (ref["name"], ref["key"]) in (secrets or {}):
                    value = secrets[(ref["name"], ref["key"])]  # type: ignore[index]
                elif ref.get("optional"):
                    continue
                else:
                    raise ValueError(f"env {e['name']} needs Secret {ref['name']}/{ref['key']}: pass secrets={{('{ref['name']}', '{ref['key']}'): …}}")
            elif "configMapKeyRef" in e.get("valueFrom", {}):
                ref = e["valueFrom"]["configMapKeyRef"]
                value = configmaps.get(ref["name"], {}).get(ref["key"], "")
            elif "resourceFieldRef" in e.get("valueFrom", {}):
                res = e["valueFrom"]["resourceFieldRef"]["resource"]
                kind, _, rname = res.partition(".")
                value = str(cont.get("resources", {}).get(kind, {}).get(rname, ""))
            else:
                raise ValueError(f"env {e.get('name')}: unsupported valueFrom {list(e.get('valueFrom', {}))}")
            if value.isdigit() and int(value) in ports and e["name"].endswith("PORT"):
                value = str(ports[int(value)])
            if e["name"] == "NPROC_PER_NODE" and value == str(gpus):
                value = str(nproc)
            pod_env[e["name"]] = local(value)
        env.update(pod_env)
        env.setdefault("JOB_COMPLETION_INDEX", str(i))  # the Job controller injects it too
        env["HOSTNAME"] = f"{name}-{i}"
        env.update(extra_env or {})
        argv = [local(_expand(a, pod_env)) for a in [*cont.get("command", []), *cont.get("args", [])]]
        if not argv:
            raise ValueError(f"Job/{name}: the container has neither command nor args; local_run cannot run an image's "
                             "entrypoint alone")
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        pods.append(LocalPod(i, f"{name}-{i}", argv, env))
    mounts_all = {**shared, **{m["mountPath"]: workdir / "pod0" / m["name"] for m in cont.get("volumeMounts", [])
                               if m["mountPath"] not in shared and m["mountPath"] != "/dev/shm"}}
    return LocalRun(pods, workdir, mounts_all, ports)


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
