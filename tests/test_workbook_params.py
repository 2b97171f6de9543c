"""``nvrx_lab.workbook.Parameters``: a notebook's parameters checked one call each, a bad value a one-line
``ParameterError`` naming the parameter, and a value the user set never replaced by a smoke default."""

from __future__ import annotations

import math

import pytest

from nvrx_lab.workbook import SMOKE_ENV, ParameterError, Parameters, parse_smoke


@pytest.fixture(autouse=True)
def _no_smoke_env(monkeypatch):
    monkeypatch.delenv(SMOKE_ENV, raising=False)


# -- the smoke switch --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("env, smoke", [(None, True), ("1", True), ("0", False), (" 0 ", False)])
def test_smoke_none_reads_the_environment(monkeypatch, env, smoke):
    if env is not None:
        monkeypatch.setenv(SMOKE_ENV, env)
    assert parse_smoke(None) is smoke
    assert Parameters(None).smoke is smoke


@pytest.mark.parametrize("given, smoke", [(True, True), (False, False), (1, True), (0, False)])
def test_smoke_as_given_beats_the_environment(monkeypatch, given, smoke):
    monkeypatch.setenv(SMOKE_ENV, "0" if smoke else "1")
    assert parse_smoke(given) is smoke


@pytest.mark.parametrize("given", ["maybe", "True", 2, 0.5, [True]])
def test_smoke_refuses_anything_else(given):
    with pytest.raises(ParameterError, match=r"^parameter smoke: expected True or False .*got ") as e:
        Parameters(given)
    assert "\n" not in str(e.value) and repr(given) in str(e.value)


def test_smoke_environment_refuses_anything_but_0_or_1(monkeypatch):
    monkeypatch.setenv(SMOKE_ENV, "yes")
    with pytest.raises(ParameterError, match=r"^\$NVRX_LAB_SMOKE must be 0 .* or 1 .*got 'yes'$"):
        Parameters(None)


# -- defaults: None takes the configuration's, a value the user set is kept ------------------------------------

@pytest.mark.parametrize("smoke, expected", [(True, 12), (False, 40)])
def test_none_takes_the_default_of_the_configuration(smoke, expected):
    p = Parameters(smoke)
    assert p.int("steps", None, min=1, smoke=12, full=40) == expected
    assert p.values["steps"] == (expected, "smoke default" if smoke else "full-size default")


@pytest.mark.parametrize("smoke", [True, False])
def test_a_value_the_user_set_is_never_replaced(smoke):
    p = Parameters(smoke)
    assert p.int("steps", 100, min=1, smoke=12, full=40) == 100
    assert p.float("threshold", 0.7, smoke=0.55, full=0.8) == 0.7
    assert p.list("modes", ["a"], smoke=["b"], full=["c"]) == ["a"]
    assert p.ints("ranks", [3], smoke=[8], full=[64]) == [3]
    assert p.values["steps"] == (100, "given")


def test_none_without_a_default_is_an_error():
    with pytest.raises(ParameterError, match=r"^parameter seed: None is not a value here; pass one$"):
        Parameters(True).int("seed", None, min=0)


# -- every kind: the right values pass, every wrong one is one line naming the parameter -------------------------

def test_values_that_pass():
    p = Parameters(True)
    assert p.int("nproc", 4, choices=(1, 2, 4, 8)) == 4
    assert p.int("steps", 5, min=5, max=5) == 5
    assert p.float("step_s", 1, min=0.0, min_exclusive=True) == 1.0 and isinstance(p.values["step_s"][0], float)
    assert p.bool("run", False) is False
    assert p.str("mode", "a", choices=["a", "b"]) == "a"
    assert p.list("kinds", ("x", "y"), choices=["x", "y", "z"], contains=["x"]) == ["x", "y"]
    assert p.ints("intervals", (2, 5), min=1, min_len=2) == [2, 5]


