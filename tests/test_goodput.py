"""Goodput arithmetic on a hand-made event stream whose answers are known."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

from nvrx_lab.observe.goodput import analyze, format_report, plot_timeline


def stream():
    ev = [{"t": 0.0, "kind": "start", "rank": 0}, {"t": 0.0, "kind": "start", "rank": 1}]
    t = 1.0  # 1 s start-up, then steps of 0.5 s
    for step in range(1, 5):
        t += 0.5
        ev.append({"t": t, "kind": "step", "rank": 0, "step": step, "step_time": 0.5, "loss": 1.0})
        if step == 2:
            ev.append({"t": t + 0.01, "kind": "ckpt_commit", "rank": 0, "step": 2})
    ev.append({"t": t + 0.1, "kind": "fault", "rank": 1, "step": 5, "fault": "exception"})  # at 3.1
    ev.append({"t": t + 1.0, "kind": "restart", "rank": 0, "cause": "exception on rank 1"})
    t += 2.1  # training resumes from the step-2 checkpoint at 5.1
    for step in range(3, 7):
        t += 0.5
        ev.append({"t": t, "kind": "step", "rank": 0, "step": step, "step_time": 0.5, "loss": 1.0})
    return ev


def test_known_answers():
    r = analyze(stream())
    assert r.final_step == 6 and r.ideal_step_s == 0.5
    assert math.isclose(r.wall_s, 7.1) and math.isclose(r.startup_s, 1.0)
    (f,) = r.faults
    assert math.isclose(f.recovery_s, 2.0)  # fault at 3.1 → step 3 starts at 5.1
    assert f.rollback_steps == 2  # steps 3 and 4 redone
    assert f.freshness_steps == 3  # fault at step 5, newest commit step 2
    assert math.isclose(r.training_goodput, 6 * 0.5 / 7.1)
    assert math.isclose(r.infrastructure_goodput, 1 - (1.0 + 2.0) / 7.1)
    assert r.causes == {"exception on rank 1": 1}
    text = format_report(r, "demo")
    assert "rollback 2 steps" in text and "checkpoint age 3 steps" in text
    assert r.row()["recovered"] == 1


def test_a_fault_never_recovered_counts_as_downtime_to_the_end():
    ev = [e for e in stream() if not (e["kind"] == "step" and e["t"] > 3.1)]
    r = analyze(ev, t_end=10.0)
    assert r.faults[0].recovery_s is None and r.recoveries == []
    assert math.isclose(r.infrastructure_goodput, 1 - (1.0 + (10.0 - 3.1)) / 10.0)
    assert "training again    never" in format_report(r)


def test_timeline_draws(tmp_path):
    ax = plot_timeline(stream(), title="t")
    ax.figure.savefig(tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_a_step_rank_0_completes_just_after_another_ranks_fault_is_not_the_recovery():
    ev = stream()
    fault = next(e for e in ev if e["kind"] == "fault")
    ev.append({"t": fault["t"] + 0.05, "kind": "step", "rank": 0, "step": 5, "step_time": 0.5, "loss": 1.0})
    fault["step"] = 6  # rank 1 failed in step 6 while rank 0 was still finishing step 5
    (f,) = analyze(ev).faults
    assert math.isclose(f.recovery_s, 2.0) and f.rollback_steps == 3  # steps 3, 4 and 5 redone


def test_a_run_without_faults_gives_a_goodput_line_of_json_not_nan():
    import json

    from nvrx_lab.observe.goodput import json_safe

    row = analyze([e for e in stream() if e["kind"] in ("start", "step") and e["t"] < 3.1]).row()
    assert row["faults"] == 0 and math.isnan(row["recovery_mean_s"])  # the analysis keeps NaN for "none"
    line = json.dumps(json_safe(row), allow_nan=False)  # the trainer's GOODPUT line: what every JSON reader accepts
    assert "NaN" not in line and json.loads(line)["recovery_mean_s"] is None and json.loads(line)["faults"] == 0
