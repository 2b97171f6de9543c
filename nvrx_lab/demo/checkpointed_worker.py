"""Both layers in a user's own script: an AsyncCheckpointer made with ``with`` inside the function that the
in-process Wrapper restarts (the first pattern of :mod:`nvrx_lab.checkpoint`'s docs; notebook 02 runs it).

::

    python -m nvrx_lab.inprocess.spawn --nproc 2 -- python -m nvrx_lab.demo.checkpointed_worker CKPT_DIR EVENTS

Rank 1 raises before step 7 of the first attempt. Leaving the ``with`` on that exception abandons the save in
flight at once (no wait on a writer that would read as a hang); every attempt restores the newest committed
step; saves, and the commit of the last one at the end, run inside ``call_wrapper.atomic()`` (no false restart
however long that commit takes). Each rank prints ``rank R finished at step 12``.
"""

import sys

import torch
import torch.distributed as dist

from nvrx_lab.checkpoint import AsyncCheckpointer
from nvrx_lab.dist import LaunchEnv
from nvrx_lab.faults import InjectedFault
from nvrx_lab.inprocess import CallWrapper, Wrapper
from nvrx_lab.observe.events import EventLog

STEPS, EVERY, FAULT = 12, 3, (1, 0, 7)  # rank 1 raises before step 7 of attempt 0


def train(cw: CallWrapper, ckpt_dir: str, events: EventLog) -> int:
    cw.init_process_group(backend="gloo")
    state = {"w": torch.zeros(64, 64), "step": 0}
    with AsyncCheckpointer(ckpt_dir, process_group=dist.group.WORLD, emit=events.emit) as ckpt:
        restored = ckpt.restore(_Stateful(state))
        step = restored.step if restored else 0
        cw.ping()  # restored: progress (a collective of its own, before the first step's)
        while step < STEPS:
            step += 1
            if (cw.initial_rank, cw.iteration, step) == FAULT:
                raise InjectedFault(f"injected exception on rank {cw.initial_rank} at step {step}")
            grad = torch.full((64, 64), float(step))
            dist.all_reduce(grad)
            state["w"] += grad
            state["step"] = step
            cw.ping()
            if step % EVERY == 0:
                with cw.atomic():
                    ckpt.async_save(dict(state), step=step)
            ckpt.finalize_async_save()
        with cw.atomic():  # the last save's commit: a restart must not cut it, and it is no hang however long
            ckpt.finalize_async_save(blocking=True)
    return step


class _Stateful:
    def __init__(self, sd):
        self.sd = sd

    def state_dict(self):
        return self.sd

    def load_state_dict(self, sd):
        self.sd.update(sd)


def main(argv: list[str]) -> int:
    ckpt_dir, events_path = argv
    rank0 = LaunchEnv.read().rank
    events = EventLog(events_path, rank=rank0)
    wrapped = Wrapper(soft_timeout=2.0, hard_timeout=20.0, max_iterations=3, emit=events.emit)(train)
    print(f"rank {rank0} finished at step {wrapped(ckpt_dir, events)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
