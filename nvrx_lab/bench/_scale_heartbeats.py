"""The scale model's heartbeats: every rank's monitor process beats (its monitor thread only if those stop) and the
store host's :class:`~nvrx_lab.inprocess.monitor_process.Judge` reads them all, once a tick."""

from __future__ import annotations

import time

from nvrx_lab.bench._scale_model import Ranks
from nvrx_lab.inprocess.monitor_process import Judge
from nvrx_lab.inprocess.rank_assignment import ShiftRanks


def measure_heartbeats(ranks: Ranks, interval: float, rounds: int = 3) -> dict:
    """``rounds`` heartbeat intervals' worth of operations; returns ops per second at ``interval``."""
    judge = Judge(ranks.n, 0.0, 1e9, ShiftRanks())
    host = ranks.stores[0]
    for r in range(ranks.n):
        ranks.stores[r].beat(r)
    judge.tick(host)  # the first tick checks that every rank has started; the others only read
    ranks.reset()
    judge_s = []
    for _ in range(rounds):
        for r in range(ranks.n):
            ranks.stores[r].beat(r)  # the monitor process, from its own interpreter
        t = time.monotonic()
        judge.tick(host)
        judge_s.append(time.monotonic() - t)
    return {"heartbeat_store_ops_per_s": ranks.ops() / rounds / interval, "judge_ms": 1000 * min(judge_s)}
