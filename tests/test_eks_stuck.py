"""Stuck pods end the run (``Watch.stuck_s``): against the recording Kubernetes API of ``test_eks_submit``, a pod held
back by an image that does not pull (its container's waiting reason) or a volume that does not mount (only an Event)
is named in one line at the next look, and after the bound the Job is deleted so its nodes are released."""

from __future__ import annotations

import time

import pytest
from test_eks_submit import CLUSTER, REGION, SPEC, aws, kube, moto_url  # noqa: F401 - the fixtures

from nvrx_lab.eks import Access, Watch, submit

PULL = {"containerStatuses": [{"name": "trainer", "ready": False, "restartCount": 0, "image": "i", "imageID": "",
                               "state": {"waiting": {"reason": "ImagePullBackOff",
                                                     "message": 'Back-off pulling image "repo/nvrx-lab:1"'}}}]}
MOUNT_EVENT = {"metadata": {"name": "e1", "namespace": "nvrx-lab"}, "type": "Warning", "reason": "FailedMount",
               "message": "MountVolume.SetUp failed for volume \"fsx\": rpc error: mount failed",
               "involvedObject": {"kind": "Pod", "name": "job-0-x", "namespace": "nvrx-lab"},
               "lastTimestamp": "2025-01-01T00:00:05Z"}


def _stuck_run(kube, stuck_s: float):  # noqa: F811 - the fixture's server
    kube.stuck = True
    said: list[str] = []
    t0 = time.monotonic()
    res = submit(SPEC, CLUSTER, REGION, dry_run=False, echo=said.append, access=Access(api_server=kube.url),
                 watch=Watch(timeout_s=30, poll_s=0.05, stuck_s=stuck_s))
    return res, said, time.monotonic() - t0


@pytest.mark.timeout(60)
def test_an_image_that_does_not_pull_is_named_and_the_job_deleted_after_the_bound(aws, kube, capsys):  # noqa: F811
    kube.pending = PULL
    res, said, took = _stuck_run(kube, stuck_s=1.0)
    assert res.status == "stuck" and 1.0 <= took < 20, (res.status, took)
    assert said[-1] == ('stuck: index 0: ImagePullBackOff: Back-off pulling image "repo/nvrx-lab:1" for 1 s; deleted '
                        "Job/llama-ft and its pods so the nodes are released (fix the cause and submit again)")
    assert ("DELETE", "/apis/batch/v1/namespaces/nvrx-lab/jobs/llama-ft") in [(m, p) for m, p, *_ in kube.requests]
    assert "pending (index 0, 1): ImagePullBackOff" in capsys.readouterr().out  # named at the first look


@pytest.mark.timeout(60)
def test_a_volume_that_does_not_mount_is_read_from_the_events(aws, kube, capsys):  # noqa: F811
    kube.pending = {"containerStatuses": [{"name": "trainer", "ready": False, "restartCount": 0, "image": "i",
                                           "imageID": "", "state": {"waiting": {"reason": "ContainerCreating"}}}]}
    kube.objects["/api/v1/namespaces/nvrx-lab/events"] = {"kind": "EventList", "apiVersion": "v1", "metadata": {},
                                                          "items": [MOUNT_EVENT]}
    res, said, _ = _stuck_run(kube, stuck_s=0.5)
    assert res.status == "stuck" and said[-1].startswith("stuck: index 0: FailedMount: MountVolume.SetUp failed")
    assert "pending (index 0): FailedMount" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_a_pod_that_only_waits_its_turn_is_not_stuck(aws, kube):  # noqa: F811
    """ContainerCreating without a Warning Event (an image still pulling) is waiting, not stuck: the watch goes on to
    its own timeout, and the Job is left alone."""
    kube.pending = {"containerStatuses": [{"name": "trainer", "ready": False, "restartCount": 0, "image": "i",
                                           "imageID": "", "state": {"waiting": {"reason": "ContainerCreating"}}}]}
    kube.stuck = True
    res = submit(SPEC, CLUSTER, REGION, dry_run=False, echo=lambda line: None, access=Access(api_server=kube.url),
                 watch=Watch(timeout_s=1.5, poll_s=0.05, stuck_s=0.2))
    assert res.status == "timeout"
    assert not [p for m, p, *_ in kube.requests if m == "DELETE"]


SHM = "The node was low on resource: memory. Container trainer was using 80Gi, which exceeds its request of 64Gi."


@pytest.mark.timeout(60)
def test_evictions_are_said_once_each_and_too_many_end_the_run(aws, kube):  # noqa: F811
    """The rendered podFailurePolicy ignores DisruptionTarget (a lost node costs no retry), so a pod the kubelet evicts
    would come back forever: each eviction is one line, and past Watch.max_evictions the Job is deleted."""
    kube.stuck, kube.evicted = True, {0: SHM, 1: SHM}
    said: list[str] = []
    res = submit(SPEC, CLUSTER, REGION, dry_run=False, echo=said.append, access=Access(api_server=kube.url),
                 watch=Watch(timeout_s=30, poll_s=0.05, max_evictions=1))
    assert res.status == "evicted"
    said = [line for line in said if not line.startswith("preflight: ")]
    assert said[:2] == [f"evicted (index 0, pod job-0-x, 1 of at most 1): {SHM}",
                        f"evicted (index 1, pod job-1-x, 2 of at most 1): {SHM}"]
    assert said[-1] == (f"evicted: 2 pods evicted by the kubelet (more than Watch.max_evictions=1; the last: {SHM}); "
                        "deleted Job/llama-ft and its pods so the nodes are released (fix the cause and submit again)")
    assert ("DELETE", "/apis/batch/v1/namespaces/nvrx-lab/jobs/llama-ft") in [(m, p) for m, p, *_ in kube.requests]


@pytest.mark.timeout(60)
def test_a_job_deleted_under_the_watch_ends_it_as_gone(aws, kube):  # noqa: F811
    kube.fail = {"GET status": (404, "jobs.batch \"llama-ft\" not found")}  # someone ran kubectl delete job
    res = submit(SPEC, CLUSTER, REGION, dry_run=False, echo=lambda line: None, access=Access(api_server=kube.url),
                 watch=Watch(timeout_s=20, poll_s=0.05))
    assert res.status == "gone"  # at the first look, not after the watch's timeout
