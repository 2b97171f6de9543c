"""Reliability cases of :mod:`nvrx_lab.reliability.restarts` with small counts: launcher restarts
(SIGKILL and hang mixed) with the orphan check, and a long phase inside a section that must not
look like a hang. The 100-restart in-process soak runs in ``tests/test_inprocess.py``."""

from __future__ import annotations

import pytest

from nvrx_lab.reliability.restarts import fault_plan, launcher_soak, long_section_no_false_hang


def test_fault_plan_is_balanced_and_seeded():
    assert sorted(fault_plan(4, seed=0)) == ["hang", "hang", "sigkill", "sigkill"]
    assert fault_plan(50, seed=3) == fault_plan(50, seed=3)
    assert fault_plan(50, seed=3).count("sigkill") == 25
    assert fault_plan(50, seed=3) != fault_plan(50, seed=4)


@pytest.mark.timeout(90)
def test_launcher_recovers_every_fault_and_leaves_no_process(tmp_path):
    row = launcher_soak(tmp_path, restarts=4, seed=0)
    assert row.ok, (row.failures, row.figures)
    assert row.trials == 4 + 2  # one per fault, exit 0, no orphans
    f = row.figures
    assert f["recovered"] == f["restarts"] == 4 and f["orphans"] == 0
    # per fault (row.ok): each kill blamed on rank 1 as SIGKILL, each hang only after the 2 s heartbeat timeout
    assert f["hang_detect_s_min"] >= 2.0, f


@pytest.mark.timeout(90)
def test_long_phase_in_a_section_is_no_hang_and_the_control_is(tmp_path):
    row = long_section_no_false_hang(tmp_path, phase_s=4, heartbeat_timeout=1.5)
    assert row.ok, (row.failures, row.figures)
    assert row.trials == 2
    # the control's hang is named during a rank's pause (its fault event, no next step yet), after the timeout
    assert row.figures["control_detect_s"] >= 1.5, row.figures


def test_long_section_refuses_a_phase_the_control_could_not_tell_apart(tmp_path):
    with pytest.raises(ValueError, match="must exceed heartbeat_timeout"):
        long_section_no_false_hang(tmp_path, phase_s=2, heartbeat_timeout=3)
