"""Healing: a replacement replica takes a live replica's state, rank ``k`` from rank ``k``, at a step boundary.

The state is the trainer's live state dict (:meth:`~nvrx_lab.train.state.TrainState.local_state_dict`: this
rank's FSDP shards of the parameters, the optimizer's state, the step): the same world inside a replica group,
the same sharding, so it is copied as it is, without a checkpoint format. It goes over the quorum's own process group
(:mod:`.group`: gloo here, NCCL on a GPU), point to point from the donor to each joiner: a header (the layout's
length, the state's bytes), the layout (JSON: where each tensor goes, its dtype and shape, and the plain values),
then every tensor's bytes in chunks of at most ``CHUNK_BYTES``, received in place into the joiner's own tensors:
no copy of the whole state is ever made on either side. Each chunk is a unit of progress (:mod:`.progress`), so a
large heal is slow, never hung, and every chunk is watched (an abort ends it; the data plane's timeout bounds it).

The donor sends from its live tensors, which nothing changes before the step's update (that waits for every member,
the joiner included); the others wait in the step's reduction meanwhile, with a patience that grows with the bytes
to move (:data:`HEAL_BPS_FLOOR`).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from .group import ReplicaGroup
from .step import local_tensor

CHUNK_BYTES = 64 << 20
"""The most one send or receive of a heal moves."""
HEAL_BPS_FLOOR = 50e6
"""Bytes a second the others' patience assumes a heal moves at least (a loaded 2-core box here; p5: 100x that)."""


def _flatten(obj, tensors: list[torch.Tensor]):
    """``obj`` with every tensor replaced by ``{"__t": i}`` (appended to ``tensors``; a DTensor's local shard)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(local_tensor(obj))  # (under no_grad: an attribute read, not an autograd op)
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


def state_bytes(state_dict: dict) -> int:
    tensors: list[torch.Tensor] = []
    _flatten(state_dict, tensors)
    return sum(t.numel() * t.element_size() for t in tensors)


def _chunks(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Byte views of contiguous ``buffers``, cut into pieces of at most ``CHUNK_BYTES`` (empty ones left out)."""
    out = []
    for t in buffers:
        flat = t.detach().reshape(-1).view(torch.uint8)
        out += [flat[i:i + CHUNK_BYTES] for i in range(0, flat.numel(), CHUNK_BYTES)]
    return out


def send_state(group: ReplicaGroup, to: list[int], state_dict: dict, aborted: Callable[[], bool],
               on_chunk: Callable[[], None] = lambda: None) -> int:
    """Send this rank's ``state_dict`` to group members ``to``; returns the bytes sent to each."""
    tensors: list[torch.Tensor] = []
    layout = _flatten(state_dict, tensors)
    meta = json.dumps({"layout": layout, "tensors": [[str(t.dtype), list(t.shape)] for t in tensors]}).encode()
    device = group.device
    payload = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    total = sum(t.numel() * t.element_size() for t in payload)
    head = torch.tensor([len(meta), total], dtype=torch.int64, device=device)
    meta_t = torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(device)
    for index in to:
        group.send([head, meta_t], index, aborted)
        group.send(_chunks(payload), index, aborted, on_chunk)
    return len(meta) + total


def recv_state(group: ReplicaGroup, src: int, state_dict: dict, aborted: Callable[[], bool],
               on_chunk: Callable[[], None] = lambda: None) -> dict:
    """Receive a donor's state into ``state_dict``'s tensors (in place) and return the whole of it (plain values too)."""
    head = torch.empty(2, dtype=torch.int64, device=group.device)
    group.recv([head], src, aborted)
    meta_len, total = (int(v) for v in head.tolist())
    meta_t = torch.empty(meta_len, dtype=torch.uint8, device=group.device)
    group.recv([meta_t], src, aborted)
    info = json.loads(bytes(meta_t.cpu().numpy()))
    mine: list[torch.Tensor] = []
    _flatten(state_dict, mine)
    shapes = [[str(t.dtype), list(t.shape)] for t in mine]
    if shapes != info["tensors"]:
        diff = next(i for i, (a, b) in enumerate(zip(shapes, info["tensors"], strict=False)) if a != b) \
            if len(shapes) == len(info["tensors"]) else None
        where = f"tensor {diff}: {info['tensors'][diff]} sent, {shapes[diff]} here" if diff is not None else \
            f"{len(info['tensors'])} tensors sent, {len(mine)} here"
        raise ValueError(f"the donor's state has another layout than this rank's ({where}): not the same model, "
                         f"world or sharding")
    into = [t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format) for t in mine]
    if sum(t.numel() * t.element_size() for t in into) != total:
        raise ValueError(f"the donor sends {total} bytes of state, this rank holds "
                         f"{sum(t.numel() * t.element_size() for t in into)}")
    with torch.no_grad():
        group.recv(_chunks(into), src, aborted, on_chunk)
        for t, buf in zip(mine, into, strict=True):
            if buf is not t:
                t.copy_(buf)
    return _restore(info["layout"], mine, state_dict)
