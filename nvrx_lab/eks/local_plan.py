"""``plan(manifests, workdir)``: the pods of an Indexed Job as local processes, mapped to a laptop; starts nothing.

A JobSet's pods are those of the Indexed Job its controller creates (:func:`~nvrx_lab.eks.jobset.child_job`).

Each completion index becomes one :class:`~nvrx_lab.eks.local_pods.LocalPod`: the container's ``command``/``args`` (with
``args`` alone, as rendered, the image's entrypoint is skipped: a laptop needs no CUDA compat set-up)
and the environment Kubernetes would give it: what the image sets (never this machine's variables, unless
passed in ``host_env``), the manifest's variables (``$(VAR)`` expanded), the downward API
(``JOB_COMPLETION_INDEX`` from the index annotation, pod name, namespace, IPs), ``HOSTNAME=<job>-<i>``, and
Secrets only if passed in ``secrets``. What a laptop does not have is
mapped, and only that, one whole value at a time (never inside a string):

* a variable naming a pod ``<job>-<i>.<service>[.<ns>[.svc[.cluster.local]]]``, or another Service the pods dial
  (``services``: the replicas mode's coordinator), -> ``127.0.0.1``;
* the Service's ports -> free local ports (``MASTER_PORT``, ``RDZV_PORT`` …), the other Services' ports -> theirs;
* a listen address ``0.0.0.0`` (every interface of a pod) -> ``127.0.0.1``: a local run is reachable from here only;
* GPUs -> CPU worker processes: ``NPROC_PER_NODE`` capped at ``max_procs_per_node``;
* volume mount paths -> directories under ``workdir`` (a PersistentVolumeClaim is shared by all
  pods like FSx, a ConfigMap's data becomes files, ``/dev/shm`` stays ``/dev/shm``).

The rendered container script (:func:`~nvrx_lab.eks.commands.container_script`, built from structured
command objects) reads all of these from its environment, the launcher's ``--config`` too
(``LAUNCHER_CONFIG``), so it runs unchanged: from :func:`~nvrx_lab.eks.render.render` or from YAML files.
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from nvrx_lab.eks.jobset import child_job
from nvrx_lab.eks.local_pods import LocalPod, LocalRun, under_mount
from nvrx_lab.net import free_port_pair
from nvrx_lab.runner import LOOPBACK

SECRETISH = re.compile(r"^AWS_|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.I)
IMAGE_ENV = {"PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}
"""What the image sets besides PATH (``manifests/Dockerfile``'s ``ENV``)."""
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""A container's PATH (Docker's default), under the ``python`` of this interpreter."""
INDEX_KEY = "batch.kubernetes.io/job-completion-index"


def _one(manifests: list[dict], kind: str) -> dict:
    found = [m for m in manifests if m.get("kind") == kind]
    if len(found) != 1:
        raise ValueError(f"manifests: expected exactly one {kind}, found {len(found)}")
    return found[0]


def workload(manifests: list[dict]) -> tuple[dict, dict | None]:
    """(the Indexed Job whose pods run, the JobSet it belongs to or ``None``): exactly one Job or one JobSet."""
    kinds = [m.get("kind") for m in manifests if m.get("kind") in ("Job", "JobSet")]
    if len(kinds) != 1:
        raise ValueError(f"manifests: expected exactly one Job or JobSet, found {len(kinds)}")
    if kinds[0] == "Job":
        return _one(manifests, "Job"), None
    js = _one(manifests, "JobSet")
    return child_job(js), js


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


@dataclass(frozen=True)
class _Job:
    """What every pod of the Job shares, and what a laptop maps it to."""

    name: str
    namespace: str
    nodes: int
    container: dict
    ports: dict[int, int]
    gpus: int
    nproc: int
    configmaps: dict[str, dict]
    secrets: Mapping[tuple[str, str], str]
    hosts: frozenset[str]
    """The pods' DNS names (``<job>-<i>.<service>[.<ns>[.svc[.cluster.local]]]``), all ``127.0.0.1`` here."""


