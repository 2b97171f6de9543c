"""The trainer: a small Llama-style decoder sharded with FSDP2, on synthetic deterministic data.

Single process (a world of one)::

    python -m nvrx_lab.train --steps 20 --metrics build/metrics.jsonl

Two ranks on CPU (gloo), or eight GPUs of a p5 node (NCCL) with the very same command::

    python -m torch.distributed.run --nproc-per-node 2 -m nvrx_lab.train --steps 20

Multi-node: torchrun's ``--nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT``, or
``python -m nvrx_lab.launcher`` (in-job restarts). Every flag comes from :class:`TrainConfig`.

The layers plug in as plain arguments of :func:`train`: a checkpointer, callables run before
and after each step (fault injection, heartbeats, progress pings) and an event log. Same seed and
world size give the same loss curve bit for bit; a resumed run continues it exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from nvrx_lab import layers, runs
from nvrx_lab.checkpoint import CheckpointError
from nvrx_lab.cli import parse_dataclass
from nvrx_lab.data import SyntheticTokens
from nvrx_lab.dist import DistContext, env_rank, init_distributed, shutdown
from nvrx_lab.events import EventLog, read_events
from nvrx_lab.goodput import analyze
from nvrx_lab.model import ModelConfig, Transformer

StepHook = Callable[[int], None]


@dataclass
class TrainConfig:
    steps: int = 20
    """Optimizer steps to run in total (a resumed run stops at the same step)."""
    seed: int = 0
    """Seed of the model initialisation and of the token stream."""
    global_batch: int = 8
    """Sequences per step across all ranks; must divide by the world size."""
    seq_len: int = 64
    """Tokens per sequence."""
    vocab_size: int = 256
    """Vocabulary of the synthetic tokens and the model."""
    dim: int = 128
    """Model width."""
    n_layers: int = 2
    """Transformer blocks (each one FSDP unit)."""
    n_heads: int = 4
    """Attention heads; dim / n_heads must be even."""
    hidden_dim: int = 344
    """SwiGLU hidden width."""
    tie_embeddings: bool = True
    """Share the input embedding with the output head."""
    lr: float = 3e-3
    """AdamW learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    step_sleep: float = 0.0
    """Extra seconds per step that stand in for a bigger model's compute (benchmarks)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: this rank's GPU when CUDA is available (NCCL), else the CPU (gloo)."""
    threads: int = 0
    """Intra-op CPU threads per rank; 0 = cores / local ranks."""
    pg_timeout: float = 90.0
    """Seconds before a collective gives up; under in-process restart on GPUs it must exceed --hard-timeout
    (the wrapper, not NCCL's watchdog, decides about a hang)."""
    run_id: str = ""
    """Names the run: a launch with the run id of the run recorded beside the checkpoints (or metrics)
    continues it even before its first checkpoint (a Kubernetes pod restart); empty: a launch that
    resumes no checkpoint is a new run (nvrx_lab.runs)."""
    metrics: str = ""
    """Event stream (JSON lines: steps, saves, faults, restarts); empty = none."""
    log_every: int = 5
    """Print a progress line every N steps on rank 0 (0 = never)."""
    ckpt: Literal["none", "sync", "async"] = "none"
    """Checkpointing: none, sync (blocks every rank on storage) or async (stage, return, write in the background)."""
    ckpt_interval: int = 10
    """Save every N steps."""
    ckpt_dir: str = ""
    """Folder of the checkpoints (shared by all ranks); a run resumes from its newest committed checkpoint."""
    ckpt_keep: int = 3
    """Committed checkpoints to keep."""
    ckpt_wait_writer: bool = False
    """Async: wait for the writer process (~2 s to import torch) before the first step. Without it no save
    ever waits; one taken while the writer starts is held, and a newer one replaces it."""
    ckpt_write_bandwidth: float = 0.0
    """Cap on each rank's write speed in bytes/s, a stand-in for a loaded shared filesystem (0 = no cap)."""
    restart: Literal["none", "inprocess", "launcher", "launcher+inprocess"] = "none"
    """Recovery: inprocess (restart the training function in the same processes), launcher (heartbeats to
    nvrx_lab.launcher, which replaces dead or hung workers), or both."""
    soft_timeout: float = 30.0
    """In-process restart: seconds without progress before a rank is interrupted and restarted."""
    hard_timeout: float = 60.0
    """In-process restart: seconds without progress before a rank is killed and the others go on."""
    max_iterations: int = 10
    """In-process restart: restarts allowed before the job gives up."""
    min_world_size: int = 1
    """In-process restart: fewest ranks to go on with after a rank is lost."""
    faults: str = ""
    """Deterministic faults RANK:STEP:KIND[:PHASE],... (kinds: exception, hang, sigkill, oom; phases: step, save,
    load); each fires once."""


