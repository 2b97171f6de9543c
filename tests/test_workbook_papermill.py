"""Notebook parameters checked in a real kernel, and the kernel run without its TCP warning.

``papermill NOTEBOOK -p steps ten`` (likewise ``-p smoke maybe`` and ``-p smoke False -p steps ten``) ends in a
``PapermillExecutionError`` whose ``ename`` is ``ParameterError`` and whose ``evalue`` is the one line naming the
parameter, raised by the cell right after the parameters: no later cell ran, so nothing was launched (that cell
only checks, see ``tests/test_notebooks_format.py``). Run against two notebooks, a few seconds each. The
papermill command line is papermill's own, with the engine of :mod:`nvrx_lab.workbook.papermill`, whose kernel
connection is tested last: encrypted (no TCP warning), and no wait without a timeout that a missed wake-up
could make endless.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from queue import Empty

import nbformat
import pytest
import zmq
import zmq.asyncio
from jupyter_client import AsyncKernelManager
from jupyter_client.session import Session
from papermill.cli import papermill as papermill_cli
from papermill.exceptions import PapermillExecutionError

from nvrx_lab.workbook.papermill import ENGINE, POLL_SLICE_S, SlicedPollChannel, WorkbookKernelClient, kernel_config, register

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PAPERMILL = Path(sys.executable).parent / "papermill"
TCP_WARNING = "Kernel is running over TCP without encryption"

CASES = {
    "steps ten": (["-p", "steps", "ten"], "parameter steps: expected an integer", "got 'ten' (str)"),
    "smoke maybe": (["-p", "smoke", "maybe"], "parameter smoke: expected True or False", "got 'maybe' (str)"),
    "full size, steps ten": (["-p", "smoke", "False", "-p", "steps", "ten"], "parameter steps: expected an integer",
                             "got 'ten' (str)"),
}


def _papermill(notebook: Path, out: Path, *args: str) -> None:
    """papermill's command line, in this process (its exception propagates), with the encrypted engine."""
    register(as_default=False)
    papermill_cli.main([str(notebook), str(out), *args, "--engine", ENGINE, "-k", "python3", "--cwd",
                        str(notebook.parent), "--no-progress-bar", "--log-level", "WARNING"], standalone_mode=False)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("notebook", ["00_overview.ipynb", "08_stragglers.ipynb"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_parameter_stops_the_notebook_in_its_check_cell(notebook, case, tmp_path, monkeypatch):
    args, starts, got = CASES[case]
    monkeypatch.setenv("NVRX_LAB_SMOKE", "1")  # the kernel inherits it: `-p smoke False` must win over it
    out = tmp_path / notebook
    with pytest.raises(PapermillExecutionError) as e:
        _papermill(NOTEBOOKS / notebook, out, *args)
    assert e.value.ename == "ParameterError"
    assert e.value.evalue.startswith(starts) and e.value.evalue.endswith(got), e.value.evalue
    assert "\n" not in e.value.evalue

    code = [c for c in nbformat.read(out, as_version=4).cells if c.cell_type == "code"]
    tagged = [i for i, c in enumerate(code) if {"parameters", "injected-parameters"} & set(c.metadata.get("tags", []))]
    check = max(tagged) + 1  # the cell right after the parameters (and papermill's injected ones)
    ran = [i for i, c in enumerate(code) if c.execution_count is not None]
    assert ran == list(range(check + 1)), f"cells {ran} ran; the check cell is {check}: nothing after it may run"
    assert "Parameters(smoke)" in code[check].source
    assert [o.get("ename") for o in code[check].outputs if o.output_type == "error"] == ["ParameterError"]


@pytest.mark.timeout(180)
def test_the_workbooks_command_says_a_bad_parameter_in_one_line_and_exits_2(tmp_path):
    """What ``make workbook`` runs, and the README names for batch runs: the check cell's error, one line."""
    res = subprocess.run([sys.executable, "-m", "nvrx_lab.workbook.papermill", str(NOTEBOOKS / "08_stragglers.ipynb"),
                          str(tmp_path / "out.ipynb"), "-p", "steps", "ten", "-k", "python3", "--cwd", str(NOTEBOOKS),
                          "--no-progress-bar", "--log-level", "WARNING"], capture_output=True, text=True, timeout=150,
                         env={**os.environ, "NVRX_LAB_SMOKE": "1"})
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr[-3000:]  # one line: no traceback, no kernel's log line from its shutdown
    line = lines[0]
    assert line.startswith("error: parameter steps: expected an integer") and line.endswith("got 'ten' (str)"), line


@pytest.mark.timeout(180)
def test_the_engine_runs_the_kernel_without_its_tcp_warning(tmp_path):
    """Plain papermill gets the kernel's warning on stderr (jupyter_client leaves transport encryption off);
    through ``python -m nvrx_lab.workbook.papermill`` the kernel gets CurveZMQ keys, runs, and has nothing to say."""
    nb = nbformat.v4.new_notebook()
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("print(6 * 7)")]
    path = tmp_path / "tiny.ipynb"
    nbformat.write(nb, path)
    common = ["-k", "python3", "--no-progress-bar", "--log-level", "WARNING"]

    plain = subprocess.run([str(PAPERMILL), str(path), str(tmp_path / "plain.ipynb"), *common],
                           capture_output=True, text=True, timeout=150)
    assert plain.returncode == 0, plain.stderr
    assert TCP_WARNING in plain.stderr, f"the kernel no longer warns under plain papermill:\n{plain.stderr}"

    ours = subprocess.run([sys.executable, "-m", "nvrx_lab.workbook.papermill", str(path), str(tmp_path / "ours.ipynb"),
                           *common], capture_output=True, text=True, timeout=150)
    assert ours.returncode == 0, ours.stderr
    assert TCP_WARNING not in ours.stderr and "WARNING" not in ours.stderr, ours.stderr
    (cell,) = nbformat.read(tmp_path / "ours.ipynb", as_version=4).cells
    assert [o.get("text") for o in cell.outputs] == ["42\n"]


def test_the_engine_waits_in_slices_and_encrypts():
    config = kernel_config()
    client = AsyncKernelManager(kernel_name="python3", config=config).client()
    assert isinstance(client, WorkbookKernelClient)
    assert client.shell_channel_class is SlicedPollChannel and client.iopub_channel_class is SlicedPollChannel
    assert config.KernelManager.transport_encryption == ("auto" if zmq.has("curve") else "disabled")


@pytest.mark.timeout(30)
def test_a_wait_without_a_timeout_lasts_across_its_poll_slices():
    """``get_msg(None)`` still means "until a message comes" (one that comes after 2.5 slices is returned), and a
    finite timeout still ends in ``Empty``."""
    async def main() -> tuple[dict, float]:
        actx, sctx = zmq.asyncio.Context(), zmq.Context()
        receiver, sender = actx.socket(zmq.PAIR), sctx.socket(zmq.PAIR)
        try:
            port = receiver.bind_to_random_port("tcp://127.0.0.1")
            sender.connect(f"tcp://127.0.0.1:{port}")
            session = Session(key=b"test")
            channel = SlicedPollChannel(receiver, session)
            with pytest.raises(Empty):
                await channel.get_msg(0.05)
            loop = asyncio.get_running_loop()
            loop.call_later(2.5 * POLL_SLICE_S, session.send, sender, "execute_reply", {"status": "ok"})
            t0 = time.monotonic()
            msg = await channel.get_msg(None)
            return msg, time.monotonic() - t0
        finally:
            receiver.close(linger=0)
            sender.close(linger=0)
            actx.term()
            sctx.term()

    msg, waited = asyncio.run(main())
    assert msg["msg_type"] == "execute_reply" and msg["content"] == {"status": "ok"}
    assert waited >= 2 * POLL_SLICE_S
