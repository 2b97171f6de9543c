"""Issue 33: the rendered 16-node manifests keep a real cluster's timing (rendezvous read/join, node loss, collective
timeout), size /dev/shm from the training state, and carry the smaller fixes (flight recorder, no CPU quota, Pod
Security, Kueue): read from the committed-style YAML, as a reviewer would."""

from __future__ import annotations

import math
import re

import pytest
import yaml

from nvrx_lab.eks import MODES, JobSpec, render
from nvrx_lab.eks.render import find
from nvrx_lab.eks.yamlio import manifest_files
from nvrx_lab.train.model import ModelConfig, parameter_count

FILES16 = manifest_files(nodes=16)


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(FILES16[name]) if d]


def _pod(docs: list[dict]) -> dict:
    w = docs[-1]
    if w["kind"] == "JobSet":
        return w["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    return w["spec"]["template"]["spec"]


def _flag(script: str, flag: str) -> str:
    m = re.search(rf"^\s+{re.escape(flag)}=(\S+)", script, re.M)
    assert m, f"{flag} not in the script"
    return m.group(1).strip('"')


JOB_FILES = [f for f in FILES16 if f.startswith("job")]


@pytest.mark.parametrize("fname", JOB_FILES)
def test_16_node_manifests_keep_a_real_clusters_timing(fname):
    docs = _docs(fname)
    pod = _pod(docs)
    script = pod["containers"][0]["args"][2]
    mode = docs[-1]["metadata"]["annotations"]["nvrx-lab/mode"]
    conf = dict(kv.split("=") for kv in _flag(script, "--rdzv-conf").split(","))
    if MODES[mode].uses_launcher or MODES[mode].replicated:  # torch's c10d store client: 60 s read timeout unless set
        assert int(conf["read_timeout"]) >= 600 and int(conf["join_timeout"]) >= 600, conf
    else:  # torchrun's static store: how long a pod waits for index 0
        assert int(conf["timeout"]) >= 600, conf
    if not MODES[mode].uses_launcher:
        assert "exec python -m nvrx_lab.eks.torchrun" in script  # a worker's exit 2 stays 2 (test_eks_usage_error)
    lost = {t["key"]: t for t in pod["tolerations"] if t["effect"] == "NoExecute"}
    assert set(lost) == {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}
    assert all(t["tolerationSeconds"] <= 60 for t in lost.values())
    pg = float(_flag(script, "--pg-timeout"))  # as short as the mode allows: a hang holds every node this long
    assert pg == (300 if mode in ("async_ckpt", "replicas") else 660 if "llama" in fname else 600), (mode, pg)
    cm = find(docs, "ConfigMap")
    if cm:
        sections = yaml.safe_load(cm[0]["data"]["launcher.yaml"])["section_timeouts"]
        assert pg >= max(float(v.split("=")[1]) for v in sections.split(","))


@pytest.mark.parametrize("fname", JOB_FILES)
def test_16_node_manifests_smaller_items(fname):
    pod = _pod(_docs(fname))
    c = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == "$(RUN_DIR)/nccl-trace/rank_"  # on FSx, created by the script:
    assert 'mkdir -p "${RUN_DIR}" "${RUN_DIR}/nccl-trace"' in c["args"][2]
    assert "cpu" in c["resources"]["requests"] and "cpu" not in c["resources"]["limits"]  # no CFS quota
    assert c["resources"]["limits"]["memory"] == c["resources"]["requests"]["memory"]
    assert c["securityContext"]["capabilities"] == {"add": ["IPC_LOCK"]}
    ns = _docs("namespace.yaml")[0]["metadata"]["labels"]
    assert ns["pod-security.kubernetes.io/enforce"] == "privileged"  # IPC_LOCK is beyond baseline
    assert ns["pod-security.kubernetes.io/warn"] == ns["pod-security.kubernetes.io/audit"] == "baseline"


def test_flight_recorder_env_is_what_torch_reads():
    """torch 2.13 reads TORCH_FR_BUFFER_SIZE / TORCH_FR_DUMP_TEMP_FILE (warning on the old TORCH_NCCL_TRACE_* name)."""
    import torch

    lib = __import__("pathlib").Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    data = lib.read_bytes()
    assert b"TORCH_FR_BUFFER_SIZE" in data and b"TORCH_FR_DUMP_TEMP_FILE" in data
    env = {e["name"] for e in find(render(JobSpec(name="a", image="i", nccl_trace_buffer=0)), "Job")[0]
           ["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert not {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"} & env  # 0 = off


def _volumes(s: JobSpec) -> dict:
    return {v["name"]: v for v in find(render(s), "Job")[0]["spec"]["template"]["spec"]["volumes"]}


def test_dev_shm_is_staging_plus_local_copies_from_the_model():
    """Llama 3.1 8B on 2 p5 nodes (16 GPUs): 12 bytes a parameter checkpointed, 5.6 GiB a GPU."""
    base = dict(name="a", image="i", model="llama3.1-8b")  # p5: 8 GPUs, /dev/shm base 64 GiB (NCCL, dataloaders)
    per_gpu = 12 * parameter_count(ModelConfig(preset="llama3.1-8b")) / 16 / 2**30
    assert _volumes(JobSpec(**base))["shm"]["emptyDir"]["sizeLimit"] == "64Gi"
    sync = JobSpec(**base, ckpt="sync")  # a sync save writes the live tensors: no staging
    assert sync.state_gib_per_gpu == pytest.approx(per_gpu) and sync.shm == 64
    staged = JobSpec(**base, ckpt="async")  # one staging copy a GPU
    assert staged.shm == 64 + math.ceil(8 * per_gpu) == 64 + 45
    local = JobSpec(**base, ckpt="async", local_ckpt_interval=5)  # + 2 own + 2 replicas a GPU
    assert local.shm == 64 + 45 + math.ceil(32 * per_gpu) and _volumes(local)["shm"]["emptyDir"]["sizeLimit"] == "289Gi"
    assert JobSpec(**base, local_ckpt_interval=5, local_ckpt_gib=48).shm == 64 + 48  # explicit, as before
    assert JobSpec(**base, nodes=4).state_gib_per_gpu == pytest.approx(per_gpu / 2)  # twice the shards, half each
    assert JobSpec(**base, train_extra=("--replicate", "2")).state_gib_per_gpu == pytest.approx(per_gpu * 2)  # HSDP


def test_local_checkpoints_on_the_nodes_nvme():
    """Llama 3.1 70B on 4 p5 nodes: 24.6 GiB a GPU checkpointed; the local copies (4 a GPU) go to disk."""
    s = JobSpec(name="a", image="i", model="llama3.1-70b", nodes=4, workload="job", ckpt="async", local_ckpt_interval=5,
                local_ckpt_on_nvme=True, fsx_capacity_gib=4800, fsx_mbps_per_tib=1000)
    local = math.ceil(32 * s.state_gib_per_gpu)
    assert s.shm == 64 + math.ceil(8 * s.state_gib_per_gpu) == 64 + 198  # staging stays in memory
    ms = render(s)
    pod = find(ms, "Job")[0]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert _volumes(s)["local-ckpt"]["emptyDir"] == {"sizeLimit": f"{local}Gi"} == {"sizeLimit": "789Gi"}  # no medium
    assert {"name": "local-ckpt", "mountPath": "/local-ckpt"} in c["volumeMounts"]
    assert c["resources"]["requests"]["ephemeral-storage"] == c["resources"]["limits"]["ephemeral-storage"] == f"{local + 20}Gi"
    assert '--local-ckpt-dir="${LOCAL_CKPT_DIR}"' in c["args"][2]
    assert {e["name"]: e.get("value") for e in c["env"]}["LOCAL_CKPT_DIR"] == "/local-ckpt"
    with pytest.raises(ValueError, match="JobSpec.train_extra: '--local-ckpt-dir'"):
        JobSpec(name="a", image="i", local_ckpt_interval=5, local_ckpt_gib=8, local_ckpt_on_nvme=True,
                train_extra=("--local-ckpt-dir", "/x"))


def test_pg_timeout_is_checked_against_the_section_timeouts():
    assert JobSpec(name="a", image="i").collective_timeout == 600  # the launcher's checkpoint section
    assert JobSpec(name="a", image="i", mode="async_ckpt").collective_timeout == 300  # nothing blocks for a save
    big = JobSpec(name="a", image="i", mode="baseline", model="llama3.1-70b", nodes=16, fsx_capacity_gib=4800)
    assert big.collective_timeout == 1500  # a blocking save of 847 GB at 1.17 GB/s: 722 s, twice, in whole minutes
    with pytest.raises(ValueError, match=r"JobSpec.pg_timeout: 700 s is shorter than the longest section timeout \(800 s\)"):
        JobSpec(name="a", image="i", pg_timeout=700, section_timeouts={"checkpoint": 800})
    assert JobSpec(name="a", image="i", mode="baseline", pg_timeout=120).collective_timeout == 120  # set: as set
    script = find(render(JobSpec(name="a", image="i", pg_timeout=1200, section_timeouts={"checkpoint": 1200})), "Job")[0]
    assert "--pg-timeout=1200 " in script["spec"]["template"]["spec"]["containers"][0]["args"][2]


def test_kueue_queue_label_on_the_workload_only():
    job = find(render(JobSpec(name="a", image="i", queue_name="p5-queue")), "Job")[0]
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "p5-queue"
    assert "kueue.x-k8s.io/queue-name" not in job["spec"]["template"]["metadata"]["labels"]
    js = find(render(JobSpec(name="a", image="i", queue_name="p5-queue", workload="jobset")), "JobSet")[0]
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "p5-queue"  # Kueue admits the JobSet, not its child
    assert "kueue.x-k8s.io/queue-name" not in js["spec"]["replicatedJobs"][0]["template"]["metadata"]["labels"]
    assert "kueue.x-k8s.io/queue-name" not in find(render(JobSpec(name="a", image="i")), "Job")[0]["metadata"]["labels"]


def test_every_pod_lands_in_one_zone_the_first_pods_or_the_one_named():
    """EFA does not cross Availability Zones: without ``zone`` the pods follow the first one's zone (pod affinity to
    the job's own pods, which the first pod satisfies by itself); with it, a node selector; no EFA, no constraint."""
    def pod(**kw):
        return find(render(JobSpec(name="a", image="i", **kw)), "Job")[0]["spec"]["template"]["spec"]

    terms = pod()["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms == [{"labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "a"}},
                      "topologyKey": "topology.kubernetes.io/zone"}]
    named = pod(zone="us-west-2b")
    assert named["nodeSelector"]["topology.kubernetes.io/zone"] == "us-west-2b" and "podAffinity" not in named["affinity"]
    assert "podAffinity" not in pod(instance_type="g5.xlarge")["affinity"]  # no EFA


