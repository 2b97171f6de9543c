"""Submission over real HTTP: moto in server mode stands in for EKS and STS, a small local HTTP server for
the Kubernetes API (it records every request and authenticates the bearer token the way EKS does: by
calling the presigned STS URL). No real AWS credentials anywhere; fake ones never reach a log."""

from __future__ import annotations

import base64
import json
import logging
import re
import threading
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
import pytest

from nvrx_lab.eks import Access, EksError, JobSpec, Watch, delete, eks_token, parse_goodput, submit
from nvrx_lab.net import free_port

pytest.importorskip("moto.server")
from moto.server import ThreadedMotoServer  # noqa: E402

ACCESS_KEY, SECRET_KEY = "AKIAFAKEFAKEFAKE1234", "fakeSecretKeyThatMustNeverBeLogged0000000"
REGION, CLUSTER = "us-west-2", "p5-cluster"


@pytest.fixture(scope="module")
def moto_url():
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        yield url
    finally:
        server.stop()


@pytest.fixture
def aws(moto_url, monkeypatch, tmp_path):
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_url)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    eks = boto3.client("eks", region_name=REGION)
    if CLUSTER not in eks.list_clusters()["clusters"]:
        eks.create_cluster(name=CLUSTER, roleArn="arn:aws:iam::123456789012:role/eks",
                           resourcesVpcConfig={"subnetIds": ["subnet-0123"]})
    return moto_url


class FakeKube(ThreadingHTTPServer):
    """Just enough of the Kubernetes API: create/replace/read/delete objects, pods that run and finish,
    a Job that completes, rank 0's log; ``fail`` = {"POST jobs": (403, message)} injects errors (the second
    word is a path segment or a whole path); ``pending`` is merged into the pods' status while they are Pending."""

    def __init__(self, nodes: int):
        super().__init__(("127.0.0.1", 0), Handler)
        self.nodes, self.objects, self.requests, self.polls, self.fail, self.pending = nodes, {}, [], 0, {}, {}
        self.stuck = False  # True: the pods stay Pending
        self.evicted: dict[int, str] = {}  # index -> the kubelet's message: that pod is Failed, reason Evicted
        self.failed_jobs: set[str] = set()  # Jobs that end Failed instead of Complete
        self.log_lines = ["node 0 of 2: 8 workers", "step    5  loss 5.1", 'GOODPUT {"training_goodput": 0.87, "faults": 2}']
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.callers = []
        # what preflight reads of a ready cluster: p5 nodes with their GPUs and EFA free, the FSx claim Bound
        self.objects["/api/v1/nodes"] = {"kind": "NodeList", "apiVersion": "v1", "metadata": {},
                                         "items": [p5_node(f"ip-10-0-0-{i}") for i in range(nodes)]}
        self.objects["/api/v1/namespaces/nvrx-lab/persistentvolumeclaims/fsx-claim"] = {
            "kind": "PersistentVolumeClaim", "apiVersion": "v1", "metadata": {"name": "fsx-claim", "namespace": "nvrx-lab"},
            "spec": {}, "status": {"phase": "Bound"}}
        self.objects["/apis/apiextensions.k8s.io/v1/customresourcedefinitions/jobsets.jobset.x-k8s.io"] = {
            "kind": "CustomResourceDefinition", "apiVersion": "apiextensions.k8s.io/v1",
            "metadata": {"name": "jobsets.jobset.x-k8s.io"},  # the JobSet controller is installed
            "spec": {"group": "jobset.x-k8s.io", "scope": "Namespaced", "names": {"plural": "jobsets", "kind": "JobSet"},
                     "versions": [{"name": "v1alpha2", "served": True, "storage": True}]}}


def p5_node(name: str, ready: bool = True, gpus: int = 8) -> dict:
    return {"metadata": {"name": name, "labels": {"node.kubernetes.io/instance-type": "p5.48xlarge"}},
            "spec": {"unschedulable": False},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "allocatable": {"nvidia.com/gpu": str(gpus), "vpc.amazonaws.com/efa": "32"}}}


