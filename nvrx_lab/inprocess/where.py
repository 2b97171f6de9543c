"""Where a rank's main thread stands once it has stopped pinging: inside a ``torch.distributed`` call (waiting on a
peer) or anywhere else (itself stuck). A hang stops every rank's pings at once, the hung rank's and those of the
peers waiting for it in a collective; the wait is what tells them apart.

Read from the monitor thread through ``sys._current_frames()``: Python frames only, no call into torch (a flight
recorder dump taken from that thread while its rank sat in a gloo collective made CI's ranks hit their hard
timeout). On a GPU a rank waiting on a peer may block outside ``torch.distributed`` (in a ``.item()`` that
synchronizes with NCCL): it then looks stuck itself, and the first report names the hang, as before.
"""

from __future__ import annotations

import os
import sys
import threading

COLLECTIVES = f"torch{os.sep}distributed{os.sep}"
"""A frame from a file under this path is a ``torch.distributed`` call (c10d, FSDP's collectives, DTensor)."""


def main_thread_at() -> tuple[bool, str]:
    """(the main thread waits inside a ``torch.distributed`` call, where it stands: ``function (file:line)``)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    innermost = None
    while frame is not None:
        code = frame.f_code
        here = f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"
        innermost = innermost or here
        if COLLECTIVES in code.co_filename:
            return True, here
        frame = frame.f_back
    return False, innermost or "unknown"