def local_ports(manifests: list[dict], service: str, cont: dict, taken: Collection[int] = ()) -> dict[int, int]:
    """Every port the Service (or the container) declares -> a free local port (and the next one free too), none of
    ``taken`` (other Services' local ports, which their processes may not have bound yet)."""
    declared = [p["port"] for s in manifests if s.get("kind") == "Service" and s["metadata"]["name"] == service
                for p in s["spec"].get("ports", [])] or [p["containerPort"] for p in cont.get("ports", [])]
    ports: dict[int, int] = {}
    for p in declared:
        while p not in ports:
            q = free_port_pair()
            if not {q, q + 1} & {*ports.values(), *taken}:
                ports[p] = q
    return ports


def _shared_mounts(pspec: dict, cont: dict, configmaps: dict[str, dict], workdir: Path) -> dict[str, Path]:
    """Mounts every pod shares: a PersistentVolumeClaim's directory (like FSx), a ConfigMap's files."""
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
    return shared


def _pod_mounts(cont: dict, shared: dict[str, Path], workdir: Path, index: int) -> dict[str, Path]:
    """The shared mounts plus this pod's own scratch volumes (``/dev/shm`` stays ``/dev/shm``); created."""
    mounts = dict(shared)
    for mount in cont.get("volumeMounts", []):
        if mount["mountPath"] not in mounts and mount["mountPath"] != "/dev/shm":
            mounts[mount["mountPath"]] = workdir / f"pod{index}" / mount["name"]
    for d in mounts.values():
        d.mkdir(parents=True, exist_ok=True)
    return mounts


def _base_env(workdir: Path, host_env: Mapping[str, str]) -> dict[str, str]:
    """What a pod starts with under its manifest's variables, as a container starts with its image's: ``python``
    (this interpreter, for the image's venv) first on PATH, the package on PYTHONPATH, a home of its own, unbuffered
    logs, no GPUs, one OpenMP thread. Of this machine's variables only ``host_env`` (without its secrets): a pod gets
    none of its node's, so none of this machine's secrets can reach it."""
    shim = workdir / "bin"
    shim.mkdir(parents=True, exist_ok=True)
    for exe in ("python", "python3"):  # a script, not a symlink: a venv's python finds its venv by its own path
        (shim / exe).write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (shim / exe).chmod(0o755)
    home = workdir / "home"
    home.mkdir(parents=True, exist_ok=True)
    base = {"HOME": str(home), **{k: v for k, v in host_env.items() if not SECRETISH.search(k)}, **IMAGE_ENV}
    pkg_root = str(Path(__file__).resolve().parents[2])
    base.update(PATH=f"{shim}{os.pathsep}{base.get('PATH', CONTAINER_PATH)}", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(filter(None, [pkg_root, base.get("PYTHONPATH")])))
    return base


def _env_value(e: dict, job: _Job, index: int, pod_env: dict[str, str]) -> str | None:
    """The value Kubernetes would give the variable ``e`` (``None``: an optional Secret that is not there)."""
    source = e.get("valueFrom", {})
    if "value" in e:
        return _expand(e["value"], pod_env)
    if "fieldRef" in source:
        return _field_ref(source["fieldRef"]["fieldPath"], job.name, job.namespace, index)
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        if (ref["name"], ref["key"]) in job.secrets:
            return job.secrets[(ref["name"], ref["key"])]
        if ref.get("optional"):
            return None
        raise ValueError(f"env {e['name']} needs Secret {ref['name']}/{ref['key']}: "
                         f"pass secrets={{('{ref['name']}', '{ref['key']}'): …}}")
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        return job.configmaps.get(ref["name"], {}).get(ref["key"], "")
    if "resourceFieldRef" in source:
        kind, _, rname = source["resourceFieldRef"]["resource"].partition(".")
        return str(job.container.get("resources", {}).get(kind, {}).get(rname, ""))
    raise ValueError(f"env {e.get('name')}: unsupported valueFrom {list(source)}")


