"""The trainer's ``main`` with this script's flags, then one line: the threads left when it returned.

Run under torchrun. A gloo worker thread still alive then can take the GIL while the interpreter finalizes,
and the process aborts after it has trained ("terminate called without an active exception", exit -6)."""

from __future__ import annotations

import json
import os
import sys

from nvrx_lab import train

if __name__ == "__main__":
    rc = train.main(sys.argv[1:])
    names = sorted(open(f"/proc/self/task/{tid}/comm").read().strip() for tid in os.listdir("/proc/self/task"))
    line = "THREADS " + json.dumps({"rank": int(os.environ["RANK"]), "rc": rc, "threads": names}) + "\n"
    sys.stdout.flush()
    os.write(1, line.encode())  # one write: the ranks share the pipe, and a print may write its newline apart
    sys.exit(rc)
