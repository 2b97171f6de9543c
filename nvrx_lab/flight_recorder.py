"""Flight-recorder dumps on a hang, asked for by the launcher before it stops the workers.

PyTorch's flight recorder keeps each rank's last collectives (``TORCH_FR_BUFFER_SIZE`` entries: NCCL's and, in torch
2.13, gloo's too); NCCL's watchdog dumps it when a collective times out. A hang the heartbeats catch first (minutes
before ``--pg-timeout``) would be killed without one, and the dump is what tells which collective, on which rank,
never completed. So each worker's :class:`~nvrx_lab.launcher.client.RankMonitorClient` listens on a second Unix
socket (:class:`DumpListener`, a daemon thread: a rank whose main thread blocks in a collective or a sleep still
answers), and on a missed heartbeat the launcher asks every live local rank for its dump (:func:`request_dumps`),
bounded by :data:`DUMP_WAIT_S`, before the restart. Each dump is torch's pickle (``_dump_fr_trace``) at
``<prefix><global rank>``, the naming of torch's own ``TORCH_FR_DUMP_TEMP_FILE``, so torch's ``fr_trace`` analyser
reads both.

Standard library only at import (the launcher's worker client, the in-process abort and the launcher share it; torch
only where a dump is taken).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

DUMP_WAIT_S = 5.0
"""How long the launcher waits for all local ranks' dumps before it stops them anyway."""


def dump_socket(directory: str, local_rank: int) -> str:
    return os.path.join(directory, f"dump-{local_rank}.sock")


def take_dump(path: str) -> dict:
    """This process's flight recorder written to ``path`` (atomically); what was written, or why nothing was."""
    import sys

    if "torch" not in sys.modules:
        return {"ok": False, "why": "torch not imported"}
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return {"ok": False, "why": "no process group"}
    import pickle

    # torch's _distributed_c10d.pyi omits _dump_fr_trace, which the extension defines (torch 2.13)
    from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]

    data = _dump_fr_trace()
    entries = len(pickle.loads(data).get("entries", []))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"  # two threads of one rank may dump at once
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return {"ok": True, "entries": entries, "bytes": len(data)}


class DumpListener:
    """The worker's end: answers ``<path>\\n`` with :func:`take_dump`'s JSON, from a daemon thread."""

    def __init__(self, directory: str, local_rank: int):
        self.path = dump_socket(directory, local_rank)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a previous attempt's
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        os.chmod(self.path, 0o600)  # in the launcher's 0700 folder too: only this user asks for (and places) dumps
        self.sock.listen(2)
        threading.Thread(target=self._serve, name="nvrx-fr-dump", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(DUMP_WAIT_S)
                try:
                    path = conn.makefile("r").readline().strip()
                    reply = take_dump(path)
                except Exception as exc:  # noqa: BLE001 - a failed dump is an answer, never the worker's end
                    reply = {"ok": False, "why": f"{type(exc).__name__}: {exc}"}
                with contextlib.suppress(OSError):
                    conn.sendall((json.dumps(reply) + "\n").encode())

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def request_dumps(directory: str, ranks: dict[int, int], prefix: str, wait_s: float = DUMP_WAIT_S) -> dict[int, dict]:
    """Ask local ranks ``{local rank: global rank}`` for their dumps at ``<prefix><global rank>``, all within
    ``wait_s``: ``{global rank: reply}`` (``{"ok": False, "why": ...}`` for a rank that did not answer)."""
    deadline = time.monotonic() + wait_s
    out: dict[int, dict] = {}
    for local, rank in sorted(ranks.items()):
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError(f"no time left of {wait_s:g} s")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(left)
                s.connect(dump_socket(directory, local))
                s.sendall(f"{prefix}{rank}\n".encode())
                out[rank] = json.loads(s.makefile("r").readline() or '{"ok": false, "why": "no answer"}')
        except (OSError, TimeoutError, ValueError) as exc:
            out[rank] = {"ok": False, "why": f"{type(exc).__name__}: {exc}"}
        if out[rank].get("ok"):
            out[rank]["path"] = f"{prefix}{rank}"
    return out
