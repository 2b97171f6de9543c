"""Straggler detection: the scores (pure), the timer and the slow fault (one process), then real ranks:
a slowed rank is named and no other, a uniformly loaded machine names nobody, a peer dying or hanging
mid-exchange ends the exchange within the group timeout, and ``--straggler-action restart`` makes the
straggler leave at an in-process restart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, run_group

from nvrx_lab.bench.straggler import busy_loops
from nvrx_lab.faults import parse_schedule
from nvrx_lab.net import free_port, free_port_pair
from nvrx_lab.observe.events import last_run, read_events
from nvrx_lab.runner import Spawn, Torchrun, trainer
from nvrx_lab.straggler import Detector, identify_stragglers, individual_perf_scores, relative_perf_scores
from nvrx_lab.train.config import TrainConfig, check_config

SMALL = dict(global_batch=4, seq_len=32, log_every=0)


def test_relative_scores_name_the_slow_rank_only():
    medians = [{"compute": 1.0, "forward": 0.4}, {"compute": 1.5, "forward": 0.7}, {"compute": 1.05, "forward": 0.41}]
    rel = relative_perf_scores(medians)
    assert rel[0]["compute"] == 1.0 and rel[1]["compute"] == pytest.approx(1 / 1.5)
    ind = individual_perf_scores(medians, [{"compute": 1.0, "forward": 0.4}] * 3)
    assert ind[1]["compute"] == pytest.approx(1 / 1.5) and ind[0]["compute"] == 1.0
    (s,) = identify_stragglers(rel, ind, threshold=0.75)
    assert (s.rank, s.section) == (1, "forward") and s.score == pytest.approx(0.667, abs=1e-3)
    assert identify_stragglers(relative_perf_scores([{"compute": 2.0}] * 4), [{}] * 4, 0.75) == []  # alike: none


def test_detector_names_after_patience_reports_and_checks_its_settings():
    detector = Detector(interval=2, threshold=0.75, patience=2)  # no process group: a world of one
    detector.record([{"compute": 1.0, "forward": 0.5, "optimizer": 0.5}] * 2)
    report = detector.report(2)
    assert report.stragglers == [] and report.relative == [{"compute": 1.0, "forward": 1.0, "optimizer": 1.0}]
    for bad, match in ((dict(interval=0), "interval"), (dict(threshold=1.5), r"threshold.*\(0, 1\]"),
                       (dict(patience=0), "patience")):
        with pytest.raises(ValueError, match=match):
            Detector(**bad)


def test_a_stretch_of_slower_steps_moves_a_score_by_its_share_only():
    """Noise on a shared core comes in stretches: 6 of 10 steps fast on one rank and 6 of 10 slow on the
    other. A median would score the second rank 10/15 = 0.67 (a rank slowed 1.5×); the mean says 12/13."""
    ranks = [Detector(interval=10), Detector(interval=10)]
    ranks[0].record([{"compute": 0.010}] * 6 + [{"compute": 0.015}] * 4)
    ranks[1].record([{"compute": 0.015}] * 6 + [{"compute": 0.010}] * 4)
    means = [d.own_means()[0] for d in ranks]
    assert means == [pytest.approx(0.012), pytest.approx(0.013)]
    rel = relative_perf_scores([{"compute": m} for m in means])
    assert rel[1]["compute"] == pytest.approx(12 / 13) and not identify_stragglers(rel, [{}] * 2, 0.75)


class _Warmup(torch.nn.Module):
    """A leaf whose forward is heavy once, as an attempt's first step is (optimizer state, cold caches)."""

    def forward(self, x):
        for _ in range(50):
            x = x @ x / x.shape[0]
        return x


def test_an_attempts_first_step_is_not_timed():
    from nvrx_lab.straggler import StragglerHooks

    events = []
    hooks = StragglerHooks(interval=3, emit=lambda kind, **f: events.append((kind, f)))
    leaf, warmup, x = torch.nn.Linear(4, 4), _Warmup(), torch.randn(1, 4)
    heavy = time.process_time()
    warmup(torch.randn(500, 500))  # what the first step's heavy forward costs in CPU time, timed alone
    heavy = (time.process_time() - heavy) * 1e3
    hooks.start()
    try:
        for step in (1, 2, 3):
            leaf(x)
            if step == 1:
                warmup(torch.randn(500, 500))
            hooks.after_step(step)
    finally:
        hooks.close()
    ((kind, fields),) = events
    assert kind == "straggler_scores" and fields["step"] == 3
    # timed, the heavy forward would put the mean at heavy / 3 at least; untimed, only the tiny forwards count
    assert fields["mean_ms"]["compute"][0] < heavy / 6, (heavy, fields)


@pytest.mark.parametrize("flags, match", [
    (dict(straggler_threshold=1.5), r"--straggler-threshold 1.5 must be in \(0, 1\]"),
    (dict(straggler_threshold=0.0), r"--straggler-threshold 0.0 must be in \(0, 1\]"),
    (dict(straggler_interval=-1), "--straggler-interval -1 must be >= 0"),
    (dict(straggler_interval=5, straggler_action="restart"), "--straggler-action restart needs --restart inprocess"),
    (dict(restart="inprocess", straggler_action="restart"), "needs --straggler-interval"),
])
def test_bad_straggler_flags_name_the_flag(flags, match):
    with pytest.raises(ValueError, match=match):
        check_config(TrainConfig.from_kwargs(**flags), 1)


