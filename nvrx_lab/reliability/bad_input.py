"""Bad input, end to end: every entry point refuses it clearly, writes nothing and loses nothing
=================================================================================================

Each trial runs a real command line (the trainer, the launcher, the EKS renderer) or calls the
checkpoint API on a prepared folder, then checks three things:

* the exit code is non-zero (an API call raises);
* the message names the flag, key, field or path, and what would be valid;
* the working folder is byte for byte what it was: nothing half-written, nothing already saved lost.

A folder that holds another model's checkpoint is the interesting one: the trainer must fail on the
load, naming the checkpoint and the mismatching tensor, and must not save over it.
"""

from __future__ import annotations

import hashlib
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nvrx_lab.reliability import Row, timed
from nvrx_lab.runner import Launcher, Value, flags_of, flat, run, trainer

RENDER = [sys.executable, "-m", "nvrx_lab.eks", "render"]


def train(**flags: Value) -> list[str]:
    """The trainer alone (a world of one), small, with ``flags``."""
    return trainer(log_every=0, global_batch=4, seq_len=32, **flags).argv()


def launch(**flags: Value) -> list[str]:
    """The launcher with ``flags`` and one worker, ``x.py`` (never started: the flags are refused first). The flags
    are written as given: a bad value must reach the launcher's own parser (:class:`Launcher` would refuse it)."""
    return [*Launcher.of(nproc_per_node=1).argv([]), *flat(flags_of(flags.items())), "x.py"]


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under ``root`` with its content hash: what "nothing changed" means."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def prepare(work: Path) -> None:
    """The folders the trials point at: another model's checkpoint, a foreign folder, a file, a YAML."""
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "other_model").exists():
        run(train(steps=2, ckpt="sync", ckpt_interval=2, dim=64, hidden_dim=172, ckpt_dir=work / "other_model"),
            timeout=300).check()
    (work / "foreign").mkdir(exist_ok=True)
    (work / "foreign" / "model.pt").write_bytes(b"someone else's weights")
    (work / "a_file").write_text("not a folder")
    (work / "typo.yaml").write_text("heartbeat_timout: 3\n")
    (work / "list.yaml").write_text("- a\n")
    (work / "empty").mkdir(exist_ok=True)
    (work / "plain_dcp" / "step_00000005").mkdir(parents=True, exist_ok=True)  # dcp.save's, no manifest
    (work / "plain_dcp" / "step_00000005" / ".metadata").write_bytes(b"not ours")


def cases(work: Path) -> list[tuple[str, list[str], list[str]]]:
    """(name, command, substrings the message must hold)."""
    w = str(work)
    return [
        ("trainer: negative --steps", train(steps=-1), ["--steps must be >= 0"]),
        ("trainer: --device tpu", train(device="tpu"), ["--device", "choose from"]),
        ("trainer: negative --local-ckpt-interval", train(ckpt="sync", ckpt_dir=f"{w}/new", local_ckpt_interval=-1),
         ["--local-ckpt-interval must be >= 0"]),
        ("trainer: local checkpoints without storage", train(local_ckpt_interval=1),
         ["--local-ckpt-interval needs --ckpt sync|async"]),
        ("trainer: async without a folder", train(ckpt="async"), ["--ckpt async needs --ckpt-dir"]),
        ("trainer: writer I/O class", train(ckpt="async", ckpt_dir=f"{w}/new", ckpt_writer_ionice="rt"),
         ["--ckpt-writer-ionice must be one of", "best-effort:7", "'rt'"]),
        ("trainer: --ckpt-interval 0", train(ckpt="sync", ckpt_dir=f"{w}/new", ckpt_interval=0),
         ["--ckpt-interval must be >= 1"]),
        ("trainer: fault schedule", train(faults="1:x:hang"), ["--faults entry '1:x:hang'", "integers"]),
        ("trainer: fault phase", train(faults="1:3:hang:later"), ["phase 'later'", "step, save, load"]),
        ("trainer: soft > hard timeout", train(soft_timeout=5, hard_timeout=2),
         ["--soft-timeout (5.0) <= --hard-timeout (2.0)"]),
        ("trainer: launcher mode without launcher", train(restart="launcher"), ["python -m nvrx_lab.launcher"]),
        ("ckpt dir: a file", train(ckpt="sync", ckpt_dir=f"{w}/a_file"), ["--ckpt-dir", "a_file", "is a file"]),
        ("trainer: fault beyond --steps", train(steps=20, faults="0:25:hang"),
         ["0:25:hang", "outside this run's steps 1..20"]),
        ("trainer: fault on a rank outside the world", train(faults="1:2:exception"),
         ["1:2:exception", "rank 1 is not in this world of 1"]),
        ("ckpt dir: not a checkpoint", train(ckpt="sync", ckpt_dir=f"{w}/foreign"),
         ["not a folder this trainer saved to", "model.pt"]),
        ("ckpt dir: an uncommitted step folder", train(ckpt="sync", ckpt_dir=f"{w}/plain_dcp"),
         ["step_00000005/ (not committed: no nvrx_commit.json)"]),
        ("ckpt dir: another model's", train(steps=4, ckpt="sync", ckpt_dir=f"{w}/other_model"),
         ["other_model", "another run", "--dim 128 (the run has 64)", "--hidden-dim 344 (the run has 172)"]),
        ("ckpt dir: another seed", train(steps=4, seed=7, dim=64, hidden_dim=172, ckpt="sync", ckpt_dir=f"{w}/other_model"),
         ["--seed 7 (the run has 0)"]),
        ("launcher: negative heartbeat timeout", launch(heartbeat_timeout=-1), ["--heartbeat-timeout"]),
        ("launcher: missing YAML", launch(config=f"{w}/missing.yaml"), ["missing.yaml", "cannot read"]),
        ("launcher: YAML typo", launch(config=f"{w}/typo.yaml"),
         ["unknown key 'heartbeat_timout'", "valid keys: ", " heartbeat_timeout,"]),  # the list, sorted
        ("launcher: YAML not a mapping", launch(config=f"{w}/list.yaml"), ["expected a mapping"]),
        ("JobSpec: 0 nodes", [*RENDER, "--out", f"{w}/manifests", "--nodes", "0"], ["JobSpec.nodes", ">= 1"]),
        ("JobSpec: unknown instance", [*RENDER, "--out", f"{w}/manifests", "--instance-type", "p9.huge"],
         ["JobSpec.instance_type", "p5.48xlarge"]),
        ("JobSpec: empty image", [*RENDER, "--out", f"{w}/manifests", "--image", ""], ["JobSpec.image", "non-empty"]),
    ]


