"""``bench replicas`` at a job's shape: what replica groups cost a step when nothing fails, and what the data plane
moves on p5.

* :func:`overhead` — the same 6 ranks and global batch trained two ways, in alternation: plain HSDP (one torchrun job,
  ``--replicate 3``: FSDP2 shards over 2 ranks and all-reduces over 3) and replica groups (3 torchrun jobs of 2 ranks,
  a coordinator, the quorum's gloo group). ``overhead_x`` = replica groups' median step ÷ HSDP's. The model is not toy
  sized: its gradients are :func:`grad_mb` MB (≥ 50) and its step well over 0.25 s here.
* :func:`p5_rows` — the arithmetic beside it: the bytes a rank sends and receives per step across replicas for Llama
  3.1 8B (one p5 node a group) and 70B (two) at 8 and 16 groups, and the time at EFA's bandwidth and at one TCP
  flow's (what the socket ring this replaced would have had).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from nvrx_lab.observe.events import read_events
from nvrx_lab.replicas.local import Groups, run_local
from nvrx_lab.runner import torchrun

SHAPE = ["--seq-len", "64", "--dim", "512", "--n-layers", "4", "--n-heads", "8", "--hidden-dim", "1536",
         "--global-batch", "12", "--log-every", "0", "--threads", "1", "--device", "cpu"]
"""14 M parameters (56 MB of float32 gradients), a row a rank: a step of about a second here at 6 ranks."""
GROUPS, RANKS = 3, 2
WARM = 3
"""Steps left out of each median (the first calls' one-off costs)."""

P5_GPUS = 8
EFA_GBPS_PER_GPU = 400.0
"""p5.48xlarge: 32 EFA interfaces x 100 Gb/s = 3,200 Gb/s a node, 400 Gb/s a GPU."""
TCP_FLOW_GBPS = 10.0
"""One TCP flow between two EC2 instances in a cluster placement group (5 Gb/s outside one)."""
MODELS = {"llama3.1-8b": (8.03e9, 1), "llama3.1-70b": (70.6e9, 2)}
"""Parameters, and p5 nodes a group: 16 bytes of state a parameter (fp32 weights, gradients, Adam's two moments) is
128 GB for 8B (one node's 640 GB of HBM) and 1.13 TB for 70B (two nodes)."""
REDUCE_BYTES = 4
"""Gradients reduced in float32 (FSDP2's MixedPrecisionPolicy(reduce_dtype=float32))."""


def grad_mb(args: list[str] = SHAPE) -> float:
    """The model's gradient bytes (float32), built on the meta device."""
    import torch

    from nvrx_lab.train.config import TrainConfig
    from nvrx_lab.train.model import Transformer

    with torch.device("meta"):
        model = Transformer(TrainConfig.from_args(args).model)
    return sum(p.numel() for p in model.parameters()) * 4 / 1e6


def _median_step(events: list[dict]) -> float:
    times = [e["t"] for e in sorted(events, key=lambda e: e["step"]) if e["step"] > WARM]
    return statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def hsdp_step(root: Path, steps: int) -> float:
    """Plain HSDP over the same ranks: its median step (seconds between committed steps, as replica groups' are)."""
    metrics = root / f"hsdp-{time.monotonic_ns()}.jsonl"
    res = torchrun(GROUPS * RANKS, "-m", "nvrx_lab.train", *SHAPE, "--steps", str(steps), "--replicate", str(GROUPS),
                   "--metrics", str(metrics), timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"HSDP exited {res.returncode}:\n{res.output[-3000:]}")
    return _median_step(read_events(metrics, "step"))


def replicas_step(root: Path, steps: int) -> float:
    """Replica groups, fault-free: replica 0's median step."""
    out = root / f"groups-{time.monotonic_ns()}"
    code = run_local(Groups(GROUPS, RANKS, max_restarts=0, min_replicas=GROUPS), out,
                     [*SHAPE, "--steps", str(steps), "--replica-fingerprint-every", "0"], timeout=900)
    if code != 0:
        logs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(out.glob("replica*.log")))
        raise RuntimeError(f"a replica group exited {code}{logs}")
    return _median_step(read_events(out / "replica0.jsonl", "step"))


def overhead(root: Path, pairs: int, steps: int) -> dict:
    """``pairs`` alternations of HSDP and replica groups; the medians and their ratio."""
    hsdp, groups = [], []
    for _ in range(pairs):
        hsdp.append(hsdp_step(root, steps))
        groups.append(replicas_step(root, steps))
    h, g = statistics.median(hsdp), statistics.median(groups)
    return {"system": "nvrx_lab", "fault": "none: vs HSDP", "runs": f"{pairs}/{pairs}", "overhead_x": g / h,
            "median_step_s": g, "hsdp_step_s": h, "grad_mb": grad_mb(),
            "shape": f"{GROUPS} groups x {RANKS} ranks, global batch 12"}


def p5_rows() -> list[dict]:
    """Bytes a rank moves across replicas per step (a ring all-reduce: 2 (R-1)/R of its shard each way) and the time
    at EFA's and at one TCP flow's bandwidth."""
    rows = []
    for name, (params, nodes) in MODELS.items():
        shard = params * REDUCE_BYTES / (P5_GPUS * nodes)
        for groups in (8, 16):
            moved = 2 * (groups - 1) / groups * shard
            rows.append({"model": name, "nodes_a_group": nodes, "groups": groups, "shard_gb": shard / 1e9,
                         "moved_gb": moved / 1e9,
                         "efa_s": moved * 8 / (EFA_GBPS_PER_GPU * 1e9), "tcp_flow_s": moved * 8 / (TCP_FLOW_GBPS * 1e9)})
    return rows
