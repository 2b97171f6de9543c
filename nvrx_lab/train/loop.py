"""One training attempt: build, resume, step, save (:func:`train`).

The layers join it through one :class:`~nvrx_lab.train.hooks.Hooks` object and one
:class:`~nvrx_lab.checkpoint.Checkpointer`, which decides at each step whether to save and where;
:mod:`nvrx_lab.train.layers` builds both from the flags, and :mod:`nvrx_lab.train.attempts` runs the attempt
plainly or inside the in-process restart wrapper. Same seed and world size give the same loss curve bit for
bit; a resumed run continues it exactly.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from nvrx_lab.checkpoint import Checkpointer
from nvrx_lab.train import runs
from nvrx_lab.train.config import TrainConfig, check_config
from nvrx_lab.train.data import token_source
from nvrx_lab.train.hooks import Attempt, ComposeHooks, Hooks
from nvrx_lab.train.resume import PREFIX, ProgressMarker, resume, start_line, starting
from nvrx_lab.train.sizing import Sizer
from nvrx_lab.train.state import TrainState, build_model


def train(cfg: TrainConfig, attempt: Attempt, checkpointer: Checkpointer | None = None, hooks: Hooks | None = None) -> dict:
    """One training attempt on an initialised process group; returns a summary.

    ``checkpointer`` restores the newest state at the start and decides after each step whether it saves;
    ``hooks`` hear of every moment of the attempt. Rank 0 says where the attempt starts from in one console
    line (:mod:`nvrx_lab.train.resume`)."""
    hooks = ComposeHooks(hooks)
    check_config(cfg, attempt.world_size)
    size = Sizer(cfg, attempt)
    model = build_model(cfg, attempt.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data = token_source(cfg)
    state = TrainState(model, optimizer, data, hooks)
    hooks.progress()
    restored = resume(state, checkpointer, attempt, hooks) if checkpointer is not None else None
    if checkpointer is not None:
        hooks.resumed(state.step)  # the in-process no-progress count (nvrx_lab.inprocess.progress)
    start = starting(cfg, attempt, restored)
    if start is not None and (line := start.before_training()):
        print(f"{PREFIX} {line}", flush=True)
    if checkpointer is not None and cfg.checkpoint.wait_writer and restored is None:  # a restart trains at once
        checkpointer.start_writer(hooks)
    start_line(attempt, hooks)
    marker = ProgressMarker(path) if attempt.rank == 0 and (path := runs.progress_file(cfg)) else None
    losses: list[float] = []
    try:
        while state.step < cfg.steps:
            step = state.step + 1
            hooks.before_step(step)
            loss, began = train_step(cfg, attempt, state, step, marker)
            losses.append(loss)
            if len(losses) == 1 and start is not None and (said := start.after_first_step(began)):
                print(f"{PREFIX} {said[0]}", flush=True)
                attempt.events.emit("recovered", step=step, **said[1])
            hooks.after_step(step)
            hooks.progress()
            if checkpointer is not None:
                checkpointer.save(state, step, hooks)
    finally:
        if marker is not None:
            marker.close()
    if checkpointer is not None:
        checkpointer.finish(hooks)
    size.measured()
    return {"steps": state.step, "losses": losses, "world_size": attempt.world_size}


def train_step(cfg: TrainConfig, attempt: Attempt, state: TrainState, step: int,
               marker: ProgressMarker | None = None) -> tuple[float, float]:
    """Forward, backward, optimizer step, and the loss averaged over ranks (rank 0 logs it and marks the step
    reached); returns the loss and the wall-clock moment the step began (its event's ``t - step_time``)."""
    t0 = time.perf_counter()
    inputs, targets = (t.to(attempt.device) for t in state.data.next_batch(attempt.rank, attempt.world_size))
    logits = state.model(inputs)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    if cfg.step_sleep:
        time.sleep(cfg.step_sleep)
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    global_loss = (global_loss / attempt.world_size).item()
    state.step = step
    step_time, t = time.perf_counter() - t0, time.time()
    if attempt.rank == 0:
        tokens = cfg.global_batch * cfg.model.seq_len
        attempt.events.emit("step", t=t, step=step, loss=global_loss, step_time=step_time,
                            tokens_per_s=tokens / step_time)
        if marker is not None:
            marker.write(step, t, t - step_time)
        if cfg.log_every and step % cfg.log_every == 0:
            print(f"step {step:5d}  loss {global_loss:.4f}  {step_time * 1e3:7.1f} ms", flush=True)
    return global_loss, t - step_time
