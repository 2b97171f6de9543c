"""Local-checkpoint cases: the job, or a node with its memory, SIGKILLed mid-save; a damaged replica.

:func:`sigkill_mid_replication` — two ranks, each a node of its own (:mod:`.local_child`), snapshot a
16 MiB state every step and replicate it to each other; at a seeded random moment the whole job is
SIGKILLed, and in every other trial node 0's memory is lost with it (its folder removed, as a replaced
node has none). A new job then restores: both ranks must agree on one step and hold exactly that step's
values (or both restore nothing, and storage would be the fallback: never a torn or mixed copy); a lost
node's rank restores from its peer's replica; a clean exit leaves nothing in node memory. The figures
count how many trials restored from a local copy and from a peer.

:func:`damaged_replica` — three ranks on three nodes save steps 1–3, then node 0 loses its memory, so
rank 0 can only restore from the replicas rank 1 holds in two slots (:mod:`.local_replica`): intact, it restores
step 3 from the ``peer``; with a flipped byte in the newest, that one is skipped with its reason logged and every
rank restores step 2 (the older slot); with both damaged, or both manifests naming an older run, no rank restores
anything (storage is the fallback); no wrong value anywhere.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from nvrx_lab.net import free_port, wait_for
from nvrx_lab.reliability import Row, timed
from nvrx_lab.runner import torchrun

WORLD = 2
REPLICA_CASES = {  # case: (what ranks 0, 1 and 2 restore, why rank 0's replica on rank 1 is skipped)
    "intact": (("3 peer ok", "3 local ok", "3 local ok"), None),
    "corrupt": (("2 peer ok", "2 local ok", "2 local ok"), "CRC32C mismatch (corrupted)"),
    "corrupt-both": (("None None ok",) * 3, "CRC32C mismatch (corrupted)"),
    "older-run": (("None None ok",) * 3, "belongs to another run ('run-0', this run is 'run-1')"),
}


def _start(mode: str, work: Path, mib: float) -> list[subprocess.Popen]:
    """The :mod:`.local_child` ranks, each a process session of its own (so a SIGKILL can land mid-save)."""
    cmd = [sys.executable, "-m", "nvrx_lab.reliability.local_child", str(work), mode, str(mib), str(free_port()),
           str(WORLD)]
    return [subprocess.Popen([*cmd, str(r)], start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for r in range(WORLD)]


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.communicate(timeout=30)


def _trial(work: Path, delay_s: float, lose_node: bool, mib: float) -> tuple[str | None, list[dict]]:
    """One kill and one restore; (what went wrong or None, each rank's result)."""
    procs = _start("save", work, mib)
    try:  # both ranks hold a replica: the job is past its first round
        wait_for(lambda: len({(p.parent, p.name.split(".")[0]) for p in work.glob("node*/rank*.replica.*.json")}) == WORLD,
                 60, "both replicas")
        time.sleep(delay_s)
    except TimeoutError as e:
        return str(e), []
    finally:
        _kill(procs)
    if lose_node:
        shutil.rmtree(work / "node0")
    procs = _start("restore", work, mib)
    try:
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    except subprocess.TimeoutExpired:
        return "the restore did not finish within 90 s", []
    finally:
        _kill(procs)
    if any(p.returncode for p in procs):
        return f"restore exit codes {[p.returncode for p in procs]}: {outputs[0][-800:]} {outputs[1][-800:]}", []
    got = [json.loads((work / f"result.{r}").read_text()) for r in range(WORLD)]
    left = sorted(str(p.relative_to(work)) for p in work.glob("node*/*"))
    if not all(g["ok"] for g in got):
        return f"values differ from the restored step: {got}", got
    if len({g["step"] for g in got}) != 1:
        return f"the ranks restored different steps: {got}", got
    if lose_node and got[0]["step"] is not None and got[0]["source"] != "peer":
        return f"node 0's memory is gone, yet rank 0 restored from {got[0]['source']}", got
    if left:
        return f"left in node memory after a clean exit: {left}", got
    return None, got


def sigkill_mid_replication(work: Path, trials: int = 20, seed: int = 0, mib: float = 16) -> Row:
    row = Row("sigkill mid-replication", holds="a new job restores one step on every rank with exactly its values "
              "(a lost node's rank from its peer), or nothing; nothing left in node memory after")
    rng = random.Random(seed)
    restored = peer = 0
    with timed(row):
        for i in range(trials):
            lose_node = i % 2 == 1
            why, got = _trial(Path(work) / f"trial{i}", rng.uniform(0.0, 0.5), lose_node, mib)
            row.check(why is None, f"trial {i} ({'node 0 lost' if lose_node else 'job killed'}): {why}")
            restored += bool(got and got[0]["step"] is not None)
            peer += bool(got and got[0]["source"] == "peer")
    row.figures = {"restored_local": restored, "from_peer": peer, "restored_none": row.trials - restored}
    return row


def damaged_replica(work: Path, rounds: int = 1) -> Row:
    row = Row("damaged replica", holds="an intact replica restores a lost node from its peer, the older slot when the "
              "newest is corrupt; a corrupt one or one of an older run is skipped with its reason logged, nothing restored "
              "once none is left, no wrong value")
    with timed(row):
        for i in range(rounds):
            res = torchrun(3, "-m", "nvrx_lab.reliability.local_replica", str(Path(work) / f"round{i}"), *REPLICA_CASES,
                           timeout=120)
            for case, (expected, reason) in REPLICA_CASES.items():
                folder = Path(work) / f"round{i}" / case
                got = tuple((folder / f"result.{r}").read_text() if (folder / f"result.{r}").exists() else "missing"
                            for r in range(3))
                logged = reason is None or re.search(rf"{case}/node1/rank1\.replica\.[01]\.json skipped: {re.escape(reason)}",
                                                     res.output) is not None
                row.check(got == expected and logged and res.returncode == 0,
                          f"round {i} {case}: restored {got}, expected {expected}; reason logged: {logged}; "
                          f"exit code {res.returncode}: {res.output[-1500:]}")
    return row
