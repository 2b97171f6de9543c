"""The evidence that tells a hung replica from a slow one (nvrx_lab.replicas.progress): units of work completed,
never a thread's CPU time. One process, a real model; the end-to-end cases are in test_replicas.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from nvrx_lab.faults.slowdown import restore, slow_down, spin
from nvrx_lab.net import wait_for
from nvrx_lab.replicas.progress import HANG_FLOOR_S, Progress


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model, optimizer) -> None:
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_every_leaf_forward_its_backward_and_the_optimizer_step_is_a_unit():
    model, optimizer = _model()
    progress = Progress(model, optimizer)
    with progress.working():
        _step(model, optimizer)
    assert progress.ticks == 3 + 3 + 1  # three leaves forward, their three backwards, one update
    progress.remove()
    _step(model, optimizer)
    assert progress.ticks == 7, "removed: no more units"


def test_the_limit_is_ten_times_the_longest_gap_of_a_finished_step_at_least_the_floor():
    model, optimizer = _model()
    progress = Progress(model, optimizer)
    assert progress.hang_after_s() == HANG_FLOOR_S
    with progress.working():
        model(torch.randn(4, 8))
        time.sleep(0.4)  # one gap of 0.4 s between two units
        _step(model, optimizer)
    assert progress.hang_after_s() == HANG_FLOOR_S, "not a finished step yet"
    progress.step_finished()
    assert progress.longest >= 0.4 and progress.hang_after_s() == 10 * progress.longest  # the gap as measured
    assert Progress(model, optimizer, hang_timeout=1.5).hang_after_s() == 1.5


@pytest.mark.parametrize("sleep", [False, True])
def test_a_slow_thread_makes_progress_whether_it_spins_or_sleeps(sleep):
    """The two cases the old CPU-time heuristic got backwards, read from another thread as the client's reader does."""
    model, optimizer = _model()
    progress = Progress(model, optimizer)
    _step(model, optimizer)
    slow_down(10, sleep=sleep)
    try:
        seen = []
        worker = threading.Thread(target=lambda: [_step(model, optimizer) for _ in range(8)])
        with progress.working():
            worker.start()  # read as the probe does, until a unit of the slowed worker completes
            seen.append(progress.report())
            wait_for(lambda: seen.append(progress.report()) or seen[-1]["ticks"] > seen[0]["ticks"], 60,
                     "a unit of the slowed worker", interval=0.05)
            worker.join(60)
    finally:
        restore()
    assert all(r["working"] for r in seen) and not worker.is_alive()


def test_a_hang_that_spins_completes_no_unit():
    model, optimizer = _model()
    progress = Progress(model, optimizer)
    with progress.working():
        _step(model, optimizer)
        before = progress.report()
        spin(0.3)  # busy, and no unit completes
        after = progress.report()
    assert after["ticks"] == before["ticks"] and after["idle_s"] >= 0.3
    assert not progress.report()["working"]
