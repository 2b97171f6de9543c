"""Ending an attempt: what is released, and in which order
=========================================================

Before the first attempt, what lives is frozen out of the collector's reach (:func:`freeze_what_lives`).
After a fault, on every rank (:class:`~.loop.RestartLoop`)::

    detach the exception                  the traceback's frames hold the old model, optimizer, activations
    destroy the attempt's process group   (the abort has already unblocked it)
    health check                          gets the exception (no frames); CudaHealthCheck: bounded sync
    drop the exception, collect garbage   until nothing is left: FSDP2 modules form reference cycles
    release cached CUDA memory            only now: emptying the cache synchronizes with the device

Without the middle two steps the next attempt builds its model next to the old one: the rank
that raised kept its exception for the health check (and through it every local of the failed
function), and cycles wait for a full collection that a loop with few Python allocations (or one
that disables automatic collection, as Megatron-LM's ``--manual-gc`` does) may not run for a long
time. NVRx collects the same way (``while gc.collect(): pass``).

After success, every rank drains the attempt's group, destroys it and joins its threads
(:func:`drain_and_destroy`, :func:`nvrx_lab.dist.join_group_threads`): torch 2.13's gloo worker threads
otherwise may still release a finished work, which holds Python-owned tensors, while the interpreter
finalizes — the process then aborts ("terminate called without an active exception", SIGABRT at exit).
"""

from __future__ import annotations

import gc
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from nvrx_lab.dist import join_group_threads


def destroy_group() -> None:
    """Destroy the default group (and every other group) if one exists; otherwise forget what an
    interrupted ``init_process_group`` left behind (:func:`forget_partial_group`)."""
    if not dist.is_available():
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    else:
        forget_partial_group()


def forget_partial_group() -> None:
    """Reset torch's group registry as ``destroy_process_group`` would, without a default group.

    ``init_process_group`` names the default group from a counter it advances first
    (``_world.group_count``); only destroying the default group resets it. An abort that ends
    the init before the default group is set (a peer failed meanwhile) leaves the counter at 1 on
    this rank: its next group is named "1" while the peers' is "0", they wait on different
    store keys, and every later attempt hangs until the soft timeout. Groups registered without
    a default are shut down."""
    c10d = dist.distributed_c10d
    world = c10d._world
    for pg in list(world.pg_map):
        try:
            pg.shutdown()
        except Exception:
            pass
    for registry in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config,
                     world.pg_to_tag, world.tags_to_pg, world.pg_coalesce_state):
        registry.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0


def detach_exception(exc: BaseException | None) -> BaseException | None:
    """Keep ``exc`` (type, message, chain) but let go of every frame its tracebacks reach.

    ``traceback.clear_frames`` drops the locals of the finished frames (those of the wrapped
    function); ``__traceback__ = None`` drops the frames themselves. Done for the whole
    ``__cause__``/``__context__`` chain. Returns ``exc``.
    """
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None
        stack += [e.__cause__, e.__context__]
    return exc


def freeze_what_lives() -> bool:
    """Collect once, then ``gc.freeze()``: what lives before the first attempt (modules, torch, the process's
    own set-up) moves to the permanent generation, and each restart's :func:`collect_garbage` scans only what
    the attempts made. A full collection of a process that imported torch is tens of ms of Python, every rank at
    once; at 16 ranks on this box's 2 cores it was most of an in-process restart (``health_s``). Returns
    whether this call froze first (then :func:`thaw` undoes it at the end; a freeze of the user's is left)."""
    first = gc.get_freeze_count() == 0
    gc.collect()
    gc.freeze()
    return first


def thaw(froze: bool) -> None:
    """Undo :func:`freeze_what_lives`: frozen objects that became garbage meanwhile can be collected again."""
    if froze:
        gc.unfreeze()


def collect_garbage(max_rounds: int = 20, on_round=None) -> int:
    """``gc.collect()`` until a round finds nothing (freeing one cycle can orphan another);
    returns the number of objects collected. ``on_round()`` after each round (a progress write: on
    a busy host the rounds of many ranks at once take seconds, which is no hang)."""
    total = 0
    for _ in range(max_rounds):
        n = gc.collect()
        total += n
        if on_round is not None:
            on_round()
        if n == 0:
            break
    return total


def release_cuda_cache() -> bool:
    """Return the caching allocator's free blocks to the device, if CUDA is in use and healthy.

    ``empty_cache`` frees with ``cudaFree``, which synchronizes: a synchronize first surfaces a
    sticky error (a poisoned context) here, and then the cache is left alone. Returns whether
    the cache was emptied. (A hung kernel blocks here; the hard timeout ends that rank.)"""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:
        return False
    return True


def cuda_memory() -> tuple[int | None, int | None]:
    """(peak, now) bytes allocated on the current CUDA device since the last call; the peak is reset,
    so each attempt reports its own. ``(None, None)`` when CUDA is not in use."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None, None
    try:
        peak, now = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    except Exception:
        return None, None
    return peak, now


def barrier_devices(pg) -> list[torch.device]:
    """One device per distinct backend of ``pg``, to address a barrier to each: ``cpu`` for gloo,
    the bound device for NCCL (an NCCL part never bound was never connected: nothing in flight)."""
    pairs = [item.split(":", 1) for item in str(dist.get_backend_config(pg)).split(",") if ":" in item]
    pairs.sort(key=lambda p: p[0] != "cpu")  # cpu first: a gloo backend serving cuda too is reached there
    devices, seen = [], set()
    for device_type, backend in pairs:
        if backend in seen:
            continue
        device = torch.device("cpu") if device_type == "cpu" else pg.bound_device_id
        if device is not None and device.type == device_type:
            devices.append(device)
            seen.add(backend)
    return devices


def drain_and_destroy(timeout: float) -> str | None:
    """Every rank returned: a barrier on each backend of the default group (bounded by ``timeout``
    s; it completes only once every collective queued before it has), then destroy the group and join
    the threads of every group no one holds any more.
    Returns the barrier's error as text, or ``None``; the group is destroyed either way."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    error = None
    try:
        pg = dist.group.WORLD
        for device in barrier_devices(pg):
            opts = dist.BarrierOptions()
            opts.device, opts.timeout, opts.asyncOp = device, timedelta(seconds=timeout), True
            pg.barrier(opts=opts).wait(timedelta(seconds=timeout))
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()
        join_group_threads()
    return error
