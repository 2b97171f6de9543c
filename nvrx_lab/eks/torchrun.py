"""``python -m nvrx_lab.eks.torchrun``: torchrun, except that a worker's usage error stays exit code 2.

The manifests' ``podFailurePolicy`` fails the Job at once on exit code 2 (a bad flag, a model that
cannot be built: the next attempt would fail the same way), and the launcher modes keep that code
(:mod:`nvrx_lab.launcher` exits 2 when a worker did). torchrun does not: a failed worker becomes
``ChildFailedError`` and torchrun's exit code 1, which the Job counts against ``backoffLimit`` — a
trainer flag error was retried ``nodes`` x 10 times before the Job gave up.

Why a wrapper rather than a pre-check: a pre-check (the trainer's parser run once before torchrun)
catches only what it re-implements, while a usage error can also come after start-up (a model that
does not fit, a world size the batch does not divide); here the workers' own exit codes decide. It
runs torch's own ``torch.distributed.run.main`` with the same flags and changes nothing but the exit
code: when any worker exited 2, one line names it and the process exits 2; any other outcome
(success, other failures, signals) is torchrun's, traceback and exit code included.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from nvrx_lab.exit_codes import USAGE_ERROR


def usage_errors(err: ChildFailedError) -> list[int]:
    """Global ranks of the workers in ``err`` that exited with :data:`USAGE_ERROR`."""
    return sorted(rank for rank, failure in err.failures.items() if failure.exitcode == USAGE_ERROR)


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun_main(argv)
    except ChildFailedError as err:
        ranks = usage_errors(err)
        if not ranks:
            raise
        print(f"nvrx_lab.eks.torchrun: worker rank(s) {', '.join(map(str, ranks))} exited {USAGE_ERROR} (a usage error, "
              "its message above): exit 2, so the Job fails without a retry", file=sys.stderr, flush=True)
        return USAGE_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