def test_slow_fault_grammar():
    (f,) = parse_schedule("1:20:slow:1.5")
    assert (f.rank, f.step, f.kind, f.factor, f.phase, f.id) == (1, 20, "slow", 1.5, "step", "1:20:slow:1.5")
    for bad in ("1:20:slow", "1:20:slow:1", "1:20:slow:fast", "1:20:slow:nan"):
        with pytest.raises(ValueError, match="RANK:STEP:slow:FACTOR"):
            parse_schedule(bad)
    # a legitimate pause is a kind of its own, with its seconds, not a slow rank
    (pause,) = parse_schedule("1:0:3:pause:4")
    assert (pause.factor, pause.value, pause.id) == (0.0, 4.0, "1:0:3:pause:4")


def _straggler_run(tmp_path, faults: str | None, steps: int, **flags) -> list[dict]:
    metrics = tmp_path / "m.jsonl"
    cmd = Torchrun.local(2, free_port_pair()).argv(trainer(steps=steps, straggler_interval=5, faults=faults,
                                                           metrics=metrics, **SMALL, **flags))
    res = run_group(cmd, timeout=170)
    assert res.returncode == 0, res.stdout[-3000:]
    return last_run(read_events(metrics))


@pytest.mark.slow
@pytest.mark.timeout(190)
def test_on_a_uniformly_loaded_machine_the_slowed_rank_is_named_within_two_reports_and_no_other(tmp_path):
    """Two busy loops load both cores: before the fault every rank is slowed alike and nobody is named."""
    with busy_loops(2):
        events = _straggler_run(tmp_path, "1:16:slow:2", steps=30)
    scores = [e for e in events if e["kind"] == "straggler_scores"]
    assert [e["step"] for e in scores] == [5, 10, 15, 20, 25, 30]
    named = [(e["rank"], e["step"]) for e in events if e["kind"] == "straggler"]
    assert named and {r for r, _ in named} == {1}, named  # rank 0 never, nobody before the fault at step 16
    assert min(s for _, s in named) <= 25, named  # below at 20 and 25: named at the second report
    assert scores[-1]["relative"]["compute"][1] < 0.75 <= scores[-1]["relative"]["compute"][0]


def _exchange(peer: str, timeout: float = 3.0) -> dict:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "tests/workers/straggler_exchange.py", "--peer", peer, "--timeout",
                               str(timeout)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2",
                                                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in (0, 1)]
    try:
        out, _ = procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, out[-3000:]
    return json.loads(lines[-1])


@pytest.mark.timeout(90)
def test_a_peer_dying_or_hanging_mid_exchange_ends_it_within_the_group_timeout():
    t0 = time.monotonic()
    died = _exchange("die")  # gloo sees the closed connection: at once, not after the timeout
    assert died["outcome"] == "error" and "closed" in died["error"].lower() and died["seconds"] < 2.5, died
    hung = _exchange("hang", timeout=3.0)  # nothing closes: the group timeout ends it
    assert hung["outcome"] == "error" and 2.5 <= hung["seconds"] < 8.0, hung
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_restart_action_makes_the_straggler_leave_and_the_rest_finish(tmp_path):
    metrics = tmp_path / "m.jsonl"
    cmd = Spawn(2, master_port=free_port_pair(), timeout=150).argv(trainer(
        steps=16, restart="inprocess", soft_timeout=20, hard_timeout=60, straggler_interval=4,
        straggler_action="restart", faults="1:3:slow:3", metrics=metrics, **SMALL))
    res = run_group(cmd, timeout=170)
    events = last_run(read_events(metrics))
    out = res.stdout[-4000:]
    assert "STRAGGLER rank 1" in res.stdout and "StragglerError: rank 1 is a persistent straggler" in res.stdout, out
    restarts = [e for e in events if e["kind"] == "restart" and e["rank"] == 0]
    assert any("StragglerDetected" in e["detail"] for e in restarts), (restarts, out)
    assert restarts[-1]["world_size"] == 1, (restarts, out)  # the wrapper went on without rank 1
    assert [(e["rank"], e["steps"]) for e in events if e["kind"] == "end"] == [(0, 16)], out


def test_goodput_counts_the_time_lost_to_a_slow_rank():
    from nvrx_lab.observe.goodput import analyze

    events = [{"t": 0.0, "kind": "start", "rank": 0, "new_run": True}]
    events += [{"t": 0.1 * s, "kind": "step", "rank": 0, "step": s, "step_time": 0.1} for s in range(1, 11)]
    events += [{"t": 1.01, "kind": "fault", "rank": 1, "step": 11, "fault": "slow", "factor": 2.0}]
    events += [{"t": 1.0 + 0.2 * i, "kind": "step", "rank": 0, "step": 10 + i, "step_time": 0.2} for i in range(1, 11)]
    report = analyze(events)
    assert report.ideal_step_s == pytest.approx(0.1) and report.slow_lost_s == pytest.approx(1.0)
    assert report.faults == [] and report.row()["slow_lost_s"] == pytest.approx(1.0)  # no failure, no recovery


def test_the_scale_model_scores_a_report_of_many_ranks_and_names_the_slow_one():
    from nvrx_lab.bench._scale_model import measure_straggler_report

    row = measure_straggler_report(256)  # raises unless the slowed last rank, and only it, is named
    assert row["straggler_bytes_per_rank"] == 256 * 3 * 8 and row["straggler_report_ms"] > 0
