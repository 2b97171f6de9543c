"""One training attempt: build, resume, step, save (:func:`train`).

The layers join it through one :class:`~nvrx_lab.train.hooks.Hooks` object and a checkpointer;
:mod:`nvrx_lab.train.layers` builds both from the flags, and :mod:`nvrx_lab.train.attempts` runs the attempt
plainly or inside the in-process restart wrapper. Same seed and world size give the same loss curve bit for
bit; a resumed run continues it exactly.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from nvrx_lab.checkpoint import CheckpointError
from nvrx_lab.dist import DistContext
from nvrx_lab.observe.events import EventLog
from nvrx_lab.train import runs
from nvrx_lab.train.config import TrainConfig, check_config
from nvrx_lab.train.data import SyntheticTokens
from nvrx_lab.train.hooks import ComposeHooks, Hooks
from nvrx_lab.train.resume import PREFIX, ProgressMarker, resume, start_line, starting, wait_for_writer
from nvrx_lab.train.state import TrainState, build_model


def train(cfg: TrainConfig, ctx: DistContext, events: EventLog, checkpointer=None, hooks: Hooks | None = None) -> dict:
    """One training attempt on an initialised process group; returns a summary.

    ``checkpointer`` follows :class:`nvrx_lab.checkpoint.AsyncCheckpointer`'s API: the attempt resumes
    from its ``latest_step()`` and saves every ``cfg.ckpt_interval`` steps (``cfg.ckpt`` sync or async).
    ``hooks`` (:class:`nvrx_lab.train.hooks.Hooks`) hear of every moment of the attempt. Rank 0 says where the
    attempt starts from in one console line (:mod:`nvrx_lab.train.resume`).
    """
    hooks = ComposeHooks(hooks)
    check_config(cfg, ctx.world_size)
    model = build_model(cfg, ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, cfg.global_batch, seed=cfg.seed)
    state = TrainState(model, optimizer, data, hooks)
    hooks.progress()
    restored = resume(state, checkpointer, ctx, events, hooks) if checkpointer is not None else None
    start = starting(cfg, ctx, restored)
    if start is not None and (line := start.before_training()):
        print(f"{PREFIX} {line}", flush=True)
    if cfg.ckpt == "async" and cfg.ckpt_wait_writer and restored is None:  # a restart trains while its writer starts
        wait_for_writer(checkpointer, hooks)
    start_line(ctx, hooks)
    marker = ProgressMarker(path) if ctx.rank == 0 and (path := runs.progress_file(cfg)) else None
    losses: list[float] = []
    try:
        while state.step < cfg.steps:
            step = state.step + 1
            hooks.before_step(step)
            loss, began = train_step(cfg, ctx, events, state, step, marker)
            losses.append(loss)
            if len(losses) == 1 and start is not None and (said := start.after_first_step(began)):
                print(f"{PREFIX} {said[0]}", flush=True)
                events.emit("recovered", step=step, **said[1])
            hooks.after_step(step)
            hooks.progress()
            if checkpointer is not None:
                if cfg.ckpt == "async" and len(losses) == 1:  # the optimizer has its state now
                    checkpointer.prepare(state.state_dict())  # the first save then blocks no longer than the later ones
                checkpoint_step(cfg, ctx, state, checkpointer, hooks)
    finally:
        if marker is not None:
            marker.close()
    if checkpointer is not None:
        with hooks.section("checkpoint_finalize"):
            checkpointer.finalize_async_save(blocking=True)
    return {"steps": state.step, "losses": losses, "world_size": ctx.world_size}


def train_step(cfg: TrainConfig, ctx: DistContext, events: EventLog, state: TrainState, step: int,
               marker: ProgressMarker | None = None) -> tuple[float, float]:
    """Forward, backward, optimizer step, and the loss averaged over ranks (rank 0 logs it and marks the step
    reached); returns the loss and the wall-clock moment the step began (its event's ``t - step_time``)."""
    t0 = time.perf_counter()
    inputs, targets = (t.to(ctx.device) for t in state.data.next_batch(ctx.rank, ctx.world_size))
    logits = state.model(inputs)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    if cfg.step_sleep:
        time.sleep(cfg.step_sleep)
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    global_loss = (global_loss / ctx.world_size).item()
    state.step = step
    step_time, t = time.perf_counter() - t0, time.time()
    if ctx.rank == 0:
        tokens = cfg.global_batch * cfg.seq_len
        events.emit("step", t=t, step=step, loss=global_loss, step_time=step_time, tokens_per_s=tokens / step_time)
        if marker is not None:
            marker.write(step, t, t - step_time)
        if cfg.log_every and step % cfg.log_every == 0:
            print(f"step {step:5d}  loss {global_loss:.4f}  {step_time * 1e3:7.1f} ms", flush=True)
    return global_loss, t - step_time


def checkpoint_step(cfg: TrainConfig, ctx: DistContext, state: TrainState, checkpointer, hooks: Hooks) -> None:
    """Save on the intervals (storage, local); commit whatever finished (a failed save is reported, training
    goes on)."""
    if state.step % cfg.ckpt_interval == 0:
        with hooks.section("checkpoint"):
            (checkpointer.save if cfg.ckpt == "sync" else checkpointer.async_save)(state.state_dict(), step=state.step)
            hooks.during("save", state.step)
        hooks.after_save()
    if cfg.local_ckpt_interval and state.step % cfg.local_ckpt_interval == 0:
        with hooks.section("checkpoint_local"):
            checkpointer.save_local(state.local_state_dict(), state.step)
    try:  # in its own section: an in-process restart must not fall between a commit and its event
        with hooks.section("checkpoint_commit"):
            checkpointer.finalize_async_save(blocking=False)
    except CheckpointError as e:  # already in the event stream; the previous checkpoint is intact
        print(f"[rank {ctx.rank}] checkpoint failed, training goes on: {e}", file=sys.stderr, flush=True)
