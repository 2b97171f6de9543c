"""A fault's price, phase by phase, on a hand-made event stream whose answers are known."""

from __future__ import annotations

import pytest

from nvrx_lab.observe.goodput import analyze, format_report
from nvrx_lab.observe.price import paired_cost, phase_medians


def stream(step_times_after=(1.0, 0.8, 0.5, 0.5)):
    """Steps of 0.5 s; an exception at 3.1 in step 5, an in-process restart, a reload of step 2 (0.5 s), then
    training again at 5.1 with two slow first steps."""
    ev = [{"t": 0.0, "kind": "start", "rank": r} for r in (0, 1)]
    t = 1.0
    for step in range(1, 5):
        t += 0.5
        ev.append({"t": t, "kind": "step", "rank": 0, "step": step, "step_time": 0.5})
    ev.append({"t": 2.01, "kind": "ckpt_commit", "rank": 0, "step": 2})
    ev.append({"t": 3.1, "kind": "fault", "rank": 1, "step": 5, "fault": "exception"})
    for rank, rendezvous in ((0, 0.3), (1, 0.25)):  # the slower rank sets each moment
        ev.append({"t": 4.0, "kind": "restart", "rank": rank, "cause": "exception", "t_fault": 3.1, "detect_s": 0.2,
                   "abort_s": 0.1, "health_s": 0.1, "rendezvous_s": rendezvous})
    ev += [{"t": 4.6, "kind": "resume", "rank": 0, "load_s": 0.5}, {"t": 4.5, "kind": "resume", "rank": 1, "load_s": 0.3}]
    t = 5.1
    for step, dt in zip(range(3, 3 + len(step_times_after)), step_times_after, strict=True):
        t += dt
        ev.append({"t": t, "kind": "step", "rank": 0, "step": step, "step_time": dt})
    return sorted(ev, key=lambda e: e["t"])


def test_phases_add_up_to_the_price_and_the_back_figure():
    r = analyze(stream())
    (p,) = r.prices
    assert p.phases == pytest.approx({"detect": 0.2, "teardown": 0.2, "rendezvous": 0.6, "restore": 0.5,
                                      "start_line": 0.5, "warmup": 0.8, "redone": 1.0, "lost_step": 0.1})
    assert list(p.phases)[:5] == ["detect", "teardown", "rendezvous", "restore", "start_line"]  # timeline order
    assert p.back_s == pytest.approx(2.0) == pytest.approx(sum(list(p.phases.values())[:5]))
    assert p.recovery_s == pytest.approx(3.8) and p.warmup_steps == 2  # step 5 begins at 6.9 at full speed
    assert p.price_s == pytest.approx(3.9) and p.redone_steps == 2
    row = r.row()
    assert row["back_median_s"] == pytest.approx(2.0) and row["recovery_median_s"] == pytest.approx(3.8)
    assert row["price_median_s"] == pytest.approx(3.9) and row["phases_median_s"]["warmup"] == pytest.approx(0.8)
    assert "full speed after  3.80 s, price 3.90 s: detect 0.20  teardown 0.20" in format_report(r)


def test_a_run_that_never_gets_back_to_full_speed_has_no_recovery():
    (p,) = analyze(stream(step_times_after=(1.0, 0.9))).prices
    assert p.back_s == pytest.approx(2.0) and p.recovery_s is None and p.warmup_steps == 2
    assert "full speed after   never," in format_report(analyze(stream(step_times_after=(1.0, 0.9))))


def test_launcher_phases_come_from_its_events():
    ev = [e for e in stream() if e["kind"] != "restart"]
    ev += [{"t": 3.4, "kind": "launcher_failure", "rank": 1}, {"t": 3.6, "kind": "launcher_restart", "rank": -1},
           {"t": 3.9, "kind": "start", "rank": 0}, {"t": 4.0, "kind": "start", "rank": 1}]
    (p,) = analyze(sorted(ev, key=lambda e: e["t"])).prices
    assert {k: round(v, 6) for k, v in p.phases.items() if k in ("detect", "teardown", "start", "rendezvous")} == \
        {"detect": 0.3, "teardown": 0.2, "start": 0.4, "rendezvous": 0.1}


