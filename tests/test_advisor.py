"""The interval advisor against closed forms and the regimes the write-up measured."""

from __future__ import annotations

import math

import pytest

from nvrx_lab.observe.advisor import advise, checkpoint_efficiency, crashloop_delay, daly_interval, expected_goodput


def test_daly_approaches_young_when_writes_are_cheap():
    w, m = 1.0, 1e6
    assert daly_interval(w, m) == pytest.approx(math.sqrt(2 * w * m), rel=1e-3)
    assert daly_interval(10, 4) == 4  # write longer than 2 × MTBF: checkpoint every MTBF
    with pytest.raises(ValueError, match="write_s=0"):
        daly_interval(0, 10)


def test_async_hides_the_write_only_when_the_interval_is_longer():
    # The seeds' shape: a 275 s write every 1000 steps of ~1 s vs every 100 steps.
    assert checkpoint_efficiency(1000, 275, async_=False) == pytest.approx(1000 / 1275)
    assert checkpoint_efficiency(1000, 275, async_=True, stage_s=2) > 0.99
    sync100, async100 = checkpoint_efficiency(100, 275, False), checkpoint_efficiency(100, 275, True, stage_s=2)
    assert 1.3 * sync100 < async100 < 0.5  # comparable interval and write: async ahead, far from free


def test_advise_maximises_expected_goodput():
    a = advise(step_s=1.0, write_s=60, mtbf_s=3600 * 4, restart_s=30)
    around = [expected_goodput(a.interval_s * f, 60, 3600 * 4, 30) for f in (0.5, 2.0)]
    assert all(a.expected_goodput >= g for g in around)
    b = advise(step_s=1.0, write_s=60, mtbf_s=3600 * 4, restart_s=30, async_=True, stage_s=0.5)
    assert b.interval_steps < a.interval_steps and b.expected_goodput > a.expected_goodput
    assert 0 < b.expected_goodput <= 1


def test_crashloop_delay_doubles_to_kubelets_cap():
    assert [crashloop_delay(i) for i in (1, 2, 3)] == [20.0, 30.0, 50.0]  # 10 s pod restart + 10, 20, 40 s back-off
    assert crashloop_delay(10) == 310.0 and crashloop_delay(1, 10.0, time_scale=0.1) == pytest.approx(2.0)


def test_local_checkpoints_cover_most_failures_so_storage_saves_space_out():
    seeds = dict(step_s=1.0, write_s=275, mtbf_s=4 * 3600, restart_s=10, async_=True, stage_s=2)
    storage_only = advise(**seeds)
    by_coverage = [advise(**seeds, local_s=0.5, local_coverage=p) for p in (0.5, 0.9, 0.99)]
    assert storage_only.local_interval_steps == 0
    assert storage_only.interval_steps < by_coverage[0].interval_steps < by_coverage[1].interval_steps \
        < by_coverage[2].interval_steps  # storage only has to cover the failures a local copy does not survive
    assert storage_only.expected_goodput < by_coverage[0].expected_goodput < by_coverage[1].expected_goodput \
        < by_coverage[2].expected_goodput
    assert all(1 <= a.local_interval_steps <= a.interval_steps for a in by_coverage)
    costly = advise(**seeds, local_s=5.0, local_coverage=0.9)
    assert costly.local_interval_steps > by_coverage[1].local_interval_steps  # dearer snapshots, further apart
    nothing_saved = expected_goodput(100, 275, 4 * 3600, 10, True, 2, local_interval_s=10, local_s=0, local_coverage=0)
    assert nothing_saved == pytest.approx(expected_goodput(100, 275, 4 * 3600, 10, True, 2))
    for bad in ({"local_s": -1}, {"local_s": 1, "local_coverage": 1.0}):
        with pytest.raises(ValueError, match="local_s=.*local_coverage="):
            advise(**seeds, **bad)
