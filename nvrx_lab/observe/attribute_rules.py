"""The rules of :mod:`nvrx_lab.observe.attribute`, which its judges (:mod:`.attribute_judges`) apply to one fault.

Who failed first, by the strength of the evidence: a rank killed by a signal (the launcher saw it); a rank's own
exception (its ``crash`` event, or the in-process wrapper's root cause); a hang (the flight-recorder dumps name the rank
that never entered the collective the others wait in; else the heartbeats or the wrapper's soft timeout); a rank that
vanished without a word while its peers lost it; an exit code. A collective timeout is a hang elsewhere: the hung ranks
are the ones that did not time out. A peer's broken collective (``crash`` with ``peer_lost``) is never the cause.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from nvrx_lab.observe.attribute_fr import find_hang, load_dump

CATEGORIES = ("exception", "oom", "hang", "nccl_timeout", "killed", "exit", "node_lost", "health", "unknown")
LABELS = {"oom": "OOM", "nccl_timeout": "collective timeout", "node_lost": "node lost", "health": "health check failed"}
OOM_TYPES = ("MemoryError", "OutOfMemoryError")
TIMEOUT_TYPES = ("RuntimeError", "DistBackendError", "DistNetworkError", "DistError", "DistStoreError", "TimeoutError")
TIMEOUT = re.compile(r"timed out|timeout|deadline exceeded", re.IGNORECASE)
CONSEQUENCES = ("RestartLimitError",)
"""Exceptions that end a rank because of earlier faults (the in-process wrapper giving up), never a fault's cause."""
SHOWN = {"crash": ("error", "message", "step", "peer_lost"),
         "restart": ("cause", "fault_rank", "detail", "reports", "trace_dump"),
         "launcher_failure": ("reason", "detail", "restart_count", "host"), "trace_dump": ("ok", "entries", "path", "why"),
         "pod_restart": ("reason", "restart_count"), "health": ("check", "status", "evidence", "host"),
         "launcher_rendezvous": ("line",)}


@dataclass
class Verdict:
    """One fault: the first rank and node to fail, the category, and the event lines that say so."""

    t: float
    rank: int | None
    node: int | None
    host: str | None
    category: str
    """One of :data:`CATEGORIES`."""
    detail: str
    """The exception (``Type: message``), the signal, the hang's collective or finding, the failed check."""
    via: str
    """What recovered from it: ``launcher restart 2``, ``in-process restart (attempt 0)``, ``pod restart 1``, ..."""
    evidence: list[str] = field(default_factory=list)
    collective: str | None = None
    """A hang's collective, ``gloo:all_reduce #57``, where flight-recorder dumps name it."""
    sure: bool = True
    """False where no evidence tells the rank apart (a hang every rank's heartbeats report alike, and no dump)."""
    stream: str = ""

    def headline(self, n: int) -> str:
        where = "no rank" if self.rank is None else f"rank {self.rank}"
        return (f"fault {n} at {time.strftime('%H:%M:%S', time.localtime(self.t))}: {where} (node "
                f"{'?' if self.node is None else self.node}, host {self.host or '?'}): "
                f"{LABELS.get(self.category, self.category)} {self.detail} [{self.via}]")


@dataclass
class Group:
    """The evidence of one fault: a launcher restart's failures, an in-process restart's records, a pod restart..."""

    kind: str
    """``launcher``, ``inprocess``, ``pod``, ``health`` or ``crash``."""
    via: str
    t: float
    events: list[dict]
    since: float = float("-inf")
    """The previous fault's moment: this attempt's evidence comes after it."""
    crashes: list[dict] = field(default_factory=list)
    extra: list[dict] = field(default_factory=list)
    """Trace dumps and rendezvous lines around it."""


class Run:
    """One event stream, indexed: where each rank ran, which ranks an attempt had."""

    def __init__(self, events: list[dict], dumps: list[tuple[int, Path, float]]):
        self.events, self.dumps = events, dumps  # dumps: the files found beside the stream, (rank, path, mtime)
        self.starts = [e for e in events if e["kind"] == "start"]
        self.ends = [e for e in events if e["kind"] == "end"]

    def where(self, rank: int | None, t: float) -> tuple[int | None, str | None]:
        """(node, host) of ``rank`` at ``t``: its latest ``start`` before, else its first."""
        mine = [s for s in self.starts if s.get("rank") == rank]
        before = [s for s in mine if s["t"] <= t] or mine[:1]
        return (before[-1].get("node"), before[-1].get("host")) if before else (None, None)

    def nodes(self, t: float) -> dict:
        """``{node: {ranks}}`` as the latest starts before ``t`` place them (ranks without a node: none)."""
        out: dict = {}
        for rank in {s["rank"] for s in self.starts if s["t"] <= t}:
            node, _ = self.where(rank, t)
            if node is not None:
                out.setdefault(node, set()).add(rank)
        return out

    def node_of_host(self, host: str | None, t: float) -> int | None:
        nodes = [s.get("node") for s in self.starts if host and s.get("host") == host and s["t"] <= t]
        return nodes[-1] if nodes else None

    def attempt(self, group: Group) -> set[int]:
        """The ranks started since the previous fault (all that ever started, if none did)."""
        ranks = {s["rank"] for s in self.starts if group.since < s["t"] <= group.t}
        return ranks or {s["rank"] for s in self.starts if s["t"] <= group.t}

    def ended(self, group: Group) -> set[int]:
        return {e["rank"] for e in self.ends if group.since < e["t"] <= group.t}


