"""The trainer with a fault inside a save, a load and a restart, and bad input end to end
(:mod:`nvrx_lab.reliability.trainer`, :mod:`nvrx_lab.reliability.bad_input`; the bench runs every mode)."""

from __future__ import annotations

import pytest

from nvrx_lab.reliability import bad_input, trainer


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case, mode", [
    pytest.param(trainer.fault_during_save, "inprocess", marks=pytest.mark.slow),
    pytest.param(trainer.fault_during_load, "inprocess", marks=pytest.mark.slow),
    (trainer.fault_during_restart, "launcher+inprocess"),
])
def test_fault_inside_checkpoint_or_restart_machinery_is_recovered_onto_one_curve(tmp_path, case, mode):
    row = case(tmp_path, modes=(mode,))
    assert row.trials == 1 and row.ok, row.failures


def test_curve_and_resume_checks_catch_what_they_promise():
    step = lambda s, loss, t: {"kind": "step", "step": s, "loss": loss, "t": t, "rank": 0}  # noqa: E731
    events = [step(1, 2.0, 1), step(2, 1.5, 2), {"kind": "resume", "step": 2, "t": 3, "rank": 1}, step(2, 1.4, 4)]
    assert "another loss" in trainer.curve_problem(events, 2)
    assert trainer.curve_problem(events[:2], 3) == "steps missing: [3]"
    assert "resumed from step 2" in trainer.resume_problem(events)
    # redone by a world of one: the same loss up to rounding passes, a real difference does not
    alone = [{"kind": "start", "rank": 0, "world_size": 2, "t": 0}, step(1, 5.440786361694336, 1),
             {"kind": "resume", "rank": 1, "world_size": 1, "step": 0, "t": 2}, {**step(1, 5.440786838531494, 3), "rank": 1}]
    assert trainer.curve_problem(alone, 1) is None
    alone[-1]["loss"] = 5.4408
    assert "another loss" in trainer.curve_problem(alone, 1)
    assert "another loss" in trainer.curve_problem([alone[0], alone[1], {**alone[1], "loss": 5.440786838531494}], 1)
    assert trainer.resume_problem([{"kind": "ckpt_commit", "step": 2, "t": 2.5, "rank": 0}, *events]) is None


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bad_checkpoint_folders_and_specs_are_refused_and_nothing_changes(tmp_path):
    row = bad_input.bad_input(tmp_path, only=("ckpt dir", "load", "JobSpec", "launcher: YAML typo", "trainer: fault",
                                                     "trainer: negative", "trainer: local"))
    assert row.trials == 20 and row.ok, row.failures


def test_snapshot_sees_a_changed_byte(tmp_path):
    (tmp_path / "a").write_bytes(b"x")
    before = bad_input.snapshot(tmp_path)
    (tmp_path / "a").write_bytes(b"y")
    assert bad_input.snapshot(tmp_path) != before
