"""Planning: DCP's save plan, made collectively in the trainer, executed later by a writer.

``torch.distributed.checkpoint.save`` runs three phases: *plan* (every rank lists what it holds; the
coordinator gathers the plans, de-duplicates replicated tensors, assigns file prefixes and builds the
global :class:`~torch.distributed.checkpoint.metadata.Metadata`; the plans are scattered back),
*write* (each rank writes its items) and *finish* (the write results are gathered and the coordinator
writes ``.metadata``). Only the planning needs the other ranks at the moment of the save, and it is
cheap: shapes and offsets, no tensor data. So :func:`plan_save` runs it right here, in
``async_save``, over the CPU (gloo) group with DCP's own ``DefaultSavePlanner``; the coordinator keeps
the global metadata, and every rank ends up with its final local plan and the *sources* to stage:

* tensor items — the local tensor of each write item (a DTensor's local shard, a plain tensor);
* byte items — non-tensor values (ints, strings, lists of them), serialised *now* with
  ``torch.save``, which is itself their consistent snapshot.

The bytes are written later, in the writer process, from the staged copy (:mod:`.writer`), and the
finish phase becomes the commit of :mod:`.commit`, fed by the completion board of :mod:`.completion`
— no collective after ``async_save``.

**A plan is made once and reused** while the state keeps its structure (:class:`PlanCache`): every rank
still builds its local plan (a walk over its state, no data), compares it with the one it saved last, and
one all-reduce of a flag says whether every rank's is unchanged. Then the coordinator's global plan and
metadata are reused, and no plan travels: one small collective per save instead of a gather of N plans to
the coordinator and a scatter back (DCP's ``enable_plan_caching`` still gathers them). The reused save's id
is derived from the planned one, so every rank names the same folder without a message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType


@dataclass
class PlannedSave:
    """What one rank must write for one step."""

    plan: SavePlan
    """This rank's final DCP plan (write items, file prefix ``__{rank}_``)."""
    tensor_items: list[WriteItem]
    """The plan's tensor items, in the order of ``tensors``."""
    tensors: list[torch.Tensor]
    """Live source tensors for ``tensor_items`` (to be staged; never sent to another process)."""
    byte_items: dict[MetadataIndex, bytes]
    """Serialised non-tensor values, keyed by write-item index."""
    metadata: Metadata | None
    """Global metadata without storage info (coordinator only)."""
    save_id: str
    """A nonce agreed by all ranks: names this save's temporary folder."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors) + sum(map(len, self.byte_items.values()))


@dataclass
class PlanCache:
    """One rank's last full plan (:func:`plan_save` with ``cache=``), and how often it was reused."""

    local: SavePlan | None = None
    central: SavePlan | None = None
    metadata: Metadata | None = None
    save_id: str = ""
    reuses: int = 0

    def reuse_id(self) -> str:
        """The next reused save's id: the same on every rank, different for every save."""
        return hashlib.sha1(f"{self.save_id}:{self.reuses + 1}".encode()).hexdigest()[:12]


def global_plan(planner: DefaultSavePlanner, local_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata, str]:
    """Coordinator: DCP's global plan of every rank's local plan, one file prefix a rank, a fresh save id."""
    plans, metadata = planner.create_global_plan(local_plans)
    plans = [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) for i, p in enumerate(plans)]
    return plans, metadata, uuid.uuid4().hex[:12]


def _gather_scatter(local: SavePlan, planner: DefaultSavePlanner, group, rank: int, world: int, prepare):
    """DCP's reduce_scatter("plan"): coordinator (group rank 0) builds the global plan."""
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(local, gathered, group=group, group_dst=0)
    if rank == 0:
        plans, metadata, save_id = global_plan(planner, gathered)
        prepare(save_id)
        payload = [(p, save_id) for p in plans]
    else:
        payload, metadata = None, None
    out = [None]
    dist.scatter_object_list(out, payload, group=group, group_src=0)
    central, save_id = out[0]
    return central, metadata, save_id


