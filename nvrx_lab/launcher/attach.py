"""The hand-over to a warm standby: the process torchelastic starts sends its job, a standby adopts it.

``python -u -s attach.py ZYGOTE_SOCK [-u] script.py args...`` (or ``-m module args...``). Standard
library only, so it starts in tens of milliseconds. It passes its environment (RANK, LOCAL_RANK,
MASTER_ADDR, TORCHELASTIC_RESTART_COUNT, ...), argv, cwd and stdio to the zygote
(:mod:`nvrx_lab.launcher.standby`), forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT to the worker, and exits
exactly as the worker did: same exit code, or killed by the same signal. If the zygote is not
there yet (first start, still importing torch) it waits up to ``NVRX_LAB_ATTACH_TIMEOUT`` s.

:func:`adopt` is the other end, run in a standby the zygote forked: it takes the job's stdio,
environment and working directory, so that process *becomes* the worker torchelastic started, and
runs the entrypoint. The job's message is defined here, once, for both ends.
"""

import json
import os
import signal
import socket
import sys
import time


def main() -> int:
    path, argv = sys.argv[1], sys.argv[2:]
    deadline = time.monotonic() + float(os.environ.get("NVRX_LAB_ATTACH_TIMEOUT", "120"))
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(path)
            break
        except OSError as e:
            sock.close()
            if time.monotonic() > deadline:
                print(f"attach: no standby zygote at {path}: {e}", file=sys.stderr)
                return 1
            time.sleep(0.02)
    job = {"op": "run", "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(sock, [json.dumps(job).encode()], [0, 1, 2])
    reply = sock.recv(1 << 16)
    if not reply:
        print("attach: the zygote refused the job", file=sys.stderr)
        return 1
    pid = json.loads(reply)["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, forward)
    status = sock.recv(1 << 16)
    if not status:
        print(f"attach: lost the zygote while worker {pid} ran", file=sys.stderr)
        return 1
    status = json.loads(status)
    if status.get("signal"):
        if status["signal"] not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(status["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), status["signal"])
        time.sleep(1)
    return int(status.get("exit", 1))


def adopt(sock: socket.socket) -> int:
    """In a standby: receive a job (``main``'s message and stdio) on ``sock``, become that worker (its stdio, its
    environment, its working directory) and run its entrypoint; returns its exit code."""
    import runpy
    import traceback

    msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
    sock.close()
    if not msg:
        return 0
    job = json.loads(msg)
    for target, fd in zip((0, 1, 2), fds, strict=False):
        os.dup2(fd, target)
        os.close(fd)
    env = job["env"]  # what torchelastic gave the attach process: this process becomes that worker
    os.environ.clear()  # written, not read: the worker's code reads its own environment (launcher/client.py)
    os.environ.update(env)
    os.chdir(job["cwd"])
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    if "OMP_NUM_THREADS" in env and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    argv = [a for a in job["argv"] if a not in ("-u", "-s")]
    try:
        if argv and argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the worker's own failure: print it as Python would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
