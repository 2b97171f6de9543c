"""Custom resources validated offline: the JobSet against its CRD's OpenAPI schema, strictly.

The schema is the ``openAPIV3Schema`` of the JobSet CustomResourceDefinition, vendored from
kubernetes-sigs/jobset (``schemas/jobset.x-k8s.io_v1alpha2.json``, its source and licence beside it;
descriptions removed, nothing else changed). Checked the way :mod:`.validate` checks built-in kinds:

* **strictly** — an object schema with ``properties`` and neither ``additionalProperties`` nor
  ``x-kubernetes-preserve-unknown-fields`` gets ``additionalProperties: false``, so a misspelt field is an
  error (the API server would prune it silently, or refuse it under ``kubectl apply``'s strict field
  validation);
* **metadata** — against Kubernetes' own ``ObjectMeta`` (the CRD says only ``type: object``), and the
  name as the API server checks it (a DNS-1123 subdomain);
* **the child Job** — its ``spec`` once more against Kubernetes' strict ``batch/v1`` ``JobSpec`` of
  :data:`~nvrx_lab.eks.validate.K8S_VERSION`.

Not checked offline: the CRD's CEL rules (``x-kubernetes-validations``, 8 of them: e.g. immutable fields
on update) and the JobSet webhook's defaults; the API server applies both on ``kubectl apply``.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import jsonschema
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

SCHEMAS = Path(__file__).resolve().parent / "schemas"
CRDS = {("JobSet", "jobset.x-k8s.io/v1alpha2"): "jobset.x-k8s.io_v1alpha2.json"}
"""(kind, apiVersion) -> vendored schema file."""
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _strict(node):
    """The schema with ``additionalProperties: false`` on every closed object schema (see the module docs)."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@cache
def _core(version: str) -> tuple[dict, Registry]:
    defs = schema_contents(f"kubernetes-json-schema/v{version}.0-local-strict/_definitions.json", version)
    return defs, Resource.from_contents(defs) @ Registry()


def _core_validator(definition: str, version: str) -> jsonschema.protocols.Validator:
    defs, registry = _core(version)
    return jsonschema.Draft202012Validator({"$ref": f"{defs['$id']}#/$defs/{definition}"}, registry=registry)


@cache
def _crd_validator(kind: str, api_version: str) -> jsonschema.protocols.Validator | None:
    fname = CRDS.get((kind, api_version))
    if fname is None:
        return None
    path = SCHEMAS / fname
    try:
        schema = json.loads(path.read_text())
    except OSError as exc:
        raise FileNotFoundError(f"{path}: the vendored {kind} schema is missing ({exc.strerror}); reinstall nvrx_lab "
                                "with its package data") from None
    schema.pop("$comment", None)
    return jsonschema.Draft202012Validator(_strict(schema))


def is_custom(kind: str, api_version: str) -> bool:
    return (kind, api_version) in CRDS


def crd_violations(manifest: dict, version: str) -> list[str]:
    """Every violation of one custom object (``JobSet``) as ``path: message`` (``Kind/name:`` added by the caller)."""
    kind, api = manifest["kind"], manifest["apiVersion"]
    validator = _crd_validator(kind, api)
    if validator is None:
        raise ValueError(f"{kind} {api}: not a custom object with a vendored schema (see is_custom)")
    errors = [(list(e.absolute_path), e.message) for e in validator.iter_errors(manifest)]
    meta = manifest.get("metadata")
    errors += [(["metadata", *e.absolute_path], e.message)
               for e in _core_validator("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta", version).iter_errors(meta)]
    name = meta.get("name") if isinstance(meta, dict) else None
    if isinstance(name, str) and (len(name) > 253 or not DNS1123_SUBDOMAIN.match(name)):
        errors.append((["metadata", "name"], f"{name!r} is not a DNS-1123 subdomain (lower-case letters, digits, '-' "
                                             "and '.')"))
    if kind == "JobSet":
        jobs = (manifest.get("spec") or {}).get("replicatedJobs") or []
        for i, rj in enumerate(jobs if isinstance(jobs, list) else []):
            spec = ((rj or {}).get("template") or {}).get("spec") if isinstance(rj, dict) else None
            if isinstance(spec, dict):
                path: list[str | int] = ["spec", "replicatedJobs", i, "template", "spec"]
                errors += [([*path, *e.absolute_path], f"{e.message} (Kubernetes {version} JobSpec)")
                           for e in _core_validator("io.k8s.api.batch.v1.JobSpec", version).iter_errors(spec)]
    return sorted(f"{'.'.join(map(str, p)) or '(root)'}: {m}" for p, m in errors)
