"""One run, one record: what makes a launch a new run or the continuation of one.

A launch continues a run when it is a restart of it: the launcher's (``TORCHELASTIC_RESTART_COUNT`` > 0;
an in-process restart never comes back here), a new launch onto a checkpoint folder that holds committed
steps (the same command again continues the run, and says "nothing to train" once it is done), or a
launch with the ``--run-id`` the run was started with (a Kubernetes pod restart: the manifests and the
goodput bench's pod-restart baseline pass the job's name). ``--fresh`` makes a first launch a new run even
there: rank 0 removes the folder's committed checkpoints first, saying so. Anything else is a **new
run**, and then:

* its events start a new segment of the ``--metrics`` file: every ``start`` event says ``new_run``,
  and :func:`nvrx_lab.observe.events.last_run` (what goodput reads) keeps only the newest run;
* faults fired by an earlier run are forgotten (rank 0 clears the fired-faults file before the
  process group exists, so before any fault can fire);
* rank 0 records the run (``run.json`` beside the checkpoints, else beside the metrics: run id, seed,
  model shape, batch), and a later launch that would resume with another identity is a usage error
  naming the flag, instead of a traceback from deep inside ``load_state_dict``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from nvrx_lab.cli import make_folder

if TYPE_CHECKING:
    from nvrx_lab.train.config import TrainConfig

RUN_FILE = "run.json"
FAULTS_FIRED = "faults_fired.jsonl"
PROGRESS = "progress"


def progress_file(cfg: TrainConfig) -> Path | None:
    """Where rank 0 marks the newest step reached (:class:`nvrx_lab.train.resume.ProgressMarker`): beside the
    checkpoints, else beside the metrics."""
    if (folder := ckpt_dir(cfg)) is not None and not _per_group(cfg):
        return folder / PROGRESS
    return Path(cfg.metrics).with_suffix(".progress") if cfg.metrics else None


def fault_state_file(cfg: TrainConfig) -> Path | None:
    """Where fired faults are remembered across restarts: beside the checkpoints, else beside the metrics."""
    if cfg.checkpoint.storage.directory and not _per_group(cfg):
        return Path(cfg.checkpoint.storage.directory) / FAULTS_FIRED
    if cfg.metrics:
        return Path(cfg.metrics).with_suffix(".faults.jsonl")
    return None


IDENTITY = ("seed", "data", "vocab_size", "seq_len", "global_batch", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim",
            "tie_embeddings", "rope_theta", "rope_scaling", "norm_eps")
"""Flags a resumed run must keep: the checkpointed state and the token stream depend on them."""


def _per_group(cfg: TrainConfig) -> bool:
    """Replica groups share one checkpoint folder: each keeps its fired faults and progress beside its own metrics."""
    return cfg.restart.mode == "replicas" and bool(cfg.metrics)


def identity(cfg: TrainConfig) -> dict:
    """The values of :data:`IDENTITY`, by flag name (``run.json``'s keys)."""
    values = {"seed": cfg.seed, "data": cfg.data, "global_batch": cfg.global_batch, **dataclasses.asdict(cfg.model)}
    return {name: values[name] for name in IDENTITY}


def ckpt_dir(cfg: TrainConfig) -> Path | None:
    """The checkpoint folder, where the run's own files live; None without checkpoints."""
    return Path(cfg.checkpoint.storage.directory) if cfg.checkpoint.enabled else None


def run_file(cfg: TrainConfig) -> Path | None:
    if (folder := ckpt_dir(cfg)) is not None:
        return folder / RUN_FILE
    return Path(cfg.metrics).with_suffix(".run.json") if cfg.metrics else None


def recorded(cfg: TrainConfig) -> dict:
    path = run_file(cfg)
    try:
        return json.loads(path.read_text()) if path is not None and path.exists() else {}
    except (OSError, json.JSONDecodeError):
        return {}  # unreadable: the loader's own checks still stand


def is_new_run(cfg: TrainConfig, restart_count: int) -> bool:
    from nvrx_lab.checkpoint.commit import committed_steps

    if restart_count > 0 or ((folder := ckpt_dir(cfg)) is not None and committed_steps(folder)):
        return False
    return not (cfg.run_id and recorded(cfg).get("run_id") == cfg.run_id)


def check_resume(cfg: TrainConfig) -> None:
    """Raise ``ValueError`` naming each flag that differs from the run the checkpoints belong to."""
    saved = recorded(cfg)
    mine = identity(cfg)
    shown = lambda v: v if v != "" else "'' (synthetic tokens)"  # noqa: E731 - --data's empty value
    differ = [f"--{k.replace('_', '-')} {shown(mine[k])} (the run has {shown(saved[k])})"
              for k in IDENTITY if k in saved and saved[k] != mine[k]]
    if differ:
        raise ValueError(f"{run_file(cfg).parent} holds the record of another run: {', '.join(differ)}; "
                         "resume with the run's values, or pass a new --ckpt-dir (or --metrics)")


def begin(cfg: TrainConfig, rank: int, restart_count: int, run_files: list[Path | None]) -> bool:
    """Check a continuation and, for a new run, reset what an earlier run left (``run_files``: the fired
    faults, the progress marker); returns ``new_run``."""
    fresh = cfg.fresh and restart_count == 0
    if cfg.metrics:  # every rank's event log writes there
        make_folder(Path(cfg.metrics).absolute().parent, "--metrics", cfg.metrics)
    if (folder := ckpt_dir(cfg)) is not None:
        make_folder(folder, "--ckpt-dir")
    new_run = fresh or is_new_run(cfg, restart_count)
    if not new_run:
        check_resume(cfg)
    elif rank == 0:
        if fresh and (folder := ckpt_dir(cfg)) is not None:
            discard_run(folder)
        for path in run_files:
            if path is not None:
                path.unlink(missing_ok=True)
        if (path := run_file(cfg)) is not None:
            part = path.with_name(path.name + f".{os.getpid()}.part")
            # nonce: what local checkpoints (in node memory, outliving the job) are told apart by
            part.write_text(json.dumps({"run_id": cfg.run_id, "nonce": uuid.uuid4().hex, **identity(cfg)}))
            os.replace(part, path)
    return new_run


def discard_run(folder: Path) -> list[int]:
    """``--fresh``: remove the committed checkpoints of the run in ``folder`` (one console line); returns their steps."""
    from nvrx_lab.checkpoint.commit import committed_steps, discard, step_dir

    steps = committed_steps(folder)
    for step in steps:
        discard(step_dir(folder, step))
    if steps:
        print(f"[nvrx_lab] --fresh: removed the {len(steps)} committed checkpoint{'s' if len(steps) > 1 else ''} of the "
              f"previous run in {folder} (step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))})", flush=True)
    return steps


def done_step(cfg: TrainConfig) -> int | None:
    """The newest committed step of ``--ckpt-dir`` when it is ``--steps`` or more (the run is done), else None; read by
    every rank alike from the files (a commit never changes), before torch builds anything: a rerun of a finished
    run says DONE in seconds, not after the model was built and the checkpoint loaded."""
    if (folder := ckpt_dir(cfg)) is None or not cfg.checkpoint.enabled:
        return None
    from nvrx_lab.checkpoint.loading import latest_step

    step = latest_step(folder, full=False, rank=0, group=None, world=1, fallback=lambda *_: None)
    return step if step is not None and step >= cfg.steps else None
