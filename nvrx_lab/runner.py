"""Launch multi-process runs from a notebook or a benchmark: torchrun on loopback, bounded, cleaned up.

Spawned children cannot import functions defined in a notebook cell, so every multi-process
step of the workbook runs a module of this package through ``python -m torch.distributed.run``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from nvrx_lab.net import free_port_pair


@dataclass
class RunResult:
    cmd: list[str]
    returncode: int
    output: str
    wall_s: float
    timed_out: bool = False

    def check(self) -> "RunResult":
        if self.returncode != 0:
            raise RuntimeError(f"exit code {self.returncode}: {' '.join(self.cmd)}\n{self.output[-3000:]}")
        return self


def run(cmd: list[str], timeout: float = 300, env: dict | None = None, cwd: str | os.PathLike | None = None) -> RunResult:
    """Run ``cmd`` in a new session; on timeout the whole process group is killed and the result says so."""
    t0 = time.perf_counter()
    timed_out = False
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, cwd=cwd)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[nvrx_lab.runner] killed after {timeout} s"
        timed_out = True
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the group (a hung rank, a writer)
        except ProcessLookupError:
            pass
    return RunResult(cmd, proc.returncode, out, time.perf_counter() - t0, timed_out)


def torchrun(nproc: int, *args: str, timeout: float = 300, env: dict | None = None, port: int | None = None) -> RunResult:
    """``python -m torch.distributed.run --nproc-per-node N ARGS…`` on 127.0.0.1 and a free port."""
    port = port or free_port_pair()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port), *args]
    return run(cmd, timeout, env)
