"""Goodput from the event stream: how much of the wall time became training progress.

Reads only what the trainer and the layers wrote (:mod:`nvrx_lab.observe.events`):

* ``step`` (rank 0: step, loss, step_time) — training progress
* ``fault`` (the target rank: step, fault) — an injected fault; a ``slow`` one is no failure (nothing
  recovers from it) and is counted as time lost instead
* ``ckpt_commit`` (step) — a checkpoint became durable
* ``restart`` (in-process: cause), ``launcher_failure`` (launcher: reason, detail), ``pod_restart``
  (the Kubernetes-style baseline: reason) — a recovery and why
* ``start`` — a (re)started process

Definitions (the write-up's, made exact):

* **training goodput** = final step × ideal step time / wall time; the ideal step time is the
  median step time of the run (or of a fault-free run when given)
* **infrastructure goodput** = time the job is up and able to train / wall time, i.e. wall time
  less start-up and every recovery
* **back** (``back_*`` columns, :attr:`FaultRecord.recovery_s`) of a fault = from the fault to the start of
  the next completed step; a step before the faulty one that rank 0 completes just after another rank's fault
  was not stopped by it. The trainer says the same figure when it trains again (a ``recovered`` event and its
  RESUME line, :mod:`nvrx_lab.train.resume`); where that event exists its moment of training again is used
* **recovery** (``recovery_*`` columns) = from the fault to the first step at full speed again, and the
  **price** of a fault its phases added up with the redone and lost work (:mod:`nvrx_lab.observe.price`)
* **rollback** = steps completed before the fault that had to be redone
* **freshness** = fault step − newest committed checkpoint step at the moment of the fault
* **time lost to a slow rank** = over the steps after the first ``slow`` fault, the step time beyond
  the ideal; with a slow fault the ideal step time is the median of the steps before it
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from nvrx_lab.observe.events import last_run
from nvrx_lab.observe.price import FaultPrice, fault_prices, format_prices, phase_medians
from nvrx_lab.observe.table import median, p95


@dataclass
class FaultRecord:
    t: float
    rank: int
    step: int
    kind: str
    recovery_s: float | None
    """None when training never resumed after this fault."""
    rollback_steps: int
    freshness_steps: int | None
    """None when no checkpoint had been committed yet."""


@dataclass
class GoodputReport:
    wall_s: float
    final_step: int
    ideal_step_s: float
    startup_s: float
    training_goodput: float
    infrastructure_goodput: float
    faults: list[FaultRecord] = field(default_factory=list)
    causes: dict[str, int] = field(default_factory=dict)
    slow_lost_s: float = 0.0
    """Seconds lost to a slow rank (the steps after a ``slow`` fault, beyond the ideal step time)."""
    prices: list[FaultPrice] = field(default_factory=list)
    """Each fault's phases to full speed (:mod:`nvrx_lab.observe.price`), in the order of ``faults``."""

    @property
    def recoveries(self) -> list[float]:
        return [f.recovery_s for f in self.faults if f.recovery_s is not None]

    def recovery_stats(self) -> dict[str, float]:
        """Median, p95 and max of the faults' back figures (fault -> training again)."""
        return _stats(self.recoveries)


    def row(self) -> dict:
        back = self.recovery_stats()
        full = _stats([p.recovery_s for p in self.prices if p.recovery_s is not None])
        return {"faults": len(self.faults), "recovered": len(self.recoveries),
                "back_median_s": back["median"], "recovery_median_s": full["median"], "recovery_p95_s": full["p95"],
                "recovery_max_s": full["max"], "recovery_mean_s": _mean([p.recovery_s for p in self.prices]),
                "price_median_s": _stats([p.price_s for p in self.prices])["median"],
                "price_mean_s": _mean([p.price_s for p in self.prices]),
                "phases_median_s": phase_medians(self.prices),
                "training_goodput": self.training_goodput, "infra_goodput": self.infrastructure_goodput,
                "rollback_steps": sum(f.rollback_steps for f in self.faults), "wall_s": self.wall_s,
                "steps": self.final_step, "slow_lost_s": self.slow_lost_s}