class Handler(BaseHTTPRequestHandler):
    server: FakeKube

    def log_message(self, *_):
        pass

    def _send(self, code: int, body, ctype="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, message: str):
        self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code,
                          "reason": {401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 409: "AlreadyExists"}.get(code, "")})

    def _authenticated(self) -> bool:
        auth = self.headers.get("Authorization", "")
        m = re.match(r"Bearer k8s-aws-v1\.([A-Za-z0-9_-]+)$", auth)
        if not m:
            return False
        url = base64.urlsafe_b64decode(m.group(1) + "=" * (-len(m.group(1)) % 4)).decode()
        if "x-k8s-aws-id" not in urllib.parse.parse_qs(urllib.parse.urlsplit(url).query).get("X-Amz-SignedHeaders", [""])[0]:
            return False
        if not self.server.callers:  # like EKS: call the presigned URL once to learn who is calling
            q = {k: v[0] for k, v in urllib.parse.parse_qs(urllib.parse.urlsplit(url).query).items()}
            # moto's server routes by the Authorization header's credential scope: the same signature, header form
            auth = (f"AWS4-HMAC-SHA256 Credential={q['X-Amz-Credential']}, SignedHeaders={q['X-Amz-SignedHeaders']}, "
                    f"Signature={q['X-Amz-Signature']}")
            req = urllib.request.Request(url, headers={"x-k8s-aws-id": CLUSTER, "Authorization": auth})
            with urllib.request.urlopen(req, timeout=10) as resp:
                self.server.callers.append(re.search(r"<Arn>(.*?)</Arn>", resp.read().decode()).group(1))
        return True

    def _handle(self, method: str):
        srv = self.server
        path, _, query = self.path.partition("?")
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        srv.requests.append((method, path, body, query))
        if not self._authenticated():
            return self._status(401, "Unauthorized")
        coll = path.rstrip("/").split("/")
        for key, (code, message) in srv.fail.items():
            m, res = key.split()
            if m == method and (res in coll or res == path):
                return self._status(code, message)
        if method == "POST":
            name = body["metadata"]["name"]
            key = f"{path}/{name}"
            if key in srv.objects:
                return self._status(409, f'{body["kind"]} "{name}" already exists')
            body.setdefault("metadata", {}).update(uid=f"uid-{len(srv.requests)}", resourceVersion="1")
            srv.objects[key] = body
            return self._send(201, body)
        if method == "PUT":
            srv.objects[path] = body
            return self._send(200, body)
        if method == "DELETE":
            gone = srv.objects.pop(path, None)  # like the API server: the deleted object comes back
            return self._send(200, gone) if gone else self._status(404, "not found")
        if path.endswith("/pods"):
            srv.polls += 1
            phase = "Pending" if srv.polls < 2 or srv.stuck else "Running" if srv.polls < 4 else "Succeeded"
            items = [{"metadata": {"name": f"job-{i}-x", "annotations": {"batch.kubernetes.io/job-completion-index": str(i)},
                                   "creationTimestamp": "2025-01-01T00:00:00Z"},
                      "status": {"phase": "Failed", "reason": "Evicted", "message": srv.evicted[i]} if i in srv.evicted
                      else {"phase": phase, **(srv.pending if phase == "Pending" else {})}}
                     for i in range(srv.nodes)]
            return self._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})
        if path.endswith("/events"):
            return self._send(200, srv.objects.get(path, {"kind": "EventList", "apiVersion": "v1", "metadata": {},
                                                         "items": []}))
        if path.endswith("/log"):
            return self._send(200, "\n".join([*srv.log_lines, ""]).encode(), "text/plain")
        if path.endswith("/status"):
            obj = srv.objects.get(path.removesuffix("/status"))
            if obj is None:
                return self._status(404, "not found")
            done = srv.polls >= 4 and not srv.stuck
            complete = "Completed" if "/jobsets/" in path else "Complete"  # a JobSet's condition, a Job's
            if path.removesuffix("/status").rsplit("/", 1)[-1] in srv.failed_jobs:
                complete = "Failed"
            return self._send(200, {**obj, "status": {"succeeded": srv.nodes if done and complete != "Failed" else 0,
                                                       "conditions": [{"type": complete, "status": "True"}] if done else []}})
        return self._send(200, srv.objects[path]) if path in srv.objects else self._status(404, "not found")

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_PUT(self):
        self._handle("PUT")

    def do_DELETE(self):
        self._handle("DELETE")


@pytest.fixture
def kube():
    srv = FakeKube(nodes=2)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


SPEC = JobSpec(name="llama-ft", image="repo/nvrx-lab:1", nodes=2, mode="ft_launcher")


def test_token_is_a_presigned_sts_get_caller_identity_bound_to_the_cluster(aws):
    token = eks_token(boto3.session.Session(), CLUSTER, REGION)
    assert token.startswith("k8s-aws-v1.") and "=" not in token
    url = base64.urlsafe_b64decode(token[len("k8s-aws-v1."):] + "==").decode()
    q = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    assert q["Action"] == ["GetCallerIdentity"] and "x-k8s-aws-id" in q["X-Amz-SignedHeaders"][0]
    assert q["X-Amz-Expires"] == ["60"]


