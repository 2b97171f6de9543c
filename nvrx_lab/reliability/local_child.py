"""One rank of :func:`.local.sigkill_mid_replication`, each rank a simulated node of its own (``local_world=1``)::

    python -m nvrx_lab.reliability.local_child WORK save|restore MIB PORT WORLD RANK   # rank 0's store: 127.0.0.1:PORT

``save`` snapshots a state of ``MIB`` MiB every step, each replicated to the other rank, until it is killed
(exit 3 if nobody kills it within 120 s). ``restore`` restores what the copies in ``WORK/node<rank>`` allow,
checks every value against the step it claims, writes ``{"step", "source", "ok"}`` to ``WORK/result.<rank>``
and closes cleanly. Every value of rank ``r``'s state at step ``s`` is ``10 s + r``. One thread per rank: the
ranks, their writers and the case share two cores.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from nvrx_lab.checkpoint.local import LocalCheckpointer

GRACE_S = 300.0
"""The node janitor's grace: the copies of a killed job outlive it until the next job holds them."""


class Blob:
    """A ``Stateful`` of ``numel`` float32 values, all ``value``, and ``value // 10`` as its step."""

    def __init__(self, numel: int, value: float):
        self.sd = {"w": torch.full((numel,), float(value)), "step": int(value) // 10}

    def state_dict(self) -> dict:
        return self.sd

    def load_state_dict(self, sd: dict) -> None:
        self.sd = sd


def main(work: str, mode: str, mib: str, port: str, world: str, rank: str) -> int:
    torch.set_num_threads(1)
    rank, world, numel = int(rank), int(world), int(float(mib) * (1 << 18))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    ckpt = LocalCheckpointer(Path(work) / f"node{rank}", run="crash", rank=rank, world=world, local_world=1,
                             grace_s=GRACE_S)
    if mode == "save":
        deadline, step = time.monotonic() + 120, 0
        while time.monotonic() < deadline:
            step += 1
            ckpt.save(Blob(numel, 10 * step + rank).state_dict(), step)
        return 3
    state = Blob(numel, -1.0)
    got = ckpt.restore(state, storage_step=None)
    ok = got is None or (bool((state.sd["w"] == 10 * got.step + rank).all()) and state.sd["step"] == got.step)
    (Path(work) / f"result.{rank}").write_text(json.dumps({"step": got and got.step, "source": got and got.source,
                                                          "ok": ok}))
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
