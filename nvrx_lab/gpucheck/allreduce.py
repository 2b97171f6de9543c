"""The EFA gate: ``torchrun … -m nvrx_lab.gpucheck --nccl-allreduce`` on two nodes before a job takes sixteen.

Every worker sums a buffer of ``--size-mb`` across all nodes with NCCL, timed like nccl-tests (warm-up, then
``--iters`` sums; bus bandwidth = bytes x 2(n-1)/n / time), with NCCL's INFO log written to one file a rank. Each rank
then reads its own log for what NCCL chose, and the ranks agree on the worst of them (one ``all_reduce`` of MIN):

* the network is the aws-ofi-nccl plugin (``Using network Libfabric``, or ``AWS Libfabric`` before 1.12), never
  ``Socket`` (NCCL's TCP fallback);
* its provider is ``efa`` (``NET/OFI Selected provider is efa``), with the NICs it found;
* the channels to the other node say ``GDRDMA`` (GPUDirect RDMA: the NIC reads the GPU's memory, no host copy);
* bus bandwidth at or above ``--min-busbw`` GB/s.

Rank 0 prints one line a check and a last line ``gate: passed …`` or ``gate: FAILED …``, which
``submit(..., access=Access(gate=True))`` reads; the workers exit 1 on a failure, so the gate's Job fails.

What p5 should give (not measured here: no GPU, no EFA): 32 EFA interfaces x 100 Gb/s = 400 GB/s a node; an
all-reduce across nodes is bound by that, and nccl-tests' bus bandwidth on two p5 nodes lands within a few tens of
GB/s under it for messages of 1 GB and more. The default floor, :data:`MIN_BUSBW_SHARE` of the line rate, fails a node
that lost half its interfaces or fell back to host copies, not one a few percent slow.

Torch is imported where the worker runs, so the EKS layer reads this module's figures without it.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

GBPS_PER_EFA = 100 / 8
"""GB/s of one EFA interface (100 Gb/s) on p4d, p5 and p5e."""
P5_EFA = 32
"""EFA interfaces of a p5.48xlarge: the default line rate without ``--min-busbw``."""
MIN_BUSBW_SHARE = 0.5
"""The default floor of bus bandwidth, as a share of the nodes' EFA line rate."""
OFI_NETWORKS = ("Libfabric", "AWS Libfabric")
CHECKS = ("network", "provider", "gdr", "busbw")


@dataclass
class NcclNetwork:
    """What one rank's NCCL INFO log says about the network it chose; ``evidence`` holds the lines that say it."""

    network: str = ""
    provider: str = ""
    nics: int = 0
    gdr_channels: int = 0
    net_channels: int = 0
    evidence: list[str] = field(default_factory=list)

    @property
    def ofi(self) -> bool:
        return self.network in OFI_NETWORKS

    @property
    def gdr(self) -> bool:
        """Every channel over the network uses GPUDirect RDMA (and there is one)."""
        return self.net_channels > 0 and self.gdr_channels == self.net_channels


USING = re.compile(r"Using network (.+?)\s*$")
PROVIDER = re.compile(r"NET/OFI Selected [Pp]rovider is (\w[\w-]*)(?:.*?found (\d+) nics)?")
CHANNEL = re.compile(r"\[(?:send|receive)\] via NET/(.+?)/(\d+)(/GDRDMA)?\s*$")


def read_nccl_log(lines) -> NcclNetwork:
    """Parse NCCL INFO lines (with ``NCCL_DEBUG_SUBSYS`` including ``INIT,NET``)."""
    net = NcclNetwork()
    for line in lines:
        line = line.rstrip("\n")
        if (m := USING.search(line)) and not net.network:
            net.network = m.group(1)
            net.evidence.append(line.strip())
        elif (m := PROVIDER.search(line)) and not net.provider:
            net.provider, net.nics = m.group(1), int(m.group(2) or 0)
            net.evidence.append(line.strip())
        elif m := CHANNEL.search(line):
            net.net_channels += 1
            net.gdr_channels += bool(m.group(3))
            if net.net_channels == 1:
                net.evidence.append(line.strip())
    return net


