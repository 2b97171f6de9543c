"""The EFA gate: a 2-node Job that sums across the nodes with NCCL before the real job takes its nodes.

A missing libfabric library, an rdma-core that does not match the AMI's driver or a node group without the EFA device
plugin shows up on 128 ranks after sixteen p5 nodes are up, as a hang or NCCL's TCP fallback at a tenth of the speed.
The gate is the job's own pod template (image, GPUs, EFA interfaces, hugepages, zone, volumes) on two nodes, running
``torchrun … -m nvrx_lab.gpucheck --nccl-allreduce`` (:mod:`nvrx_lab.gpucheck.allreduce`): it passes when NCCL chose
the aws-ofi-nccl plugin with the ``efa`` provider and GPUDirect RDMA on every network channel, at a bus bandwidth of at
least half the nodes' EFA line rate (p5: 32 x 100 Gb/s = 400 GB/s, floor 200 GB/s). ``backoffLimit: 0``: a failed
gate is not retried, and ``submit(..., access=Access(gate=True))`` (CLI ``submit --gate``) stops with its last line.
"""

from __future__ import annotations

import dataclasses

from nvrx_lab.eks.commands import flag_array, launch_head, launcher_flags
from nvrx_lab.eks.render import find, render
from nvrx_lab.eks.spec import JobSpec
from nvrx_lab.gpucheck.allreduce import GBPS_PER_EFA, MIN_BUSBW_SHARE

SUFFIX = "-efa-gate"
NODES = 2
SIZE_MB = 1024
ITERS = 20


def gate_spec(spec: JobSpec) -> JobSpec:
    """``spec``'s pods, two of them, as a plain Indexed Job that trains nothing and is never retried."""
    return dataclasses.replace(spec, name=f"{spec.name[:63 - len(SUFFIX) - 2]}{SUFFIX}", nodes=NODES, mode="baseline",
                               workload="job", faults="", local_ckpt_interval=0, local_ckpt_gib=0, ckpt="none",
                               backoff_limit=0, replica_groups=2, min_replicas=1, spare_nodes=0)


def min_busbw(spec: JobSpec) -> float:
    """GB/s the gate asks for: :data:`~nvrx_lab.gpucheck.allreduce.MIN_BUSBW_SHARE` of a node's EFA line rate."""
    return MIN_BUSBW_SHARE * spec.efa * GBPS_PER_EFA


def gate_script(g: JobSpec, floor: float) -> str:
    """The gate pod's ``bash -c`` script: torchrun across the two pods, one gate worker a GPU."""
    head = launch_head(g)
    check = ["--nccl-allreduce", f"--size-mb={SIZE_MB}", f"--iters={ITERS}", f"--min-busbw={floor:g}",
             "--log-dir=/tmp/nccl-gate"]
    return "\n".join([
        "# nvrx_lab EFA gate: an NCCL all-reduce across two of the job's nodes, read from NCCL's own log.",
        "# Rendered by nvrx_lab.eks.gate; passes on the plugin Libfabric, provider efa, GPUDirect RDMA and the floor.",
        "set -euo pipefail",
        ': "${JOB_COMPLETION_INDEX:?set by the Indexed Job}"',
        *flag_array("launcher_args", launcher_flags(g, head)),
        f'exec python -m {head.module} "${{launcher_args[@]}}" -m nvrx_lab.gpucheck {" ".join(check)}',
    ]) + "\n"


def gate_manifests(spec: JobSpec) -> list[dict]:
    """The gate's objects, in creation order: the namespace and storage if ``spec`` renders them, its headless Service
    and its Job, whose container runs :func:`gate_script`."""
    g = gate_spec(spec)
    manifests = render(g)
    job = find(manifests, "Job")[0]
    job["metadata"]["annotations"] = {"nvrx-lab/gate": f"EFA gate of {spec.name}"}
    job["spec"]["ttlSecondsAfterFinished"] = 3600
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["args"] = [*container["args"][:2], gate_script(g, min_busbw(spec))]
    return manifests
