"""Talking to an EKS cluster with nothing but boto3 and the official kubernetes client.

* ``describe_cluster`` gives the API server endpoint and its certificate authority.
* The bearer token is the aws-iam-authenticator scheme: a presigned STS ``GetCallerIdentity``
  URL, signed with the ``x-k8s-aws-id: <cluster>`` header, urlsafe-base64 encoded without
  padding, prefixed ``k8s-aws-v1.``. EKS calls that URL to learn who we are; no kubectl, no aws
  CLI, no kubeconfig. Tokens live 15 minutes; the client refreshes its token every
  :data:`TOKEN_REFRESH_S` seconds, so a watch may run for hours.

Neither the token nor the credentials are ever logged: the presigned URL contains the access key id.
"""

from __future__ import annotations

import base64
import contextlib
import inspect
import json
import os
import tempfile
import time
import weakref

import boto3
import botocore.exceptions
import kubernetes.client
from kubernetes.client.rest import ApiException

TOKEN_PREFIX = "k8s-aws-v1."
TOKEN_REFRESH_S = 600
CA_IN_MEMORY = "ca_cert_data" in inspect.signature(kubernetes.client.Configuration.__init__).parameters
"""Whether the kubernetes client takes the cluster's CA certificate as data (newer clients): nothing on disk."""


class EksError(RuntimeError):
    """One clear sentence about what went wrong with the cluster and what to do."""


def eks_token(session: boto3.session.Session, cluster: str, region: str) -> str:
    """A bearer token for ``cluster`` from a presigned STS GetCallerIdentity URL."""
    sts = session.client("sts", region_name=region)

    def add_cluster_header(request, **_):
        request.headers["x-k8s-aws-id"] = cluster

    sts.meta.events.register("before-sign.sts.GetCallerIdentity", add_cluster_header)
    url = sts.generate_presigned_url("get_caller_identity", Params={}, ExpiresIn=60, HttpMethod="GET")
    return TOKEN_PREFIX + base64.urlsafe_b64encode(url.encode()).decode().rstrip("=")


def cluster_endpoint(session: boto3.session.Session, cluster: str, region: str) -> tuple[str, bytes]:
    """(API server URL, CA certificate PEM bytes) of ``cluster``."""
    info = session.client("eks", region_name=region).describe_cluster(name=cluster)["cluster"]
    if info.get("status") not in (None, "ACTIVE", "UPDATING"):
        raise EksError(f"EKS cluster {cluster!r} in {region} is {info['status']}, not ACTIVE: wait for it or pick another")
    data = (info.get("certificateAuthority") or {}).get("data", "")
    try:
        ca = base64.b64decode(data + "=" * (-len(data) % 4)) if data else b""
    except (ValueError, TypeError):
        ca = b""
    return info["endpoint"], ca


def api_client(cluster: str, region: str, session: boto3.session.Session | None = None,
               api_server: str | None = None) -> kubernetes.client.ApiClient:
    """A kubernetes ApiClient authenticated to ``cluster``; ``api_server`` overrides the endpoint
    (a tunnel, a proxy to a private endpoint, or a test server)."""
    session = session or boto3.session.Session()
    try:
        endpoint, ca = cluster_endpoint(session, cluster, region)
        token = eks_token(session, cluster, region)
    except Exception as exc:  # noqa: BLE001 - every AWS failure becomes one sentence
        raise explain(exc, cluster, region) from None
    cfg = kubernetes.client.Configuration()
    cfg.host = (api_server or endpoint).rstrip("/")
    ca_file = ""
    if cfg.host.startswith("https://") and ca:
        if CA_IN_MEMORY:
            cfg.ca_cert_data = ca.decode(errors="replace")
        else:  # the client reads a file: removed again when it closes or is garbage-collected
            with tempfile.NamedTemporaryFile("wb", suffix=".crt", prefix=f"eks-{cluster}-", delete=False) as f:
                f.write(ca)
            cfg.ssl_ca_cert = ca_file = f.name
    cfg.api_key = {"authorization": token}
    cfg.api_key_prefix = {"authorization": "Bearer"}
    issued = [time.monotonic()]

    def refresh(conf: kubernetes.client.Configuration) -> None:
        if time.monotonic() - issued[0] > TOKEN_REFRESH_S:
            conf.api_key["authorization"] = eks_token(session, cluster, region)
            issued[0] = time.monotonic()

    # kubernetes declares the hook only by its default, None (the type checker reads None), and calls it as hook(cfg)
    cfg.refresh_api_key_hook = refresh  # type: ignore[assignment]
    return _CaFileClient(cfg, ca_file) if ca_file else kubernetes.client.ApiClient(cfg)


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class _CaFileClient(kubernetes.client.ApiClient):
    """An ApiClient whose certificate authority is a file of its own: removed when it closes or is garbage-collected."""

    def __init__(self, cfg: kubernetes.client.Configuration, ca_file: str):
        super().__init__(cfg)
        self.ca_file = ca_file
        weakref.finalize(self, _unlink, ca_file)

    def close(self) -> None:
        super().close()
        _unlink(self.ca_file)


