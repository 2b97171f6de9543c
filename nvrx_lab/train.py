"""The trainer: a small Llama-style decoder sharded with FSDP2, on synthetic deterministic data.

Single process (a world of one)::

    python -m nvrx_lab.train --steps 20 --metrics build/metrics.jsonl

Two ranks on CPU (gloo), or eight GPUs of a p5 node (NCCL) with the very same command::

    python -m torch.distributed.run --nproc-per-node 2 -m nvrx_lab.train --steps 20

Multi-node: torchrun's ``--nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT``, or
``python -m nvrx_lab.launcher`` (in-job restarts). Every flag comes from :class:`TrainConfig`.

:func:`train` is one attempt: build, resume, step, save. The layers join it through one
:class:`~nvrx_lab.hooks.Hooks` object and a checkpointer; :mod:`nvrx_lab.layers` builds both from the
flags, and :mod:`nvrx_lab.attempts` runs the attempt plainly or inside the in-process restart wrapper.
Same seed and world size give the same loss curve bit for bit; a resumed run continues it exactly.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from nvrx_lab import attempts, layers, runs
from nvrx_lab.checkpoint import CheckpointError
from nvrx_lab.cli import parse_dataclass
from nvrx_lab.config import TrainConfig, check_config, model_config
from nvrx_lab.data import SyntheticTokens
from nvrx_lab.dist import DistContext, device_mesh, env_rank, peer_lost
from nvrx_lab.events import EventLog, last_launch, read_events
from nvrx_lab.goodput import analyze
from nvrx_lab.hooks import ComposeHooks, Hooks
from nvrx_lab.model import Transformer
from nvrx_lab.resume import PREFIX, ProgressMarker, resume, start_line, starting, wait_for_writer

__all__ = ["TrainConfig", "TrainState", "build_model", "main", "train"]


def configure_threads(cfg: TrainConfig) -> None:
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local_world))


def build_model(cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    """Same initial weights on every rank (seeded), then ``fully_shard`` per block and the root, on a mesh
    of this device type (FSDP2's default mesh takes the accelerator whenever one exists, --device cpu too)."""
    torch.manual_seed(cfg.seed)
    model = Transformer(model_config(cfg)).to(device)
    mesh = device_mesh(device) if dist.is_initialized() else None
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class TrainState:
    """Everything a resume needs, as a (DCP-shardable) state dict: weights, optimizer, data position, step,
    and the state of hooks that keep some (the launcher's computed timeouts, under ``"monitor"``)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: SyntheticTokens,
                 hooks: Hooks | None = None):
        self.model, self.optimizer, self.data, self.hooks = model, optimizer, data, hooks or ComposeHooks()
        self.step = 0

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "data": self.data.state_dict(), "step": self.step,
                **(self.hooks.state_dict() or {})}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self._load_rest(state)

    def local_state_dict(self) -> dict:
        """The same state as it lives in this rank's memory, for local snapshots (same world, same model): the
        parameters' and the optimizer's own tensors, no FQN mapping (0.2 ms here; ``get_state_dict`` 3.8 ms)."""
        params = dict(self.model.named_parameters())
        if any(p.requires_grad and p not in self.optimizer.state for p in params.values()):
            get_state_dict(self.model, self.optimizer)  # a fresh optimizer: DCP gives it its state (a step at lr 0)
        return {"model": {**params, **dict(self.model.named_buffers())},
                "optim": {"state": {n: self.optimizer.state[p] for n, p in params.items() if p in self.optimizer.state},
                          "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]},
                "data": self.data.state_dict(), "step": self.step, **(self.hooks.state_dict() or {})}

    def load_local_state_dict(self, state: dict) -> None:
        """After a snapshot was copied into :meth:`local_state_dict`'s tensors in place: the rest."""
        for group, saved in zip(self.optimizer.param_groups, state["optim"]["param_groups"], strict=True):
            group.update(saved)
        self._load_rest(state)

    def _load_rest(self, state: dict) -> None:
        self.data.load_state_dict(state["data"])
        self.step = int(state["step"])
        self.hooks.load_state_dict(state)


def train(cfg: TrainConfig, ctx: DistContext, events: EventLog, checkpointer=None, hooks: Hooks | None = None) -> dict:
    """One training attempt on an initialised process group; returns a summary.

    ``checkpointer`` follows :class:`nvrx_lab.checkpoint.AsyncCheckpointer`'s API: the attempt resumes
    from its ``latest_step()`` and saves every ``cfg.ckpt_interval`` steps (``cfg.ckpt`` sync or async).
    ``hooks`` (:class:`nvrx_lab.hooks.Hooks`) hear of every moment of the attempt. Rank 0 says where the
    attempt starts from in one console line (:mod:`nvrx_lab.resume`).
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


def left_job(error: BaseException) -> str | None:
    """The line of a rank the in-process restart sent away (its health check failed: a straggler, a poisoned GPU)."""
    from nvrx_lab.inprocess import HealthCheckError

    if isinstance(error, HealthCheckError):
        return f"left the job at the in-process restart ({error}); the other ranks go on without it"
    return None


def main(argv: list[str] | None = None) -> int:
    cfg = parse_dataclass(TrainConfig, argv, prog="python -m nvrx_lab.train", description=__doc__.split("\n\n")[0])
    rank, world_size, _ = env_rank()
    restart_count = layers.launcher_restart_count()
    try:
        layers.check_flags(cfg, world_size)
        new_run = runs.begin(cfg, rank, restart_count, [runs.fault_state_file(cfg), runs.progress_file(cfg)])
    except ValueError as e:  # exit 2: a usage error, which no restart mends (the launcher does not retry it)
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.restart.endswith("inprocess"):
        os.environ.update(layers.INPROCESS_NCCL_ENV)  # torchrun sets =1: NCCL's watchdog would kill the process
    configure_threads(cfg)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; else CUDA matmuls raise
    torch.use_deterministic_algorithms(True)
    events = EventLog(cfg.metrics or None, rank=rank)
    events.emit("start", world_size=world_size, restart_count=restart_count, new_run=new_run, pid=os.getpid())
    hooks = layers.make_hooks(cfg, rank, events)
    run = attempts.run_inprocess if cfg.restart.endswith("inprocess") else attempts.run_plain
    try:
        summary = run(cfg, events, hooks, lambda ctx, ckpt, h: train(cfg, ctx, events, ckpt, h))
    except CheckpointError as e:  # e.g. another model's checkpoint: no restart mends it
        print(f"[rank {rank}] error: {e}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:  # a peer's fault seen from here, or this rank sent away: one line, not a traceback
        if (line := peer_lost(e) or left_job(e)) is None:
            raise
        print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"[rank {rank}] interrupted (Ctrl-C): a save in flight was abandoned; the newest committed "
              f"checkpoint{' in ' + cfg.ckpt_dir if cfg.ckpt_dir else ''} is intact", file=sys.stderr, flush=True)
        return 130
    events.emit("end", steps=summary["steps"],  # the last attempt's peak (gpucheck c); earlier ones: restart events
                cuda_peak_bytes=torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None)
    if rank == 0 and cfg.metrics and summary["losses"]:  # one line a job log collector (nvrx_lab.eks.submit) picks up
        print("GOODPUT " + json.dumps(analyze(last_launch(read_events(cfg.metrics))).row()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