def test_dry_run_renders_and_validates_without_touching_aws(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: any call would fail
    res = submit(SPEC, CLUSTER, REGION)
    assert res.status == "dry-run" and [m["kind"] for m in res.manifests][-1] == "Job" and not res.actions


@pytest.mark.timeout(60)
def test_submit_creates_watches_streams_rank0_and_picks_up_goodput(aws, kube, caplog, capsys):
    caplog.set_level(logging.INFO)
    res = submit(SPEC, CLUSTER, REGION, dry_run=False, watch=Watch(timeout_s=30, poll_s=0.05), access=Access(api_server=kube.url))
    assert res.status == "Succeeded", res
    assert res.goodput == {"training_goodput": 0.87, "faults": 2}
    assert any("GOODPUT" in line for line in res.log_tail)
    rbac = ["ServiceAccount/llama-ft-pods", "ClusterRole/nvrx-lab-node-marker",
            "ClusterRoleBinding/nvrx-lab-node-marker-nvrx-lab-llama-ft"]  # the node marker (nvrx_lab.eks.rbac)
    assert res.actions == ["created Namespace/nvrx-lab", "created ConfigMap/llama-ft-launcher",
                           *(f"created {r}" for r in rbac), "created Service/llama-ft", "created Job/llama-ft"]
    posts = [p for m, p, *_ in kube.requests if m == "POST"]
    roles = "/apis/rbac.authorization.k8s.io/v1"
    assert posts == ["/api/v1/namespaces", "/api/v1/namespaces/nvrx-lab/configmaps",
                     "/api/v1/namespaces/nvrx-lab/serviceaccounts", f"{roles}/clusterroles", f"{roles}/clusterrolebindings",
                     "/api/v1/namespaces/nvrx-lab/services", "/apis/batch/v1/namespaces/nvrx-lab/jobs"]
    assert kube.callers and kube.callers[0].startswith("arn:aws:")  # the token worked against (moto's) STS
    assert res.phases == {0: "Succeeded", 1: "Succeeded"}
    out = capsys.readouterr()
    ours = [r.getMessage() for r in caplog.records if r.name != "werkzeug"]  # werkzeug = moto's server, i.e. AWS's side
    text = "\n".join(ours) + out.out + out.err + repr(res)
    assert ACCESS_KEY not in text and SECRET_KEY not in text


@pytest.mark.timeout(60)
def test_resubmit_replaces_config_service_and_job_but_keeps_the_namespace(aws, kube):
    submit(SPEC, CLUSTER, REGION, dry_run=False, watch=None, access=Access(api_server=kube.url))
    kube.requests.clear()
    res = submit(SPEC, CLUSTER, REGION, dry_run=False, watch=None, access=Access(api_server=kube.url), replace=True)
    assert res.actions == ["exists Namespace/nvrx-lab", "replaced ConfigMap/llama-ft-launcher",
                           "exists ServiceAccount/llama-ft-pods", "exists ClusterRole/nvrx-lab-node-marker",
                           "exists ClusterRoleBinding/nvrx-lab-node-marker-nvrx-lab-llama-ft",
                           "replaced Service/llama-ft", "replaced Job/llama-ft"]
    methods = [(m, p.rsplit("/", 2)[-2:]) for m, p, *_ in kube.requests]
    assert ("DELETE", ["jobs", "llama-ft"]) in methods
    job_delete = next(q for m, p, _, q in kube.requests if m == "DELETE" and p.endswith("/jobs/llama-ft"))
    assert "propagationPolicy=Foreground" in job_delete  # the pods go with the Job
    assert delete(SPEC, CLUSTER, REGION, access=Access(api_server=kube.url)) == [
        "deleted Job/llama-ft", "deleted Service/llama-ft", "deleted ConfigMap/llama-ft-launcher",
        "deleted ServiceAccount/llama-ft-pods", "deleted ClusterRoleBinding/nvrx-lab-node-marker-nvrx-lab-llama-ft"]
    assert delete(SPEC, CLUSTER, REGION, access=Access(api_server=kube.url)) == []


def test_cluster_not_found_is_one_clear_message(aws, kube):
    with pytest.raises(EksError, match=r"EKS cluster 'nope' not found in us-west-2: check the name and region") as err:
        submit(SPEC, "nope", REGION, dry_run=False, access=Access(api_server=kube.url))
    assert SECRET_KEY not in str(err.value) and ACCESS_KEY not in str(err.value)


@pytest.mark.parametrize("message, expected", [
    ('jobs.batch is forbidden: User "arn:aws:sts::123456789012:assumed-role/dev" cannot create resource "jobs"',
     r"forbidden in namespace 'nvrx-lab' \(403\): jobs.batch is forbidden"),
    ("exceeded quota: gpu, requested: requests.nvidia.com/gpu=16, used: 0, limited: 8",
     r"ResourceQuota exceeded in namespace 'nvrx-lab': exceeded quota"),
])
def test_forbidden_and_quota_are_one_clear_message(aws, kube, message, expected):
    kube.fail = {"POST jobs": (403, message)}
    with pytest.raises(EksError, match=expected):
        submit(SPEC, CLUSTER, REGION, dry_run=False, access=Access(api_server=kube.url))


def test_no_credentials_is_one_clear_message(aws, monkeypatch, kube):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(EksError, match="no AWS credentials found"):
        submit(SPEC, CLUSTER, REGION, dry_run=False, access=Access(api_server=kube.url))


def test_goodput_line_formats():
    assert parse_goodput('GOODPUT {"training_goodput": 0.5}') == {"training_goodput": 0.5}
    assert parse_goodput('{"kind": "goodput_summary", "t": 1, "infra": 0.9}')["infra"] == 0.9
    assert parse_goodput('{"kind": "step", "loss": 1.0}') is None
    assert parse_goodput("step 5 goodput soon") is None and parse_goodput("GOODPUT {not json") is None