def _api_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body or "{}").get("message") or exc.reason or ""
    except (ValueError, AttributeError):
        return exc.reason or ""


def explain(exc: BaseException, cluster: str, region: str, namespace: str = "") -> EksError:
    """Turn an AWS, network or Kubernetes API failure into an :class:`EksError` with one clear message."""
    if isinstance(exc, EksError):
        return exc
    if isinstance(exc, (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError)):
        return EksError("no AWS credentials found: set AWS_PROFILE (and run `aws sso login`), or AWS_ACCESS_KEY_ID and "
                        "AWS_SECRET_ACCESS_KEY, or run where an instance/pod role is available")
    if isinstance(exc, botocore.exceptions.ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        if code == "ResourceNotFoundException":
            return EksError(f"EKS cluster {cluster!r} not found in {region}: check the name and region "
                            f"(aws eks list-clusters --region {region})")
        if code in ("ExpiredToken", "ExpiredTokenException", "RequestExpired"):
            return EksError("AWS credentials have expired: refresh them (aws sso login, or new session credentials)")
        if code in ("AccessDeniedException", "AccessDenied", "UnauthorizedOperation", "UnrecognizedClientException",
                    "InvalidClientTokenId", "SignatureDoesNotMatch"):
            return EksError(f"AWS refused eks:DescribeCluster on {cluster!r} ({code}): the IAM identity needs "
                            "eks:DescribeCluster, and valid credentials")
        return EksError(f"AWS error {code or type(exc).__name__} on cluster {cluster!r} in {region}")
    if isinstance(exc, botocore.exceptions.EndpointConnectionError):
        return EksError(f"cannot reach AWS in {region}: check the region name and the network")
    if isinstance(exc, ApiException):
        msg = _api_message(exc)
        where = f" in namespace {namespace!r}" if namespace else ""
        if exc.status == 401:
            return EksError(f"the Kubernetes API of {cluster!r} rejected the token (401): the IAM identity has no "
                            "EKS access entry (or aws-auth mapping) on this cluster")
        if exc.status == 403 and "quota" in msg.lower():
            return EksError(f"ResourceQuota exceeded{where}: {msg}; lower nodes/GPUs or ask for a larger quota")
        if exc.status == 403:
            return EksError(f"forbidden{where} (403): {msg or 'no permission'}; the IAM identity's access entry needs "
                            "get/create/delete on jobs, services, configmaps, get/list on pods and pods/log and list on events")
        if exc.status == 422:
            return EksError(f"the API server rejected a manifest (422): {msg}")
        return EksError(f"Kubernetes API error {exc.status} {exc.reason}{where}: {msg}")
    if type(exc).__module__.startswith("urllib3") or isinstance(exc, (ConnectionError, OSError)):
        return EksError(f"cannot reach the Kubernetes API of {cluster!r}: {type(exc).__name__}; check the endpoint's "
                        "public/private access and your network")
    return EksError(f"{type(exc).__name__} while talking to {cluster!r}: {exc}")