def test_the_kueue_cluster_queue_covers_every_resource_the_pods_ask_for():
    """A resource the ClusterQueue does not cover leaves the job pending for good: the queue is read from the pod."""
    from nvrx_lab.eks.kueue import kueue_objects

    s = JobSpec(name="a", image="i", nodes=16, workload="job", queue_name="p5", hugepages_2mi=1024, model="llama3.1-8b",
                local_ckpt_interval=5, local_ckpt_on_nvme=True)
    pod = find(render(s), "Job")[0]["spec"]["template"]["spec"]
    flavor, queue, local = kueue_objects(s, pod)
    group = queue["spec"]["resourceGroups"][0]
    assert group["coveredResources"] == ["cpu", "memory", "nvidia.com/gpu", "vpc.amazonaws.com/efa", "hugepages-2Mi",
                                         "ephemeral-storage"]
    quota = {r["name"]: r["nominalQuota"] for r in group["flavors"][0]["resources"]}
    assert quota["nvidia.com/gpu"] == "128" and quota["vpc.amazonaws.com/efa"] == "512"  # 16 pods x 8 GPUs, x 32 EFA
    assert quota["hugepages-2Mi"] == "16384Mi" and quota["cpu"] == "2752"  # 16 x 172 (90 % of 192 vCPUs)
    assert flavor["spec"]["nodeLabels"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert local["metadata"] == {"name": "p5", "namespace": "nvrx-lab"} and local["spec"]["clusterQueue"] == queue[
        "metadata"]["name"]
