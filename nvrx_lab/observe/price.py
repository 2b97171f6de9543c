"""A fault's true price: where the wall clock goes from the fault to full-speed training, phase by phase.

"Training again" (the trainer's ``RESUME ... training again X s after the fault`` line) is not the end of a
fault's cost: the first steps after a restart run slow (allocator, caches, a writer starting), the steps
since the restored checkpoint are trained twice, and the step the fault broke is lost. This module splits
each fault of one run's event stream (:mod:`nvrx_lab.observe.events`) into consecutive phases, each with the
part of the system that owns it, so the phases add up to what the fault cost:

====================  =======================================================================================
phase                 from → to (owner)
====================  =======================================================================================
``detect``            the fault → a layer knew (in-process monitor or launcher monitor; a baseline: the job
                      exiting, a hang after the collective timeout)
``teardown``          → the old attempt gone (in-process: abort + health check; launcher: stop and respawn)
``pod``               → the pod started again (baseline only: pod restart + CrashLoopBackOff)
``start``             → every new worker process running (interpreter + imports; launcher and baseline only)
``rendezvous``        → the ranks met again (in-process: the store rendezvous; else the process group and the
                      model built, up to the restore)
``restore``           → the checkpoint loaded (the slowest rank's load)
``start_line``        → the first step began (every rank at the start line: the slowest load, the writer)
``discarded``         steps trained after one restart and thrown away by the next one in the same fault's
                      window (an in-process restart to fewer ranks, then the launcher restarting the group)
``warmup``            the first steps' time beyond the ideal step, until a step at full speed again
``redone``            the steps since the restored checkpoint, trained again at the ideal step time
``lost_step``         the part of the broken step done before the fault
====================  =======================================================================================

**Recovery** (:attr:`FaultPrice.recovery_s`) is the fault → the start of the first step at full speed again
(step time ≤ ``tolerance`` × the ideal step); :attr:`FaultPrice.price_s` adds the redone and lost work. The
wall-clock cost a fault really has comes from a paired design (:func:`paired_cost`, ``bench goodput
--pairs``): the same run with and without faults, interleaved; its gap to the summed phases says how much
time this accounting misses (e.g. slower steps all run long, a longer start).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

OWNERS = {"detect": "fault detection", "teardown": "old attempt torn down", "pod": "Kubernetes pod restart",
          "start": "new worker processes", "rendezvous": "rendezvous + model build", "restore": "checkpoint load",
          "start_line": "start line (slowest rank, writer)", "discarded": "steps trained, then restarted again",
          "warmup": "first steps' warm-up",
          "redone": "steps since the checkpoint redone", "lost_step": "the broken step's work"}
"""Phase -> what owns it, in timeline order."""
AFTER_BACK = ("warmup", "redone", "lost_step")
"""The phases that are not downtime: training is back, slowly, or redoing work."""


@dataclass
class FaultPrice:
    t: float
    rank: int
    step: int
    kind: str
    phases: dict[str, float] = field(default_factory=dict)
    """Phase -> seconds (only the phases this fault went through), in :data:`OWNERS` order."""
    back_s: float | None = None
    """The fault -> the first step began (the trainer's "training again"); None: it never trained again."""
    recovery_s: float | None = None
    """The fault -> the first step at full speed began; None: never at full speed again."""
    warmup_steps: int = 0
    redone_steps: int = 0

    @property
    def price_s(self) -> float:
        return sum(self.phases.values())

    @property
    def downtime_s(self) -> float:
        """The phases up to training again (everything but the warm-up and the work done twice): ``back_s``."""
        return sum(v for k, v in self.phases.items() if k not in AFTER_BACK)


def fault_prices(events: list[dict], faults: list, ideal_step_s: float, tolerance: float = 1.25) -> list[FaultPrice]:
    """One :class:`FaultPrice` per fault of ``faults`` (:class:`nvrx_lab.observe.goodput.FaultRecord`) from the run's
    ``events`` sorted by time. A fault's window runs to the next fault; when it holds more than one restart (an
    in-process restart to fewer ranks, then the launcher restarting the group), training is back only after the
    last one, and what was trained in between is ``discarded``."""
    steps = [e for e in events if e["kind"] == "step"]
    out = []
    for i, f in enumerate(faults):
        p = FaultPrice(f.t, f.rank, f.step, f.kind)
        until = faults[i + 1].t if i + 1 < len(faults) else float("inf")
        # a step begun before the fault and logged after it (a rank descheduled before its step event) is not training
        # after the fault: it stays out of the window, or it would be counted as steps discarded by a later restart
        window = [e for e in events if f.t < e["t"] < until and not (e["kind"] == "step" and e["t"] - e["step_time"] < f.t)]
        last = max((e["t"] for e in window if e["kind"] in RESTARTS), default=f.t)
        back = next((s["t"] - s["step_time"] for s in steps if s["t"] - s["step_time"] >= last - 1e-6
                     and f.t < s["t"] < until), None)
        if f.recovery_s is None or back is None:
            out.append(p)
            continue
        p.back_s = back - f.t
        p.phases = _downtime(f.t, back, [e for e in window if e["t"] <= back + 1e-6])
        warm, p.warmup_steps, full = _warmup(steps, back, until, ideal_step_s, tolerance)
        p.phases["warmup"] = warm
        p.recovery_s = full - f.t if full is not None else None
        reached = max((s["step"] for s in steps if s["t"] < back), default=0)
        p.redone_steps = max(0, reached - (_first_step_from(steps, back) - 1))
        p.phases["redone"] = p.redone_steps * ideal_step_s
        before = [s["t"] for s in steps if s["t"] <= f.t]
        p.phases["lost_step"] = min(f.t - before[-1], ideal_step_s) if before else 0.0  # the broken step, at most a step
        out.append(p)
    return out


RESTARTS = ("start", "resume", "restart", "launcher_restart", "pod_restart")
"""Events that begin (part of) a new attempt: training is back at the first step after the last of them."""


def _first_step_from(steps: list[dict], t: float) -> int:
    return next(s["step"] for s in steps if s["t"] - s["step_time"] >= t - 1e-6)


def _marks(window: list[dict]) -> list[tuple[float, str]]:
    """(moment, phase that ends there) for every moment the window's events give."""
    marks: list[tuple[float, str]] = []
    inproc: dict = {}
    resumes: dict[int, dict] = {}  # per stretch between steps: the rank whose load ended last
    trained = 0
    for e in window:
        kind = e["kind"]
        if kind == "restart" and e.get("t_fault") is not None:
            inproc.setdefault(e.get("iteration"), []).append(e)
        elif kind == "launcher_failure":
            marks.append((e["t"], "detect"))
        elif kind == "launcher_restart":
            marks.append((e["t"], "teardown"))
        elif kind == "pod_restart":
            marks += [(e["t"], "detect"), (e["t"] + e.get("delay_s", 0.0), "pod")]
        elif kind == "start":
            marks.append((e["t"], "start"))
        elif kind == "resume" and e["t"] >= resumes.get(trained, {}).get("t", 0.0):
            resumes[trained] = e
        elif kind == "step":  # trained, then thrown away by a later restart in the same window
            marks += [(e["t"] - e["step_time"], "start_line"), (e["t"], "discarded")]
            trained += 1
    for e in resumes.values():  # its load is the restore, what came before it the rendezvous
        marks += [(e["t"] - e.get("load_s", 0.0), "rendezvous"), (e["t"], "restore")]
    for group in inproc.values():  # the slowest rank of each in-process restart sets its moments
        marks += [(_latest(group, "detect_s"), "detect"), (_latest(group, "detect_s", "abort_s", "health_s"), "teardown"),
                  (_latest(group, "detect_s", "abort_s", "health_s", "rendezvous_s"), "rendezvous")]
    return sorted(marks)


def _latest(restarts: list[dict], *phases: str) -> float:
    """The moment the last rank of one in-process restart finished ``phases`` (counted from its fault report)."""
    return max(e["t_fault"] + sum(e.get(k) or 0.0 for k in phases) for e in restarts)


def _downtime(t_fault: float, back: float, window: list[dict]) -> dict[str, float]:
    """The fault -> training again, split at the moments the window's events give (each phase the time from the
    previous moment; several of one name add up), so the phases add up to ``back - t_fault`` exactly."""
    phases: dict[str, float] = {}
    last = t_fault
    for t, name in [*_marks(window), (back, "start_line")]:
        t = min(max(t, last), back)
        if t > last or name not in phases:
            phases[name] = phases.get(name, 0.0) + (t - last)
        last = t
    return {k: phases[k] for k in OWNERS if k in phases and (phases[k] > 0 or k in ("detect", "start_line"))}


def _warmup(steps: list[dict], back: float, until: float, ideal: float, tolerance: float) -> tuple[float, int, float | None]:
    """(seconds beyond the ideal step, steps, the moment full speed began) over the steps from ``back`` on,
    before the next fault at ``until``."""
    extra, n = 0.0, 0
    for s in steps:
        began = s["t"] - s["step_time"]
        if began < back - 1e-6 or began >= until:
            continue
        if s["step_time"] <= tolerance * ideal:
            return extra, n, began
        extra += s["step_time"] - ideal
        n += 1
    return extra, n, None


def paired_cost(pairs: list[tuple[float, float]], faults: int) -> dict:
    """Wall-clock seconds per fault from ``(fault-free wall, faulty wall)`` pairs of the same run:
    ``(faulty - fault-free) / faults`` per pair, its median and spread."""
    if not pairs or faults <= 0:
        raise ValueError(f"paired_cost needs at least one (fault-free, faulty) pair and faults > 0, got "
                         f"{len(pairs)} pairs and faults={faults}")
    each = [(faulty - free) / faults for free, faulty in pairs]
    return {"cost_per_fault_s": statistics.median(each), "cost_min_s": min(each), "cost_max_s": max(each),
            "pairs": len(pairs), "each_s": each}


def phase_medians(prices: list[FaultPrice]) -> dict[str, float]:
    """Median seconds of each phase over ``prices`` (a phase a fault did not go through counts as 0)."""
    names = [k for k in OWNERS if any(k in p.phases for p in prices)]
    return {k: statistics.median(p.phases.get(k, 0.0) for p in prices) for k in names} if prices else {}


def format_prices(prices: list[FaultPrice]) -> str:
    """One line per fault: its phases in order, the recovery to full speed and the price."""
    lines = []
    for p in prices:
        phases = "  ".join(f"{k} {v:.2f}" for k, v in p.phases.items() if v >= 0.005)
        rec = f"{p.recovery_s:.2f} s" if p.recovery_s is not None else "never"
        lines.append(f"  step {p.step:5d} rank {p.rank} {p.kind:9s} full speed after {rec:>7s}, price {p.price_s:.2f} s: "
                     f"{phases}")
    return "\n".join(lines)


COLORS = {"detect": "tab:red", "teardown": "tab:orange", "start": "tab:brown", "pod": "tab:pink",
          "rendezvous": "tab:blue", "restore": "tab:gray", "start_line": "tab:olive", "discarded": "black",
          "warmup": "tab:purple", "redone": "tab:cyan", "lost_step": "tab:green"}


def plot_prices(rows: dict[str, list[FaultPrice]], ax=None, title: str = ""):
    """One stacked bar per fault (grouped by run): its phases in timeline order, then the redone and lost work;
    a tick where the fault was back at full speed. ``rows``: run label -> its faults' prices."""
    import matplotlib.pyplot as plt

    bars = [(f"{label}: {p.kind} @ {p.step}", p) for label, prices in rows.items() for p in prices]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.45 * len(bars) + 1.2))
    for y, (_, p) in enumerate(bars):
        left = 0.0
        for name, seconds in p.phases.items():
            ax.barh(y, seconds, left=left, color=COLORS[name], height=0.6)
            left += seconds
        if p.recovery_s is not None:
            ax.plot([p.recovery_s], [y], "k|", markersize=16)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the fault (| : full speed again)")
    ax.set_title(title or "what each fault cost, phase by phase")
    used = [k for k in OWNERS if any(k in p.phases for _, p in bars)]
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in used], [f"{k}: {OWNERS[k]}" for k in used],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax
