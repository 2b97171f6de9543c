"""Submission safety, on the fakes of test_eks_submit.py (moto for EKS and STS, a small Kubernetes API):
an existing Job is never replaced by accident, a namespace-scoped user can submit, pending pods say why,
and the cluster's CA certificate never stays on disk."""

from __future__ import annotations

import dataclasses
import gc
import tempfile

import pytest
from test_eks_submit import CLUSTER, REGION, SPEC, aws, kube, moto_url, p5_node  # noqa: F401 - the fixtures

from nvrx_lab.eks import Access, EksError, Watch, auth, delete, submit
from nvrx_lab.eks.__main__ import main as eks_main
from nvrx_lab.eks.auth import api_client


@pytest.mark.timeout(60)
def test_resubmitting_a_running_job_is_an_error_unless_replace(aws, kube, capsys):
    submit(SPEC, CLUSTER, REGION, dry_run=False, watch=None, access=Access(api_server=kube.url))
    kube.requests.clear()
    with pytest.raises(EksError, match=r"Job nvrx-lab/llama-ft already exists .*replace=True \(CLI: --replace\)"):
        submit(SPEC, CLUSTER, REGION, dry_run=False, watch=None, access=Access(api_server=kube.url))
    assert [m for m, *_ in kube.requests if m != "GET"] == []  # nothing deleted, replaced or created
    cli = ["submit", "--cluster", CLUSTER, "--region", REGION, "--name", "llama-ft", "--image", "repo/nvrx-lab:1",
           "--api-server", kube.url, "--no-dry-run"]
    assert eks_main(cli) == 1 and "--replace" in capsys.readouterr().err
    assert eks_main([*cli, "--replace"]) == 0
    assert ("DELETE", "/apis/batch/v1/namespaces/nvrx-lab/jobs/llama-ft") in [(m, p) for m, p, *_ in kube.requests]


@pytest.mark.timeout(60)
def test_namespace_scoped_user_submits_into_an_existing_namespace(aws, kube):
    """Access that stops at the namespace: reading or creating the Namespace is forbidden; it exists."""
    kube.objects["/api/v1/namespaces/nvrx-lab"] = {"kind": "Namespace", "metadata": {"name": "nvrx-lab"}}
    forbidden = 'namespaces "nvrx-lab" is forbidden: User "dev" cannot get resource "namespaces" at the cluster scope'
    kube.fail = {"GET /api/v1/namespaces/nvrx-lab": (403, forbidden), "POST /api/v1/namespaces": (403, forbidden)}
    res = submit(SPEC, CLUSTER, REGION, dry_run=False, watch=None, access=Access(api_server=kube.url))
    assert res.status == "submitted"
    assert res.actions[0].startswith("assumed Namespace/nvrx-lab (403") and res.actions[-1] == "created Job/llama-ft"
    kube.fail = {}  # and one who may read it: read first, never a create that would be refused
    kube.requests.clear()
    res = submit(dataclasses.replace(SPEC, name="other"), CLUSTER, REGION, dry_run=False, watch=None,
                 access=Access(api_server=kube.url))
    assert res.actions[0] == "exists Namespace/nvrx-lab"
    assert "/api/v1/namespaces" not in [p for m, p, *_ in kube.requests if m == "POST"]


@pytest.mark.timeout(60)
def test_watch_says_why_pods_are_pending(aws, kube, capsys):
    kube.pending = {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                    "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]}
    res = submit(SPEC, CLUSTER, REGION, dry_run=False, watch=Watch(timeout_s=30, poll_s=0.05), access=Access(api_server=kube.url),
                 echo=lambda line: None)
    assert res.status == "Succeeded"
    out = capsys.readouterr().out
    assert out.count("pending (index 0, 1): Unschedulable: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu.") == 1
    assert res.waiting == {}  # cleared once the pods ran


@pytest.mark.parametrize("in_memory", [True, False], ids=["ca-data", "ca-file"])
@pytest.mark.parametrize("ends", ["close", "garbage-collected"])
def test_ca_certificate_is_never_left_on_disk(aws, tmp_path, monkeypatch, in_memory, ends):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(auth, "CA_IN_MEMORY", in_memory and auth.CA_IN_MEMORY)  # False: as older clients do
    api = api_client(CLUSTER, REGION)  # moto's endpoint is https, with a CA
    cfg = api.configuration
    assert cfg.host.startswith("https://") and (cfg.ca_cert_data or cfg.ssl_ca_cert)
    assert len(list(tmp_path.iterdir())) == (0 if auth.CA_IN_MEMORY else 1)
    if ends == "close":
        api.close()
    del api, cfg
    gc.collect()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_a_leftover_service_or_configmap_is_not_replaced_without_replace(aws, kube):
    """A Job's TTL removes only the Job: its Service and ConfigMap stay, and may be someone else's."""
    kube.objects["/api/v1/namespaces/nvrx-lab/services/llama-ft"] = {"kind": "Service", "metadata": {"name": "llama-ft"}}
    with pytest.raises(EksError, match=r"Service/llama-ft already exist in namespace nvrx-lab .*replace=True \(CLI: --replace\)"):
        submit(SPEC, CLUSTER, REGION, dry_run=False, watch=None, access=Access(api_server=kube.url))
    assert [m for m, *_ in kube.requests if m != "GET"] == []  # nothing created or replaced: nothing half-submitted
    kube.requests.clear()
    res = submit(SPEC, CLUSTER, REGION, dry_run=False, watch=None, access=Access(api_server=kube.url), replace=True)
    assert "replaced Service/llama-ft" in res.actions and res.actions[-1] == "created Job/llama-ft"


def test_a_jobset_is_created_watched_and_deleted_like_a_job(aws, kube):
    """From 4 nodes up ``workload='auto'`` is a JobSet: created through its custom resource, watched until its
    ``Completed`` condition, replaced and deleted with its pods like a Job."""
    spec = dataclasses.replace(SPEC, nodes=4)
    kube.nodes = 4
    kube.objects["/api/v1/nodes"]["items"] = [p5_node(f"ip-10-0-0-{i}") for i in range(4)]
    res = submit(spec, CLUSTER, REGION, dry_run=False, echo=lambda line: None, access=Access(api_server=kube.url),
                 watch=Watch(timeout_s=30, poll_s=0.05))
    jobsets = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/nvrx-lab/jobsets"
    assert res.status == "Succeeded" and res.actions[-1] == "created JobSet/llama-ft", res
    assert ("POST", jobsets) in [(m, p) for m, p, *_ in kube.requests]
    assert not [p for m, p, *_ in kube.requests if m == "POST" and p.endswith(("/jobs", "/services"))]  # the controller's
    assert res.phases == {i: "Succeeded" for i in range(4)}
    with pytest.raises(EksError, match="JobSet nvrx-lab/llama-ft already exists"):
        submit(spec, CLUSTER, REGION, dry_run=False, watch=None, access=Access(api_server=kube.url))
    assert delete(spec, CLUSTER, REGION, access=Access(api_server=kube.url))[0] == "deleted JobSet/llama-ft"
    assert ("DELETE", f"{jobsets}/llama-ft") in [(m, p) for m, p, *_ in kube.requests]
