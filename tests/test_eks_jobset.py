"""The JobSet variant: validated offline against the JobSet CRD's OpenAPI schema (strictly), the same pods as the
Indexed Job under the JobSet's names, and run by local_run with the JobSet controller's rules: a failed child Job
recreates every pod at once up to maxRestarts; a usage error fails the JobSet (test_eks_usage_error)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from nvrx_lab.eks import MODES, JobSpec, ManifestError, local_run, plan, render, validate
from nvrx_lab.eks.crd import SCHEMAS
from nvrx_lab.eks.jobset import child_job
from nvrx_lab.eks.render import find
from nvrx_lab.observe.events import read_events

ROOT = Path(__file__).resolve().parents[1]
TINY = ("--seq-len", "16", "--dim", "32", "--n-layers", "1", "--n-heads", "2", "--hidden-dim", "64", "--log-every", "1")


def _spec(**kw) -> JobSpec:
    return JobSpec(**{"name": "llama-ft", "image": "repo/nvrx-lab:1", "workload": "jobset", **kw})


@pytest.mark.parametrize("mode", [m for m in MODES if not MODES[m].replicated])  # replicas refuses a JobSet
def test_every_mode_renders_a_jobset_that_validates_against_the_crd(mode):
    ms = render(_spec(mode=mode, nodes=16, queue_name="p5", local_ckpt_interval=5, model="llama3.1-8b",
                      local_ckpt_on_nvme=True, hugepages_2mi=1024))
    validate(ms)
    rbac = ["ServiceAccount", "ClusterRole", "ClusterRoleBinding"] if MODES[mode].uses_launcher else []  # the node marker
    assert [m["kind"] for m in ms] == ["Namespace"] + (["ConfigMap"] if MODES[mode].uses_launcher else []) + rbac + ["JobSet"]
    js = ms[-1]
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    (rj,) = js["spec"]["replicatedJobs"]
    assert rj["replicas"] == 1 and rj["template"]["spec"]["completions"] == 16 == rj["template"]["spec"]["parallelism"]
    assert rj["template"]["spec"]["backoffLimit"] == 0  # any counted failure restarts the whole group
    assert js["spec"]["failurePolicy"]["maxRestarts"] == (3 if MODES[mode].uses_launcher else 10)
    assert js["spec"]["failurePolicy"]["rules"] == [
        {"name": "usage-error", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]
    affinity = rj["template"]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]  # one pod per node
    assert affinity["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == "kubernetes.io/hostname"
    zone = rj["template"]["spec"]["template"]["spec"]["affinity"]["podAffinity"]  # and one zone: EFA does not cross
    assert zone["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    assert "alpha.jobset.sigs.k8s.io/exclusive-topology" not in js["metadata"].get("annotations", {})


def test_committed_jobset_files_validate():
    for path in sorted((ROOT / "manifests").glob("jobset-*.yaml")):
        validate([d for d in yaml.safe_load_all(path.read_text()) if d])


def test_the_crd_schema_is_strict_and_names_each_violation():
    js = find(render(_spec()), "JobSet")[0]
    js["spec"]["failurePolicy"]["maxRestartz"] = 3
    js["spec"]["failurePolicy"]["rules"][0]["action"] = "Explode"
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    js["metadata"]["name"] = "Bad_Name"
    with pytest.raises(ManifestError) as err:
        validate([js])
    text = "\n".join(err.value.errors)
    assert "JobSet/Bad_Name: spec.failurePolicy: Additional properties are not allowed ('maxRestartz'" in text
    assert "spec.failurePolicy.rules.0.action: 'Explode' is not one of ['FailJobSet'" in text
    assert "spec.replicatedJobs.0.template.spec.template.spec.containers.0: Additional properties" in text
    assert "metadata.name: 'Bad_Name' is not a DNS-1123 subdomain" in text


def test_the_vendored_schema_says_where_it_comes_from():
    schema = json.loads((SCHEMAS / "jobset.x-k8s.io_v1alpha2.json").read_text())
    assert "kubernetes-sigs/jobset v0.12.0" in schema["$comment"] and "Apache License 2.0" in schema["$comment"]
    assert "Apache License" in (SCHEMAS / "LICENSE-jobset").read_text()
    assert {"replicatedJobs", "failurePolicy", "network"} <= set(schema["properties"]["spec"]["properties"])


def test_auto_is_a_jobset_from_four_nodes_up_with_blocking_recreate():
    auto = JobSpec(name="a", image="i", nodes=4)
    assert [m["kind"] for m in render(auto)][-1] == "JobSet" and auto.rank0_host == "a-node-0-0.a"
    assert find(render(auto), "JobSet")[0]["spec"]["failurePolicy"]["restartStrategy"] == "BlockingRecreate"
    assert [m["kind"] for m in render(JobSpec(name="a", image="i", nodes=3))][-2:] == ["Service", "Job"]
    assert [m["kind"] for m in render(JobSpec(name="a", image="i", nodes=16, workload="job"))][-1] == "Job"
    replicas = JobSpec(name="a", image="i", nodes=4, mode="replicas")  # a JobSet would restart the survivors
    assert replicas.workload_kind == "job"
    with pytest.raises(ValueError, match="JobSpec.workload: 'jobset'"):
        JobSpec(name="a", image="i", nodes=4, mode="replicas", workload="jobset")


def test_child_job_and_pod_names_are_the_jobset_controllers(tmp_path):
    s = _spec(nodes=3)
    js = find(render(s), "JobSet")[0]
    job = child_job(js)
    assert job["metadata"]["name"] == "llama-ft-node-0" and job["spec"]["template"]["spec"]["subdomain"] == "llama-ft"
    assert s.rank0_host == "llama-ft-node-0-0.llama-ft"  # pod <jobset>-<replicatedJob>-<job index>-<pod index>
    run = plan(render(s), tmp_path)
    assert [p.hostname for p in run.pods] == ["llama-ft-node-0-0", "llama-ft-node-0-1", "llama-ft-node-0-2"]
    assert all(p.env["RANK0_HOST"] == "127.0.0.1" for p in run.pods)  # rank 0's JobSet DNS name, mapped
    assert set(run.ports) == {29400, 29500, 29501}  # no Service of ours: the container's ports


def _with_script(ms: list[dict], script: str) -> list[dict]:
    js = find(ms, "JobSet")[0]
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["args"] = [
        "/bin/bash", "-c", script]
    return ms


@pytest.mark.timeout(60)
def test_local_run_recreates_the_whole_group_up_to_max_restarts(tmp_path):
    s = _spec(mode="baseline", nodes=2, backoff_limit=2)  # 2 failed pods of 2 nodes: one group restart
    once = 'f="$RUN_DIR/seen-$JOB_COMPLETION_INDEX"; mkdir -p "$RUN_DIR"; [ -e "$f" ] && exit 0; touch "$f"; ' \
           '[ "$JOB_COMPLETION_INDEX" = 1 ] && exit 1; sleep 30'
    run = local_run(_with_script(render(s), once), workdir=tmp_path / "a", timeout_s=50)
    assert run.ok and run.group_restarts == 1 and run.failures == 1, (run.status, [p.returncodes for p in run.pods])
    assert [len(p.logs) for p in run.pods] == [2, 2]  # index 0 was healthy, and recreated with the group anyway
    stopped = [e for e in run.events if e.kind == "stopped"]
    restarted = [e for e in run.events if e.kind == "start" and e.attempt == 1]
    assert [e.index for e in stopped] == [0] and len(restarted) == 2  # the healthy pod stopped by the recreate
    assert max(e.t for e in stopped) <= min(e.t for e in restarted)  # BlockingRecreate: the old group gone first
    always = local_run(_with_script(render(s), "exit 1"), workdir=tmp_path / "b", timeout_s=50)
    assert always.status == "Failed" and always.group_restarts == 1  # maxRestarts 1: the second group failure ends it


@pytest.mark.timeout(150)
@pytest.mark.slow  # the JobSet's rules: test_local_run_recreates_the_whole_group_up_to_max_restarts; the trainer: test_eks_local
@pytest.mark.parametrize("mode", ["baseline", "ft_launcher"])
def test_a_real_trainer_trains_as_a_jobset(mode, tmp_path):
    s = _spec(name="tiny", mode=mode, nodes=2, steps=4, global_batch=16, ckpt_interval=3, train_extra=TINY,
              initial_heartbeat_timeout=60, heartbeat_timeout=30)
    run = local_run(render(s), workdir=tmp_path, timeout_s=130)
    assert run.ok, f"{run.status}\n{run.log(0)[-3000:]}\n{run.log(1)[-2000:]}"
    steps = [e["step"] for e in read_events(run.local_path("/fsx/tiny/metrics.jsonl")) if e["kind"] == "step"]
    assert steps == [1, 2, 3, 4]
