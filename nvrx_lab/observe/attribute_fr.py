"""Flight-recorder dumps for :mod:`nvrx_lab.observe.attribute`: which rank never entered the collective the others wait in.

A dump is torch's pickle (``_dump_fr_trace``, taken by :mod:`nvrx_lab.flight_recorder` or NCCL's watchdog): a dict of
plain values, ``pg_status`` (per process group: ``last_enqueued_collective``, ``last_completed_collective``) and
``entries`` (``pg_id``, ``collective_seq_id``, ``profiling_name`` such as ``gloo:all_reduce``, ``state``)::

    rank 0: enqueued #184 gloo:all_gather, completed #183    <- waits in #184
    rank 1: enqueued #183,                 completed #183    <- never entered #184: the hung rank

It is read by an unpickler that builds no object (plain dicts, lists and strings; no torch, nothing executed).
"""

from __future__ import annotations

import io
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

MAX_DUMP_BYTES = 256 << 20
DUMP_NAME = re.compile(r"^(?P<prefix>.*?)(?P<rank>\d+)$")
"""``<prefix><global rank>``: torch's ``TORCH_FR_DUMP_TEMP_FILE`` naming, the launcher's too (``nccl-trace/rank_1``)."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"not a flight-recorder dump: it names {module}.{name}")


def load_dump(path: str | os.PathLike) -> dict | None:
    """The dump at ``path``, or ``None`` (missing, too big, not a flight-recorder pickle)."""
    try:
        p = Path(path)
        if p.stat().st_size > MAX_DUMP_BYTES:
            return None
        data = _PlainUnpickler(io.BytesIO(p.read_bytes())).load()
    except Exception:  # noqa: BLE001 - any bytes may lie here: a torn or foreign file is no dump
        return None
    ok = isinstance(data, dict) and isinstance(data.get("entries"), list) and isinstance(data.get("pg_status", {}), dict)
    return data if ok else None


def find_dumps(folder: Path, depth: int = 2) -> list[tuple[int, Path, float]]:
    """Candidate dump files in ``folder`` and its subfolders (``depth`` levels): ``(rank, path, mtime)``; whether
    each is a dump is for :func:`load_dump` to say."""
    found = []
    for level in range(depth + 1):
        for p in folder.glob("/".join(["*"] * (level + 1))):
            m = DUMP_NAME.match(p.name)
            if m is None or not p.is_file() or "ckpt" in p.relative_to(folder).parts:
                continue
            with p.open("rb") as f:
                if f.read(1) != b"\x80":  # a pickle's protocol opcode
                    continue
            found.append((int(m["rank"]), p, p.stat().st_mtime))
    return found


def _last(dump: dict, pg: str) -> tuple[int, int]:
    """(last entered, last completed) collective sequence ids of process group ``pg`` in ``dump``."""
    status = dump.get("pg_status", {}).get(pg)
    if isinstance(status, dict) and "last_enqueued_collective" in status:
        return int(status["last_enqueued_collective"]), int(status.get("last_completed_collective", -1))
    seqs = [int(e.get("collective_seq_id", -1)) for e in dump["entries"] if str(e.get("pg_id")) == pg]
    done = [int(e.get("collective_seq_id", -1)) for e in dump["entries"]
            if str(e.get("pg_id")) == pg and e.get("state") == "completed"]
    return max(seqs, default=-1), max(done, default=-1)


def _groups(dump: dict) -> set[str]:
    return set(dump.get("pg_status", {})) | {str(e.get("pg_id")) for e in dump["entries"]}


def _name(dump: dict, pg: str, seq: int) -> str:
    for e in reversed(dump["entries"]):
        if str(e.get("pg_id")) == pg and e.get("collective_seq_id") == seq:
            return str(e.get("profiling_name") or "?")
    return "?"


@dataclass
class Hang:
    """What the dumps say of a hang."""

    behind: list[int]
    """Ranks that never entered :attr:`seq` (empty: every rank entered it, none completed it)."""
    waiting: list[int]
    """Ranks inside :attr:`seq`, waiting for the rest."""
    collective: str
    """Its ``profiling_name``, e.g. ``gloo:all_reduce``."""
    seq: int
    pg: str
    evidence: list[str] = field(default_factory=list)


def _newest(dumps: dict[int, dict], pg: str) -> float:
    """When the newest collective of process group ``pg`` was entered, on any rank (0: no entry left of it)."""
    return max((e.get("time_created_ns") or 0 for d in dumps.values() for e in d["entries"] if str(e.get("pg_id")) == pg),
               default=0) / 1e9


def find_hang(dumps: dict[int, dict], after: float = float("-inf"), before: float = float("inf")) -> Hang | None:
    """The hung ranks and the collective the others wait in, from one dump per rank (``{rank: dump}``); ``None``
    when no process group shows a collective left unfinished.

    A dump holds every process group the rank made (an in-process restart makes one an attempt), so a later fault's
    dump still tells an earlier one's: only the groups whose newest collective was entered in ``(after, before]`` are
    read, the newest first."""
    if not dumps:
        return None
    shared = set.intersection(*(_groups(d) for d in dumps.values()))
    timed = sorted(((_newest(dumps, pg), pg) for pg in shared), reverse=True)
    stuck = None
    for _, pg in [(t, pg) for t, pg in timed if after < t <= before]:
        last = {r: _last(d, pg) for r, d in sorted(dumps.items())}
        low, high = min(e for e, _ in last.values()), max(e for e, _ in last.values())
        if low < high:  # some ranks went on to the next collective; the rest never entered it
            behind, seq = [r for r, (e, _) in last.items() if e == low], low + 1
            waiting = [r for r, (e, _) in last.items() if e > low]
        else:  # all entered the same one: unfinished on some?
            behind, waiting, seq = [], [r for r, (e, c) in last.items() if c < e], high
            if not waiting:
                continue
        hang = Hang(behind, waiting, _name(dumps[waiting[0]], pg, seq), seq, pg)
        hang.evidence = [f"flight recorder rank {r}: process group {pg} entered #{e} ({_name(dumps[r], pg, e)}), "
                         f"completed #{c}: " + ("never entered" if r in behind else "waits in") + f" #{seq}"
                         for r, (e, c) in last.items()]
        if behind:
            return hang
        stuck = stuck or hang
    return stuck