def test_paired_cost_is_the_median_gap_per_fault_and_refuses_nothing_to_pair():
    cost = paired_cost([(20.0, 24.0), (21.0, 23.0), (20.0, 30.0)], faults=2)
    assert cost["cost_per_fault_s"] == 2.0 and cost["each_s"] == [2.0, 1.0, 5.0] and cost["pairs"] == 3
    with pytest.raises(ValueError, match="faults > 0"):
        paired_cost([], faults=2)
    assert phase_medians([]) == {}


def test_a_fault_restarted_twice_is_back_only_after_the_second_restart():
    """A SIGKILL under launcher+inprocess: the survivor restarts in-process at world size 1 and trains two steps,
    then the launcher restarts the group: those steps are discarded, and training is back at the second resume."""
    ev = [e for e in stream() if e["t"] < 3.05] + [{"t": 3.1, "kind": "fault", "rank": 1, "step": 5, "fault": "sigkill"}]
    ev += [{"t": 3.35, "kind": "restart", "rank": 0, "iteration": 0, "t_fault": 3.1, "detect_s": 0.1, "abort_s": 0.0,
            "health_s": 0.0, "rendezvous_s": 0.1}, {"t": 3.4, "kind": "resume", "rank": 0, "load_s": 0.1}]
    ev += [{"t": 3.9, "kind": "step", "rank": 0, "step": 3, "step_time": 0.5},
           {"t": 4.4, "kind": "step", "rank": 0, "step": 4, "step_time": 0.5}]
    ev += [{"t": 4.5, "kind": "launcher_failure", "rank": 0}, {"t": 4.6, "kind": "launcher_restart", "rank": -1},
           {"t": 5.0, "kind": "start", "rank": 0}, {"t": 5.1, "kind": "start", "rank": 1},
           {"t": 5.6, "kind": "resume", "rank": 0, "load_s": 0.3}, {"t": 5.55, "kind": "resume", "rank": 1, "load_s": 0.3}]
    ev += [{"t": 5.6 + 0.5 * (i + 1), "kind": "step", "rank": 0, "step": 3 + i, "step_time": 0.5} for i in range(4)]
    (p,) = analyze(sorted(ev, key=lambda e: e["t"])).prices
    assert p.back_s == pytest.approx(2.5) and p.recovery_s == pytest.approx(2.5)
    assert {k: round(v, 6) for k, v in p.phases.items()} == {
        "detect": 0.2, "teardown": 0.1, "start": 0.5, "rendezvous": 0.3, "restore": 0.4, "start_line": 0.0,
        "discarded": 1.0, "warmup": 0.0, "redone": 1.0, "lost_step": 0.1}
    assert p.redone_steps == 2 and p.price_s == pytest.approx(3.6) and p.downtime_s == pytest.approx(p.back_s)


def test_prices_plot(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from nvrx_lab.observe.price import plot_prices

    ax = plot_prices({"demo": analyze(stream()).prices}, title="t")
    ax.figure.savefig(tmp_path / "p.png", bbox_inches="tight")
    assert (tmp_path / "p.png").stat().st_size > 1000 and len(ax.patches) == 8  # one bar piece per phase


def test_a_step_begun_before_the_fault_and_logged_after_it_is_not_discarded():
    """Rank 0 descheduled after its step 4 and before its step event: the event lands after the fault (3.1). The step
    was trained before the fault, not after a restart, so nothing is discarded and the phases are the same."""
    ev = [dict(e, t=3.3) if e["kind"] == "step" and e["step"] == 4 and e["t"] < 3.1 else e for e in stream()]
    (late,) = analyze(sorted(ev, key=lambda e: e["t"])).prices
    (plain,) = analyze(stream()).prices
    assert "discarded" not in late.phases
    same = lambda phases: {k: v for k, v in phases.items() if k != "lost_step"}  # noqa: E731 (the broken step's start moved)
    assert same(late.phases) == pytest.approx(same(plain.phases)) and late.back_s == pytest.approx(plain.back_s)
    started_after = ev + [{"t": 3.9, "kind": "step", "rank": 0, "step": 5, "step_time": 0.5}]  # begun at 3.4: after it
    (p,) = analyze(sorted(started_after, key=lambda e: e["t"])).prices
    assert "discarded" in p.phases
