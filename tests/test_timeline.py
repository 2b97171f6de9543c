"""Restart timelines and the shared helpers of benches and notebooks, on hand-made event streams."""

from __future__ import annotations

import json

import matplotlib
import pytest

matplotlib.use("Agg")

from nvrx_lab.demo.state import equal, make_state, mutate, zeros_like
from nvrx_lab.observe.table import format_table, median, p95
from nvrx_lab.observe.timeline import plot_restarts, recovery_times, step_periods


def launcher_run():
    """Two ranks; a fault in restart 0 at t=1 (both back by t=3.5), one in restart 1 after which nobody trains."""
    ev = [{"t": 0.5 + 0.1 * i, "kind": "step", "rank": r, "step": i, "restart": 0} for i in range(4) for r in (0, 1)]
    ev += [{"t": 1.0, "kind": "fault", "rank": 1, "step": 4, "fault": "kill", "restart": 0},
           {"t": 1.2, "kind": "launcher_failure", "rank": 1, "reason": "signal", "restart_count": 1},
           {"t": 1.2, "kind": "launcher_failure", "rank": 0, "reason": "terminated", "restart_count": 1},
           {"t": 2.9, "kind": "launcher_ready", "rank": -1, "restart_count": 1},
           {"t": 3.0, "kind": "step", "rank": 0, "step": 0, "restart": 1},
           {"t": 3.5, "kind": "step", "rank": 1, "step": 0, "restart": 1},
           {"t": 3.6, "kind": "step", "rank": 1, "step": 1, "restart": 1},
           {"t": 4.0, "kind": "fault", "rank": 1, "step": 2, "fault": "hang", "restart": 1}]
    return ev


def test_recovery_is_the_last_rank_back_and_unrecovered_faults_are_counted(tmp_path):
    assert recovery_times(launcher_run(), attempt="restart") == ([pytest.approx(2.5)], 2)
    path = tmp_path / "ev.jsonl"
    path.write_text("".join(json.dumps({**e, "attempt": e.get("restart")}) + "\n" for e in launcher_run()))
    assert recovery_times(path) == ([pytest.approx(2.5)], 2)  # a file, the default attempt field


def test_a_step_period_never_spans_a_restart():
    # restart 0: three periods of 0.1 s a rank; restart 1: rank 1's 0.1 s; the 2.5 s across the fault is not one
    assert step_periods(launcher_run(), attempt="restart") == [pytest.approx(0.1)] * 7


def test_one_timeline_for_launcher_and_in_process_restarts(tmp_path):
    ax = plot_restarts(launcher_run(), attempt="restart", title="launcher")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["step", "fault", "launcher: detected",
                                                                     "launcher: all ranks beating"]
    inproc = [{**e, "iteration": e.pop("restart")} for e in launcher_run() if e["kind"] in ("step", "fault")]
    inproc += [{"t": 1.3, "kind": "restart", "rank": r, "iteration": 0, "t_fault": 1.0, "detect_s": 0.01, "abort_s": 0.2,
                "health_s": 0.0, "rendezvous_s": 0.5, "reload_s": None} for r in (0, 1)]
    ax = plot_restarts(inproc, attempt="iteration")
    assert "rendezvous" in [t.get_text() for t in ax.get_legend().get_texts()]
    ax.figure.savefig(tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_demo_state_and_table():
    state = make_state(0.5)
    before = {k: v.clone() if hasattr(v, "clone") else v for k, v in state.items()}
    mutate(state)
    assert not equal(state, before) and equal(before, before) and state["step"] == 0
    assert set(zeros_like(state)) == set(state)
    assert median([3.0, 1.0, 2.0]) == 2.0 and p95(list(range(101))) == 95 and median([]) != median([])
    assert format_table([{"a": 1, "b": 0.123456}]).splitlines() == ["a       b", "-  ------", "1  0.1235"]
