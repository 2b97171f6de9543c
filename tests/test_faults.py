"""Fault schedules are deterministic, reject bad entries clearly and fire each fault once across restarts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nvrx_lab.faults import Fault, FaultConfig, FaultInjector, InjectedFault, format_schedule, make_schedule, parse_schedule
from nvrx_lab.observe.events import EventLog, read_events


def test_parse_round_trip():
    faults = parse_schedule("1:5:exception, 0:9:hang,1:12:sigkill,0:10:exception:load")
    assert faults == [Fault(1, 5, "exception"), Fault(0, 9, "hang"), Fault(1, 12, "sigkill"),
                      Fault(0, 10, "exception", "load")]
    assert parse_schedule(format_schedule(faults)) == faults
    assert parse_schedule("") == []


@pytest.mark.parametrize("spec, message", [
    ("1:5", "expected RANK:STEP:KIND"),
    ("a:5:exception", "non-negative integers"),
    ("1:5:explode", "is not one of exception, hang, sigkill, oom"),
    ("1:5:exception:later", "phase 'later' is not one of step, save, load"),
    ("1:5:exception:load:x", "expected RANK:STEP:KIND"),
])
def test_bad_entries_name_the_entry(spec, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_schedule(spec)
    assert spec in str(err.value)


def test_make_schedule_is_deterministic_and_skips_rank_0():
    a = make_schedule(5, world_size=4, steps=100, seed=7, kinds=("exception", "hang"))
    assert a == make_schedule(5, world_size=4, steps=100, seed=7, kinds=("exception", "hang"))
    assert a != make_schedule(5, world_size=4, steps=100, seed=8, kinds=("exception", "hang"))
    assert len({f.step for f in a}) == 5 and all(f.rank != 0 and 5 <= f.step < 100 for f in a)
    assert [f.kind for f in a] == ["exception", "hang"] * 2 + ["exception"]
    with pytest.raises(ValueError, match="do not fit"):
        make_schedule(10, world_size=2, steps=10)


def test_a_fault_fires_once_even_after_a_restart(tmp_path):
    faults = parse_schedule("1:3:exception,0:3:exception")
    state, metrics = tmp_path / "fired.jsonl", tmp_path / "m.jsonl"
    inject = FaultInjector(faults, rank=1, state_file=state, emit=EventLog(metrics, rank=1))
    inject(2)
    with pytest.raises(InjectedFault, match="rank 1 at step 3"):
        inject(3)
    # A new process (a restart) reads the persisted record and does not fire again.
    FaultInjector(faults, rank=1, state_file=state)(3)
    fired = read_events(metrics, "fault")
    assert len(fired) == 1 and fired[0]["step"] == 3 and fired[0]["fault"] == "exception"
    with pytest.raises(InjectedFault):  # rank 0's own fault is separate
        FaultInjector(faults, rank=0, state_file=state)(3)


def test_oom_stand_in_raises_memory_error():
    with pytest.raises(MemoryError, match="injected memory exhaustion"):
        FaultInjector(parse_schedule("0:1:oom"), rank=0)(1)


def test_sigkill_takes_the_process(tmp_path):
    code = ("from nvrx_lab.faults import FaultInjector, parse_schedule; "
            f"FaultInjector(parse_schedule('0:1:sigkill'), 0, state_file={str(tmp_path / 'f.jsonl')!r})(1); print('survived')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == -9 and "survived" not in res.stdout
    assert "0:1:sigkill" in (tmp_path / "f.jsonl").read_text()  # recorded before it acted


def test_phases_fire_only_in_their_phase(tmp_path):
    inject = FaultInjector(parse_schedule("0:5:exception:load,0:5:exception:save"), rank=0)
    inject(5)  # the step phase of step 5: nothing scheduled
    inject.during("load", 4)
    with pytest.raises(InjectedFault):
        inject.during("load", 5)
    inject.during("load", 5)  # once only
    with pytest.raises(InjectedFault):
        inject.during("save", 5)


def test_attempts_are_for_callers_that_know_their_attempt():
    faults = parse_schedule("1:0:4:exception,0:1-2:7:hang,2:*:9:sigkill,*:0:3:pause:5")
    assert [f.fires_in(1) for f in faults] == [False, True, True, False]
    assert faults[0] == Fault(1, 4, "exception", attempts=range(0, 1)) and faults[2].fires_in(999)
    assert faults[3].hits(0) and faults[3].hits(7) and faults[3].value == 5  # every rank pauses 5 s
    assert parse_schedule(format_schedule(faults)) == faults
    with pytest.raises(ValueError, match="ATTEMPTS is for the demo workers"):
        FaultConfig("1:0:4:exception")  # the trainer fires each fault once instead
    with pytest.raises(ValueError, match="'3-1' is an empty range"):
        parse_schedule("1:3-1:4:exception")


def test_a_fault_with_attempts_fires_in_each_of_them_and_one_without_once():
    faults = parse_schedule("0:0-1:2:exception,0:3:exception")
    for attempt in (0, 1):
        with pytest.raises(InjectedFault):
            FaultInjector(faults, rank=0, attempt=attempt)(2)
    FaultInjector(faults, rank=0, attempt=2)(2)  # not in attempt 2
    once = FaultInjector(faults, rank=0, attempt=0)
    with pytest.raises(InjectedFault):
        once(3)
    once.attempt = 1
    once(3)  # fired once already: an in-process restart does not fire it again
