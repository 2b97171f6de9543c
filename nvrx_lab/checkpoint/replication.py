"""Replicating a rank's local snapshot to the next node, while the next step computes.

gloo moves the bytes of a point-to-point send only once the receiver has posted its receive: here a
64 MiB ``isend`` posted 0.5 s before its ``irecv`` still took 31 ms after it; with the receive posted
first, its ``wait`` a second later took 0.5 ms. So a rank posts the receive of its peer's next snapshot
when it starts a round, at its own save, and the bytes cross while both ranks compute the next step;
the next save finds them there and only commits them. Before, the receive was posted when the header
had been read, in the next save, which then waited for the whole transfer (on p5, a GPU's shard of the
state over the front-end network, every save).

The receive needs the length in advance: it is the length of the peer's previous round (a state keeps
its size from step to step). The first round after a (re)bind has none, and a round whose length
changed cannot use it; their data goes on a tag of its own, received once the header has said how long
it is, and a changed length first fills the receive the peer posted for the old one. Both sides know
which case a round is: the sender's last length announced is the receiver's last length received.

Two replica slots: a round receives into the one that does not hold the newest committed replica, so
the peer's previous step stays restorable while the next one arrives (a node lost mid-transfer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from . import snapshot as snap
from .staging import StagingBuffer

HEADER, DATA, RESIZED = 7301, 7302, 7304
"""Tags: the header (step, length, meta offset, meta size); data the peer posted for; data of a new length."""


@dataclass
class _Round:
    slot: int
    header: torch.Tensor
    works: dict = field(default_factory=dict)
    """``header`` and ``data`` (the receive posted in advance, if any), ``sends``."""


class Replication:
    """One round at a time: this rank's snapshot to ``peer``, ``source``'s into a replica slot (module docs)."""

    def __init__(self, slots: list[StagingBuffer], manifest_path: Callable[[int], Path], describe: Callable):
        self.slots, self.manifest_path, self.describe = slots, manifest_path, describe
        """``describe(slot, step, length, meta_at, meta_len)``: the replica's manifest, before its checksum."""
        self.announced: int | None = None  # the length this rank sent last: the peer posted a receive for it
        self.expected: int | None = None  # the length the peer sent last: this rank posts a receive for it
        self.newest: int | None = None  # the slot of the newest committed replica
        self._round: _Round | None = None

    @property
    def in_flight(self) -> bool:
        return self._round is not None

    def start(self, group, peer: int, source: int, region, manifest: dict) -> None:
        """Post the receive of ``source``'s next snapshot and send ours (``region``, described by ``manifest``)."""
        if self.newest is None:  # a new process: keep the slot that holds the newer replica on disk
            steps = [_step(self.manifest_path(i)) for i in (0, 1)]
            self.newest = 0 if steps[0] >= steps[1] else 1
        slot = self.newest ^ 1
        self.manifest_path(slot).unlink(missing_ok=True)  # its region is about to change
        r = _Round(slot, torch.zeros(4, dtype=torch.int64))
        r.works["header"] = dist.irecv(r.header, group=group, group_src=source, tag=HEADER)
        if self.expected is not None:
            self.slots[slot].ensure(self.expected)
            into = torch.frombuffer(self.slots[slot].region, dtype=torch.uint8, count=self.expected)
            r.works["data"] = dist.irecv(into, group=group, group_src=source, tag=DATA)
        length = manifest["length"]
        data = torch.frombuffer(region, dtype=torch.uint8, count=length)
        sends = [dist.isend(torch.tensor([manifest["step"], length, *manifest["meta"]], dtype=torch.int64),
                            group=group, group_dst=peer, tag=HEADER)]
        if self.announced == length:
            sends.append(dist.isend(data, group=group, group_dst=peer, tag=DATA))
        else:
            if self.announced is not None:  # fill the receive the peer posted for the old length
                sends.append(dist.isend(torch.zeros(self.announced, dtype=torch.uint8), group=group, group_dst=peer,
                                        tag=DATA))
            sends.append(dist.isend(data, group=group, group_dst=peer, tag=RESIZED))
        self.announced = length
        r.works["sends"] = sends
        self._round, self._group, self._source = r, group, source

    def finish(self) -> dict | None:
        """Complete the round (usually already through): commit the replica it brought; its manifest, or None."""
        if (r := self._round) is None:
            return None
        self._round = None
        r.works["header"].wait()
        step, length, meta_at, meta_len = r.header.tolist()
        if "data" in r.works:
            r.works["data"].wait()
        if length != self.expected:  # the first round, or a new length: its data came on its own tag
            self.slots[r.slot].ensure(length)
            into = torch.frombuffer(self.slots[r.slot].region, dtype=torch.uint8, count=length)
            dist.irecv(into, group=self._group, group_src=self._source, tag=RESIZED).wait()
        self.expected = length
        manifest = {**self.describe(r.slot, step, length, meta_at, meta_len)}
        manifest["crc32c"] = snap.checksum(self.slots[r.slot].region, length)
        snap.write_manifest(self.manifest_path(r.slot), manifest)  # restorable, whatever kills this process next
        self.newest = r.slot
        for work in r.works["sends"]:  # complete once the peer has posted its receives (its own round)
            work.wait()
        return manifest

    def drop(self) -> None:
        """An aborted attempt's round: its group is gone and the slot it was filling is invalid (its manifest
        went at the start). Both sides start again from the slow path (every rank of the job rebinds)."""
        self._round = None
        self.announced = self.expected = None


def _step(path: Path) -> int:
    try:
        return int((snap.read_manifest(path) or {}).get("step", -1))
    except (ValueError, TypeError, OSError, AttributeError):  # unreadable: the slot to overwrite
        return -1
