"""A user's first try at both layers together: an AsyncCheckpointer made with ``with`` inside the function the
in-process Wrapper restarts (issue #32 item 4). No ``__main__`` guard, on purpose: nothing may run this script
again (the writer is forked or a clean interpreter of our own module).

    python -m nvrx_lab.inprocess.spawn --nproc 2 -- python tests/workers/wrapped_checkpointer.py CKPT_DIR EVENTS
"""

import sys

import torch
import torch.distributed as dist

from nvrx_lab.checkpoint import AsyncCheckpointer
from nvrx_lab.inprocess import CallWrapper, Wrapper
from nvrx_lab.observe.events import EventLog

ckpt_dir, events_path = sys.argv[1], sys.argv[2]
STEPS, EVERY, FAULT = 12, 3, (1, 0, 7)  # rank 1 raises before step 7 of attempt 0
rank0 = int(__import__("os").environ["RANK"])
events = EventLog(events_path, rank=rank0)


@Wrapper(soft_timeout=2.0, hard_timeout=20.0, max_iterations=3, emit=events.emit)
def train(cw: CallWrapper) -> int:
    cw.init_process_group(backend="gloo")
    state = {"w": torch.zeros(64, 64), "step": 0}
    with AsyncCheckpointer(ckpt_dir, process_group=dist.group.WORLD, emit=events.emit) as ckpt:
        restored = ckpt.restore(_Stateful(state))
        step = restored.step if restored else 0
        while step < STEPS:
            step += 1
            if (cw.initial_rank, cw.iteration, step) == FAULT:
                raise RuntimeError(f"injected exception on rank {cw.initial_rank} at step {step}")
            grad = torch.full((64, 64), float(step))
            dist.all_reduce(grad)
            state["w"] += grad
            state["step"] = step
            cw.ping()
            if step % EVERY == 0:
                with cw.atomic():
                    ckpt.async_save(dict(state), step=step)
            ckpt.finalize_async_save()
    return step


class _Stateful:
    def __init__(self, sd):
        self.sd = sd

    def state_dict(self):
        return self.sd

    def load_state_dict(self, sd):
        self.sd.update(sd)


print(f"rank {rank0} finished at step {train()}", flush=True)
