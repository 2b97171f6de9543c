"""Two ranks, each a node of its own (``local_world=1``): snapshots whose size changes from save to save.

``torchrun --nproc-per-node 2 tests/workers/local_resize.py WORK``. Steps 1–2 save 1,000 floats a rank, steps 3–4
3,000 (the replication's length grows: the receive posted for the old length is filled, the data goes on its own
tag), step 5 500 (it shrinks). After each save's round completes, each rank checks the replica it holds of its
peer: that step, that length, those values. Then node 0 loses its memory and restores step 5 from rank 1's replica.
Each rank writes ``WORK/ok.RANK`` (a file: two ranks' lines on one pipe can interleave), or raises.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nvrx_lab.checkpoint import snapshot as snap
from nvrx_lab.checkpoint.local import LocalCheckpointer

SIZES = {1: 1000, 2: 1000, 3: 3000, 4: 3000, 5: 500}


class Blob:
    def __init__(self, n: int, fill: float):
        self.sd = {"w": torch.full((n,), float(fill)), "step": 0}

    def state_dict(self) -> dict:
        return self.sd

    def load_state_dict(self, sd: dict) -> None:
        self.sd = sd


def main(work: Path) -> None:
    dist.init_process_group("gloo")
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    node = work / f"node{rank}"
    ckpt = LocalCheckpointer(node, run="resize", rank=rank, world=2, local_world=1)
    for step, n in SIZES.items():
        ckpt.save(Blob(n, 10 * rank + step).state_dict(), step)
        ckpt.wait()  # this round is through on both sides: the replica of the peer's step is committed
        manifests = [m for m in map(snap.read_manifest, sorted(node.glob(f"rank{rank}.replica.*.json"))) if m]
        newest = max(manifests, key=lambda m: m["step"])
        region = open(node / newest["file"], "rb").read()
        snap.check(newest, region, run="resize", world=2, rank=peer)
        values = torch.frombuffer(bytearray(region[:4 * n]), dtype=torch.float32)
        assert newest["step"] == step and bool((values == 10 * peer + step).all()), (step, newest)
    ckpt.close(keep=True)
    dist.barrier()
    if rank == 0:  # node 0 is replaced: its memory is gone
        for path in node.glob("rank0.*"):
            path.unlink()
    dist.barrier()
    again = LocalCheckpointer(node, run="resize", rank=rank, world=2, local_world=1)
    state = Blob(SIZES[5], -1.0)
    got = again.restore(state, storage_step=None)
    assert got is not None and got.step == 5 and got.source == ("peer" if rank == 0 else "local"), got
    assert bool((state.sd["w"] == 10 * rank + 5).all()), state.sd["w"][:4]
    again.close()
    (work / f"ok.{rank}").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
