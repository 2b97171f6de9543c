"""EKS manifests: every mode renders and validates strictly, bad specs name their field, rank 0 is found
for any node count, the committed manifests match the renderer, and nothing is privileged or inline-secret."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import yaml

from nvrx_lab.cli import leaves
from nvrx_lab.eks import MODES, JobSpec, ManifestError, pod_launcher, render, to_yaml, validate, write_manifests
from nvrx_lab.eks.__main__ import main as eks_main
from nvrx_lab.eks.commands import argv, launcher_flags, trainer_flags
from nvrx_lab.eks.render import find
from nvrx_lab.eks.validate import K8S_VERSION

ROOT = Path(__file__).resolve().parents[1]
FSX = dict(fsx_volume_handle="fs-0123456789abcdef0", fsx_dns_name="fs-0123456789abcdef0.fsx.us-west-2.amazonaws.com",
           fsx_mount_name="abcdefgh")


def spec(**kw) -> JobSpec:
    return JobSpec(**{"name": "llama-ft", "image": "repo/nvrx-lab:1", "workload": "job", **kw})  # auto: a JobSet from 4 nodes


def job_of(ms):
    return find(ms, "Job")[0]


def container_of(ms):
    return job_of(ms)["spec"]["template"]["spec"]["containers"][0]


def script_of(ms) -> str:
    return container_of(ms)["args"][2]


def env_of(ms) -> dict:
    return {e["name"]: e for e in container_of(ms)["env"]}


def walk(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from walk(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from walk(v, f"{path}.{i}")
    yield path, obj


def test_pinned_kubernetes_version_ships_with_kubernetes_validate():
    from kubernetes_validate.utils import all_versions
    assert any(v.startswith(K8S_VERSION + ".") for v in all_versions())


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_renders_and_validates_strictly(mode):
    ms = render(spec(mode=mode, hugepages_2mi=5120, priority_class="training", **FSX))
    validate(ms)
    kinds = [m["kind"] for m in ms]
    launcher = MODES[mode].uses_launcher
    coordinator = ["Service", "StatefulSet", "PodDisruptionBudget"]  # then two groups (tests/test_eks_replicas)
    workload = [*coordinator, "Service", "Job", "Service", "Job"] if MODES[mode].replicated else ["Service", "Job"]
    marks = launcher and not MODES[mode].replicated  # the node marker's RBAC (nvrx_lab.eks.rbac)
    assert kinds == (["Namespace", "PersistentVolume", "PersistentVolumeClaim"] + (["ConfigMap"] if launcher else [])
                     + (["ServiceAccount", "ClusterRole", "ClusterRoleBinding"] if marks else []) + workload)
    assert yaml.safe_load_all(to_yaml(ms)) and list(yaml.safe_load_all(to_yaml(ms))) == ms  # comments only, same data


def test_validate_reports_every_violation_with_its_path():
    ms = render(spec())
    j = job_of(ms)
    j["spec"]["completions"] = "two"
    j["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    with pytest.raises(ManifestError) as err:
        validate(ms)
    assert len(err.value.errors) == 2
    assert any("Job/llama-ft: spec.completions:" in e for e in err.value.errors)
    assert any("spec.template.spec.containers.0:" in e and "resourcez" in e for e in err.value.errors)


@pytest.mark.parametrize("kw, field, allowed", [
    (dict(name="Llama_FT"), "name", "DNS-1035"),
    (dict(name="1llama"), "name", "starting with a letter"),
    (dict(namespace="My_NS"), "namespace", "lower-case letters, digits and '-', starting and ending with a letter or "
                                           "digit, at most 63"),
    (dict(name="x" * 62, nodes=128), "name", "63"),
    (dict(nodes=0), "nodes", ">= 1"),
    (dict(gpus_per_node=9), "gpus_per_node", "1..8"),
    (dict(efa_per_node=33), "efa_per_node", "0..32"),
    (dict(instance_type="p4d.24xlarge", efa_per_node=8), "efa_per_node", "0..4"),
    (dict(instance_type="p5en.48xlarge", efa_per_node=32), "efa_per_node", "0..16"),
    (dict(instance_type="g5.xlarge", efa_per_node=1), "efa_per_node", "0..0"),
    (dict(instance_type="p9.huge"), "instance_type", "p5.48xlarge"),
    (dict(mode="ft-launcher"), "mode", "ft_launcher+inprocess"),
    (dict(global_batch=3), "global_batch", "multiple of the world size"),
    (dict(ckpt="fast"), "ckpt", "async"),
    (dict(faults="rank1-step5"), "faults", "RANK:STEP:KIND"),
    (dict(faults="1:5:exception:later"), "faults", "phase 'later'"),
    (dict(faults="16:5:exception"), "faults", "ranks 0..15 (world size 16 = 2 nodes x 8 GPUs)"),
    (dict(nodes=4, gpus_per_node=2, faults="1:5:hang,8:6:sigkill"), "faults", "ranks 0..7"),
    (dict(faults="1:1001:exception"), "faults", "steps 1..1000"),
    (dict(steps=50, faults="0:0:exception"), "faults", "steps 1..50"),
    (dict(env={"HF_TOKEN": "hf_abc"}), "env", "secret_env"),
    (dict(train_extra=("--steps", "5")), "train_extra", "--steps"),
    (dict(mount_path="/dev/fsx"), "mount_path", "absolute path"),
    (dict(master_port=29399), "master_port", "distinct"),
    (dict(shm_gib=5000), "shm_gib", "0 (auto) or 1.."),
    (dict(fsx_volume_handle="fs-0123456789abcdef0"), "fsx_dns_name", "required"),
    (dict(image=""), "image", "non-empty"),
    (dict(local_ckpt_gib=-1), "local_ckpt_gib", "0 (from the model)"),
    (dict(local_ckpt_interval=1, local_ckpt_gib=8, ckpt="none"), "local_ckpt_interval", "fallback"),
    (dict(local_ckpt_interval=1, local_ckpt_gib=5000), "local_ckpt_gib", "up to half"),
    (dict(model="llama3.1-70b", nodes=4, local_ckpt_interval=1, ckpt="async", fsx_capacity_gib=4800), "model",
     "local_ckpt_on_nvme=True"),
    (dict(model="llama3.1-70b", nodes=16), "fsx_capacity_gib", "kept checkpoints and one being written (847 GB each); "
                                                               "allowed: >= 4800"),
    (dict(model="llama3.1-70b", nodes=16, fsx_capacity_gib=4800, pg_timeout=900), "pg_timeout",
     "a save of llama3.1-70b on this FSx takes 722 s"),
    (dict(fsx_mbps_per_tib=2000), "fsx_mbps_per_tib", "50..1000"),
    (dict(zone="use1-az1"), "zone", "like us-west-2b"),
    (dict(model="llama3.1-70b"), "model", "needs 90.8 GB a GPU"),
    (dict(model="llama3.1-70b"), "model", "allowed: nodes >= 4"),
    (dict(model="gpt2"), "model", "expected one of tiny, llama3.2-1b"),
    (dict(data="tokens/llama3"), "data", "absolute path"),
    (dict(train_extra=("--model", "llama3.1-8b")), "train_extra", "--model"),
    (dict(local_ckpt_on_nvme=True), "local_ckpt_on_nvme", "local_ckpt_interval"),
    (dict(workload="jobsets"), "workload", "jobset"),
    (dict(workload="jobset", name="x" * 55, nodes=128), "name", "at most 52 characters"),
    (dict(queue_name="team a"), "queue_name", "LocalQueue"),
    (dict(pg_timeout=300), "pg_timeout", "longest section timeout (600 s)"),
    (dict(pg_timeout=0, mode="baseline"), "pg_timeout", "> 0"),
    (dict(rdzv_read_timeout=0), "rdzv_read_timeout", ">= 1"),
    (dict(rdzv_keep_alive_s=0.1), "rdzv_keep_alive_s", "(0.3 s) must be at least 2 x poll_interval (0.4 s)"),
    (dict(rdzv_poll_s=2), "rdzv_poll_s", "poll_interval seconds from 0.01 to 1"),
    (dict(rdzv_poll_s="0.2"), "rdzv_poll_s", "allowed: seconds, or None"),
    (dict(nodes=1024, rdzv_keep_alive_s=1), "rdzv_keep_alive_s", "273 MB/s on index 0's store; allowed: >= 1.4 s"),
    (dict(node_lost_toleration_s=600), "node_lost_toleration_s", "0..300"),
    (dict(nccl_trace_buffer=-1), "nccl_trace_buffer", "0 (off)"),
    (dict(train_extra=("--pg-timeout", "5")), "train_extra", "--pg-timeout"),
    (dict(heartbeat_timeout=0), "launcher.heartbeat_timeout", "> 0 seconds"),
    (dict(max_restarts=-1), "launcher.max_restarts", ">= 0"),
    (dict(monitor_interval=400), "launcher.monitor_interval", "shorter than heartbeat_timeout (300 s)"),
    (dict(section_timeouts={"Checkpoint": 60}), "launcher.section_timeouts", "lower-case section names"),
    (dict(launcher=pod_launcher(metrics_file="/tmp/m.jsonl")), "launcher.metrics_file", "None"),
])
def test_bad_spec_raises_naming_the_field_and_what_is_allowed(kw, field, allowed):
    with pytest.raises(ValueError) as err:
        spec(**kw)
    assert str(err.value).startswith(f"JobSpec.{field}:"), str(err.value)
    assert allowed in str(err.value)


@pytest.mark.parametrize("nodes", [2, 16, 128])
@pytest.mark.parametrize("mode", ["baseline", "ft_launcher+inprocess"])
def test_rank0_and_node_rank_for_any_node_count(nodes, mode):
    s = spec(nodes=nodes, mode=mode)
    ms = render(s)
    validate(ms)
    j, svc = job_of(ms), find(ms, "Service")[0]
    assert j["spec"]["completionMode"] == "Indexed"
    assert j["spec"]["completions"] == j["spec"]["parallelism"] == nodes
    pod = j["spec"]["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"] == "llama-ft" and svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= j["spec"]["template"]["metadata"]["labels"].items()
    env = env_of(ms)
    assert env["RANK0_HOST"]["value"] == "llama-ft-0.llama-ft"  # <job>-0.<service>, whatever the node count
    assert env["NNODES"]["value"] == str(nodes)
    assert "batch.kubernetes.io/job-completion-index" in env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    script = script_of(ms)
    assert "getent" not in script and "sleep" not in script and "HOSTNAME" not in script
    for index in (0, nodes - 1):
        args = argv(launcher_flags(s), {"NNODES": str(nodes), "NPROC_PER_NODE": "8", "RANK0_HOST": s.rank0_host,
                                        "MASTER_PORT": "29500", "RDZV_PORT": "29400", "JOB_COMPLETION_INDEX": str(index),
                                        "IS_RDZV_HOST": str(int(index == 0))})
        if MODES[mode].uses_launcher:
            assert "--rdzv-endpoint=llama-ft-0.llama-ft:29400" in args
            assert (f"--rdzv-conf=is_host={int(index == 0)},join_timeout=1800,read_timeout=600,rejoin_read_timeout=60,"
                    "keep_alive_interval=0.5,poll_interval=0.2") in args
        else:
            assert f"--node-rank={index}" in args and "--master-addr=llama-ft-0.llama-ft" in args
            assert "--rdzv-conf=timeout=1800" in args
    assert "IS_RDZV_HOST=$(( JOB_COMPLETION_INDEX == 0 ? 1 : 0 ))" in script or not MODES[mode].uses_launcher


def test_launcher_flags_parse_with_torchruns_own_parser():
    from torch.distributed.run import get_args_parser
    env = {"NNODES": "2", "NPROC_PER_NODE": "8", "RANK0_HOST": "j-0.j", "MASTER_PORT": "29500", "RDZV_PORT": "29400",
           "JOB_COMPLETION_INDEX": "1", "IS_RDZV_HOST": "0", "RUN_DIR": "/fsx/j"}
    for mode in MODES:
        s = spec(mode=mode)
        flags = [f for f in launcher_flags(s) if f.flag not in ("--config", "--metrics-file", "--mark-node")]  # ours
        args = get_args_parser().parse_args([*argv(flags, env), "-m", "nvrx_lab.train", *argv(trainer_flags(s), env)])
        assert args.nnodes == "2" and args.nproc_per_node == "8" and args.module
        assert args.training_script == "nvrx_lab.train" and "--steps=1000" in args.training_script_args


def test_per_mode_commands_and_restart_policies():
    ms = {m: render(spec(mode=m)) for m in MODES}
    scripts = {m: script_of(x) for m, x in ms.items()}
    for m in ("baseline", "async_ckpt", "inprocess"):
        assert "exec python -m nvrx_lab.eks.torchrun" in scripts[m] and "--max-restarts=0" in scripts[m]
        assert job_of(ms[m])["spec"]["backoffLimit"] == 20 and not find(ms[m], "ConfigMap")
    for m in ("ft_launcher", "ft_launcher+inprocess"):
        assert "exec python -m nvrx_lab.launcher" in scripts[m] and "--max-restarts=10" in scripts[m]
        assert job_of(ms[m])["spec"]["backoffLimit"] == 6  # 3 whole-group failures of 2 pods
        cfg = yaml.safe_load(find(ms[m], "ConfigMap")[0]["data"]["launcher.yaml"])
        assert cfg["heartbeat_timeout"] == 300 and cfg["section_timeouts"] == "checkpoint=600"
        mounts = {v["mountPath"] for v in container_of(ms[m])["volumeMounts"]}
        assert "/etc/nvrx_lab" in mounts and '--config="${LAUNCHER_CONFIG}"' in scripts[m]
        assert env_of(ms[m])["LAUNCHER_CONFIG"]["value"] == "/etc/nvrx_lab/launcher.yaml"
    assert yaml.safe_load(find(ms["ft_launcher"], "ConfigMap")[0]["data"]["launcher.yaml"])["restart_policy"] == "any-failed"
    config = find(ms["ft_launcher+inprocess"], "ConfigMap")[0]["data"]["launcher.yaml"]
    assert yaml.safe_load(config)["restart_policy"] == "min-healthy"
    assert "--ckpt=async" in scripts["async_ckpt"] and "--ckpt=sync" in scripts["baseline"]
    assert "--restart=inprocess" in scripts["inprocess"] and "--restart=launcher+inprocess" in scripts["ft_launcher+inprocess"]
    for m, x in ms.items():
        env = env_of(x)
        assert env["FI_PROVIDER"]["value"] == "efa" and env["FI_EFA_FORK_SAFE"]["value"] == "1"
        assert env["NCCL_NET"]["value"] == "AWS Libfabric"
        assert env["FI_EFA_USE_DEVICE_RDMA"]["value"] == "1"
        inproc = MODES[m].inprocess
        assert ("NCCL_NVLS_ENABLE" in env) == inproc and ("TORCH_NCCL_RETHROW_CUDA_ERRORS" in env) == inproc
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"]["value"] == ("2" if inproc else "1" if MODES[m].uses_launcher else "3")
        rules = job_of(x)["spec"]["podFailurePolicy"]["rules"]
        assert {r["action"] for r in rules} == {"FailJob", "Ignore"}
    g5 = env_of(render(spec(instance_type="g5.48xlarge", mode="baseline")))
    assert "FI_EFA_USE_DEVICE_RDMA" not in g5 and g5["FI_PROVIDER"]["value"] == "efa"  # g5 has EFA without RDMA
    g6 = env_of(render(spec(instance_type="g6.xlarge", mode="baseline")))
    assert "FI_PROVIDER" not in g6 and "NCCL_NET" not in g6  # no EFA at all: NCCL's own sockets


def test_every_launcher_setting_of_the_spec_reaches_the_pods_launcher(tmp_path):
    """``JobSpec.launcher`` is the launcher's own config: the pod's flags and its ConfigMap, read back by the
    launcher's parser, give that config (with the mode's restart policy and the run's event file)."""
    from nvrx_lab.launcher.cli import parse

    launcher = pod_launcher(heartbeat_timeout=42.5, shutdown_timeout=30, standby=False, standby_preload=["torch"],
                            min_healthy=1, section_timeouts={"checkpoint": 700, "eval": 30})
    s = spec(mode="ft_launcher+inprocess", launcher=launcher, pg_timeout=900)
    ms = render(s)
    (tmp_path / "launcher.yaml").write_text(find(ms, "ConfigMap")[0]["data"]["launcher.yaml"])
    env = {"NNODES": "2", "NPROC_PER_NODE": "8", "RANK0_HOST": "j-0.j", "RDZV_PORT": "29400", "NODE_ADDR": "j-0.j",
           "IS_RDZV_HOST": "1", "RUN_DIR": str(tmp_path), "LAUNCHER_CONFIG": str(tmp_path / "launcher.yaml"),
           "NODE_NAME": "ip-10-0-0-1"}
    args, read = parse([*argv(launcher_flags(s), env), "-m", "nvrx_lab.train"])
    assert read == dataclasses.replace(s.launcher, metrics_file=f"{tmp_path}/metrics.jsonl", mark_node="ip-10-0-0-1")
    assert read.restart_policy == "min-healthy" and read.heartbeat_timeout == 42.5 and read.standby is False
    assert (args.max_restarts, args.monitor_interval, args.shutdown_timeout) == (10, 1.0, 30)