def line(e: dict) -> str:
    """An event as one short evidence line."""
    keys = SHOWN.get(e["kind"], tuple(k for k in e if k not in ("t", "kind", "rank")))
    said = ", ".join(f"{k}={' '.join(str(e[k]).split())}" for k in keys if e.get(k) not in (None, "", []))
    clock = f"{time.strftime('%H:%M:%S', time.localtime(e['t']))}.{int(e['t'] * 1000) % 1000:03d}"
    text = f"{clock} {e['kind']} rank {e.get('rank')}: {said}"
    return text if len(text) <= 220 else text[:217] + "..."


def classify(error: str, message: str) -> tuple[str, str]:
    """(category, detail) of an exception named ``error`` with ``message``."""
    first = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", (message.strip().splitlines() or [""])[0])  # gloo's source line
    detail = f"{error}: {first}"[:200]
    if error in OOM_TYPES or "out of memory" in message.lower():
        return "oom", detail
    if error in TIMEOUT_TYPES and TIMEOUT.search(message):
        return "nccl_timeout", detail
    return "exception", detail


def dumps_for(group: Group, run: Run, named: dict[int, str]) -> tuple[dict[int, dict], list[str]]:
    """This fault's dumps ``{rank: dump}``, and the ones that could not be read: those its events name (``{rank:
    path}``), or, where none does, the files found beside the stream that were written during the fault's attempt."""
    dumps, said = {}, []
    for rank, path in sorted(named.items()):
        p = Path(path)
        if not p.exists():  # a relative path, or a folder moved since: the file of that name found beside the stream
            p = next((q for _, q, _ in run.dumps if q.name == p.name), p)
        if (dump := load_dump(p)) is None:
            said.append(f"flight recorder rank {rank}: {path} missing or unreadable")
        else:
            dumps[rank] = dump
    if named:
        return dumps, said
    for rank, path, mtime in sorted(run.dumps):
        if group.since < mtime <= group.t + 30.0 and (dump := load_dump(path)) is not None:
            dumps[rank] = dump
    return dumps, said


def whole_node(run: Run, ranks: set[int], t: float) -> int | None:
    """The node whose every rank is in ``ranks`` (a node lost at once), if any: of several nodes, or a node of several ranks."""
    nodes = run.nodes(t)
    for node, members in sorted(nodes.items()):
        if members <= ranks and (len(nodes) > 1 or len(members) > 1):
            return node
    return None


def verdict(run: Run, group: Group, t: float, rank: int | None, category: str, detail: str,
            collective: str | None = None, evidence: list[str] | None = None) -> Verdict:
    node, host = run.where(rank, t)
    lines = [line(e) for e in sorted(group.events + group.crashes + group.extra, key=lambda e: e["t"])]
    return Verdict(t, rank, node, host, category, detail, group.via, lines + (evidence or []), collective)


def hang_verdict(run: Run, group: Group, t: float, suspect: int | None, finding: str, named: dict[int, str],
                 before: float, known: bool = False) -> Verdict:
    """A hang: the rank the dumps say never entered the collective the others wait in (read in the process groups used
    between the previous fault and ``before``); else the rank whose dump recorded fewer collectives (as the launcher's
    ``trace_dump`` events said when the files were written: a later dump may have replaced them); else ``suspect``
    (``known``: for a reason of the caller's, else not :attr:`~Verdict.sure`)."""
    dumps, said = dumps_for(group, run, named)
    hang = find_hang(dumps, group.since - 1.0, before)
    counts = {e["rank"]: e["entries"] for e in group.extra if group.kind == "launcher" and e["kind"] == "trace_dump"
              and e.get("ok") and isinstance(e.get("entries"), int)}
    if hang is None or not hang.behind:
        said += hang.evidence if hang else []
        if sure := len(set(counts.values())) > 1:
            suspect = min(counts, key=lambda r: (counts[r], r))
            said.append(f"trace dumps: rank {suspect} recorded {counts[suspect]} collectives, the others up to "
                        f"{max(counts.values())}: it is behind")
        elif suspect is not None and not known:
            finding += f"; rank {suspect} as first reported: no dump tells the hung rank from those waiting for it"
        v = verdict(run, group, t, suspect, "hang", f"({finding})", evidence=said)
        v.sure = sure or known
        return v
    collective = f"{hang.collective} #{hang.seq}"
    if suspect is not None and suspect not in hang.behind:  # a rank waiting in a collective stops beating too
        said.append(f"(the first report named rank {suspect}, which waits in {collective} for rank {hang.behind[0]})")
    return verdict(run, group, t, hang.behind[0], "hang", f"in {collective} ({finding})", collective, said + hang.evidence)
