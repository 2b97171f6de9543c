"""Ranks each on a simulated node of its own (``local_world=1``: rank r replicates to rank r + 1, the last to rank
0) save local checkpoints; then node 0 loses its memory, so rank 0 can only restore from the replica rank 1 holds.

One rank of :func:`.local.damaged_replica`: ``python -m nvrx_lab.reliability.local_replica WORK CASE...`` (env: RANK,
WORLD_SIZE = 3, MASTER_ADDR/PORT), each CASE one
of ``intact`` (the newest replica restores), ``corrupt`` (a flipped byte in the newest: skipped, the older replica
slot restores the step before), ``corrupt-both`` (both slots: skipped, nothing restored) and ``older-run`` (both
manifests name another run: skipped), in its own folder. Each rank writes ``step source ok`` to
``WORK/CASE/result.RANK`` (a file, not stdout: three ranks' lines on one pipe can interleave).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from nvrx_lab.checkpoint.local import LocalCheckpointer
from nvrx_lab.reliability.local_child import GRACE_S, Blob


def main(work: str, cases: list[str]) -> None:
    dist.init_process_group("gloo")
    for case in cases:
        run_case(Path(work) / case, case, dist.get_rank())
    dist.destroy_process_group()


def run_case(work: Path, case: str, rank: int) -> None:
    node = work / f"node{rank}"
    world = dist.get_world_size()
    ckpt = LocalCheckpointer(node, run="run-1", rank=rank, world=world, local_world=1, grace_s=GRACE_S)
    for step in (1, 2, 3):
        ckpt.save(Blob(1000, 10 * rank + step).state_dict(), step)
    ckpt.wait()
    ckpt.close(keep=True)
    dist.barrier()
    if rank == 0:  # node 0 is replaced: its memory is gone
        for path in node.glob("rank0.*"):
            path.unlink()
    elif rank == 1:  # rank 1 holds rank 0's replica, in two slots: the newest last
        manifests = sorted(node.glob("rank1.replica.*.json"), key=lambda m: json.loads(m.read_text())["step"])
        for manifest in {"corrupt": manifests[-1:], "corrupt-both": manifests}.get(case, []):
            with open(node / json.loads(manifest.read_text())["file"], "r+b") as f:
                f.seek(100)
                f.write(b"\xff\xfe")
        if case == "older-run":
            for manifest in manifests:
                manifest.write_text(manifest.read_text().replace('"run-1"', '"run-0"'))
    dist.barrier()
    again = LocalCheckpointer(node, run="run-1", rank=rank, world=world, local_world=1, grace_s=GRACE_S)
    state = Blob(1000, -1.0)
    got = again.restore(state, storage_step=None)
    ok = got is None or float(state.sd["w"][0]) == 10 * rank + got.step
    (work / f"result.{rank}").write_text(f"{got and got.step} {got and got.source} {'ok' if ok else 'WRONG-VALUES'}")
    again.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