def test_every_launcher_and_trainer_flag_carries_a_comment():
    for mode in MODES:
        script = script_of(render(spec(mode=mode, faults="1:50:exception")))
        flag_lines = [ln for ln in script.splitlines() if re.match(r"^\s+--", ln)]
        assert len(flag_lines) >= 12
        assert all(re.search(r"\S\s+# \w", ln) for ln in flag_lines), flag_lines
    cm = find(render(spec(mode="ft_launcher")), "ConfigMap")[0]["data"]["launcher.yaml"].splitlines()
    keys = [i for i, ln in enumerate(cm) if re.match(r"^\w+:", ln)]
    assert keys and all(cm[i - 1].startswith("# ") for i in keys)


def test_resources_devices_storage_and_scheduling():
    ms = render(spec(hugepages_2mi=5120, **FSX))
    c = container_of(ms)
    req, lim = c["resources"]["requests"], c["resources"]["limits"]
    assert {k: v for k, v in req.items() if k != "cpu"} == lim and "cpu" in req  # no CPU limit: no CFS quota
    guaranteed = container_of(render(spec(cpu_limit=True)))["resources"]
    assert guaranteed["requests"] == guaranteed["limits"]
    assert lim["nvidia.com/gpu"] == "8" and lim["vpc.amazonaws.com/efa"] == "32" and lim["hugepages-2Mi"] == "5120Mi"
    assert int(req["cpu"]) <= 192 and int(lim["memory"].removesuffix("Gi")) < 2048
    pod = job_of(ms)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert {t["key"] for t in pod["tolerations"]} >= {"nvidia.com/gpu"}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert vols["fsx"]["persistentVolumeClaim"]["claimName"] == "fsx-claim"
    pv, pvc = find(ms, "PersistentVolume")[0], find(ms, "PersistentVolumeClaim")[0]
    assert pv["spec"]["csi"]["driver"] == "fsx.csi.aws.com" and pv["spec"]["csi"]["volumeHandle"] == FSX["fsx_volume_handle"]
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"] and pv["spec"]["claimRef"]["name"] == pvc["metadata"]["name"]
    small = container_of(render(spec(instance_type="p5en.48xlarge", gpus_per_node=4, efa_per_node=8)))
    assert small["resources"]["limits"]["vpc.amazonaws.com/efa"] == "8" and small["resources"]["limits"]["nvidia.com/gpu"] == "4"


