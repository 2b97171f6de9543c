"""Local checkpoints: this rank's state in node memory every few steps, replicated to a peer node.

The storage checkpoint (:class:`~.checkpointer.AsyncCheckpointer`) is the durable restore point, but it
is written every tens of steps, and a fault rolls back to it. A *local* checkpoint is cheap enough to take
every step: each rank copies its own shards into a region in node-local shared memory (:mod:`.snapshot`,
the staging of :mod:`.staging`) and returns; a background thread checksums it and commits its manifest;
the region goes to one peer on another node over the CPU group (:mod:`.replication`: the receive is posted
first, so the bytes cross while the next step computes, and the next save commits them)::

    rank r   stage (copy)  | return ... thread: CRC32C, manifest ...
             isend -> rank r + local_world (the same local rank on the next node)
             irecv <- rank r - local_world, into a replica slot, posted at the save; committed at the next

Every copy outlives something else: the process's own (``memory``) an in-process restart; the files in
``<dir>`` (``local``) the death of the process, for the worker the launcher starts in its place; the
replica on the next node (``peer``) the loss of this node. :meth:`LocalCheckpointer.restore` agrees with
every rank on the newest step *all* ranks can restore from some copy (one ``all_gather`` of a few
numbers a rank), fetches what a replaced node lacks from the peers that hold it (one ``isend``/``irecv``
pair a rank that needs it), and fills the state in place; older storage wins only when it is newer.

**Memory bound**: two own regions, each with its manifest (``rank<r>.<0|1>.data|json``): a save
overwrites the older one, so the newest stays restorable while the next is written, and ranks that
stopped one save apart still share a step. Two replica slots a rank (``rank<r>.replica.<0|1>.*``, of rank
``r - local_world``): a round receives into the older one (its manifest removed first), so a node lost
mid-replication restores its peer's previous step. At most one save's background work is in flight.

**Cleanliness**: a clean :meth:`close` removes this rank's files (the last rank on the node the folder);
a failed process leaves them for its replacement; a whole job SIGKILLed leaves them to the node's
:mod:`.janitor`, which removes the folder once no process of the run has held it for a grace period.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from . import janitor
from . import snapshot as snap
from .contracts import LiveStateful
from .loading import Restored
from .planning import all_gather
from .replication import Replication
from .staging import StagingBuffer, open_region

FETCH = 7303
"""Tag of a copy sent to a rank that lacks the agreed step (a replaced node), from the peer holding it."""
GRACE_S = 120.0
"""Seconds the node's janitor keeps a killed job's copies once no process holds them (``--local-ckpt-grace``)."""


class LocalCheckpointer:
    """Snapshots of one rank in node-local memory, replicated to the next node (see the module docs)."""

    def __init__(self, directory, run: str, rank: int = 0, world: int = 1, local_world: int = 1, group=None,
                 emit=None, grace_s: float = GRACE_S):
        self.dir = Path(directory)
        self.run, self.local_world = run, max(1, local_world)
        self.emit = emit or (lambda kind, **fields: None)
        self._alive = janitor.hold(str(self.dir))
        janitor.start(str(self.dir), grace_s)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nvrx-local", initializer=background_priority)
        self._job = None  # (slot, future) of the newest save's background commit
        self.reached = 0
        self.rank = self.world = None  # bound below
        self._slots: list[StagingBuffer] = []
        self._replicas: list[StagingBuffer] = []
        self._replication: Replication | None = None
        self.bind(group, rank, world)

    # ------------------------------------------------------------------ saving
    def bind(self, group, rank: int, world: int) -> None:
        """Use ``group`` (a new one after an in-process restart; ranks may have moved)."""
        self._drop_round()
        same = (self.rank, self.world) == (rank, world)
        if self._slots and not same:  # ranks moved: the copies describe another world
            self._release(remove=True)
        self.group, self.rank, self.world = group, rank, world
        self.peer = (rank + self.local_world) % world if world > self.local_world else None
        self.source = (rank - self.local_world) % world if self.peer is not None else None
        if same:  # an in-process restart in the same place: this process's copies stay valid (``memory``)
            return
        self._slots = [StagingBuffer(tag="local", path=str(self._own(i))) for i in (0, 1)]
        self._replicas = [StagingBuffer(tag="replica", path=str(self._replica_file(i, "data"))) for i in (0, 1)]
        self._replication = Replication(self._replicas, lambda i: self._replica_file(i, "json"), self._describe_replica)
        self._committed: dict[int, dict] = {}  # slot -> manifest of a snapshot this process committed
        self._newest = 1  # the slot of the newest snapshot: a save writes the other one

    def save(self, state_dict: dict, step: int) -> float:
        """Stage ``state_dict`` over the older of the two snapshots and return; returns the seconds it blocked.
        ``state_dict`` is the one :meth:`restore` fills: the state's ``local_state_dict()`` where it has one
        (its live tensors, in place), else its ``state_dict()``."""
        t0 = time.monotonic()
        self.wait()
        tensors, meta, (slots, total) = snap.layout(state_dict)
        slot = self._newest ^ 1
        self._committed.pop(slot, None)
        self._manifest(slot).unlink(missing_ok=True)  # its old snapshot is about to be overwritten
        buf = self._slots[slot]
        buf.stage(tensors, reserve=len(meta), planned=(slots, total))
        buf.region[total:total + len(meta)] = meta
        manifest = {"run": self.run, "step": step, "world": self.world, "rank": self.rank,
                    "file": self._own(slot).name, "length": total + len(meta), "meta": [total, len(meta)]}
        self._job = (slot, self._pool.submit(commit, buf.region, manifest, self._manifest(slot)))
        self._newest = slot
        if self.peer is not None:
            self._replication.start(self.group, self.peer, self.source, buf.region, manifest)
        self.reached = max(self.reached, step)
        return time.monotonic() - t0

    def wait(self) -> None:
        """Until the newest save is committed here and at the peer, and the replica received is committed."""
        if self._job is not None:
            slot, future = self._job
            self._job = None
            self._committed[slot] = future.result()
        if self._replication is not None:
            self._replication.finish()

    def _describe_replica(self, slot: int, step: int, length: int, meta_at: int, meta_len: int) -> dict:
        return {"run": self.run, "step": step, "world": self.world, "rank": self.source,
                "file": self._replica_file(slot, "data").name, "length": length, "meta": [meta_at, meta_len]}

    def _drop_round(self) -> None:
        """An aborted attempt's messages: their group is gone; the replica they were filling is invalid."""
        if self._replication is not None:
            self._replication.drop()
        if self._job is not None:
            slot, future = self._job
            self._job = None
            try:
                self._committed[slot] = future.result()
            except OSError as e:
                print(f"[rank {self.rank}] local snapshot not committed: {e}", file=sys.stderr, flush=True)

    # --------------------------------------------------------------- restoring
    def restore(self, state, storage_step: int | None) -> Restored | None:
        """Collective: load ``state`` (a ``Stateful``) from the newest step every rank can restore from a
        local copy, unless ``storage_step`` is newer (then None: load storage). Bad copies are skipped, logged."""
        self.wait()
        own = [c for c in (self._candidate(slot) for slot in (0, 1)) if c is not None]
        # both replica slots: the ranks' newest copies may differ by a step (a node killed while one round of
        # replication had finished and the next had not), and the step they agree on may be in the older slot
        replicas = [c for c in (self._candidate(None, i) for i in (0, 1)) if c is not None]
        plain = [{k: v for k, v in c.items() if k not in ("region", "slot")} for c in replicas]
        known = max([self.reached, *(c["step"] for c in own + replicas)])
        table = all_gather(([c["step"] for c in own], plain, known), self.group, self.world)
        step = agreed_step(table, self.local_world)
        reached = max(row[2] for row in table)
        self.reached = reached
        if step is None or (storage_step is not None and step < storage_step):
            return None
        replica = next((c for c in replicas if c["step"] == step), None)
        source, region, manifest = self._gather_copy(table, step, own, replica)
        live = isinstance(state, LiveStateful)  # the snapshot was taken from its live tensors (see ``save``)
        state_dict = state.local_state_dict() if live else state.state_dict()
        try:
            fitted, why = snap.fitting(state_dict, region, manifest), None
        except snap.SnapshotError as e:
            fitted, why = None, str(e)
        if any(whys := all_gather(why, self.group, self.world)):  # nothing is written yet: all ranks fall back
            bad = next(r for r, w in enumerate(whys) if w)
            self._skipped(f"step {step} ({source})", f"rank {bad}'s copy does not fit its state: {whys[bad]}")
            return None
        snap.fill(state_dict, region, manifest, fitted)
        (state.load_local_state_dict if live else state.load_state_dict)(state_dict)
        return Restored(step, source, max(0, reached - step))

    def _candidate(self, slot: int | None, replica: int = 0) -> dict | None:
        """Own snapshot ``slot`` (None: replica slot ``replica``, held for the previous node), checked; None, logged,
        if unusable."""
        if slot in self._committed:
            return {**self._committed[slot], "region": self._slots[slot].region, "source": "memory", "slot": slot}
        path = self._replica_file(replica, "json") if slot is None else self._manifest(slot)
        try:
            if (manifest := snap.read_manifest(path)) is None:
                return None
            region = open_region(str(self.dir / manifest["file"]))
            snap.check(manifest, region, run=self.run, world=self.world, rank=self.rank if slot is not None else self.source)
        except (snap.SnapshotError, OSError, KeyError) as e:
            self._skipped(str(path), str(e))
            return None
        return {**manifest, "region": region, "source": "local" if slot is not None else "peer", "slot": slot}

    def _skipped(self, copy: str, reason: str) -> None:
        self.emit("local_ckpt_skipped", copy=copy, reason=reason)
        print(f"[rank {self.rank}] local checkpoint {copy} skipped: {reason}", file=sys.stderr, flush=True)

    def _gather_copy(self, table: list, step: int, own: list[dict], replica: dict | None):
        """This rank's copy of ``step``: its own, or the replica its peer sends (kept as its own from then on)."""
        needs = [r for r, row in enumerate(table) if step not in row[0]]
        works = []
        if replica is not None and replica["rank"] in needs:
            data = torch.frombuffer(replica["region"], dtype=torch.uint8, count=replica["length"])
            works.append(dist.isend(data, group=self.group, group_dst=self.source, tag=FETCH))  # its owner
        if self.rank in needs:
            manifest = next(m for m in table[self.peer][1] if m["step"] == step and m["rank"] == self.rank)
            slot = self._newest ^ 1
            self._committed.pop(slot, None)
            self._slots[slot].ensure(manifest["length"])
            into = torch.frombuffer(self._slots[slot].region, dtype=torch.uint8, count=manifest["length"])
            works.append(dist.irecv(into, group=self.group, group_src=self.peer, tag=FETCH))
        for work in works:
            work.wait()
        if self.rank not in needs:
            mine = next(c for c in own if c["step"] == step)
            self._newest = mine["slot"]  # the next save keeps it
            return mine["source"], mine["region"], mine
        region = self._slots[slot].region
        snap.check(manifest, region, run=self.run, world=self.world, rank=self.rank)
        self._committed[slot] = {**manifest, "file": self._own(slot).name}
        snap.write_manifest(self._manifest(slot), self._committed[slot])
        self._newest = slot
        return "peer", region, manifest

    # ---------------------------------------------------------------- closing
    def close(self, keep: bool = False) -> None:
        """Stop; remove this rank's copies unless ``keep`` (a failed process: its replacement restores)."""
        if self._alive is None:
            return
        try:
            if not keep:
                self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self._release(remove=not keep)
            os.close(self._alive)
            self._alive = None
            if not keep:
                janitor.remove_if_unheld(str(self.dir))

    def _release(self, remove: bool) -> None:
        for buf in (*self._slots, *self._replicas):
            buf.release()
        if remove:
            for path in (self._own(0), self._own(1), self._manifest(0), self._manifest(1),
                         *(self._replica_file(i, ext) for i in (0, 1) for ext in ("data", "json"))):
                path.unlink(missing_ok=True)

    def _own(self, slot: int) -> Path:
        return self.dir / f"rank{self.rank}.{slot}.data"

    def _manifest(self, slot: int) -> Path:
        return self.dir / f"rank{self.rank}.{slot}.json"

    def _replica_file(self, slot: int, ext: str) -> Path:
        """A replica this rank holds (of rank ``source``), slot 0 or 1: every rank of a node has a peer."""
        return self.dir / f"rank{self.rank}.replica.{slot}.{ext}"


def background_priority() -> None:
    """The checksum thread runs at the lowest CPU priority (Linux: a thread's own nice value), so it takes
    what training leaves; a save waits for it only if the next one comes first."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def commit(region, manifest: dict, path: Path) -> dict:
    """Checksum the snapshot in ``region`` and write its manifest: from now on it can be restored."""
    manifest = {**manifest, "crc32c": snap.checksum(region, manifest["length"])}
    snap.write_manifest(path, manifest)
    return manifest


def agreed_step(table: list, local_world: int) -> int | None:
    """The newest step every rank can restore: one of its own copies, or a replica its peer holds of it (a row is
    ``(own steps, the replicas this rank holds, step reached)``)."""
    world, common = len(table), None
    for r, (own, _, _) in enumerate(table):
        held = table[(r + local_world) % world][1] if world > local_world else []
        steps = set(own) | {m["step"] for m in held if m["rank"] == r}
        common = steps if common is None else common & steps
    return max(common) if common else None
