"""Programs the checkpoint cases run in a process of their own
==============================================================

Two small programs for :mod:`nvrx_lab.reliability.checkpoint`, plus the state they save.

``python -m nvrx_lab.reliability.checkpoint_child trainer DIR --mib 2 --bandwidth 4194304`` is the
trainer that :func:`~nvrx_lab.reliability.checkpoint.sigkill_trainer_mid_save` kills. It opens an
:class:`~nvrx_lab.checkpoint.AsyncCheckpointer` on ``DIR``, resumes, checks what it loaded, then saves
step after step until it is killed, printing one line per event::

    writer 1234      the pid of its writer process, so the parent can watch it die
    ready            imported, writer up; waits for a line on stdin (the parent starts the next
                     trainers while this one runs, which hides ~8 s of imports per trial)
    resumed 7        loaded step 7 and found exactly what step 7 saved ("resumed 7 MISMATCH" if not)
    saving 8         about to call async_save for step 8
    committed 8      finalize_async_save(blocking=True) committed step 8

``python -m nvrx_lab.reliability.checkpoint_child readonly DIR`` is the scenario of
:func:`~nvrx_lab.reliability.checkpoint.permission_denied`: the folder turns read-only mid-run,
once before a save and once while one is being written. Run as root, the parent starts it without
the capabilities that let root ignore file modes. It prints one JSON line per trial:
``{"ok": bool, "why": str}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
from pathlib import Path

import torch

from nvrx_lab.checkpoint import AsyncCheckpointer, CheckpointWriteError
from nvrx_lab.net import wait_for


def _numel(mib: float) -> int:
    return max(1, int(mib * (1 << 20)) // 4)


def state_at(step: int, mib: float) -> dict:
    """What step ``step`` saves: ``mib`` MiB of float32 drawn from a generator seeded with the step."""
    return {"w": torch.randn(_numel(mib), generator=torch.Generator().manual_seed(step)), "step": step}


def holds_step(state: dict, step: int, mib: float) -> bool:
    """True when ``state`` (loaded from a checkpoint) is exactly what ``step`` saved."""
    return state["step"] == step and torch.equal(state["w"], state_at(step, mib)["w"])


def blank(mib: float) -> dict:
    """A state to load into."""
    return {"w": torch.zeros(_numel(mib)), "step": -1}


def stray(folder: Path) -> list[str]:
    """Temporary or trash entries (``.tmp_step_*``, ``.trash_step_*``, ``*.part``) in ``folder``."""
    return sorted(p.name for p in Path(folder).iterdir() if p.name.startswith(".") or p.name.endswith(".part"))


def fresh(folder: Path) -> Path:
    """``folder``, empty: every case starts from nothing, even in a work folder used before."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def say(*words) -> None:
    print(*words, flush=True)


# -------------------------------------------------------------------------- the trainer that is killed
def trainer(folder: Path, mib: float, bandwidth: float) -> None:
    ckpt = AsyncCheckpointer(folder, keep_last=2, write_bandwidth=bandwidth).start()
    say("writer", ckpt.writer_pid)
    say("ready")
    sys.stdin.readline()
    step = ckpt.latest_step()
    if step is None:
        step = -1
        say("resumed none")
    else:
        state = blank(mib)
        ckpt.load(state, step=step)
        say("resumed", step, *([] if holds_step(state, step, mib) else ["MISMATCH"]))
    for nxt in range(step + 1, step + 50):  # the parent kills it long before
        state = state_at(nxt, mib)
        say("saving", nxt)
        ckpt.async_save(state, step=nxt)
        ckpt.finalize_async_save(blocking=True)
        say("committed", nxt)
    ckpt.close()


# -------------------------------------------------------------------------- the read-only folder
def _expect_denied(ckpt: AsyncCheckpointer, step: int, folder: Path) -> str | None:
    """None if finalize raises a clear "Permission denied" naming the step and a path in ``folder``."""
    try:
        ckpt.finalize_async_save(blocking=True)
    except CheckpointWriteError as e:
        if e.step != step or "Permission denied" not in str(e) or str(folder) not in str(e):
            return f"unclear error for step {step}: {e} (path {e.path})"
        return None
    return f"finalize_async_save raised nothing for step {step} in a read-only folder"


def _after_denied(ckpt: AsyncCheckpointer, folder: Path, good: int, step: int, mib: float) -> list[str]:
    """Checks once the folder is writable again: ``good`` intact, the next save (``step``) commits."""
    problems = []
    state = blank(mib)
    if ckpt.latest_step() != good or ckpt.load(state) != good or not holds_step(state, good, mib):
        problems.append(f"previous checkpoint {good} not intact (latest {ckpt.latest_step()})")
    folder.chmod(0o755)
    ckpt.async_save(state_at(step, mib), step=step)
    if ckpt.finalize_async_save(blocking=True) != [step]:
        problems.append(f"save of step {step} did not commit once the folder was writable again")
    if left := stray(folder):
        problems.append(f"stray entries after the next save: {left}")
    return problems


def readonly(folder: Path, mib: float = 0.5, bandwidth: float = 1 << 20) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with AsyncCheckpointer(folder, keep_last=3) as ckpt:
        ckpt.async_save(state_at(1, mib), step=1)
        ckpt.finalize_async_save(blocking=True)
        # 1. read-only before the save: the writer cannot create the step's temporary folder
        folder.chmod(0o555)
        try:
            (folder / ".probe").touch()
            (folder / ".probe").unlink()
            folder.chmod(0o755)
            say(json.dumps({"ok": False, "why": "this process can still write into a 0555 folder "
                                                "(root's CAP_DAC_OVERRIDE not dropped?)"}))
            return
        except PermissionError:
            pass
        ckpt.async_save(state_at(2, mib), step=2)
        problems = [p for p in [_expect_denied(ckpt, 2, folder)] if p]
        problems += _after_denied(ckpt, folder, good=1, step=3, mib=mib)
        say(json.dumps({"ok": not problems, "why": "read-only before the save: " + "; ".join(problems)}))
        # 2. read-only while the shards are written: the commit's rename is refused
        ckpt.config.write_bandwidth = bandwidth  # ~0.5 s of writing
        ckpt.async_save(state_at(4, mib), step=4)
        with contextlib.suppress(TimeoutError):  # not there after 30 s: the checks below say what happened
            wait_for(lambda: list(folder.glob(".tmp_step_00000004_*")), 30, "step 4's temporary folder", interval=0.005)
        folder.chmod(0o555)
        problems = [p for p in [_expect_denied(ckpt, 4, folder)] if p]
        ckpt.config.write_bandwidth = None
        problems += _after_denied(ckpt, folder, good=3, step=5, mib=mib)
        say(json.dumps({"ok": not problems, "why": "read-only during the save: " + "; ".join(problems)}))


def main(argv=None) -> None:
    torch.set_num_threads(1)  # the parent and the next trainers share the two cores
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("program", choices=["trainer", "readonly"])
    p.add_argument("folder", type=Path)
    p.add_argument("--mib", type=float, default=2.0)
    p.add_argument("--bandwidth", type=float, default=4 << 20)
    a = p.parse_args(argv)
    if a.program == "trainer":
        trainer(a.folder, a.mib, a.bandwidth)
    else:
        readonly(a.folder)


if __name__ == "__main__":
    main()
