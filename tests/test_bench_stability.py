"""``python -m nvrx_lab.bench stability``: the pass/fail judgement without processes, and one real plain run."""

import json
import sys

import pytest

from nvrx_lab.bench.stability import COMMANDS, Trial, judge, main, summarize

FAULTS = COMMANDS["inprocess"].faults  # two faults


def events(*, faults: int, last_step: int) -> list[dict]:
    return ([{"kind": "step", "rank": 0, "step": s} for s in range(1, last_step + 1)]
            + [{"kind": "fault", "rank": 1, "step": 12} for _ in range(faults)] + [{"kind": "end", "rank": 0}])


def test_judge_passes_only_with_exit_0_every_fault_and_the_last_step():
    assert judge(0, events(faults=2, last_step=40), 40, FAULTS) is None
    assert judge(0, events(faults=0, last_step=8), 8, "") is None
    assert judge(0, events(faults=1, last_step=40), 40, FAULTS) == "1 of 2 scheduled faults fired"
    assert judge(0, events(faults=2, last_step=39), 40, FAULTS) == "last step 39, expected 40"
    assert judge(-6, events(faults=0, last_step=8), 8, "") == "exit code -6"
    assert judge(-9, [], 8, "", timed_out=True) == "timed out"


def test_summarize_counts_exit_codes_per_command():
    trials = [Trial("plain", 1, 0, 3.0, None, "", "", 0), Trial("plain", 2, 1, 5.0, "exit code 1", "w", "x"),
              Trial("plain", 3, 0, 4.0, None, "", "", 2)]
    assert summarize(trials, ["plain"]) == [{"command": "plain", "runs": 3, "passed": 2, "failed": 1,
                                             "exit_codes": {0: 2, 1: 1}, "median_wall_s": 4.0,
                                             "median_rollback_steps": 1.0}]


@pytest.mark.timeout(150)
def test_one_plain_run_writes_the_table_and_json(tmp_path, capsys):
    out = tmp_path / "stability.json"
    rc = main(["--runs", "1", "--commands", "plain", "--timeout", "120", "--workdir", str(tmp_path / "runs"),
               "--out", str(out)])
    data = json.loads(out.read_text())
    [row] = data["rows"]
    assert set(row) == {"command", "runs", "passed", "failed", "exit_codes", "median_wall_s", "median_rollback_steps"}
    assert row["command"] == "plain" and row["runs"] == 1 and row["passed"] + row["failed"] == 1
    assert sum(row["exit_codes"].values()) == 1
    assert rc == (0 if row["passed"] else 1)  # the trainer's exit may still be flaky: the shape is what we check
    [trial] = data["trials"]
    assert trial["command"] == "plain" and trial["exit"] == int(next(iter(row["exit_codes"])))
    assert data["commands"]["plain"].startswith(sys.executable) and data["load"] == 0
    assert "median_wall_s" in capsys.readouterr().out
