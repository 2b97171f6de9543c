"""Worker for tests/test_checkpoint_dist.py: FSDP2 ranks save or load with AsyncCheckpointer.

    python -m torch.distributed.run --nproc-per-node 2 ... tests/workers/ckpt_fsdp.py save DIR
    python -m torch.distributed.run --nproc-per-node 3 ... tests/workers/ckpt_fsdp.py load DIR

``save`` trains 2 steps, writes the full (unsharded) reference to DIR/ref.pt, async-saves step 2,
trains a third step in place *before* finalizing, commits on rank 0 while the other ranks wait in a
barrier (their writers' outcomes reach the store without them), and checks every rank agrees on
``latest_step``.
``load`` builds differently initialised FSDP2 modules on N ranks, loads, and compares with ref.pt.
``plans`` plans saves with a :class:`PlanCache`: reused while no rank's state changes its structure,
planned anew on every rank when one rank's does (the folder made for the reuse that was voted down is gone).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from nvrx_lab.checkpoint import AsyncCheckpointer
from nvrx_lab.checkpoint import commit as cm
from nvrx_lab.checkpoint.planning import PlanCache, all_gather, plan_save


def build(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(4, 16, generator=g)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def plans(rank: int, world: int, pg, out: Path) -> None:
    w = f"w{rank}"  # a plain tensor of the same name on every rank would be saved by one rank only (dedup)
    cache, state, ids = PlanCache(), {w: torch.full((4,), float(rank)), "meta": {"step": 0}}, []

    def plan(step: int):
        state["meta"]["step"] = step
        planned = plan_save(state, rank, world, pg, lambda sid: cm.make_tmp(out, step, sid), cache=cache,
                            unprepare=lambda sid: cm.unmake_tmp(out, step, sid))
        assert len(set(all_gather(planned.save_id, pg, world))) == 1, "every rank names the same folder"
        ids.append(planned.save_id)
        return planned

    plan(1)
    assert cache.reuses == 0
    second = plan(2)
    assert cache.reuses == 1 and ids[1] != ids[0], (cache.reuses, ids)
    assert [i.index.fqn for i in second.tensor_items] == [w]
    assert second.tensors[0].data_ptr() == state[w].data_ptr(), "the reused plan stages the live tensor"
    voted_down = cache.reuse_id()
    if rank == 1:
        state["extra"] = torch.ones(3)  # one rank's structure changes: every rank plans anew
    third = plan(3)
    assert cache.reuses == 0, "rank 0's state did not change, but rank 1's did"
    if rank == 0:
        assert "extra" in third.metadata.state_dict_metadata
        assert not cm.tmp_dir(out, 3, voted_down).exists(), "the folder made before the vote was removed"
        assert sorted(p.name for p in out.iterdir()) == sorted(cm.tmp_dir(out, s, i).name for s, i in
                                                               zip((1, 2, 3), ids, strict=True))
    plan(4)
    assert cache.reuses == 1
    print(f"PLANS_OK rank={rank}", flush=True)


def main(mode: str, out: Path) -> None:
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    rank = dist.get_rank()
    pg = dist.new_group(backend="gloo")
    if mode == "plans":
        plans(rank, dist.get_world_size(), pg, out)
    elif mode == "save":
        model, opt = build(0)
        for step in range(2):
            train_step(model, opt, step)
        msd, osd = get_state_dict(model, opt)
        ref = {"model": {k: full(v).clone() for k, v in msd.items()},
               "exp_avg": {k: full(v["exp_avg"]).clone() for k, v in osd["state"].items()}}
        if rank == 0:
            torch.save(ref, out / "ref.pt")
        with AsyncCheckpointer(out / "ckpt", process_group=pg) as ckpt:
            ckpt.start()  # writers up before the barrier below (it times out after 60 s; torch imports take long under load)
            ckpt.save({"model": msd, "optim": osd, "meta": {"step": 1, "name": "sync"}}, step=1)  # sync path
            ckpt.async_save({"model": msd, "optim": osd, "meta": {"step": 2, "name": "fsdp"}}, step=2)
            train_step(model, opt, 2)  # mutates params and optimizer state in place while the writer runs
            if rank == 0:  # commits while the other ranks wait in a barrier: their posts need no call of theirs
                assert ckpt.finalize_async_save(blocking=True) == [2]
            dist.barrier(group=pg)
            ckpt.finalize_async_save(blocking=True)
            assert ckpt.latest_step() == 2, ckpt.latest_step()
        print(f"SAVE_OK rank={rank}", flush=True)
    else:
        model, opt = build(1234)
        train_step(model, opt, 0)  # materialise optimizer state so there is something to load into
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "meta": {"step": -1, "name": ""}}
        with AsyncCheckpointer(out / "ckpt", process_group=pg, start_writer=False) as ckpt:
            assert ckpt.load(state) == 2
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        ref = torch.load(out / "ref.pt", weights_only=True)
        msd, osd = get_state_dict(model, opt)
        for k, v in ref["model"].items():
            assert torch.equal(full(msd[k]), v), f"model {k} differs"
        for k, v in ref["exp_avg"].items():
            assert torch.equal(full(osd["state"][k]["exp_avg"]), v), f"exp_avg {k} differs"
        assert state["meta"] == {"step": 2, "name": "fsdp"}, state["meta"]
        print(f"LOAD_OK rank={rank} world={dist.get_world_size()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
    # What this worker checks is done. Under load, torch 2.13's interpreter teardown after a gloo group has aborted
    # once in ~800 runs ("terminate called without an active exception", exit -6, after every LOAD_OK): not ours to
    # test here, so the worker leaves without it.
    sys.stdout.flush()
    os._exit(0)
