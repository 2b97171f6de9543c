"""local_run: the shipped container command lines as local CPU processes, one per completion index, with
pod DNS names, ports, GPU counts and volume paths mapped; the Job controller's restart rules hold."""

from __future__ import annotations

import dataclasses

import pytest

from nvrx_lab.eks import JobSpec, local_run, plan, render
from nvrx_lab.eks.render import find
from nvrx_lab.observe.events import read_events


def test_plan_maps_dns_ports_gpus_and_paths_and_drops_host_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "host-secret")
    monkeypatch.setenv("HF_TOKEN", "host-token")
    s = JobSpec(name="llama-ft", image="i", nodes=3, mode="ft_launcher")
    run = plan(render(s), tmp_path, max_procs_per_node=2, secrets={("hf-token", "token"): "hf_from_secret"})
    assert [p.index for p in run.pods] == [0, 1, 2]
    for p in run.pods:
        assert p.env["JOB_COMPLETION_INDEX"] == str(p.index) and p.env["HOSTNAME"] == f"llama-ft-{p.index}"
        assert p.env["RANK0_HOST"] == "127.0.0.1"  # llama-ft-0.llama-ft -> loopback
        assert p.env["NPROC_PER_NODE"] == "2"  # 8 GPUs -> 2 CPU workers
        assert p.env["RDZV_PORT"] == str(run.ports[29400]) != "29400"
        assert p.env["MASTER_PORT"] == str(run.ports[29500])
        assert p.env["RUN_DIR"] == str(tmp_path / "pvc" / "fsx-claim" / "llama-ft")  # FSx -> a shared directory
        assert p.env["HF_TOKEN"] == "hf_from_secret" and "AWS_SECRET_ACCESS_KEY" not in p.env
        assert p.env["CUDA_VISIBLE_DEVICES"] == ""
        assert p.argv[:2] == ["/bin/bash", "-c"] and '--config="${LAUNCHER_CONFIG}"' in p.argv[2]  # run as written
        assert p.env["LAUNCHER_CONFIG"] == f"{tmp_path}/configmap/llama-ft-launcher/launcher.yaml"
    assert (tmp_path / "configmap" / "llama-ft-launcher" / "launcher.yaml").read_text().startswith("# nvrx_lab.launcher")
    assert run.local_path("/fsx/llama-ft/metrics.jsonl") == tmp_path / "pvc" / "fsx-claim" / "llama-ft" / "metrics.jsonl"
    with pytest.raises(ValueError, match="is not under any volume mount"):
        run.local_path("/data/x")
    with pytest.raises(ValueError, match="max_nodes=4"):
        local_run(render(dataclasses.replace(s, nodes=16)))


def _with_command(manifests, script: str):
    find(manifests, "Job")[0]["spec"]["template"]["spec"]["containers"][0]["args"] = ["/bin/bash", "-c", script]
    return manifests


def test_job_controller_rules_backoff_limit_fail_job_and_replacement(tmp_path):
    s = JobSpec(name="flaky", image="i", nodes=2, mode="baseline", backoff_limit=2)
    failjob = local_run(_with_command(render(s), "exit 2"), workdir=tmp_path / "a", timeout_s=30)
    assert failjob.status == "Failed" and failjob.failures == 0  # podFailurePolicy: exit 2 fails the Job at once
    counted = local_run(_with_command(render(s), "exit 1"), workdir=tmp_path / "b", timeout_s=30)
    assert counted.status == "Failed" and counted.failures == 3  # backoffLimit 2: the third failure ends it
    once = 'f="$RUN_DIR/seen-$JOB_COMPLETION_INDEX"; mkdir -p "$RUN_DIR"; [ -e "$f" ] && exit 0; touch "$f"; exit 1'
    replaced = local_run(_with_command(render(s), once), workdir=tmp_path / "c", timeout_s=30)
    assert replaced.ok and replaced.failures == 2 and [p.returncodes for p in replaced.pods] == [[1, 0], [1, 0]]


TINY = ("--seq-len", "16", "--dim", "32", "--n-layers", "1", "--n-heads", "2", "--hidden-dim", "64", "--log-every", "1")


@pytest.mark.timeout(150)  # under the launcher: test_eks_rejoin
@pytest.mark.parametrize("mode", ["baseline", pytest.param("ft_launcher", marks=pytest.mark.slow)])
def test_real_trainer_under_local_run(mode, tmp_path):
    import nvrx_lab.train as train
    fields = set(train.TrainConfig.flags())
    missing = {"ckpt", "ckpt_interval", "ckpt_dir", "restart"} - fields
    assert not missing, f"nvrx_lab.train has no {sorted(missing)} flags"
    # One save (step 3): the trainer computes heartbeat timeouts only after a second save (see layers.LauncherHooks).
    s = JobSpec(name="tiny", image="i", nodes=2, mode=mode, steps=4, global_batch=16, ckpt_interval=3, train_extra=TINY,
                initial_heartbeat_timeout=60, heartbeat_timeout=30)
    run = local_run(render(s), workdir=tmp_path, timeout_s=130)
    assert run.ok, f"{run.status}\n{run.log(0)[-4000:]}\n{run.log(1)[-2000:]}"
    events = read_events(run.local_path("/fsx/tiny/metrics.jsonl"))  # FSx -> one directory shared by both "nodes"
    assert [e["step"] for e in events if e["kind"] == "step"] == [1, 2, 3, 4]
    assert {e["world_size"] for e in events if e["kind"] == "start"} == {2}  # 2 nodes x (8 GPUs -> 1 CPU worker)
    assert "rank 0 at 127.0.0.1" in run.log(1)  # <job>-0.<job> -> loopback
    assert any(run.local_path("/fsx/tiny/ckpt").iterdir())



def test_manifests_read_back_from_yaml_plan_the_same_pods(tmp_path):
    """The committed YAML runs as it is written: nothing in the script depends on the JobSpec it came from."""
    import yaml

    from nvrx_lab.eks import to_yaml

    s = JobSpec(name="llama-ft", image="i", nodes=2, mode="ft_launcher")
    from_yaml = [m for m in yaml.safe_load_all(to_yaml(render(s))) if m]
    direct, again = plan(render(s), tmp_path / "a"), plan(from_yaml, tmp_path / "b")
    assert [p.argv for p in direct.pods] == [p.argv for p in again.pods]
    assert again.pods[0].env["LAUNCHER_CONFIG"] == str(tmp_path / "b" / "configmap" / "llama-ft-launcher" / "launcher.yaml")
    assert (tmp_path / "b" / "configmap" / "llama-ft-launcher" / "launcher.yaml").exists()