def configure_threads(cfg: TrainConfig) -> None:
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local_world))


def model_config(cfg: TrainConfig) -> ModelConfig:
    return ModelConfig(vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                       hidden_dim=cfg.hidden_dim, max_seq_len=cfg.seq_len, tie_embeddings=cfg.tie_embeddings)


def build_model(cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    """Same initial weights on every rank (seeded), then ``fully_shard`` per block and the root, on a mesh
    of this device type (FSDP2's default mesh takes the accelerator whenever one exists, --device cpu too)."""
    torch.manual_seed(cfg.seed)
    model = Transformer(model_config(cfg)).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),)) if dist.is_initialized() else None
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class TrainState:
    """Everything a resume needs, as a (DCP-shardable) state dict: weights, optimizer, data position, step,
    and the launcher's computed timeouts when a monitor is attached."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: SyntheticTokens, monitor=None):
        self.model, self.optimizer, self.data, self.monitor = model, optimizer, data, monitor
        self.step = 0

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        sd = {"model": model_sd, "optim": optim_sd, "data": self.data.state_dict(), "step": self.step}
        if self.monitor is not None:
            sd["monitor"] = self.monitor.state_dict()
        return sd

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.data.load_state_dict(state["data"])
        self.step = int(state["step"])
        if self.monitor is not None and state.get("monitor"):
            self.monitor.load_state_dict(state["monitor"])


def check_config(cfg: TrainConfig, world_size: int) -> None:
    if cfg.steps < 0:
        raise ValueError(f"--steps must be >= 0, got {cfg.steps}")
    if cfg.global_batch % world_size:
        raise ValueError(f"--global-batch {cfg.global_batch} does not divide by the world size {world_size}")
    if cfg.dim % cfg.n_heads or (cfg.dim // cfg.n_heads) % 2:
        raise ValueError(f"--dim {cfg.dim} / --n-heads {cfg.n_heads} must give an even head size")


def train(cfg: TrainConfig, ctx: DistContext, events: EventLog, checkpointer=None, monitor=None,
          before_step: tuple[StepHook, ...] = (), after_step: tuple[StepHook, ...] = (),
          io_section: Callable[[str], contextlib.AbstractContextManager] | None = None,
          on_resume: Callable[[float], None] | None = None, progress: Callable[[], None] | None = None,
          during: Callable[[str, int], None] | None = None) -> dict:
    """One training attempt on an initialised process group; returns a summary.

    ``checkpointer`` follows :class:`nvrx_lab.checkpoint.AsyncCheckpointer`'s API: the attempt resumes
    from its ``latest_step()`` and saves every ``cfg.ckpt_interval`` steps (``cfg.ckpt`` sync or async).
    ``monitor`` (:class:`nvrx_lab.layers.Monitor`) gets a heartbeat per step and a section around
    checkpoint I/O (``checkpoint_load``, ``checkpoint``, ``checkpoint_finalize``). ``before_step`` and
    ``after_step`` are called with the step number; ``io_section(name)`` wraps checkpoint I/O (a restart
    must not cut it); ``on_resume(load_s)`` hears of a reload; ``progress()`` is called whenever the
    attempt moves on (model built, state loaded, each step). ``during(phase, step)`` is called inside
    the checkpoint I/O (``"load"`` once read, ``"save"`` once handed over): fault injection's hook.
    """
    progress = progress or (lambda: None)
    during = during or (lambda phase, step: None)
    check_config(cfg, ctx.world_size)
    model = build_model(cfg, ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, cfg.global_batch, seed=cfg.seed)
    state = TrainState(model, optimizer, data, monitor)
    progress()
    section = io_section or (monitor.section if monitor is not None else (lambda name: contextlib.nullcontext()))
    if checkpointer is not None and (resume := checkpointer.latest_step()) is not None:
        t0 = time.perf_counter()
        with section("checkpoint_load"):
            sd = state.state_dict()
            checkpointer.load(sd, step=resume)
            during("load", resume)
            state.load_state_dict(sd)
        load_s = time.perf_counter() - t0
        events.emit("resume", step=state.step, load_s=load_s, world_size=ctx.world_size)
        if on_resume is not None:
            on_resume(load_s)
        progress()
    if checkpointer is not None and cfg.ckpt == "async" and cfg.ckpt_wait_writer:
        for _ in range(240):  # <= 120 s; waiting is progress, not a hang
            try:
                checkpointer.start(timeout=0.5)
                break
            except TimeoutError:
                progress()
    tokens_per_step = cfg.global_batch * cfg.seq_len
    losses: list[float] = []
    while state.step < cfg.steps:
        step = state.step + 1
        for hook in before_step:
            hook(step)
        t0 = time.perf_counter()
        inputs, targets = (t.to(ctx.device) for t in data.next_batch(ctx.rank, ctx.world_size))
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cfg.step_sleep:
            time.sleep(cfg.step_sleep)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss = (global_loss / ctx.world_size).item()
        state.step = step
        step_time = time.perf_counter() - t0
        losses.append(global_loss)
        if ctx.rank == 0:
            events.emit("step", step=step, loss=global_loss, step_time=step_time, tokens_per_s=tokens_per_step / step_time)
            if cfg.log_every and step % cfg.log_every == 0:
                print(f"step {step:5d}  loss {global_loss:.4f}  {step_time * 1e3:7.1f} ms", flush=True)
        if monitor is not None:
            monitor.heartbeat(step)
        progress()
        if checkpointer is not None and cfg.ckpt == "async" and not losses[:-1]:  # the optimizer has its state now
            checkpointer.prepare(state.state_dict())  # the first save then blocks no longer than the later ones
        if checkpointer is not None:
            if step % cfg.ckpt_interval == 0:
                with section("checkpoint"):
                    (checkpointer.save if cfg.ckpt == "sync" else checkpointer.async_save)(state.state_dict(), step=step)
                    during("save", step)
                if monitor is not None:
                    monitor.after_save()
            try:  # io_section: an in-process restart must not fall between a commit and its event
                with io_section("checkpoint_commit") if io_section else contextlib.nullcontext():
                    checkpointer.finalize_async_save(blocking=False)
            except CheckpointError as e:  # already in the event stream; the previous checkpoint is intact
                print(f"[rank {ctx.rank}] checkpoint failed, training goes on: {e}", file=sys.stderr, flush=True)
        for hook in after_step:
            hook(step)
    if checkpointer is not None:
        with section("checkpoint_finalize"):
            checkpointer.finalize_async_save(blocking=True)
    return {"steps": state.step, "losses": losses, "world_size": ctx.world_size}


def run_plain(cfg: TrainConfig, events: EventLog, injector, monitor) -> dict:
    """One attempt under torchrun or the launcher: whatever fails ends this process (the launcher may restart it)."""
    ctx = init_distributed(cfg.device, cfg.pg_timeout)
    checkpointer = layers.make_checkpointer(cfg, ctx, events)
    clean = False
    try:
        if monitor is not None:
            monitor.start()
        summary = train(cfg, ctx, events, checkpointer, monitor, before_step=(injector,) if injector else (),
                        during=injector.during if injector else None)
        clean = True
        return summary
    finally:
        if monitor is not None:  # first: shutting down the writer is no reason to be declared hung
            monitor.close()
        if checkpointer is not None:  # a failed or interrupted run abandons its save in flight
            checkpointer.close() if clean else checkpointer.abandon()
        shutdown(ctx, clean)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_dataclass(TrainConfig, argv, prog="python -m nvrx_lab.train", description=__doc__.split("\n\n")[0])
    rank, world_size, _ = env_rank()
    restart_count = layers.launcher_restart_count()
    try:
        layers.check_flags(cfg, world_size)
        new_run = runs.begin(cfg, rank, restart_count, layers.fault_state_file(cfg))
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
    injector = layers.make_fault_injector(cfg, rank, events)
    monitor = layers.Monitor() if cfg.restart.startswith("launcher") else None
    try:
        if cfg.restart.endswith("inprocess"):
            summary = layers.run_inprocess(cfg, events, injector, monitor)
        else:
            summary = run_plain(cfg, events, injector, monitor)
    except CheckpointError as e:  # e.g. another model's checkpoint: no restart mends it
        print(f"[rank {rank}] error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"[rank {rank}] interrupted (Ctrl-C): a save in flight was abandoned; the newest committed "
              f"checkpoint{' in ' + cfg.ckpt_dir if cfg.ckpt_dir else ''} is intact", file=sys.stderr, flush=True)
        return 130
    events.emit("end", steps=summary["steps"],  # the last attempt's peak (gpucheck c); earlier ones: restart events
                cuda_peak_bytes=torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None)
    if rank == 0 and cfg.metrics:  # one line a job log collector (nvrx_lab.eks.submit) picks up
        print("GOODPUT " + json.dumps(analyze(read_events(cfg.metrics)).row()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
