"""EKS 'ready for p5' renderings: the node rank is the completion index for any node count, NCCL cannot fall
back to TCP unnoticed, hugepages are not switched off by fork safety, the script runs after the image's
entrypoint (args, not command), Kubernetes absorbs whole-group failures, and comments say true things."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from nvrx_lab.eks import JobSpec, render, validate
from nvrx_lab.eks.render import find

ROOT = Path(__file__).resolve().parents[1]


def _spec(**kw) -> JobSpec:
    return JobSpec(**{"name": "llama-ft", "image": "repo/nvrx-lab:1", "workload": "job", **kw})


def _container(ms) -> dict:
    return find(ms, "Job")[0]["spec"]["template"]["spec"]["containers"][0]


def _env(ms) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in _container(ms)["env"]}


def _launcher_argv(script: str, index: int, workdir: Path) -> list[str]:
    """Run the rendered script for one completion index with a stand-in ``python`` that prints its argv."""
    (workdir / "python").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (workdir / "python").chmod(0o755)
    env = {"PATH": f"{workdir}:{os.environ['PATH']}", "JOB_COMPLETION_INDEX": str(index), "NNODES": "12",
           "NODE_NAME": f"ip-10-0-0-{index}", "POD_IP": f"10.0.0.{index}", "NPROC_PER_NODE": "8",
           "RANK0_HOST": "llama-ft-0.llama-ft", "RDZV_PORT": "29400", "MASTER_PORT": "29500",
           "RUN_DIR": str(workdir / "run"), "LAUNCHER_CONFIG": "/etc/nvrx_lab/launcher.yaml"}
    out = subprocess.run(["/bin/bash", "-c", script], env=env, capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.splitlines()


@pytest.mark.parametrize("mode", ["ft_launcher", "ft_launcher+inprocess", "baseline"])
def test_node_rank_is_the_completion_index_with_12_nodes(mode, tmp_path):
    """c10d ranks nodes by sorting their addresses as strings; the pods' FQDNs would put index 10 before 2."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    script = _container(render(_spec(nodes=12, mode=mode)))["args"][2]
    argvs = {i: _launcher_argv(script, i, tmp_path) for i in range(12)}
    if mode == "baseline":  # torchrun's static rendezvous takes the node rank as given
        assert all(f"--node-rank={i}" in argv for i, argv in argvs.items())
        return
    addrs = {i: next(a.split("=", 1)[1] for a in argv if a.startswith("--local-addr=")) for i, argv in argvs.items()}
    assert addrs[0] == "llama-ft-0.llama-ft"  # index 0 hosts the stores: its address must resolve
    assert addrs[3] == "llama-ft-0.llama-ft/node-00003@10.0.0.3"  # a sort key, then where its round store listens
    participants = sorted(_NodeDesc(addr, pid=1000 - i, local_id=0) for i, addr in addrs.items())  # as c10d assigns ranks
    assert [addrs_index for d in participants for addrs_index, a in addrs.items() if a == d.addr] == list(range(12))


def test_efa_pins_the_ofi_plugin_and_hugepages_drop_fork_safety():
    env = _env(render(_spec()))
    assert env["NCCL_NET"] == "AWS Libfabric"  # NCCL fails at init when the aws-ofi-nccl plugin is missing
    assert env["FI_EFA_FORK_SAFE"] == "1" and env["FI_EFA_USE_HUGE_PAGE"] == "0"
    huge = render(_spec(hugepages_2mi=5120))
    validate(huge)
    env = _env(huge)
    assert "FI_EFA_FORK_SAFE" not in env and env["FI_EFA_USE_HUGE_PAGE"] == "1"  # fork safety would disable them
    assert _container(huge)["resources"]["limits"]["hugepages-2Mi"] == "5120Mi"


def test_script_is_args_so_the_image_entrypoint_runs_first():
    for mode in ("baseline", "ft_launcher"):
        c = _container(render(_spec(mode=mode)))
        assert "command" not in c and c["args"][:2] == ["/bin/bash", "-c"]
    text = (ROOT / "manifests" / "job-baseline.yaml").read_text()
    assert "args, not command: the image's entrypoint" in text


@pytest.mark.parametrize("nodes", [2, 16])
def test_backoff_limit_covers_whole_group_failures(nodes):
    """A launcher out of restarts closes the rendezvous and every pod fails: the Job must survive that."""
    launcher = find(render(_spec(nodes=nodes, mode="ft_launcher")), "Job")[0]["spec"]
    assert launcher["backoffLimit"] == 3 * nodes
    baseline = find(render(_spec(nodes=nodes, mode="baseline")), "Job")[0]["spec"]
    assert baseline["backoffLimit"] == 10 * nodes
    rules = launcher["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    assert find(render(_spec(nodes=nodes, backoff_limit=0)), "Job")[0]["spec"]["backoffLimit"] == 0
    assert _spec().launcher.max_restarts >= 10


def test_fault_schedule_uses_the_trainers_grammar():
    s = _spec(faults="1:5:exception,0:9:hang:load,15:100:sigkill:save")
    script = _container(render(s))["args"][2]
    assert "--faults=1:5:exception,0:9:hang:load,15:100:sigkill:save" in script
    assert dataclasses.replace(s, nodes=1, faults="7:1:oom").faults == "7:1:oom"


def test_committed_fsx_claim_has_no_pod_qos_comment():
    docs = (ROOT / "manifests" / "fsx-storage.yaml").read_text().split("\n---\n")
    pvc = next(d for d in docs if "kind: PersistentVolumeClaim" in d)
    assert "CPU has no limit" not in pvc
    assert "binds to a volume at least this large" in pvc
    assert "CPU has no limit" in (ROOT / "manifests" / "job-ft-launcher.yaml").read_text()  # where it is true
    assert [d["kind"] for d in yaml.safe_load_all((ROOT / "manifests" / "fsx-storage.yaml").read_text())] == [
        "PersistentVolume", "PersistentVolumeClaim"]