BAD = [
    # (check, expected message)
    (lambda p: p.int("steps", "ten", min=2), "parameter steps: expected an integer >= 2, got 'ten' (str)"),
    (lambda p: p.int("steps", 12.0), "parameter steps: expected an integer, got 12.0 (float)"),
    (lambda p: p.int("steps", True), "parameter steps: expected an integer, got True (bool)"),
    (lambda p: p.int("steps", 1, min=2, max=9), "parameter steps: must be in [2, 9], got 1"),
    (lambda p: p.int("steps", 20, min=50, why="five reports of 10 steps"),
     "parameter steps: must be >= 50 (five reports of 10 steps), got 20"),
    (lambda p: p.int("nproc", 3, choices=(1, 2, 4, 8), why="they split a batch of 8"),
     "parameter nproc: must be one of 1, 2, 4, 8 (they split a batch of 8), got 3"),
    (lambda p: p.float("threshold", "high", min=0.0, max=1.0), "parameter threshold: expected a number in [0.0, 1.0], "
                                                               "got 'high' (str)"),
    (lambda p: p.float("threshold", math.nan), "parameter threshold: expected a number, got nan (float)"),
    (lambda p: p.float("factor", 1.0, min=1.0, min_exclusive=True), "parameter factor: must be > 1.0, got 1.0"),
    (lambda p: p.float("factor", 0.5, max=0.25), "parameter factor: must be <= 0.25, got 0.5"),
    (lambda p: p.bool("run", "True"), "parameter run: expected True or False, got 'True' (str)"),
    (lambda p: p.bool("run", 1), "parameter run: expected True or False, got 1 (int)"),
    (lambda p: p.str("mode", 3), "parameter mode: expected a string, got 3 (int)"),
    (lambda p: p.str("mode", "c", choices=["a", "b"]), "parameter mode: 'c' is not one of 'a', 'b'"),
    (lambda p: p.str("name", "", empty=False), "parameter name: must not be empty"),
    (lambda p: p.list("modes", "baseline", choices=["baseline"]),
     "parameter modes: expected a list of strings (one of 'baseline'), got 'baseline' (str)"),
    (lambda p: p.list("modes", ["x"], choices=["a", "b"]), "parameter modes: 'x' not among 'a', 'b'"),
    (lambda p: p.list("modes", [], min_len=1), "parameter modes: needs at least 1 entry, got []"),
    (lambda p: p.list("modes", ["a", "a"]), "parameter modes: repeats an entry: ['a', 'a']"),
    (lambda p: p.list("modes", ["a"], contains=["baseline"], why="the others are compared with it"),
     "parameter modes: must include 'baseline' (the others are compared with it), got ['a']"),
    (lambda p: p.ints("ranks", [8, "64"]), "parameter ranks: expected a list of integers, got [8, '64'] (list)"),
    (lambda p: p.ints("ranks", [8, True]), "parameter ranks: expected a list of integers, got [8, True] (list)"),
    (lambda p: p.ints("ranks", [1, 8, 9000], min=2, max=4096),
     "parameter ranks: every entry must be in [2, 4096], got 1, 9000 in [1, 8, 9000]"),
    (lambda p: p.ints("intervals", [2], min_len=2), "parameter intervals: needs at least 2 entries, got [2]"),
    (lambda p: p.ints("intervals", [2, 2]), "parameter intervals: repeats an entry: [2, 2]"),
]


@pytest.mark.parametrize("check, message", BAD, ids=[m.split(":")[0] + ": " + m.split(": ", 1)[1][:30] for _, m in BAD])
def test_a_bad_value_is_one_line_naming_the_parameter(check, message):
    p = Parameters(True)
    with pytest.raises(ParameterError) as e:
        check(p)
    assert str(e.value) == message
    assert "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


def test_a_bad_value_is_not_kept():
    p = Parameters(True)
    with pytest.raises(ParameterError):
        p.int("steps", "ten")
    assert "steps" not in p.values


def test_done_is_one_line_of_every_value_and_its_origin(capsys):
    p = Parameters(True)
    p.int("steps", None, smoke=12, full=40)
    p.int("nproc", 2)
    p.list("modes", None, smoke=["baseline"], full=["baseline", "launcher"])
    assert p.done() is None  # the last line of a cell: a returned value would show a second time as Out[…]
    line = "parameters: smoke=True, steps=12 (smoke default), nproc=2, modes=['baseline'] (smoke default)"
    assert capsys.readouterr().out == line + "\n" and p.line() == line


def test_done_names_the_environment_as_the_origin_of_smoke(monkeypatch, capsys):
    monkeypatch.setenv(SMOKE_ENV, "0")
    p = Parameters(None)
    p.int("steps", None, smoke=12, full=40)
    assert p.line() == "parameters: smoke=False ($NVRX_LAB_SMOKE), steps=40 (full-size default)"
