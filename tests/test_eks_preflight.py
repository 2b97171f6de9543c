"""Preflight (``nvrx_lab.eks.preflight``) against moto's ECR and the recording Kubernetes API of ``test_eks_submit``: a
ready cluster passes and ``submit`` says each check; an example value, a missing image, an unbound or missing claim,
too few ready nodes or a namespace whose Pod Security refuses the pods is one line naming the field, and nothing is
created."""

from __future__ import annotations

import boto3
import pytest
from test_eks_submit import CLUSTER, REGION, aws, kube, moto_url, p5_node  # noqa: F401 - the fixtures

from nvrx_lab.eks import Access, JobSpec, PreflightFailed, submit
from nvrx_lab.eks.__main__ import main as eks_main

ACCOUNT = "210987654321"
IMAGE = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/llama-train:7"
MANIFEST = '{"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json"}'


@pytest.fixture
def ecr(aws, monkeypatch):  # noqa: F811 - the fixture
    """An ECR repository ``llama-train`` in account :data:`ACCOUNT` holding tag 7."""
    monkeypatch.setenv("MOTO_ACCOUNT_ID", ACCOUNT)  # moto's answers are this account's now: the cluster too
    eks = boto3.client("eks", region_name=REGION)
    if CLUSTER not in eks.list_clusters()["clusters"]:
        eks.create_cluster(name=CLUSTER, roleArn=f"arn:aws:iam::{ACCOUNT}:role/eks",
                           resourcesVpcConfig={"subnetIds": ["subnet-0123"]})
    client = boto3.client("ecr", region_name=REGION)
    if "llama-train" not in [r["repositoryName"] for r in client.describe_repositories()["repositories"]]:
        client.create_repository(repositoryName="llama-train")
        client.put_image(repositoryName="llama-train", imageManifest=MANIFEST, imageTag="7")
    return client


def _submit(kube, **changes):  # noqa: F811 - the fixture's server
    spec = JobSpec(**{"name": "llama-ft", "image": IMAGE, "nodes": 2, "mode": "ft_launcher", **changes})
    said: list[str] = []
    result = submit(spec, CLUSTER, REGION, dry_run=False, watch=None, echo=said.append,
                    access=Access(api_server=kube.url))
    return result, said


def test_a_ready_cluster_passes_and_submit_says_each_check(ecr, kube):  # noqa: F811
    result, said = _submit(kube)
    assert result.status == "submitted"
    digest = ecr.describe_images(repositoryName="llama-train", imageIds=[{"imageTag": "7"}])["imageDetails"][0][
        "imageDigest"]
    assert said.pop() == f"image: {IMAGE} pinned to {digest} (every pod, replacements too, runs this image)"
    job = [body for m, p, body, _ in kube.requests if m == "POST" and p.endswith("/jobs")][0]
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == f"{IMAGE}@{digest}"  # a tag moves, this not
    assert said == [f"preflight: {line}" for line in (
        "no example values", f"image {IMAGE}: in ECR, {digest[:19]}…", "volume: fsx-claim Bound",
        "nodes: 2 of 2 p5.48xlarge nodes ready with 8 GPUs and 32 EFA, 2 wanted",
        "namespace nvrx-lab: created by this submit (enforce privileged)",
        "controller: the Job controller (an Indexed Job)")]


