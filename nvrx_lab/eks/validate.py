"""``validate(manifests)``: every object against the Kubernetes OpenAPI schemas, strictly.

Uses the JSON schemas that ship with ``kubernetes-validate`` for :data:`K8S_VERSION` (an EKS
standard-support version whose Jobs have ``podFailurePolicy`` and Indexed completion as GA), in
their *strict* form: an unknown or misspelt field is an error, not silently dropped by the API
server. Unlike ``kubernetes_validate.validate``, which stops at the first problem, this collects
every violation with its path, e.g. ``Job/llama-ft: spec.template.spec.containers.0.resources.limits:
… is not valid``. A JobSet is checked against its CRD's schema (:mod:`.crd`), as strictly; Kueue's objects for their
shape only (its CRDs are not vendored: ``kubectl apply --dry-run=server`` checks them on a cluster).
"""

from __future__ import annotations

import re
from functools import cache

import jsonschema
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

from nvrx_lab.eks.crd import crd_violations, is_custom

K8S_VERSION = "1.33"
"""Kubernetes version whose schemas the manifests must satisfy (shipped by kubernetes-validate)."""


class ManifestError(ValueError):
    """Schema violations; ``errors`` lists each as ``Kind/name: path: message``."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__(f"{len(errors)} schema violation(s):\n" + "\n".join(f"  {e}" for e in errors))


@cache
def _validator(kind: str, api_version: str, version: str, strict: bool) -> jsonschema.protocols.Validator:
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    folder = f"v{version}.0-local" + ("-strict" if strict else "")
    try:
        schema = schema_contents(f"kubernetes-json-schema/{folder}/{kind.lower()}-{group}.json", version)
    except FileNotFoundError:
        raise ManifestError([f"{kind} ({api_version}): no schema for this kind in Kubernetes {version}"]) from None
    defs = schema_contents(f"kubernetes-json-schema/{folder}/_definitions.json", version)
    registry = Resource.from_contents(schema) @ (Resource.from_contents(defs) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def violations(manifest: dict, version: str = K8S_VERSION, strict: bool = True) -> list[str]:
    """Every schema violation of one object, as ``Kind/name: path: message``."""
    if not isinstance(manifest, dict):
        return [f"(document): a {type(manifest).__name__}, not a Kubernetes object; allowed: a mapping with "
                "apiVersion, kind and metadata"]
    kind, api = manifest.get("kind"), manifest.get("apiVersion")
    meta = manifest.get("metadata")
    name = meta.get("name", "?") if isinstance(meta, dict) else "?"
    if not isinstance(kind, str) or not isinstance(api, str) or not kind or not api:
        return [f"{kind or '?'}/{name}: apiVersion and kind are required"]
    if is_custom(kind, api):
        return [f"{kind}/{name}: {v}" for v in crd_violations(manifest, version)]
    if api.startswith("kueue.x-k8s.io/"):  # Kueue's CRDs are not vendored: the shape only
        return [] if isinstance(manifest.get("spec"), dict) else [f"{kind}/{name}: spec must be a mapping"]
    errors = _validator(kind, api, version, strict).iter_errors(manifest)
    return sorted(f"{kind}/{name}: {'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in errors)


def validate(manifests: list[dict], version: str = K8S_VERSION, strict: bool = True) -> None:
    """Raise :class:`ManifestError` with the path of every schema violation in ``manifests``."""
    errors = [v for m in manifests for v in violations(m, version, strict)]
    if errors:
        raise ManifestError(errors)
