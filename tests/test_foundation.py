"""Small pieces the layers stand on: data stream, CLI from dataclasses, events, benchmark dispatch."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from typing import Literal

import pytest
import torch

from nvrx_lab.cli import add_dataclass_args, dataclass_from_args, field_docs
from nvrx_lab.observe.events import EventLog, read_events
from nvrx_lab.train.data import SyntheticTokens


def test_data_stream_is_independent_of_world_size_and_resumable():
    one = SyntheticTokens(256, 16, global_batch=4, seed=3)
    x1, _ = one.next_batch()
    two = [SyntheticTokens(256, 16, global_batch=4, seed=3) for _ in range(2)]
    halves = [d.next_batch(rank=r, world_size=2)[0] for r, d in enumerate(two)]
    assert torch.equal(torch.cat(halves), x1)
    resumed = SyntheticTokens(256, 16, global_batch=4, seed=3)
    resumed.load_state_dict(one.state_dict())
    assert torch.equal(resumed.next_batch()[0], one.next_batch()[0])
    with pytest.raises(ValueError, match="seed=4"):
        SyntheticTokens(256, 16, 4, seed=4).load_state_dict(one.state_dict())
    with pytest.raises(ValueError, match="global_batch=4 is not divisible by world_size=3"):
        one.next_batch(0, 3)


@dataclasses.dataclass
class _Cfg:
    rate: float = 0.5
    """How fast."""
    mode: Literal["a", "b"] = "a"
    """Which way."""
    on: bool = False
    """Switch it on."""


def test_cli_flags_come_from_the_dataclass():
    assert field_docs(_Cfg) == {"rate": "How fast.", "mode": "Which way.", "on": "Switch it on."}
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, _Cfg)
    cfg = dataclass_from_args(_Cfg, parser.parse_args(["--rate", "2", "--mode", "b", "--on", "true"]))
    assert cfg == _Cfg(rate=2.0, mode="b", on=True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "c"])


def test_event_log_appends_lines_and_skips_a_torn_tail(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path, rank=3)
    log.emit("step", step=1, loss=2.5)
    log("save", step=1)
    with path.open("a") as f:
        f.write('{"kind": "step", "ste')  # a writer killed mid-line
    assert [(e["kind"], e["rank"]) for e in read_events(path)] == [("step", 3), ("save", 3)]
    assert read_events(path, "save")[0]["step"] == 1
    EventLog(None).emit("step")  # disabled log: no file, no error


def test_bench_dispatch_rejects_an_unknown_benchmark():
    res = subprocess.run([sys.executable, "-m", "nvrx_lab.bench", "nope"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown benchmark 'nope'" in res.stderr


def test_deterministic_sets_torchs_flag_without_loading_inductor():
    """A worker start must not pay for dynamo and inductor: the flag is set, nothing compiles here."""
    code = ("import sys, torch; from nvrx_lab.dist import deterministic; deterministic(); "
            "assert torch.are_deterministic_algorithms_enabled(); "
            "assert 'torch._inductor' not in sys.modules and 'torch._dynamo' not in sys.modules, 'inductor loaded'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.timeout(60)
def test_run_ends_when_the_job_exits_and_names_what_still_holds_its_output():
    """A child of the job that keeps its stdout open (a stuck helper) must not hold the caller until it exits by
    itself: the wall time ends at the leader's exit, and the child is killed and named."""
    from nvrx_lab import runner

    child = "import time; time.sleep(300)"
    code = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}]); print('leader done')"
    t0 = time.monotonic()
    res = runner.run([sys.executable, "-c", code], timeout=30)
    assert time.monotonic() - t0 < runner.LINGER_S + 10 and res.wall_s < runner.LINGER_S
    assert res.returncode == 0 and "leader done" in res.output
    assert "still held its output 5 s later: killed" in res.output and "time.sleep(300)" in res.output


def test_free_ports_come_from_this_workers_slice_and_a_bad_slice_is_named(monkeypatch):
    """``make test``'s two workers pick ports from slices of their own (``tests/conftest.py``): a port one
    worker's test checked and handed to a process can never be picked by the other's meanwhile."""
    from nvrx_lab.net import PORTS_ENV, free_ports, port_range, worker_ports

    mine = worker_ports(0, 1)
    if (worker := os.environ.get("PYTEST_XDIST_WORKER")) is not None:  # under xdist (make test): this worker's slice
        mine = worker_ports(int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
        assert os.environ[PORTS_ENV] == f"{mine.start}-{mine.stop - 1}"
    halves = [worker_ports(i, 2) for i in (0, 1)]
    assert halves[0].stop <= halves[1].start and all(h.start in port_range() and h.stop - 1 in port_range() for h in halves)
    low = mine.start + 100  # a hundred ports of this worker's own slice: the other worker never picks them
    monkeypatch.setenv(PORTS_ENV, f"{low}-{low + 99}")
    assert all(low <= p <= low + 99 for p in free_ports(20)) and len(set(free_ports(20))) == 20
    first, *_ = free_ports(2, consecutive=True)
    assert low <= first < low + 99
    monkeypatch.setenv(PORTS_ENV, "9-8")
    with pytest.raises(ValueError, match=r"\$NVRX_LAB_PORTS='9-8': expected LO-HI"):
        free_ports(1)
    monkeypatch.delenv(PORTS_ENV)
    pool = port_range()
    assert all(p in pool for p in free_ports(5))