def api_cases(work: Path) -> list[tuple[str, callable, list[str]]]:
    """Checkpoint API calls on bad folders: (name, call, substrings of the error)."""
    import torch

    from nvrx_lab.checkpoint import AsyncCheckpointer

    def load(folder: str, state: dict | None = None):
        return lambda: AsyncCheckpointer(work / folder, start_writer=False).load(state or {"w": torch.zeros(1)})

    return [
        ("load: missing folder", load("missing"), ["missing", "does not exist"]),
        ("load: empty folder", load("empty"), ["empty", "nothing saved yet"]),
        ("load: not a checkpoint", load("foreign"), ["not a checkpoint directory", "model.pt"]),
        ("load: another model's", load("other_model", {"model": {"embed.weight": torch.zeros(3)}}),
         ["other_model", "step_00000002"]),
    ]


def _command(cmd: list[str], work: Path):
    """An attempt that runs ``cmd``: (refused, what it printed)."""
    def attempt() -> tuple[bool, str]:
        res = run(cmd, timeout=120, cwd=work)
        return res.returncode != 0 and not res.timed_out, f"exit {res.returncode}: {res.output}"
    return attempt


def _call(fn):
    """An attempt that calls ``fn``: (refused, the error)."""
    def attempt() -> tuple[bool, str]:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            return True, f"{type(e).__name__}: {e}"
        return False, "no error raised"
    return attempt


def bad_input(work: Path, only: tuple[str, ...] = ()) -> Row:
    """Every case, or those whose name starts with one of ``only`` (e.g. ``("ckpt dir", "load")``)."""
    row = Row("bad input", "non-zero exit naming the field or path and what is valid; nothing written or lost")
    with timed(row):
        prepare(work)
        attempts = ([(name, _command(cmd, work), needles) for name, cmd, needles in cases(work)]
                    + [(name, _call(fn), needles) for name, fn, needles in api_cases(work)])
        attempts = [a for a in attempts if not only or a[0].startswith(only)]
        before = snapshot(work)

        def judge(case) -> tuple[bool, str]:
            name, attempt, needles = case
            refused, text = attempt()
            missing = [n for n in needles if n not in text]
            changed = sorted(set(snapshot(work).items()) ^ set(before.items()))  # by this trial or the one beside it
            return (refused and not missing and not changed,
                    f"{name}: refused {refused}, message lacks {missing}, changed {changed[:3]}: {text[-300:]}")

        with ThreadPoolExecutor(2) as pool:  # each trial is a fresh interpreter importing torch: two at a time
            for ok, why in pool.map(judge, attempts):
                row.check(ok, why)
    return row


__all__ = ["bad_input", "cases", "snapshot"]
