"""The trainer's one extension point: ComposeHooks fans each moment out in order, nests sections with the
first outermost, closes every hook even when one fails, and keeps named hooks' state by name."""

from __future__ import annotations

import contextlib

import pytest

from nvrx_lab.train.hooks import ComposeHooks, Hooks


class Recorder(Hooks):
    def __init__(self, tag: str, log: list, name: str = ""):
        self.tag, self.log, self.name, self.state = tag, log, name, None

    def before_step(self, step):
        self.log.append((self.tag, "before_step", step))

    def during(self, phase, step):
        self.log.append((self.tag, "during", phase, step))

    @contextlib.contextmanager
    def section(self, name):
        self.log.append((self.tag, "enter", name))
        yield
        self.log.append((self.tag, "exit", name))

    def close(self):
        self.log.append((self.tag, "close"))

    def state_dict(self):
        return f"state of {self.tag}"

    def load_state_dict(self, state):
        self.state = state


def test_each_moment_reaches_every_hook_in_order():
    log: list = []
    hooks = ComposeHooks(Recorder("a", log), None, ComposeHooks(Recorder("b", log)))
    hooks.before_step(3)
    hooks.during("save", 3)
    hooks.progress()  # a moment nobody overrides is a no-op
    assert log == [("a", "before_step", 3), ("b", "before_step", 3), ("a", "during", "save", 3),
                   ("b", "during", "save", 3)]


def test_sections_nest_first_outermost():
    log: list = []
    with ComposeHooks(Recorder("outer", log), Recorder("inner", log)).section("checkpoint"):
        log.append("body")
    assert log == [("outer", "enter", "checkpoint"), ("inner", "enter", "checkpoint"), "body",
                   ("inner", "exit", "checkpoint"), ("outer", "exit", "checkpoint")]


def test_close_reaches_every_hook_when_one_fails():
    log: list = []

    class Broken(Hooks):
        def close(self):
            raise RuntimeError("monitor gone")

    with pytest.raises(RuntimeError, match="monitor gone"):
        ComposeHooks(Recorder("a", log), Broken(), Recorder("b", log)).close()
    assert ("a", "close") in log and ("b", "close") in log


def test_state_is_kept_under_each_named_hook():
    log: list = []
    named, anonymous = Recorder("m", log, name="monitor"), Recorder("f", log)
    hooks = ComposeHooks(named, anonymous)
    assert hooks.state_dict() == {"monitor": "state of m"}
    hooks.load_state_dict({"monitor": "saved", "model": {}})
    assert named.state == "saved" and anonymous.state is None
    hooks.load_state_dict({})  # a checkpoint from a run without the launcher: nothing to load
    assert named.state == "saved"
