"""``bench replicas``' shape grid: every share shape a real job has, each group lost in turn.

A real job's quorum is 8-16 groups of 8 ranks and a global batch that rarely divides by the survivors: after a loss
the lost group's rows are reshared among the others and split among their ranks, so most ranks of a redo get no row
at all. Each case here is ``groups`` torchrun jobs of ``ranks`` ranks (FSDP inside each) and a global batch that
divides (a row a rank) or not (one more), and every group is lost in turn: group ``g`` loses its rank ``g % ranks`` at
step ``3 + 2g``, the kinds in turn (an exception, a SIGKILL, a hang), and ``--min-replicas`` is every group, so the
next step waits for the replacement, which heals from a live group. A case passes when it exits 0, its ledger is
exact (every row of every committed step trained once), every fault fired, and the groups' fingerprints agree at
every step.
"""

from __future__ import annotations

import time
from pathlib import Path

from nvrx_lab.observe.events import read_events
from nvrx_lab.observe.table import format_table
from nvrx_lab.replicas import ledger
from nvrx_lab.replicas.local import Groups, run_local

MODEL = ["--seq-len", "16", "--dim", "32", "--n-layers", "1", "--n-heads", "2", "--hidden-dim", "64", "--log-every", "0",
         "--threads", "1", "--replica-fingerprint-every", "1"]
KINDS = ("exception", "sigkill", "hang")
FULL = [(g, r) for g in (2, 3, 4) for r in (1, 2, 3, 4)]
CORNERS = [(2, 1), (4, 1), (2, 4), (3, 2)]
"""``--quick``'s cases: the fewest and most groups of one rank, the most ranks, and the issue's 3 x 2."""


def batches(groups: int, ranks: int) -> tuple[int, int]:
    """A batch that divides (a row a rank) and one that does not."""
    return groups * ranks, groups * ranks + 1


def schedule(groups: int, ranks: int) -> tuple[str, int]:
    """Every group lost in turn (a fault's rank counts across the groups: replica x ranks + rank); the steps to run."""
    spec = ",".join(f"{g * ranks + g % ranks}:{3 + 2 * g}:{KINDS[g % len(KINDS)]}" for g in range(groups))
    return spec, 3 + 2 * groups + 2


def run_case(root: Path, groups: int, ranks: int, batch: int, timeout: float = 600.0) -> dict:
    """One case; its row (``ok`` False with ``error`` saying which check failed and where the logs are)."""
    out = root / f"grid-{groups}x{ranks}-b{batch}-{time.monotonic_ns()}"
    spec, steps = schedule(groups, ranks)
    t0 = time.monotonic()
    code = run_local(Groups(groups, ranks, max_restarts=2, min_replicas=groups), out,
                     [*MODEL, "--global-batch", str(batch), "--steps", str(steps), "--faults", spec], timeout=timeout)
    row = {"groups": groups, "ranks": ranks, "global_batch": batch, "faults": spec, "exit": code,
           "wall_s": time.monotonic() - t0}
    book = ledger.check_dir(out, batch)
    fired = sorted(e["step"] for g in range(groups) for e in read_events(out / f"replica{g}.jsonl", "fault"))
    row.update(steps=book.steps, samples_lost=book.lost, samples_duplicated=book.duplicated,
               fingerprinted=book.fingerprinted, faults_fired=len(fired))
    problems = [what for what, bad in (
        (f"exit {code}", code != 0),
        (f"{book.steps} of {steps} steps committed", book.steps != steps),
        (book.line(), not book.exact or not book.agree or book.fingerprinted < steps - 1),
        (f"faults fired at steps {fired}, scheduled {spec}", fired != [3 + 2 * g for g in range(groups)]),
    ) if bad]
    row["ok"] = not problems
    if problems:
        logs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(out.glob("replica*.log")))
        row["error"] = f"{groups} groups x {ranks} ranks, batch {batch}: " + "; ".join(problems) + logs
    print(f"[bench replicas] grid {groups} groups x {ranks} ranks, batch {batch}: "
          f"{'exact' if row['ok'] else 'FAILED'} in {row['wall_s']:.0f} s", flush=True)
    return row


def grid(root: Path, quick: bool = False) -> list[dict]:
    """Every case of the grid (``quick``: :data:`CORNERS`), both batches each."""
    return [run_case(root, g, r, b) for g, r in (CORNERS if quick else FULL) for b in batches(g, r)]


GRID_COLUMNS = ["groups", "ranks", "global_batch", "ok", "steps", "faults_fired", "samples_lost", "samples_duplicated",
                "fingerprinted", "wall_s"]


def print_grid(shapes: list[dict]) -> None:
    """The shape grid's table, then each failed case's error (its logs' tails)."""
    if not shapes:
        return
    print(f"The shape grid (every group lost in turn; {sum(r['ok'] for r in shapes)}/{len(shapes)} cases exact):\n"
          f"{format_table(shapes, GRID_COLUMNS)}\n")
    for r in shapes:
        if not r["ok"]:
            print(f"[bench replicas] grid: FAILED {r['error']}", flush=True)