def test_local_checkpoints_get_their_flag_and_room_in_dev_shm():
    ms = render(spec(local_ckpt_interval=1, local_ckpt_gib=48))
    assert re.search(r"--local-ckpt-interval=1\s+# .*rolls back", script_of(ms))
    vols = {v["name"]: v for v in job_of(ms)["spec"]["template"]["spec"]["volumes"]}
    assert vols["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "112Gi"}, "64 GiB for NCCL and loaders + 48"
    assert "--local-ckpt-interval" not in script_of(render(spec())), "off by default: the manifests/ do not change"


@pytest.mark.parametrize("mode", list(MODES))
def test_never_privileged_only_ipc_lock_and_no_inline_secrets(mode):
    ms = render(spec(mode=mode, env={"MY_FLAG": "1"}, secret_env={"HF_TOKEN": "hf/token", "WANDB_API_KEY": "wandb/key"}))
    for path, value in walk(ms):
        assert not (path.endswith(".privileged") and value is True), path
        assert "hostPath" not in path and not path.endswith(".hostNetwork") and not path.endswith(".hostPID")
    c = container_of(ms)
    assert c["securityContext"]["capabilities"] == {"add": ["IPC_LOCK"]}
    assert c["securityContext"]["privileged"] is False and c["securityContext"]["allowPrivilegeEscalation"] is False
    pod = job_of(ms)["spec"]["template"]["spec"]
    if not find(ms, "ClusterRole"):
        assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    else:  # the node marker's token (nvrx_lab.eks.rbac): it may get and patch nodes, nothing else
        assert pod["automountServiceAccountToken"] is True and pod["serviceAccountName"] == "llama-ft-pods"
        assert find(ms, "ClusterRole")[0]["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
        assert find(ms, "ClusterRoleBinding")[0]["subjects"] == [{"kind": "ServiceAccount", "name": "llama-ft-pods",
                                                                  "namespace": "nvrx-lab"}]
        assert not render(spec(mode=mode, mark_unhealthy_nodes=False))[-1]["spec"]["template"]["spec"][
            "automountServiceAccountToken"]
    env = env_of(ms)
    for name in ("HF_TOKEN", "WANDB_API_KEY"):
        assert "value" not in env[name] and "secretKeyRef" in env[name]["valueFrom"]
    assert not [e for e in c["env"] if "value" in e and re.search("TOKEN|SECRET|PASSWORD|KEY", e["name"])]
    assert not find(ms, "Secret")


def test_committed_manifests_do_not_drift_from_the_renderer(tmp_path):
    fresh = {p.name: p.read_text() for p in write_manifests(tmp_path)}
    committed = {p.name: p.read_text() for p in (ROOT / "manifests").glob("*.yaml")}
    assert {f"jobset-{m}.yaml" for m in ("baseline", "ft-launcher")} <= set(committed)
    assert set(committed) == set(fresh), \
        "manifests/ has stale or missing files: run python -m nvrx_lab.eks render --out manifests/"
    for name, text in fresh.items():
        assert committed[name] == text, f"manifests/{name} drifted: run python -m nvrx_lab.eks render --out manifests/"
    for text in committed.values():
        validate([d for d in yaml.safe_load_all(text) if d])
    assert (ROOT / "manifests" / "Dockerfile").exists() and (ROOT / "manifests" / "README.md").exists()


def test_cli_render_and_validate(tmp_path, capsys):
    assert eks_main(["render", "--out", str(tmp_path), "--nodes", "16"]) == 0
    assert eks_main(["validate", *map(str, sorted(tmp_path.glob("*.yaml")))]) == 0
    job = [d for d in yaml.safe_load_all((tmp_path / "job-ft-launcher.yaml").read_text()) if d][-1]
    assert job["spec"]["completions"] == 16
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {clusterIP: None, portz: []}\n")
    assert eks_main(["validate", str(bad)]) == 2
    assert "portz" in capsys.readouterr().err


def test_trainer_accepts_every_rendered_trainer_flag():
    import nvrx_lab.train as train
    fields = set(train.TrainConfig.flags())
    flags = {f.flag[2:].replace("-", "_") for m in MODES for f in trainer_flags(spec(mode=m, faults="1:5:exception"))}
    assert flags <= fields, f"nvrx_lab.train has no flag for {sorted(flags - fields)}"
    choices = {flag: typing.get_args(kind) for _, _, kind, flag in leaves(train.TrainConfig)}
    for m in MODES:  # and the values are among the trainer's choices
        s = spec(mode=m)
        assert s.mode_info.restart in choices["restart"]
        assert s.ckpt_mode in choices["ckpt"]


def test_the_trainer_never_runs_as_root_and_the_one_root_step_only_chowns_the_run_folder():
    from nvrx_lab.eks.render import RUN_AS

    pod = job_of(render(spec()))["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS}
    assert "runAsUser" not in pod["containers"][0]["securityContext"]  # the pod's: uid 1000
    init = pod["initContainers"][0]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert init["command"][-1] == f'mkdir -p "$RUN_DIR" && chown {RUN_AS}:{RUN_AS} "$RUN_DIR"'
    assert {"name": "RUN_DIR", "value": "/fsx/llama-ft"} in init["env"]
    assert f"USER {RUN_AS}:{RUN_AS}" in (ROOT / "manifests" / "Dockerfile").read_text()  # the image agrees
