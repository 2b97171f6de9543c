"""A stand-in training state and loop, for checkpoint studies without a model.

:func:`make_state` builds N MiB of tensors (16 float32 tensors, a bf16 tensor and an int step);
:func:`mutate` is the "optimizer step" that changes every tensor in place, so a save that reads the
live tensors after it returns is caught. :func:`loop_efficiency` runs a loop of ``time.sleep``
steps that mutate the state and save it every ``interval`` steps: checkpoint efficiency in one
process, in seconds instead of the trainer's minutes.

Used by ``python -m nvrx_lab.bench checkpoint`` and notebook 01.
"""

from __future__ import annotations

import time

import torch

from nvrx_lab.observe.table import median


def make_state(mib: float) -> dict:
    """A state dict of about ``mib`` MiB: ``layer0.weight`` … ``layer15.weight`` (float32), ``norm.bf16``, ``step``."""
    n = 16
    numel = max(1, int(mib * (1 << 20)) // 4 // n)
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n)}
    state["norm.bf16"] = torch.randn(1024, generator=g).to(torch.bfloat16)
    state["step"] = 0
    return state


def zeros_like(state: dict) -> dict:
    """A load target of the same shapes: zero tensors, ``-1`` for every other value."""
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in state.items()}


def mutate(state: dict) -> None:
    """One "optimizer step": add 1 to every tensor, in place."""
    for v in state.values():
        if isinstance(v, torch.Tensor):
            v.add_(1)


def equal(a: dict, b: dict) -> bool:
    """Same keys of ``a`` in ``b`` with equal tensors and values."""
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def loop_efficiency(ckpt, state: dict, mode: str, interval: int, steps: int, step_s: float) -> dict:
    """In one process: a loop of ``time.sleep(step_s)`` "steps" saving with ``ckpt`` every ``interval`` steps.

    A quick stand-in for the trainer runs of ``python -m nvrx_lab.bench efficiency``: the same
    checkpointer and throttle (``ckpt.config.write_bandwidth``). ``mode`` is ``none``, ``sync`` or
    ``async``. Returns ``{"seconds", "save_block_s"}``; efficiency = seconds(none) / seconds(mode).
    The last write is finished (outside the timing) before returning.
    """
    blocks: list[float] = []
    emit, ckpt.emit = ckpt.emit, lambda kind, **f: blocks.append(f["blocking_s"]) if kind == "ckpt_save" else None
    try:
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            time.sleep(step_s)
            mutate(state)
            ckpt.finalize_async_save()
            if mode != "none" and step % interval == 0:
                (ckpt.save if mode == "sync" else ckpt.async_save)(state, step=step)
        seconds = time.perf_counter() - t0
        ckpt.finalize_async_save(blocking=True)
    finally:
        ckpt.emit = emit
    return {"seconds": seconds, "save_block_s": median(blocks) if blocks else 0.0}
