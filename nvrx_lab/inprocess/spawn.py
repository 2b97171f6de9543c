"""A minimal local launcher that lets the survivors run
=====================================================

``torchrun`` stops every worker as soon as one exits with an error or is killed — right for
restarting the whole group, wrong for in-process restart, where the survivors should carry on
without a dead rank. This launcher starts ``--nproc`` copies of a command with the torchrun
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) and only waits::

    python -m nvrx_lab.inprocess.spawn --nproc 2 -- python -m nvrx_lab.demo.inprocess_worker --steps 20

Exit status: 0 when at least one rank exited 0 and none exited with an error code (ranks
killed by a signal are reported, not counted as errors); otherwise the first error code.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys

from nvrx_lab.net import free_port_pair, wait_for


def rank_env(rank: int, nproc: int, master_addr: str, master_port: int, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               GROUP_RANK="0", MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    return env


def launch(cmd: list[str], nproc: int, master_addr: str = "127.0.0.1", master_port: int | None = None,
           env: dict | None = None, **popen_kwargs) -> list[subprocess.Popen]:
    """Start the ranks; ``master_port`` defaults to a port whose successor is free too."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    port = master_port or free_port_pair(master_addr)
    return [subprocess.Popen(cmd, env=rank_env(r, nproc, master_addr, port, env), **popen_kwargs)
            for r in range(nproc)]


def exit_status(codes: list[int]) -> int:
    errors = [c for c in codes if c > 0]
    if errors:
        return errors[0]
    return 0 if any(c == 0 for c in codes) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Start N ranks of a command; survivors are never stopped.")
    ap.add_argument("--nproc", "--nproc-per-node", type=int, default=2, help="number of ranks")
    ap.add_argument("--master-addr", default="127.0.0.1", help="MASTER_ADDR given to the ranks")
    ap.add_argument("--master-port", type=int, default=None, help="MASTER_PORT (default: a free pair)")
    ap.add_argument("--timeout", type=float, default=None, help="kill everything after this many seconds")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and arguments")
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no command given (put it after --)")
    procs = launch(cmd, a.nproc, a.master_addr, a.master_port)
    try:
        wait_for(lambda: all(p.poll() is not None for p in procs), math.inf if a.timeout is None else a.timeout,
                 "every rank to exit")
    except TimeoutError:
        print(f"spawn: timeout after {a.timeout} s; killing ranks", file=sys.stderr)
        for p in procs:
            p.kill()
    except KeyboardInterrupt:
        for p in procs:
            p.send_signal(signal.SIGINT)
    codes = [p.wait() for p in procs]
    for r, c in enumerate(codes):
        if c < 0:
            print(f"spawn: rank {r} was killed by {signal.Signals(-c).name}", file=sys.stderr)
    return exit_status(codes)


if __name__ == "__main__":
    sys.exit(main())