def verdicts(net: NcclNetwork, busbw: float, min_busbw: float) -> dict[str, tuple[bool, str]]:
    """Each check's (passed, one line)."""
    return {
        "network": (net.ofi, f"network {net.network or 'not named in the log'}" + (
            "" if net.ofi else ": not the aws-ofi-nccl plugin (is NCCL_NET set, the plugin in LD_LIBRARY_PATH? "
                               "Socket is NCCL's TCP fallback)")),
        "provider": (net.provider == "efa", f"provider {net.provider or 'none'}" + (
            f" ({net.nics} NICs)" if net.nics else "") + ("" if net.provider == "efa" else
                                                          ": not efa (FI_PROVIDER=efa? the EFA device plugin's "
                                                          "vpc.amazonaws.com/efa resources?)")),
        "gdr": (net.gdr, f"GPUDirect RDMA on {net.gdr_channels} of {net.net_channels} network channels" + (
            "" if net.gdr else " (FI_EFA_USE_DEVICE_RDMA=1? the nvidia-peermem or dmabuf support of the AMI?)")),
        "busbw": (busbw >= min_busbw, f"bus bandwidth {busbw:.1f} GB/s, floor {min_busbw:.1f} GB/s"),
    }


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce, GB/s."""
    return nbytes / seconds * 2 * (world - 1) / world / 1e9


def _log_env(log_dir: Path, rank: int) -> None:
    """NCCL's INFO log, one file a rank (set before the first communicator: NCCL reads them then)."""
    from nvrx_lab.dist import export_env

    log_dir.mkdir(parents=True, exist_ok=True)
    export_env({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
                "NCCL_DEBUG_FILE": str(log_dir / f"nccl-rank{rank}.%h.%p.log")})


def _timed_sums(size_mb: int, iters: int, device) -> float:
    """Seconds of one all-reduce of ``size_mb`` MB, the mean of ``iters`` after 5 warm-ups."""
    import torch
    import torch.distributed as dist

    buf = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32, device=device)
    for _ in range(5):
        dist.all_reduce(buf)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    sync()
    return (time.perf_counter() - t0) / iters


def run(size_mb: int, iters: int, min_busbw: float | None, log_dir: Path, cpu: bool) -> int:
    """One worker of the gate; 0 when every check passed on every rank."""
    import torch
    import torch.distributed as dist

    from nvrx_lab.dist import LaunchEnv

    launch = LaunchEnv.read()
    if not cpu:
        _log_env(log_dir, launch.rank)
        torch.cuda.set_device(launch.local_rank)
    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    try:
        seconds = _timed_sums(size_mb, iters, device)
        busbw = bus_bandwidth(size_mb * 2**20, seconds, world)
        nodes = max(1, world // launch.local_world_size)
        floor = min_busbw if min_busbw is not None else MIN_BUSBW_SHARE * _line_rate(nodes)
        if cpu:
            found = {"busbw": (busbw >= floor, f"bus bandwidth {busbw:.2f} GB/s (gloo on the CPU: the network is not "
                                               "checked)")}
        else:
            net = read_nccl_log(_own_log(log_dir, rank))
            found = verdicts(net, busbw, floor)
        passed = torch.tensor([int(found.get(c, (True,))[0]) for c in CHECKS], device=device)
        dist.all_reduce(passed, op=dist.ReduceOp.MIN)  # the worst rank decides
        ok = bool(passed.min())
        if rank == 0:
            for check, (_, line) in found.items():
                print(f"gate: {'ok' if passed[CHECKS.index(check)] else 'FAILED'} {check}: {line}", flush=True)
            if not cpu:
                print("gate: evidence: " + " | ".join(net.evidence[:3]), flush=True)
            bad = [c for c, p in zip(CHECKS, passed.tolist(), strict=True) if not p]
            print(f"gate: {'passed' if ok else 'FAILED (' + ', '.join(bad) + ')'}: {world} ranks on {nodes} nodes, "
                  f"{size_mb} MB all-reduce, {busbw:.1f} GB/s bus bandwidth", flush=True)
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


def _line_rate(nodes: int) -> float:
    """GB/s of a p5 node's 32 EFA interfaces across nodes (the gate's Job passes its own floor); 0 on one node."""
    return 0.0 if nodes < 2 else P5_EFA * GBPS_PER_EFA


def _own_log(log_dir: Path, rank: int) -> list[str]:
    files = sorted(log_dir.glob(f"nccl-rank{rank}.*.log"))
    return files[-1].read_text(errors="replace").splitlines() if files else []


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m nvrx_lab.gpucheck --nccl-allreduce", description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="MB summed a time (default 1024, as nccl-tests' 1 GB)")
    ap.add_argument("--iters", type=int, default=20, help="timed sums after 5 warm-ups (default 20)")
    ap.add_argument("--min-busbw", type=float, default=None, help="GB/s floor (default: half a p5's EFA line rate, 200)")
    ap.add_argument("--log-dir", default="/tmp/nccl-gate", help="where NCCL's INFO logs go, one file a rank")
    ap.add_argument("--cpu-dry-run", action="store_true", help="gloo on the CPU: tests this script, checks no network")
    a = ap.parse_args(argv)
    if a.size_mb < 1 or a.iters < 1:
        print(f"error: --size-mb and --iters must be >= 1, got {a.size_mb} and {a.iters}", file=sys.stderr)
        return 2
    return run(a.size_mb, a.iters, a.min_busbw, Path(a.log_dir), a.cpu_dry_run)
