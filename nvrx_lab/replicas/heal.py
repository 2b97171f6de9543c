"""Healing: a replacement replica takes a live replica's state, rank ``k`` from rank ``k``, at a step boundary.

The state is the trainer's live state dict (:meth:`~nvrx_lab.train.state.TrainState.local_state_dict`: this
rank's FSDP shards of the parameters, the optimizer's state, the step): the same world inside a replica group,
the same sharding, so it is copied as it is, without a checkpoint format. One connection from the donor to the
joiner (:meth:`.ring.Ring.send_to`): the lengths, the layout (JSON: where each tensor goes, its dtype and shape,
and the plain values), then every tensor's bytes in one buffer. The joiner fills its own tensors in place. The donor
sends from its live tensors, which nothing changes before the step's update (that waits for every member,
the joiner included), so the others do not pause for it beyond the joiner's own step.
"""

from __future__ import annotations

import json
import struct

import torch
from torch.distributed.tensor import DTensor

from .group import ReplicaGroup
from .ring import recv_exact

_HEAD = struct.Struct("!qq")  # the layout's length, the tensors' bytes


def _flatten(obj, tensors: list[torch.Tensor]):
    """``obj`` with every tensor replaced by ``{"__t": i}`` (appended to ``tensors``; a DTensor's local shard)."""
    if isinstance(obj, torch.Tensor):
        with torch.no_grad():  # then to_local is an attribute read, not an autograd op
            tensors.append(obj.to_local() if isinstance(obj, DTensor) else obj)
        return {"__t": len(tensors) - 1}
    if isinstance(obj, dict):
        return {str(k): _flatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_flatten(v, tensors) for v in obj]
    return obj


def _restore(layout, tensors: list[torch.Tensor], into=None):
    """The plain values of ``layout``, with ``into``'s own tensors where it had them (filled in place already)."""
    if isinstance(layout, dict) and set(layout) == {"__t"}:
        return into if into is not None else tensors[layout["__t"]]
    if isinstance(layout, dict):
        return {k: _restore(v, tensors, into.get(k) if isinstance(into, dict) else None) for k, v in layout.items()}
    if isinstance(layout, list):
        return [_restore(v, tensors) for v in layout]
    return layout


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def send_state(group: ReplicaGroup, to: list[int], state_dict: dict) -> int:
    """Send this rank's ``state_dict`` to group members ``to``; returns the bytes sent to each."""
    tensors: list[torch.Tensor] = []
    layout = _flatten(state_dict, tensors)
    meta = json.dumps({"layout": layout, "tensors": [[str(t.dtype), list(t.shape)] for t in tensors]}).encode()
    blob = torch.cat([_bytes(t).cpu() for t in tensors]) if tensors else torch.empty(0, dtype=torch.uint8)
    for index in to:
        group.ring.send_to(index, [_HEAD.pack(len(meta), blob.numel()), meta, memoryview(blob.numpy())])
    return len(meta) + blob.numel()


def recv_state(group: ReplicaGroup, src: int, state_dict: dict) -> dict:
    """Receive a donor's state into ``state_dict``'s tensors (in place) and return the whole of it (plain values too)."""
    conn = group.ring.recv_from(src)
    meta_len, blob_len = _HEAD.unpack(recv_exact(conn, bytearray(_HEAD.size)))
    info = json.loads(bytes(recv_exact(conn, bytearray(meta_len))))
    mine: list[torch.Tensor] = []
    _flatten(state_dict, mine)
    shapes = [(str(t.dtype), list(t.shape)) for t in mine]
    if shapes != [tuple(x) for x in info["tensors"]]:
        raise ValueError(f"the donor's state has another layout ({len(info['tensors'])} tensors) than this rank's "
                         f"({len(mine)}): not the same model, world or sharding")
    blob = torch.empty(blob_len, dtype=torch.uint8)
    recv_exact(conn, memoryview(blob.numpy()))
    offset = 0
    with torch.no_grad():
        for t in mine:
            n = t.numel() * t.element_size()
            t.copy_(blob[offset:offset + n].view(t.dtype).view(t.shape))
            offset += n
    return _restore(info["layout"], mine, state_dict)
