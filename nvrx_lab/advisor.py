"""Checkpoint interval advisor: Young/Daly for synchronous saves, and what async overlap changes.

Inputs are measured quantities: step time, the time a checkpoint write takes, the blocking time of
an async save (staging), restart time and the job's mean time between failures (MTBF, whole job).
First-order model, per interval of ``τ`` seconds of compute:

* sync: every interval pays the whole write ``w``; a failure loses on average half an interval
  plus the restart: efficiency ``τ / (τ + w)``, waste per failure ``R + (τ + w) / 2``
* async: every interval pays only the staging ``b`` (plus ``w − τ`` when the write outlasts the
  interval and saves queue); the newest durable checkpoint lags by ``w``, so a failure loses
  ``R + τ / 2 + w``

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
                     async_: bool = False, stage_s: float = 0.0) -> float:
    """Fraction of wall time that becomes kept progress (first order in 1 / MTBF), clipped to [0, 1]."""
    eff = checkpoint_efficiency(interval_s, write_s, async_, stage_s)
    lost = restart_s + interval_s / 2 + (write_s if async_ else write_s / 2)
    return min(1.0, max(0.0, eff * (1 - lost / mtbf_s)))


def crashloop_delay(restart: int, pod_restart_s: float = 10.0, time_scale: float = 1.0) -> float:
    """Seconds before the ``restart``-th restart (1-based): pod restart + kubelet back-off (10 s, 20 s, … 300 s).

    What a Kubernetes pod restart adds to ``restart_s``; the ``baseline`` mode of ``python -m
    nvrx_lab.bench goodput`` waits it, times ``time_scale`` so a CPU run stays short."""
    backoff = min(300.0, 10.0 * 2 ** (restart - 1))
    return (pod_restart_s + backoff) * time_scale


def advise(step_s: float, write_s: float, mtbf_s: float, restart_s: float = 0.0, async_: bool = False,
           stage_s: float = 0.0) -> Advice:
    """The interval (seconds and steps) that maximises expected goodput, and that goodput.

    Sync saves follow Daly. With async saves the write is hidden while it is shorter than the interval,
    so the best interval is searched numerically over whole steps (it is shorter than Daly's)."""
    if step_s <= 0:
        raise ValueError(f"step_s={step_s} must be > 0")
    if not async_:
        steps = max(1, round(daly_interval(write_s, mtbf_s) / step_s))
    else:
        upper = max(2, int(4 * max(daly_interval(max(write_s, 1e-9), mtbf_s), write_s) / step_s) + 2)
        stride = max(1, upper // 4000)
        steps = max(range(1, upper, stride),
                    key=lambda k: expected_goodput(k * step_s, write_s, mtbf_s, restart_s, True, stage_s))
    tau = steps * step_s
    return Advice(tau, steps, expected_goodput(tau, write_s, mtbf_s, restart_s, async_, stage_s),
                  checkpoint_efficiency(tau, write_s, async_, stage_s))
