"""The writer process is a clean interpreter of our own module: a script without a ``__main__`` guard
checkpoints, and a writer that cannot start says why at once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from nvrx_lab.checkpoint import writer
from nvrx_lab.checkpoint.commit import committed_steps

NO_GUARD = """
import sys, torch
from nvrx_lab.checkpoint import AsyncCheckpointer
print("top level ran", flush=True)
state = {"w": torch.arange(1024.0)}
with AsyncCheckpointer(sys.argv[1]) as ckpt:
    for step in (1, 2):
        ckpt.async_save(state, step=step)
        ckpt.finalize_async_save(blocking=True)
"""


@pytest.mark.timeout(120)
def test_a_script_without_main_guard_checkpoints_and_is_not_rerun(tmp_path):
    script = tmp_path / "train_no_guard.py"
    script.write_text(textwrap.dedent(NO_GUARD))
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], capture_output=True, text=True,
                         timeout=100)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("top level ran") == 1, res.stdout  # the writer never ran the script again
    assert "died" not in res.stderr, res.stderr
    assert committed_steps(tmp_path / "ckpt") == [1, 2]


@pytest.mark.timeout(60)
def test_a_writer_that_cannot_start_says_why_at_once(monkeypatch):
    monkeypatch.setattr(writer, "command", lambda conn_fd, death_fd, priority: [
        sys.executable, "-c", "import sys; print('ImportError: no module named fast_storage', file=sys.stderr); sys.exit(3)"])
    proc = writer.WriterProcess(rank=5, fork=False)  # a clean interpreter (forked writers run no command)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"writer of rank 5 could not start: exit code 3: ImportError: no module"):
        proc.wait_ready(timeout=60)
    assert time.monotonic() - t0 < 10
    proc.submit({"step": 7, "tmp": "/nonexistent/.tmp_step_00000007_x"})
    kind, step, info = proc.poll(timeout=10)
    assert (kind, step) == ("died", 7) and "no module named fast_storage" in info["why"]
    proc.close()


@pytest.mark.timeout(60)
def test_a_writer_closed_mid_save_announces_nothing_and_says_why_without_its_log(monkeypatch):
    """Abandon closes the writer with a save in flight; its reader thread, which sees the connection drop a
    moment later, must neither announce that save nor read the closed log (it raised in that thread)."""
    monkeypatch.setattr(writer, "command", lambda conn_fd, death_fd, priority: [
        sys.executable, "-c", "import time; time.sleep(60)"])  # never ready: the save stays in flight
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    proc = writer.WriterProcess(rank=3, fork=False)
    outcomes = []
    proc.submit({"step": 4, "tmp": "/nonexistent/.tmp_step_00000004_x"}, on_outcome=lambda *a: outcomes.append(a))
    proc.close(timeout=0.1)
    reader = [t for t in threading.enumerate() if t.name == "nvrx-ckpt-writer-3-reader"]
    for t in reader:
        t.join(10)
    proc._announce("died", None)  # a reader thread later still
    assert not [t for t in reader if t.is_alive()] and raised == [] and outcomes == []
    assert proc.why() == "exit code -9"


@pytest.mark.timeout(240)  # a wedge's bound: a spawned writer imports torch, which took 60 s beside a loaded suite
@pytest.mark.parametrize("fork", [True, False], ids=["forked", "spawned"])
def test_the_writer_exits_with_its_trainer(tmp_path, fork):
    """The death pipe: the writer exits when the process holding the write end is gone."""
    code = ("import sys, time; from nvrx_lab.checkpoint.writer import WriterProcess; "
            f"w = WriterProcess(fork={fork}); w.wait_ready(60); print(w.pid, flush=True); time.sleep(60)")
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(trainer.stdout.readline())
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid), "the writer outlived its trainer"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(60)
def test_prepare_sizes_and_touches_the_staging_region_before_the_first_save(tmp_path):
    import torch

    from nvrx_lab.checkpoint import AsyncCheckpointer

    sd = {"w": torch.randn(64, 1024), "b": torch.arange(77, dtype=torch.int64), "s": torch.tensor(3.0)}
    with AsyncCheckpointer(tmp_path, start_writer=False) as ckpt:
        ckpt.prepare(sd, plan=True)
        region = ckpt._buffer.path
        assert region and ckpt._buffer.capacity >= 64 * 1024 * 4
        assert not [p for p in tmp_path.iterdir() if "step" in p.name], "a plan made no folder"
        ckpt.async_save(sd, step=1)  # no new region: staging copies into memory already touched
        assert ckpt._buffer.path == region and ckpt._plans.reuses == 1  # and the plan made in prepare
        ckpt.finalize_async_save(blocking=True)
    assert committed_steps(tmp_path) == [1]


@pytest.mark.timeout(60)
def test_a_forked_writer_is_ready_at_once_and_holds_none_of_the_trainers_descriptors(tmp_path):
    """Forked from a process with torch imported it answers ``ready`` in well under a second (a clean
    interpreter takes ~2 s); it keeps its socket, its death pipe and stdio, and none of the trainer's
    files or sockets (a gloo socket held by a writer would outlive a killed trainer)."""
    import socket

    import torch  # noqa: F401 - what the trainer has imported when it forks

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    log = open(tmp_path / "trainer.log", "w")  # noqa: SIM115 - kept open across the fork on purpose
    try:
        proc = writer.WriterProcess(rank=2)
        assert proc.forked
        proc.wait_ready(timeout=30)
        assert proc.ready_s < 1.0, proc.ready_s
        fds = os.listdir(f"/proc/{proc.pid}/fd")
        targets = {os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in fds}
        assert not any(str(tmp_path) in t for t in targets), targets
        assert f"socket:[{os.fstat(held.fileno()).st_ino}]" not in targets, targets
        assert len(fds) <= 8, targets  # stdio, its socket, the death pipe, and what its own start opened
        proc.close()
        assert proc.why() == "exit code 0"
    finally:
        held.close()
        log.close()
