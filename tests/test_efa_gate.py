"""The EFA gate's worker: NCCL's INFO log read for the network, the provider and GPUDirect RDMA (log lines as
aws-ofi-nccl 1.7-1.13 and NCCL 2.18-2.23 print them), bus bandwidth as nccl-tests computes it, and the worker run for
real under torchrun on the CPU (gloo: the network unchecked, and said)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_eks_submit import CLUSTER, REGION, SPEC, aws, kube, moto_url  # noqa: F401 - the fixtures

from nvrx_lab.eks import Access, EksError, JobSpec, Watch, local_run, render, submit, validate
from nvrx_lab.eks.gate import gate_manifests
from nvrx_lab.eks.render import find
from nvrx_lab.gpucheck.allreduce import bus_bandwidth, read_nccl_log, verdicts
from nvrx_lab.net import free_port

H = "ip-10-1-2-3:1234:1300 [0] NCCL INFO "
P5 = [H + "NCCL version 2.21.5+cuda12.4", H + "NET/Plugin: Loaded net plugin Libfabric (v8)",
      H + "NET/OFI Initializing aws-ofi-nccl 1.13.2-aws", H + "NET/OFI Selected provider is efa, fabric is efa (found 32 nics)",
      H + "Using network Libfabric",
      H + "Channel 00/0 : 8[0] -> 0[0] [receive] via NET/Libfabric/0/GDRDMA",
      H + "Channel 01/0 : 0[0] -> 8[0] [send] via NET/Libfabric/0/GDRDMA",
      H + "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read"]
OLD = [H + "NET/OFI Selected Provider is efa (found 4 nics)", H + "Using network AWS Libfabric",
       H + "Channel 00/0 : 8[0] -> 0[0] [receive] via NET/AWS Libfabric/0/GDRDMA"]
SOCKET = [H + "NET/Plugin: Could not find: libnccl-net.so", H + "NET/Socket : Using [0]eth0:10.1.2.3<0>",
          H + "Using network Socket", H + "Channel 00/0 : 8[0] -> 0[0] [receive] via NET/Socket/0"]
NO_GDR = [*P5[:5], H + "Channel 00/0 : 8[0] -> 0[0] [receive] via NET/Libfabric/0",
          H + "Channel 01/0 : 0[0] -> 8[0] [send] via NET/Libfabric/0/GDRDMA"]


def test_a_p5_log_passes_every_check():
    net = read_nccl_log(P5)
    assert (net.network, net.provider, net.nics, net.gdr_channels, net.net_channels) == ("Libfabric", "efa", 32, 2, 2)
    found = verdicts(net, busbw=352.0, min_busbw=200.0)
    assert all(ok for ok, _ in found.values()), found
    assert found["provider"][1] == "provider efa (32 NICs)"
    assert found["gdr"][1] == "GPUDirect RDMA on 2 of 2 network channels"
    assert net.evidence[0].endswith("Selected provider is efa, fabric is efa (found 32 nics)")


def test_the_older_plugin_names_pass_too():
    net = read_nccl_log(OLD)
    assert (net.network, net.provider, net.nics, net.gdr) == ("AWS Libfabric", "efa", 4, True)


@pytest.mark.parametrize("log,failed,says", [
    (SOCKET, {"network", "provider", "gdr"}, "network Socket: not the aws-ofi-nccl plugin"),
    (NO_GDR, {"gdr"}, "GPUDirect RDMA on 1 of 2 network channels (FI_EFA_USE_DEVICE_RDMA=1?"),
    ([], {"network", "provider", "gdr"}, "network not named in the log"),
])
def test_a_fallback_names_what_failed(log, failed, says):
    found = verdicts(read_nccl_log(log), busbw=352.0, min_busbw=200.0)
    assert {c for c, (ok, _) in found.items() if not ok} == failed
    assert any(line.startswith(says) for _, line in found.values()), found


def test_bus_bandwidth_is_nccl_tests():
    # 16 ranks, 1 GiB in 5 ms: algbw 214.7 GB/s, busbw x 2*15/16
    assert bus_bandwidth(2**30, 0.005, 16) == pytest.approx(2**30 / 0.005 * 30 / 16 / 1e9)
    assert verdicts(read_nccl_log(P5), busbw=150.0, min_busbw=200.0)["busbw"] == (
        False, "bus bandwidth 150.0 GB/s, floor 200.0 GB/s")


@pytest.mark.timeout(120)
def test_the_worker_runs_under_torchrun_on_the_cpu(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "nvrx_lab.gpucheck", "--nccl-allreduce", "--cpu-dry-run", "--size-mb", "4", "--iters", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    gate = [line for line in out.stdout.splitlines() if line.startswith("gate: ")]
    assert gate[0].startswith("gate: ok busbw: bus bandwidth") and "the network is not checked" in gate[0]
    assert gate[-1].startswith("gate: passed: 2 ranks on 1 nodes, 4 MB all-reduce")
    # a gate under its floor fails its pods: notebook 05 runs the rendered gate on p5's floor (gate: FAILED (busbw))


# -- the gate's Job: rendered from the job's pods, run by submit --gate, and run here by local_run -----------------

def test_the_gate_is_the_jobs_pods_on_two_nodes_never_retried():
    spec = JobSpec(name="llama3-8b", image="repo/nvrx-lab:1", nodes=16, model="llama3.1-8b", zone="us-west-2b")
    ms = gate_manifests(spec)
    validate(ms)
    job = find(ms, "Job")[0]
    pod, own = job["spec"]["template"]["spec"], find(render(spec), "JobSet")[0]
    own_pod = own["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert job["metadata"]["name"] == "llama3-8b-efa-gate" and job["spec"]["completions"] == 2
    assert job["spec"]["backoffLimit"] == 0
    assert pod["containers"][0]["resources"] == own_pod["containers"][0]["resources"]  # GPUs, EFA, hugepages, memory
    assert pod["containers"][0]["image"] == "repo/nvrx-lab:1" and pod["nodeSelector"] == own_pod["nodeSelector"]
    script = pod["containers"][0]["args"][2]
    assert "-m nvrx_lab.gpucheck --nccl-allreduce --size-mb=1024 --iters=20 --min-busbw=200 " in script  # 32 x 12.5 / 2
    p4d = gate_manifests(JobSpec(name="a", image="i", instance_type="p4d.24xlarge"))
    assert "--min-busbw=25 " in find(p4d, "Job")[0]["spec"]["template"]["spec"]["containers"][0]["args"][2]


PASSED = ["gate: ok network: network Libfabric", "gate: passed: 16 ranks on 2 nodes, 1024 MB all-reduce, 352.1 GB/s bus "
          "bandwidth"]


@pytest.mark.timeout(60)
def test_submit_gate_runs_the_gate_first_and_deletes_it(aws, kube):  # noqa: F811
    kube.log_lines = [*PASSED, *kube.log_lines]
    said: list[str] = []
    res = submit(SPEC, CLUSTER, REGION, dry_run=False, echo=said.append, watch=Watch(timeout_s=30, poll_s=0.05),
                 access=Access(api_server=kube.url, gate=True))
    assert res.status == "Succeeded"
    jobs = "/apis/batch/v1/namespaces/nvrx-lab/jobs"
    calls = [(m, p) for m, p, *_ in kube.requests if m in ("POST", "DELETE") and "/jobs" in p]
    assert calls == [("POST", jobs), ("DELETE", f"{jobs}/llama-ft-efa-gate"), ("POST", jobs)]
    assert f"{PASSED[1]} (Job/llama-ft-efa-gate deleted)" in said


@pytest.mark.timeout(60)
def test_a_failed_gate_stops_the_submit_with_its_verdict(aws, kube):  # noqa: F811
    verdict = "gate: FAILED (provider, gdr): 16 ranks on 2 nodes, 1024 MB all-reduce, 21.0 GB/s bus bandwidth"
    kube.log_lines, kube.failed_jobs = ["gate: FAILED provider: provider tcp: not efa", verdict], {"llama-ft-efa-gate"}
    with pytest.raises(EksError) as failed:
        submit(SPEC, CLUSTER, REGION, dry_run=False, echo=lambda line: None, watch=Watch(timeout_s=30, poll_s=0.05),
               access=Access(api_server=kube.url, gate=True))
    assert str(failed.value).startswith(f"EFA gate Failed: {verdict}; llama-ft was not submitted (kubectl -n nvrx-lab "
                                        "logs job/llama-ft-efa-gate")
    posts = [body["metadata"]["name"] for m, p, body, _ in kube.requests if m == "POST" and p.endswith("/jobs")]
    assert posts == ["llama-ft-efa-gate"]  # the job itself never created


@pytest.mark.timeout(120)
def test_the_gate_job_runs_its_pods_here(tmp_path):
    """The rendered gate, its two pods as local processes (local_run), on gloo: the rendezvous and the verdict."""
    ms = gate_manifests(JobSpec(name="tiny", image="i", nodes=4))
    c = find(ms, "Job")[0]["spec"]["template"]["spec"]["containers"][0]
    c["args"][2] = c["args"][2].replace("--nccl-allreduce", "--nccl-allreduce --cpu-dry-run").replace(
        "--size-mb=1024", "--size-mb=4").replace("--min-busbw=200", "--min-busbw=0")  # p5's floor: not on gloo
    run = local_run(ms, workdir=tmp_path, timeout_s=100)
    assert run.ok, f"{run.status}\n{run.log(0)[-3000:]}"
    assert "gate: passed: 2 ranks on 2 nodes, 4 MB all-reduce" in run.log(0)


def test_the_eks_layer_reads_the_gates_figures_without_torch():
    code = "import sys, nvrx_lab.eks, nvrx_lab.eks.gate; assert 'torch' not in sys.modules, 'torch imported'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
