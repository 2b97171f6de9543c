"""``python -m nvrx_lab.health [--folder DIR] [--expected-nics N]``: this node's health checks, one line each;
exit 0 when none failed (skipped ones are said), 5 otherwise."""

from __future__ import annotations

import argparse
import sys

from nvrx_lab.exit_codes import UNHEALTHY
from nvrx_lab.health.checks import HealthSettings, run_all
from nvrx_lab.health.nic import SYSFS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nvrx_lab.health", description=__doc__.split("\n")[0])
    ap.add_argument("--folder", default=None, help="the checkpoints' folder: a write+fsync and its free space")
    ap.add_argument("--expected-nics", type=int, default=None, help="RDMA devices this node must have (32 on p5)")
    ap.add_argument("--sysfs", default=SYSFS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    verdicts = run_all(HealthSettings(folder=a.folder, sysfs=a.sysfs, expected_nics=a.expected_nics))
    for v in verdicts:
        print(v.line(), file=sys.stderr if v.failed else sys.stdout)
    return UNHEALTHY if any(v.failed for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
