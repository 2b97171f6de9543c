"""The process torchelastic starts when standby workers are on: hand the job to a warm standby.

``python -u -s attach.py ZYGOTE_SOCK [-u] script.py args...`` (or ``-m module args...``). Standard
library only, so it starts in tens of milliseconds. It passes its environment (RANK, LOCAL_RANK,
MASTER_ADDR, TORCHELASTIC_RESTART_COUNT, ...), argv, cwd and stdio to the zygote
(:mod:`nvrx_lab.launcher.standby`), forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT to the worker, and exits
exactly as the worker did: same exit code, or killed by the same signal. If the zygote is not
there yet (first start, still importing torch) it waits up to ``NVRX_LAB_ATTACH_TIMEOUT`` s.
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


if __name__ == "__main__":
    sys.exit(main())
