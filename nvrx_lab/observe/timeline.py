"""Restart timelines: what each rank did around a fault, read from the event stream.

Every restart demo writes the same kinds of events (:mod:`nvrx_lab.observe.events`): ``step`` (rank, the
attempt it belongs to), ``fault`` (just before a fault is injected), and, depending on who restarts,
``restart`` (in-process: the phases of one restart on one rank, see
:mod:`nvrx_lab.inprocess.restart_log`) or ``launcher_failure`` / ``launcher_ready`` (the launcher
saw a rank fail / every rank beating again). Only the name of the attempt field differs: ``attempt``
(:mod:`nvrx_lab.demo.recovery_worker`), ``iteration`` (:mod:`nvrx_lab.demo.inprocess_worker`), ``restart``
(:mod:`nvrx_lab.demo.launcher_worker`, from ``TORCHELASTIC_RESTART_COUNT``).

* :func:`recovery_times` — fault → every rank training again, per fault (the recovery benchmark's figure);
* :func:`step_periods` — one rank's step to its next in the same attempt: what a step costs without a restart;
* :func:`plot_restarts` — one row per rank: steps coloured by attempt, faults, restart phases,
  launcher detection (notebooks 02 and 03).

The trainer's stream (rank 0's steps only) has its own view: :func:`nvrx_lab.observe.goodput.plot_timeline`.
"""

from __future__ import annotations

from pathlib import Path

from nvrx_lab.observe.events import read_events

PHASES = {"detect_s": ("tab:red", "detect"), "abort_s": ("tab:orange", "abort"), "health_s": ("tab:purple", "health"),
          "rendezvous_s": ("tab:blue", "rendezvous"), "reload_s": ("tab:gray", "reload")}
"""The phases of an in-process ``restart`` event, in order: field → (colour, label)."""
ATTEMPT_COLORS = ("tab:green", "tab:olive", "tab:cyan", "tab:brown", "tab:pink")


def _events(events: list[dict] | str | Path) -> list[dict]:
    return read_events(events) if isinstance(events, (str, Path)) else list(events)


def recovery_times(events: list[dict] | str | Path, attempt: str = "attempt") -> tuple[list[float], int]:
    """(seconds from each fault to every rank training again, number of faults).

    A fault in attempt ``a`` is recovered at the latest first step among the ranks that train in
    attempt ``a + 1`` after it; faults after which no rank trained again are left out of the list.
    ``events``: a list of events or the path of a JSONL event file.
    """
    events = _events(events)
    faults = [e for e in events if e["kind"] == "fault"]
    steps = [e for e in events if e["kind"] == "step"]
    out = []
    for f in faults:
        first: dict[int, float] = {}
        for s in steps:
            if s[attempt] == f[attempt] + 1 and s["t"] > f["t"]:
                first[s["rank"]] = min(first.get(s["rank"], s["t"]), s["t"])
        if first:
            out.append(max(first.values()) - f["t"])
    return out, len(faults)


def step_periods(events: list[dict] | str | Path, attempt: str = "attempt", after: int | None = None) -> list[float]:
    """Seconds from each rank's step to its next step of the same attempt (the whole step: whatever the trainer
    does between two step events, its checkpoints too), only from steps past ``after`` if given: steps with no
    restart between them, so at each world size the step a recovery ends with can be set against one that
    follows no fault."""
    last: dict[tuple, tuple[int, float]] = {}
    out = []
    for s in sorted((e for e in _events(events) if e["kind"] == "step"), key=lambda e: e["t"]):
        key = (s["rank"], s.get(attempt))  # a run without restarts has no attempt field
        if key in last and s["step"] == last[key][0] + 1 and (after is None or last[key][0] > after):
            out.append(s["t"] - last[key][1])
        last[key] = (s["step"], s["t"])
    return out


def _draw_restart_phases(ax, restarts: list[dict], t0: float) -> None:
    for r in restarts:
        start = r["t_fault"] - t0
        for field, (color, _) in PHASES.items():
            d = r.get(field) or 0.0
            ax.broken_barh([(start, max(d, 0.01))], (r["rank"] - 0.35, 0.7), color=color)
            start += d


def _draw_markers(ax, events: list[dict], t0: float, top: float) -> None:
    detections = set()  # one line per detection, however many ranks it reported
    for e in events:
        x = e["t"] - t0
        if e["kind"] == "fault":
            ax.axvline(x, color="k", lw=0.8, ls="--")
            ax.text(x, top, " " + str(e.get("fault") or e.get("fault_kind") or "fault"), fontsize=8)
        elif e["kind"] == "launcher_failure" and e.get("restart_count") not in detections:
            detections.add(e.get("restart_count"))
            ax.axvline(x, color="tab:orange")
            ax.text(x, -0.6, "detected", color="tab:orange", fontsize=8)
        elif e["kind"] == "launcher_ready":
            ax.axvline(x, color="tab:gray", ls=":")


def plot_restarts(events: list[dict] | str | Path, attempt: str = "attempt", ax=None, title: str = ""):
    """Per-rank timeline of a restart demo; returns the axes.

    Steps are ticks coloured by attempt (green first); a dashed line with the fault's kind marks each
    fault. In-process restarts add a bar per rank and restart: the phases of :data:`PHASES` from
    the fault on. Launcher restarts add an orange line where a failed rank was detected and a dotted
    grey one where every rank was beating again.
    """
    import matplotlib.pyplot as plt

    events = sorted(_events(events), key=lambda e: e["t"])
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.8))
    steps = [e for e in events if e["kind"] == "step"]
    t0 = min(e["t"] for e in steps)
    ranks = sorted({e["rank"] for e in steps} | {e["rank"] for e in events if e["kind"] == "restart"})
    for e in steps:
        color = ATTEMPT_COLORS[e.get(attempt, 0) % len(ATTEMPT_COLORS)]
        ax.plot(e["t"] - t0, e["rank"], "|", color=color, markersize=14)
    restarts = [e for e in events if e["kind"] == "restart"]
    _draw_restart_phases(ax, restarts, t0)
    _draw_markers(ax, events, t0, max(ranks) + 0.4)
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(-0.8, max(ranks) + 0.8)
    ax.set_xlabel(f"seconds (steps coloured by {attempt})")
    ax.set_title(title or "restart timeline")
    _legend(ax, {e["kind"] for e in events})
    return ax


def _legend(ax, kinds: set[str]) -> None:
    import matplotlib.pyplot as plt

    line = lambda **kw: plt.Line2D([], [], **kw)  # noqa: E731
    items = [(line(color=ATTEMPT_COLORS[0], marker="|", ls="", markersize=10), "step"),
             (line(color="k", lw=0.8, ls="--"), "fault")]
    if "restart" in kinds:
        items += [(plt.Rectangle((0, 0), 1, 1, color=c), label) for c, label in PHASES.values()]
    if "launcher_failure" in kinds:
        items.append((line(color="tab:orange"), "launcher: detected"))
    if "launcher_ready" in kinds:
        items.append((line(color="tab:gray", ls=":"), "launcher: all ranks beating"))
    ax.legend(*zip(*items, strict=True), ncol=len(items), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3))
