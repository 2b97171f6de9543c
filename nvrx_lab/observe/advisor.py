"""Checkpoint interval advisor: Young/Daly for synchronous saves, and what async overlap changes.

Inputs are measured quantities: step time, the time a checkpoint write takes, the blocking time of
an async save (staging), restart time and the job's mean time between failures (MTBF, whole job).
First-order model, per interval of ``τ`` seconds of compute:

* sync: every interval pays the whole write ``w``; a failure loses on average half an interval
  plus the restart: efficiency ``τ / (τ + w)``, waste per failure ``R + (τ + w) / 2``
* async: every interval pays only the staging ``b`` (plus ``w − τ`` when the write outlasts the
  interval and saves queue); the newest durable checkpoint lags by ``w``, so a failure loses
  ``R + τ / 2 + w``

* local checkpoints (:mod:`nvrx_lab.checkpoint.local`) every ``τₗ`` of compute, each costing ``c``:
  the fraction ``p`` of failures a local copy survives (a process, a hang, one node with its replica
  elsewhere) loses ``R + τₗ / 2``; the rest (correlated losses: a rack, the whole job) fall back to
  storage. So storage saves only have to cover failures ``1 / (1 − p)`` times rarer, and their
  interval grows by about ``√(1 / (1 − p))``

Young (1974): ``τ* = √(2·w·M)``; Daly (2006) adds higher-order terms, used here for ``w < 2M``.
Under Kubernetes restarts, the restart time grows with every restart: :func:`crashloop_delay`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Advice:
    interval_s: float
    interval_steps: int
    expected_goodput: float
    checkpoint_efficiency: float
    """Throughput with saves / without, fault-free."""
    local_interval_steps: int = 0
    """Steps between local checkpoints (0: none)."""


def daly_interval(write_s: float, mtbf_s: float) -> float:
    """Daly's optimal compute time between synchronous checkpoints (seconds)."""
    if write_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"write_s={write_s} and mtbf_s={mtbf_s} must be > 0")
    if write_s >= 2 * mtbf_s:
        return mtbf_s
    x = write_s / (2 * mtbf_s)
    return math.sqrt(2 * write_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - write_s


def checkpoint_efficiency(interval_s: float, write_s: float, async_: bool, stage_s: float = 0.0) -> float:
    """Fault-free throughput with saves every ``interval_s`` of compute / throughput without."""
    overhead = stage_s + max(0.0, write_s - interval_s) if async_ else write_s
    return interval_s / (interval_s + overhead)


def expected_goodput(interval_s: float, write_s: float, mtbf_s: float, restart_s: float = 0.0,
                     async_: bool = False, stage_s: float = 0.0, local_interval_s: float = 0.0, local_s: float = 0.0,
                     local_coverage: float = 0.0) -> float:
    """Fraction of wall time that becomes kept progress (first order in 1 / MTBF), clipped to [0, 1].

    With ``local_interval_s`` > 0, a local checkpoint costing ``local_s`` every ``local_interval_s`` of
    compute restores the fraction ``local_coverage`` of failures; the rest roll back to storage."""
    eff = checkpoint_efficiency(interval_s, write_s, async_, stage_s)
    storage_lost = interval_s / 2 + (write_s if async_ else write_s / 2)
    lost = restart_s + storage_lost
    if local_interval_s > 0:
        eff *= local_interval_s / (local_interval_s + local_s)
        lost = restart_s + local_coverage * local_interval_s / 2 + (1 - local_coverage) * storage_lost
    return min(1.0, max(0.0, eff * (1 - lost / mtbf_s)))


def crashloop_delay(restart: int, pod_restart_s: float = 10.0, time_scale: float = 1.0) -> float:
    """Seconds before the ``restart``-th restart (1-based): pod restart + kubelet back-off (10 s, 20 s, … 300 s).

    What a Kubernetes pod restart adds to ``restart_s``; the ``baseline`` mode of ``python -m
    nvrx_lab.bench goodput`` waits it, times ``time_scale`` so a CPU run stays short."""
    backoff = min(300.0, 10.0 * 2 ** (restart - 1))
    return (pod_restart_s + backoff) * time_scale


def _best_steps(goodput, upper: int) -> int:
    """The whole number of steps in ``1 .. upper`` (searched on at most ~4,000 points) with the best ``goodput(k)``."""
    return max(range(1, max(2, upper), max(1, upper // 4000)), key=goodput)


def advise(step_s: float, write_s: float, mtbf_s: float, restart_s: float = 0.0, async_: bool = False,
           stage_s: float = 0.0, local_s: float | None = None, local_coverage: float = 0.9) -> Advice:
    """The interval (seconds and steps) that maximises expected goodput, and that goodput.

    Sync saves follow Daly. With async saves the write is hidden while it is shorter than the interval,
    so the best interval is searched numerically over whole steps (it is shorter than Daly's). With
    ``local_s`` (the cost of one local checkpoint) both intervals are searched, in turn, on the model's
    goodput: the local one near Young's for the failures it covers, the storage one for the rest."""
    if step_s <= 0:
        raise ValueError(f"step_s={step_s} must be > 0")
    if local_s is not None and (local_s < 0 or not 0 <= local_coverage < 1):
        raise ValueError(f"local_s={local_s} must be >= 0 and local_coverage={local_coverage} in [0, 1)")
    local_steps = 0
    if local_s is not None:  # storage covers only the failures a local copy does not survive
        storage_mtbf = mtbf_s / (1 - local_coverage)
        local_steps = max(1, round(math.sqrt(2 * max(local_s, 1e-9) * mtbf_s / max(local_coverage, 1e-9)) / step_s))
    else:
        storage_mtbf = mtbf_s

    def goodput(k: int, k_local: int) -> float:
        return expected_goodput(k * step_s, write_s, mtbf_s, restart_s, async_, stage_s, k_local * step_s,
                                local_s or 0.0, local_coverage if k_local else 0.0)

    upper = int(4 * max(daly_interval(max(write_s, 1e-9), storage_mtbf), write_s) / step_s) + 2
    if not async_ and not local_steps:
        steps = max(1, round(daly_interval(write_s, storage_mtbf) / step_s))
    else:
        steps = _best_steps(lambda k: goodput(k, local_steps), upper)
    for _ in range(2 if local_steps else 0):  # each interval in turn, the other held (the local one <= storage's)
        local_steps = _best_steps(lambda k, held=steps: goodput(held, k), min(4 * local_steps + 2, steps + 1))
        steps = _best_steps(lambda k, held=local_steps: goodput(k, held), upper)
    tau = steps * step_s
    eff = checkpoint_efficiency(tau, write_s, async_, stage_s)
    if local_steps:
        eff *= local_steps * step_s / (local_steps * step_s + local_s)
    return Advice(tau, steps, goodput(steps, local_steps), eff, local_steps)