def _broken(kube, case: str) -> dict:
    """Break the ready cluster as ``case`` says; the spec's changes."""
    pvc = "/api/v1/namespaces/nvrx-lab/persistentvolumeclaims/fsx-claim"
    if case == "pending claim":
        kube.objects[pvc]["status"]["phase"] = "Pending"
    elif case == "no claim":
        del kube.objects[pvc]
    elif case == "a node not ready":
        kube.objects["/api/v1/nodes"]["items"][1] = p5_node("ip-10-0-0-1", ready=False)
    elif case == "baseline namespace":
        kube.objects["/api/v1/namespaces/nvrx-lab"] = {
            "kind": "Namespace", "apiVersion": "v1",
            "metadata": {"name": "nvrx-lab", "labels": {"pod-security.kubernetes.io/enforce": "baseline"}}}
    elif case == "no JobSet controller":
        del kube.objects["/apis/apiextensions.k8s.io/v1/customresourcedefinitions/jobsets.jobset.x-k8s.io"]
    return {"no JobSet controller": {"workload": "jobset"},
            "example image": {"image": f"123456789012.dkr.ecr.{REGION}.amazonaws.com/nvrx-lab:0.1.0"},
            "example FSx": {"fsx_volume_handle": "fs-0123456789abcdef0", "fsx_dns_name": "x.fsx.us-west-2.amazonaws.com",
                            "fsx_mount_name": "abcdefgh"},
            "missing tag": {"image": IMAGE.replace(":7", ":8")},
            "missing repository": {"image": IMAGE.replace("llama-train", "llama-tran")}}.get(case, {})


@pytest.mark.parametrize("case,line", [
    ("example image", "JobSpec.image: 123456789012.dkr.ecr.us-west-2.amazonaws.com/nvrx-lab:0.1.0 is the workbook's example"),
    ("example FSx", "JobSpec.fsx_volume_handle: fs-0123456789abcdef0 is the example FSx id"),
    ("missing tag", "JobSpec.image: 210987654321.dkr.ecr.us-west-2.amazonaws.com/llama-train:8: no such tag or digest"),
    ("missing repository", "no repository llama-tran in account 210987654321"),
    ("pending claim", "JobSpec.fsx_claim: fsx-claim is Pending, not Bound"),
    ("no claim", "JobSpec.fsx_claim: no PersistentVolumeClaim fsx-claim in namespace nvrx-lab"),
    ("a node not ready", "JobSpec.nodes: 2 wanted, 1 of 2 p5.48xlarge nodes ready"),
    ("baseline namespace", "JobSpec.namespace: nvrx-lab enforces Pod Security 'baseline'"),
    ("no JobSet controller", "JobSpec.workload: a JobSet ('jobset', 2 nodes) needs jobsets.jobset.x-k8s.io, which is "
                             "not installed"),
])
def test_each_mistake_is_one_line_and_nothing_is_created(case, line, ecr, kube):  # noqa: F811
    changes = _broken(kube, case)
    with pytest.raises(PreflightFailed) as failed:
        _submit(kube, **changes)
    bad = [f.line for f in failed.value.findings if not f.ok]
    assert len(bad) == 1 and line in bad[0], bad
    assert not [r for r in kube.requests if r[0] in ("POST", "PUT", "DELETE")]  # refused before anything exists


def test_kueue_admits_later_and_the_skip_is_said(ecr, kube):  # noqa: F811
    kube.objects["/api/v1/nodes"]["items"] = []
    result, said = _submit(kube, queue_name="p5")
    assert result.status == "submitted" and any("Kueue queue p5 admits the 2 pods" in line for line in said)
    spec = JobSpec(name="other", image=IMAGE, nodes=2)  # no nodes at all, and preflight skipped: said
    quiet: list[str] = []
    submit(spec, CLUSTER, REGION, dry_run=False, watch=None, echo=quiet.append,
           access=Access(api_server=kube.url, preflight=False))
    assert quiet == ["preflight: skipped (Access(preflight=False)): the image, the volume, the nodes and Pod Security are "
                     "not checked"]


def test_the_command_prints_every_check_and_an_error_line_for_each_failure(ecr, kube, capsys):  # noqa: F811
    argv = ["preflight", "--cluster", CLUSTER, "--region", REGION, "--name", "llama-ft", "--image", IMAGE,
            "--api-server", kube.url]
    assert eks_main(argv) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith(f"ok: image {IMAGE}: in ECR, sha256:")
    kube.objects["/api/v1/namespaces/nvrx-lab/persistentvolumeclaims/fsx-claim"]["status"]["phase"] = "Lost"
    assert eks_main([*argv, "--nodes", "3"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert [e.split(":")[0] for e in err] == ["error", "error"] and "fsx-claim is Lost" in err[0] and \
        "JobSpec.nodes: 3 wanted" in err[1], err