def _local_value(name: str, value: str, job: _Job, mounts: dict[str, Path]) -> str:
    """One variable's value on this machine: a Service port, the GPU count, a pod's DNS name or a path
    under a volume mount is replaced as a whole; anything else is kept."""
    if name.endswith("PORT") and value.isdigit() and int(value) in job.ports:
        return str(job.ports[int(value)])
    if name == "NPROC_PER_NODE" and value == str(job.gpus):
        return str(job.nproc)
    if value in job.hosts or value == "0.0.0.0":
        return LOOPBACK
    local = under_mount(mounts, value)
    return value if local is None else str(local)


def _argv(manifests: list[dict], job: _Job, pod_env: dict[str, str], mounts: dict[str, Path]) -> list[str]:
    """The container's command + args as written (``$(VAR)`` expanded); the script reads the rest from its
    environment."""
    cont = job.container
    argv = [_expand(a, pod_env) for a in [*cont.get("command", []), *cont.get("args", [])]]
    if not argv:
        raise ValueError(f"Job/{job.name}: the container has neither command nor args; local_run cannot run an image's "
                         "entrypoint alone")
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def plan(manifests: list[dict], workdir: str | Path, max_procs_per_node: int = 1,
         secrets: Mapping[tuple[str, str], str] | None = None, extra_env: Mapping[str, str] | None = None,
         host_env: Mapping[str, str] | None = None, services: Mapping[str, Mapping[int, int]] | None = None) -> LocalRun:
    """The processes :func:`~nvrx_lab.eks.local.local_run` would start, with their argv and env; starts nothing.
    ``host_env``: this machine's variables every pod starts with, under the image's and the manifest's (none by
    default; secrets are dropped). ``services``: other Services the pods dial, name -> {port: local port}."""
    manifest, _ = workload(manifests)
    workdir = Path(workdir)
    name, ns = manifest["metadata"]["name"], manifest["metadata"].get("namespace", "default")
    jspec, pspec = manifest["spec"], manifest["spec"]["template"]["spec"]
    if jspec.get("completionMode") != "Indexed":
        raise ValueError(f"Job/{name}: spec.completionMode must be Indexed for local_run")
    cont, service, nodes = pspec["containers"][0], pspec.get("subdomain", name), int(jspec["completions"])
    configmaps = {m["metadata"]["name"]: m.get("data", {}) for m in manifests if m.get("kind") == "ConfigMap"}
    gpus = int((cont.get("resources", {}).get("limits", {}) or {}).get("nvidia.com/gpu", 1))
    suffixes = ("", f".{ns}", f".{ns}.svc", f".{ns}.svc.cluster.local")
    hosts = frozenset([*(f"{name}-{i}.{service}{suffix}" for i in range(nodes) for suffix in suffixes),
                       *(f"{other}{suffix}" for other in services or {} for suffix in suffixes)])
    theirs = {p: q for other in (services or {}).values() for p, q in other.items()}
    own = local_ports(manifests, service, cont, taken=theirs.values())
    job = _Job(name, ns, nodes, cont, theirs | own, gpus, max(1, min(gpus, max_procs_per_node)), configmaps, secrets or {}, hosts)
    shared = _shared_mounts(pspec, cont, configmaps, workdir)
    base = _base_env(workdir, host_env or {})
    pods = []
    for i in range(nodes):
        mounts = _pod_mounts(cont, shared, workdir, i)
        pod_env: dict[str, str] = {}
        for e in cont.get("env", []):
            value = _env_value(e, job, i, pod_env)
            if value is not None:
                pod_env[e["name"]] = _local_value(e["name"], value, job, mounts)
        env = {**base, **pod_env}
        env.setdefault("JOB_COMPLETION_INDEX", str(i))  # the Job controller injects it too
        env["HOSTNAME"] = f"{name}-{i}"
        env.update(extra_env or {})
        pods.append(LocalPod(i, f"{name}-{i}", _argv(manifests, job, pod_env, mounts), env))
    return LocalRun(pods, workdir, _pod_mounts(cont, shared, workdir, 0), own)


__all__ = ["plan", "workload"]
