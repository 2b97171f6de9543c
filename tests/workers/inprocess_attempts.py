"""Two attempts of a wrapped function (2 ranks, gloo): what the end of an attempt releases.

Attempt 0: every rank builds an object graph with reference cycles (a module whose forward hook
refers to the module, and activations with their autograd graph) and keeps weak references to
it; then initial rank 1 raises from a nested call (its traceback holds the model, the exception
itself the activations) while rank 0 waits in an ``all_reduce``.
Attempt 1 prints ``{"rank", "alive": [...]}`` — which of attempt 0's objects still exist — then
queues ``--tail-ops`` asynchronous ``all_reduce`` calls it never waits for and returns. After
the wrapped call each rank prints ``{"rank", "pg_initialized", "result"}``.

Automatic garbage collection is off (as Megatron-LM's ``--manual-gc`` runs it): what is freed
must not depend on when the collector happens to run. ``--unhealthy-rank R``: a health check
that fails on initial rank R. Launched by ``nvrx_lab.inprocess.spawn --nproc 2``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import weakref

import torch
import torch.distributed as dist

from nvrx_lab.inprocess import CallWrapper, HealthCheckError, Wrapper

ATTEMPT0: list[tuple[str, weakref.ref]] = []


def emit(row: dict) -> None:
    """One JSON line in one write: the ranks share the launcher's stdout."""
    os.write(1, (json.dumps(row) + "\n").encode())


class StepError(RuntimeError):
    def __init__(self, message: str, batch: torch.Tensor):
        super().__init__(message)
        self.batch = batch  # exceptions may carry data too


def build_graph() -> tuple[torch.nn.Module, torch.Tensor]:
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512))

    def hook(module, args, out):  # a cycle: model -> hook -> model
        assert module is model

    model.register_forward_hook(hook)
    out = model(torch.randn(256, 512, requires_grad=True))
    ATTEMPT0.extend([("model", weakref.ref(model)), ("weight", weakref.ref(model[0].weight)),
                     ("activation", weakref.ref(out))])
    return model, out


def fail(model, out) -> None:
    raise StepError("injected exception (attempt 0)", out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tail-ops", type=int, default=0)
    ap.add_argument("--unhealthy-rank", type=int, default=-1)
    a = ap.parse_args()
    rank0 = int(os.environ["RANK"])
    gc.disable()

    def health(state):
        if state.initial_rank == a.unhealthy_rank:
            raise RuntimeError("fake: device unhealthy")
        return state

    @Wrapper(soft_timeout=3.0, hard_timeout=6.0, max_iterations=3, heartbeat_interval=0.2, heartbeat_timeout=2.0,
             barrier_timeout=30.0, health_check=health)
    def attempt(cw: CallWrapper):
        if cw.iteration == 0:
            model, out = build_graph()
            cw.init_process_group(backend="gloo")
            if cw.initial_rank == 1:
                fail(model, out)
            dist.all_reduce(torch.ones(1))  # rank 1 never joins: ended by the abort
            raise AssertionError("attempt 0 should not finish")
        alive = [name for name, ref in ATTEMPT0 if ref() is not None]
        emit({"rank": rank0, "iteration": cw.iteration, "alive": alive})
        cw.init_process_group(backend="gloo")
        for _ in range(a.tail_ops):  # in flight when the function returns
            dist.all_reduce(torch.ones(1000), async_op=True)
        return {"iteration": cw.iteration, "world_size": cw.world_size}

    try:
        result = attempt()
    except HealthCheckError as e:
        emit({"rank": rank0, "left": f"{type(e).__name__}: {e}"})
        return 3
    emit({"rank": rank0, "pg_initialized": dist.is_initialized(), "result": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