def plan_save(state_dict: dict, rank: int = 0, world: int = 1, group=None,
              prepare: Callable[[str], object] = lambda save_id: None, cache: PlanCache | None = None,
              unprepare: Callable[[str], object] = lambda save_id: None) -> PlannedSave:
    """Plan one save of ``state_dict`` (collective over ``group`` when ``world > 1``). Rank 0 calls
    ``prepare(save_id)`` before any other rank learns the plan (it creates the save's folder).
    ``cache``: reuse the last plan while every rank's local plan is unchanged (module docs); rank 0
    prepares the reused id's folder before the vote and calls ``unprepare`` on it if the vote fails."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict=state_dict, storage_meta=None, is_coordinator=rank == 0)
    local = planner.create_local_plan()
    if cache is not None:  # every rank votes, even one with nothing cached: the same collectives everywhere
        same, save_id = cache.local is not None and cache.local == local, cache.reuse_id()
        if rank == 0 and same:
            prepare(save_id)
        if _everyone(same, group, world):
            cache.reuses += 1
            metadata = dataclasses.replace(cache.metadata) if cache.metadata is not None else None
            return _planned(planner, cache.central, metadata, save_id)  # a copy: the commit fills it in
        if rank == 0 and same:
            unprepare(save_id)
    if world > 1:
        central, metadata, save_id = _gather_scatter(local, planner, group, rank, world, prepare)
    else:
        (central,), metadata, save_id = global_plan(planner, [local])
        prepare(save_id)
    if cache is not None:
        cache.local, cache.central, cache.metadata, cache.save_id, cache.reuses = local, central, metadata, save_id, 0
        metadata = dataclasses.replace(metadata) if metadata is not None else None
    return _planned(planner, central, metadata, save_id)


def _everyone(flag: bool, group, world: int) -> bool:
    """Whether ``flag`` holds on every rank: one all-reduce of one int."""
    if world == 1:
        return flag
    vote = torch.tensor([0 if flag else 1], dtype=torch.int32)
    dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group)
    return not vote.item()


def plan_ranks(state_dicts: list[dict]) -> list[PlannedSave]:
    """Plan one save of simulated ranks in one process, rank ``r`` holding ``state_dicts[r]``: what
    :func:`plan_save` gives each real rank, without a process group (tests, the scale model)."""
    planners = [DefaultSavePlanner() for _ in state_dicts]
    for r, (planner, sd) in enumerate(zip(planners, state_dicts, strict=True)):
        planner.set_up_planner(state_dict=sd, storage_meta=None, is_coordinator=r == 0)
    plans, metadata, save_id = global_plan(planners[0], [p.create_local_plan() for p in planners])
    return [_planned(p, plan, metadata if r == 0 else None, save_id)
            for r, (p, plan) in enumerate(zip(planners, plans, strict=True))]


def _planned(planner: DefaultSavePlanner, central: SavePlan, metadata, save_id: str) -> PlannedSave:
    final = planner.finish_plan(central)
    tensor_items, tensors, byte_items = [], [], {}
    for item in final.items:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            byte_items[item.index] = data.getvalue()
        else:
            tensor_items.append(item)
            tensors.append(data)
    return PlannedSave(final, tensor_items, tensors, byte_items, metadata, save_id)


def local_tensors(state_dict: dict) -> list:
    """The tensors this rank's saves of ``state_dict`` stage, in plan order (local planning only: no
    collective), for sizing the staging buffer ahead of the first save."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict=state_dict, storage_meta=None, is_coordinator=False)
    return [planner.resolve_data(item) for item in planner.create_local_plan().items
            if item.type != WriteItemType.BYTE_IO]


def broadcast(obj, group, world: int):
    """``obj`` of group rank 0 on every rank (identity in one process)."""
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def all_gather(obj, group, world: int) -> list:
    """Every rank's ``obj``, in rank order."""
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out