def json_safe(value):
    """``value`` with every NaN (a figure a run without faults has none of) as ``None``: JSON's ``null``, where
    ``json.dumps`` would write ``NaN``, which no JSON reader accepts."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _mean(values: list[float | None]) -> float:
    """The mean of ``values``; NaN when there are none, or when one is None (a fault never recovered)."""
    return statistics.fmean(values) if values and None not in values else float("nan")


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": median(values), "p95": p95(values), "max": max(values, default=float("nan"))}


def analyze(events: list[dict], ideal_step_s: float | None = None, t_start: float | None = None,
            t_end: float | None = None) -> GoodputReport:
    """Goodput of one run from its events (the newest run of a file several runs appended to, see
    :func:`nvrx_lab.observe.events.last_run`); ``t_start``/``t_end`` default to its first and last event."""
    events = last_run(events)
    if not events:
        raise ValueError("no events: was the trainer run with --metrics?")
    events = sorted(events, key=lambda e: e["t"])
    steps = [e for e in events if e["kind"] == "step"]
    t0 = events[0]["t"] if t_start is None else t_start
    t1 = events[-1]["t"] if t_end is None else t_end
    wall = max(t1 - t0 - idle_between_launches(events), 1e-9)
    slow = [e for e in events if e["kind"] == "fault" and e.get("fault") == "slow"]
    before_slow = [e["step_time"] for e in steps if slow and e["t"] < slow[0]["t"]]
    if ideal_step_s is None and len(before_slow) >= 3:
        ideal_step_s = statistics.median(before_slow)
    ideal = ideal_step_s if ideal_step_s is not None else (statistics.median(e["step_time"] for e in steps) if steps else 0.0)
    slow_lost = sum(max(0.0, e["step_time"] - ideal) for e in steps if slow and e["t"] > slow[0]["t"])
    final_step = max((e["step"] for e in steps), default=0)
    startup = (steps[0]["t"] - steps[0]["step_time"] - t0) if steps else wall
    commits = [e for e in events if e["kind"] == "ckpt_commit"]
    trained_again = sorted(e["fault_t"] + e["recovery_s"] for e in events if e["kind"] == "recovered")
    faults = []
    for f in (e for e in events if e["kind"] == "fault" and e.get("fault") != "slow"):
        before = [s for s in steps if s["t"] <= f["t"]]
        after = [s for s in steps if s["t"] > f["t"]]
        done = before[-1]["step"] if before else 0
        while after and after[0]["step"] == done + 1 < f["step"]:  # rank 0 finishing a step the fault did not stop
            done = after.pop(0)["step"]
        committed = [c["step"] for c in commits if c["t"] <= f["t"]]
        nxt = after[0] if after else None
        again = next((t for t in trained_again if t > f["t"]), None)  # what the trainer said, if it did
        if nxt is not None and again is None:
            again = nxt["t"] - nxt["step_time"]
        faults.append(FaultRecord(
            t=f["t"], rank=f["rank"], step=f["step"], kind=f["fault"],
            recovery_s=(again - f["t"]) if nxt else None,
            rollback_steps=max(0, done - (nxt["step"] - 1)) if nxt else 0,
            freshness_steps=(f["step"] - max(committed)) if committed else None))
    downtime = startup + sum(f.recovery_s if f.recovery_s is not None else t1 - f.t for f in faults)
    causes = Counter(restart_causes(events).values())
    return GoodputReport(wall_s=wall, final_step=final_step, ideal_step_s=ideal, startup_s=startup,
                         training_goodput=final_step * ideal / wall,
                         infrastructure_goodput=max(0.0, 1.0 - downtime / wall),
                         faults=faults, causes=dict(causes), slow_lost_s=slow_lost,
                         prices=fault_prices(events, faults, ideal))


def idle_between_launches(events: list[dict]) -> float:
    """Seconds between the launches of one run that no restart explains: a launch that ended without a
    ``pod_restart`` (a person relaunching later) leaves the job idle, not down, until the next one starts."""
    idle, last, explained, seen = 0.0, None, False, set()
    for e in events:
        if e["kind"] == "start" and not e.get("restart_count") and e.get("rank") in seen:
            if last is not None and not explained:
                idle += max(0.0, e["t"] - last)
            seen, explained = set(), False
        if e["kind"] == "start":
            seen.add(e.get("rank"))
        explained = explained or e["kind"] == "pod_restart"
        last = e["t"]
    return idle


def restart_causes(events: list[dict]) -> dict[tuple, str]:
    """One cause per restart, however many ranks reported it: an in-process restart by its fault report
    (every rank emits one), a launcher restart by its number (its likely cause first), a pod restart each."""
    causes: dict[tuple, str] = {}
    for e in events:
        if e["kind"] == "restart":
            key = ("inprocess", e.get("t_fault"), e.get("iteration"))
        elif e["kind"] == "launcher_failure":
            key = ("launcher", e.get("restart_count"), e.get("action"))
        elif e["kind"] == "pod_restart":
            key = ("pod", e["t"])
        else:
            continue
        causes.setdefault(key, e.get("cause") or e.get("reason") or "unknown")
    return causes


def format_report(report: GoodputReport, title: str = "") -> str:
    s = report.recovery_stats()
    lines = [title] if title else []
    lines += [f"wall {report.wall_s:.1f} s, {report.final_step} steps, ideal step {report.ideal_step_s * 1e3:.1f} ms, "
              f"start-up {report.startup_s:.1f} s",
              f"training goodput {report.training_goodput:.1%}, infrastructure goodput {report.infrastructure_goodput:.1%}",
              f"faults {len(report.faults)}, recovered {len(report.recoveries)}; training again after median "
              f"{s['median']:.2f} s, p95 {s['p95']:.2f} s, max {s['max']:.2f} s"]
    for f in report.faults:
        rec = f"{f.recovery_s:.2f} s" if f.recovery_s is not None else "never"
        fresh = f"{f.freshness_steps} steps" if f.freshness_steps is not None else "no checkpoint"
        lines.append(f"  step {f.step:5d} rank {f.rank} {f.kind:9s} training again {rec:>8s}  rollback {f.rollback_steps} steps  "
                     f"checkpoint age {fresh}")
    if report.prices:
        lines += ["the price of each fault, phase by phase (seconds; observe.price):", format_prices(report.prices)]
    if report.slow_lost_s:
        lines.append(f"time lost to a slow rank {report.slow_lost_s:.1f} s")
    if report.causes:
        lines.append("restart causes: " + ", ".join(f"{k} × {v}" for k, v in sorted(report.causes.items())))
    return "\n".join(lines)


def plot_timeline(events: list[dict], ax=None, title: str = ""):
    """Per-rank timeline: training (rank 0's steps span all ranks), faults, restarts, commits."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3))
    events = sorted(events, key=lambda e: e["t"])
    t0 = events[0]["t"]
    ranks = sorted({e["rank"] for e in events})
    for s in (e for e in events if e["kind"] == "step"):
        for r in ranks:
            ax.barh(r, s["step_time"], left=s["t"] - s["step_time"] - t0, color="#4c9be8", height=0.5)
    styles = {"fault": ("X", "#d62728", "fault"), "ckpt_commit": ("|", "#2ca02c", "checkpoint committed"),
              "restart": ("o", "#ff7f0e", "in-process restart"), "launcher_failure": ("s", "#9467bd", "launcher restart"),
              "pod_restart": ("D", "#8c564b", "pod restart"),
              "start": ("^", "#555555", "process start")}
    for kind, (marker, color, label) in styles.items():
        pts = [(e["t"] - t0, e["rank"]) for e in events if e["kind"] == kind]
        if pts:
            ax.scatter(*zip(*pts, strict=True), marker=marker, color=color, s=60, zorder=3, label=label)
    ax.set(xlabel="seconds since start", ylabel="rank", yticks=ranks, title=title or "timeline")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return ax
