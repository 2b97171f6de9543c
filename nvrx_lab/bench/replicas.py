"""``python -m nvrx_lab.bench replicas``: what a fault in one replica group costs the others, ours and torchft's.

Three replica groups of one rank train the same small model; one fault (an exception, a SIGKILL, a hang) hits
replica 1 at step ``--fault-step``, and its launcher (torchrun ``--max-restarts``) starts a replacement, which
heals from a live replica. Ours: ``python -m nvrx_lab.replicas.local`` (a coordinator, a quorum per step, the
survivors redo the step with the lost rows). torchft 0.2.0 as its README runs it (Lighthouse, ``Manager``,
``ProcessGroupGloo``, DDP, ``min_replica_size`` 1; :mod:`._replicas_torchft`), when the peers extra is installed.
Per system and fault, the medians of ``--runs`` runs:

* ``survivor_stall_x`` — the survivors' longest step in the three from the fault and the three from the
  replacement's rejoin ÷ their median step before the fault;
* ``steps_lost`` — steps the survivors computed and did not commit (a redo), plus any committed step lost;
* ``heal_s`` — ours: the fault to the replacement's first committed step (``start_s`` of it: until its process
  ran, ``transfer_s``: the state's transfer); torchft: the replacement's spawn to its first participating commit
  (its harness holds a hung victim before killing it);
* ``samples_lost`` / ``samples_duplicated`` — from the data ledger of committed steps;
* ``goodput`` — committed samples per second ÷ a fault-free run's.

Ours also with the coordinator killed once step ``--fault-step`` is committed and a new one started on its address
1 s later (``replicas.local --coordinator-fault``, as a restarted pod behind its Service): ``survivor_stall_x`` over the
three steps from the kill, ``steps_lost`` the committed steps it went back (0: it goes on from the last one), and
``heal_s`` from the kill to the restarted coordinator's first commit (the 1 s start-up included). A last row of ours: one run
through ``--many`` faults (every kind, on every replica in turn), its ledger.
Fault-free at a job's shape (:mod:`._replicas_shape`): ``overhead_x``, replica groups' step ÷ plain HSDP's over the
same 6 ranks and global batch (56 MB of gradients, a step of about a second), and the data plane's bytes and time per
step on p5 for Llama 3.1 8B and 70B.
The shape grid (:mod:`._replicas_grid`): groups 2-4 x ranks 1-4, batches that divide and do not, every group lost in
turn; each case's exit, ledger and fingerprints (``--grid``).
``--quick``: one run per fault, 6 faults in the long run, one HSDP/replica-groups pair, the grid's corners.
"""

from __future__ import annotations

import importlib.util
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from nvrx_lab.bench._replicas_grid import grid, print_grid
from nvrx_lab.bench._replicas_shape import EFA_GBPS_PER_GPU, TCP_FLOW_GBPS, WARM, overhead, p5_rows
from nvrx_lab.cli import Parser
from nvrx_lab.observe.events import read_events
from nvrx_lab.observe.table import exit_status, format_table, report
from nvrx_lab.replicas import ledger
from nvrx_lab.replicas.local import Groups, run_local


def model_args(dim: int = 64) -> list[str]:
    """The model both systems train (one torch thread per replica in both). A larger ``dim`` makes a longer step, so
    the fixed costs of a fault (the victim's exit, the new group's connections) weigh less in the stall."""
    return ["--seq-len", "32", "--dim", str(dim), "--n-layers", "2", "--n-heads", "2", "--hidden-dim", str(2 * dim),
            "--global-batch", "12"]


KINDS = ("exception", "sigkill", "hang")
STALL_WINDOW = 3
"""Steps from the fault, and from the replacement's rejoin, in which the survivors' longest step is looked for (the
steps in between are the box's noise, not the fault's)."""
VICTIM = 1


def _steps(out: Path, replica: int) -> list[dict]:
    """A replica's committed steps in order (a replacement's continue its predecessor's)."""
    return sorted(read_events(out / f"replica{replica}.jsonl", "step"), key=lambda e: e["step"])


def _gaps(steps: list[dict]) -> dict[int, float]:
    """Step -> seconds since the step before it committed (on this replica)."""
    return {b["step"]: b["t"] - a["t"] for a, b in zip(steps, steps[1:], strict=False) if b["step"] == a["step"] + 1}


def measure(out: Path, replicas: int, fault_step: int | None, global_batch: int) -> dict:
    """One run's figures from its event streams (``fault_step`` None: a fault-free run)."""
    coord = read_events(out / "coordinator.jsonl")
    quorums = [e for e in coord if e["kind"] == "quorum"]
    redos = ledger.redone_steps(coord)
    book = ledger.check_dir(out, global_batch)
    survivors = [r for r in range(replicas) if fault_step is None or r != VICTIM]
    steps = {r: _steps(out, r) for r in survivors}
    first, last = min(s[0]["t"] for s in steps.values()), max(s[-1]["t"] for s in steps.values())
    row = {"steps": book.steps, "steps_lost": redos, "samples_lost": book.lost, "samples_duplicated": book.duplicated,
           "samples_per_s": (book.steps - 1) * global_batch / (last - first)}
    gaps = {r: _gaps(s) for r, s in steps.items()}
    if fault_step is None:
        row["median_step_s"] = statistics.median(g for gs in gaps.values() for g in gs.values())
        return row
    before = [g for gs in gaps.values() for s, g in gs.items() if 2 < s < fault_step]
    row["median_step_s"] = statistics.median(before)
    joined = [q["step"] for q in quorums if q.get("joiners") and q["step"] >= fault_step]
    around = {*range(fault_step, fault_step + STALL_WINDOW), *(range(joined[0], joined[0] + STALL_WINDOW) if joined else ())}
    row["survivor_stall_x"] = max(g for gs in gaps.values() for s, g in gs.items() if s in around) / row["median_step_s"]
    lost = [e for e in coord if e["kind"] == "replica_lost" and e["replica"] == VICTIM]
    events = read_events(out / f"replica{VICTIM}.jsonl")
    back = [e for e in events if e["kind"] == "step" and lost and e["t"] > lost[0]["t"]]
    starts = [e for e in events if e["kind"] == "start" and e.get("restart_count")]
    healed = [e for e in events if e["kind"] == "healed"]
    if not (lost and back and starts and healed):
        raise RuntimeError(f"replica {VICTIM} was not lost and healed (see {out})")
    row.update(heal_s=back[0]["t"] - lost[0]["t"], start_s=starts[0]["t"] - lost[0]["t"], transfer_s=healed[0]["seconds"])
    return row


def measure_coordinator(out: Path, replicas: int, global_batch: int) -> dict:
    """A run whose coordinator was killed and restarted: the groups' stall, the committed steps it went back."""
    coord = read_events(out / "coordinator.jsonl")
    killed = [e for e in coord if e["kind"] == "coordinator_killed"]
    resumed = [e for e in coord if e["kind"] == "quorum" and e.get("resumed")]
    if not (killed and resumed):
        raise RuntimeError(f"the coordinator was not killed and resumed (see {out})")
    book = ledger.check_dir(out, global_batch)
    steps = {r: _steps(out, r) for r in range(replicas)}
    gaps = [g for s in steps.values() for g in _gaps(s).values()]
    before = [g for s in steps.values() for st, g in _gaps(s).items() if 2 < st <= killed[0]["committed"]]  # warm
    after = [e["t"] for s in steps.values() for e in s if e["step"] >= resumed[0]["step"]]  # the new one's commits
    k, median = killed[0]["committed"], statistics.median(before or gaps)
    stall = max(g for s in steps.values() for st, g in _gaps(s).items() if k < st <= k + STALL_WINDOW)
    return {"steps": book.steps, "steps_lost": k - resumed[0]["committed"], "samples_lost": book.lost,
            "samples_duplicated": book.duplicated, "median_step_s": median,
            "survivor_stall_x": stall / median, "heal_s": min(after) - killed[0]["t"],
            "samples_per_s": (book.steps - 1) * global_batch / (max(s[-1]["t"] for s in steps.values())
                                                               - min(s[0]["t"] for s in steps.values()))}


def ours(root: Path, fault: str | None, steps: int, fault_step: int, replicas: int = 3, faults: str = "",
         min_replicas: int = 1, dim: int = 64) -> dict:
    """One run of ours (``faults`` overrides the single fault; ``fault="coordinator"`` kills the coordinator); its
    :func:`measure` and wall time."""
    out = root / f"ours-{fault or 'none'}-{time.monotonic_ns()}"
    spec = faults or (f"{VICTIM}:{fault_step}:{fault}" if fault and fault != "coordinator" else "")
    args = [*model_args(dim), "--log-every", "0", "--threads", "1", "--steps", str(steps), *(["--faults", spec] if spec else [])]
    t0 = time.monotonic()
    code = run_local(Groups(replicas, 1, max_restarts=max(3, spec.count(",") + 1), min_replicas=min_replicas), out,
                     args, timeout=600, coordinator_fault=(fault_step, 1.0) if fault == "coordinator" else None)
    if code != 0:
        logs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(out.glob("replica*.log")))
        raise RuntimeError(f"a replica group exited {code}{logs}")
    if fault == "coordinator":
        row = measure_coordinator(out, replicas, 12)
    else:
        row = measure(out, replicas, fault_step if fault and not faults else None, 12)
    return {**row, "wall_s": time.monotonic() - t0}


def many_faults(n: int, gap: int = 3) -> tuple[str, int]:
    """``n`` faults, every kind, on replicas 1 and 2 in turn, ``gap`` steps apart; the schedule and the steps to run.
    Replica 0 is never hit (a live replica always holds the state) and the run uses ``--min-replicas 3``: the
    survivors redo the faulted step without the lost group (its rows shared among them), and the next step waits for
    its replacement, so every fault fires at its step whatever the box's speed. (With 2, a replacement that starts
    after the others trained the last step never fires its group's last fault.)"""
    spec = ",".join(f"{1 + i % 2}:{4 + gap * i}:{KINDS[i % len(KINDS)]}" for i in range(n))
    return spec, 4 + gap * n + 4


def _median_row(system: str, fault: str, runs: list[dict], clean: dict | None, failed: list[str]) -> dict:
    row: dict = {"system": system, "fault": fault, "runs": f"{len(runs)}/{len(runs) + len(failed)}"}
    for key in ("survivor_stall_x", "steps_lost", "heal_s", "start_s", "transfer_s", "samples_lost",
                "samples_duplicated", "median_step_s", "wall_s"):
        values = [r[key] for r in runs if key in r]
        row[key] = statistics.median(values) if values else None
    if clean and runs:
        row["goodput"] = statistics.median(r["samples_per_s"] for r in runs) / clean["samples_per_s"]
    if failed:
        row["error"] = failed[0][-3000:]
    return row


def _repeat(fn, runs: int, label: str) -> tuple[list[dict], list[str]]:
    done: tuple[list[dict], list[str]] = ([], [])
    for i in range(runs):
        _once(done, fn, i, label)
    return done


def _once(done: tuple[list[dict], list[str]], fn, i: int, label: str) -> None:
    """Run ``fn`` once into ``done`` (its rows, its failures: a failed run is an error with its output, never a gap)."""
    try:
        done[0].append(fn())
    except RuntimeError as e:
        print(f"[bench replicas] {label} run {i + 1}: FAILED\n{e}", flush=True)
        done[1].append(str(e))


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="python -m nvrx_lab.bench replicas", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one run per fault, 6 faults in the long run")
    ap.add_argument("--runs", type=int, default=10, help="runs per system and fault (default 10)")
    ap.add_argument("--steps", type=int, default=400,
                    help="steps of each run (default 400: the replacement, ~4 s to start, joins before the end)")
    ap.add_argument("--fault-step", type=int, default=20, help="the step the fault hits replica 1 at (default 20)")
    ap.add_argument("--dim", type=int, default=64, help="the model's width (default 64: a ~15 ms step here)")
    ap.add_argument("--many", type=int, default=20, help="faults of the long run (default 20; 0: no long run)")
    ap.add_argument("--overhead-pairs", type=int, default=3,
                    help="alternations of plain HSDP and replica groups at a job's shape, fault-free (default 3, "
                         "--quick 1; 0: none): the overhead_x row")
    ap.add_argument("--overhead-steps", type=int, default=16, help="steps of each of those runs (default 16)")
    ap.add_argument("--grid", choices=["full", "corners", "none"], default="full",
                    help="the shape grid: groups 2-4 x ranks 1-4 (full, ~25 min here), its corners (--quick) or none")
    ap.add_argument("--rows", default=",".join(ROWS),
                    help=f"which rows, a comma list of {', '.join(ROWS)} (default all; e.g. --rows grid)")
    ap.add_argument("--peers", choices=["auto", "no"], default="auto", help="torchft rows when installed (auto)")
    ap.add_argument("--out", default="build/bench/replicas.json")
    a = ap.parse_args(argv)
    if not 4 <= a.fault_step <= a.steps - 4:
        ap.error(f"--fault-step must be in 4..--steps - 4 ({a.steps - 4}), got {a.fault_step}")
    runs, many = (1, min(a.many, 6)) if a.quick else (a.runs, a.many)
    pairs = min(a.overhead_pairs, 1) if a.quick else a.overhead_pairs
    if runs < 1:
        ap.error(f"--runs must be >= 1, got {runs}")
    if pairs < 0 or a.overhead_steps < WARM + 3:
        ap.error(f"--overhead-pairs must be >= 0 and --overhead-steps >= {WARM + 3}, got {pairs} and {a.overhead_steps}")
    want = {r.strip() for r in a.rows.split(",") if r.strip()}
    if not want or want - set(ROWS):
        ap.error(f"--rows {a.rows!r}: expected a comma list of {', '.join(ROWS)}")
    cases = ("corners" if a.quick and a.grid == "full" else a.grid) if "grid" in want else "none"
    runs, pairs, many = (runs if "faults" in want else 0), (pairs if "overhead" in want else 0), (many if "many" in want else 0)
    rows, failed, shapes = [], [], []
    with tempfile.TemporaryDirectory(prefix="nvrx-replicas-") as tmp:
        root = Path(tmp)
        if runs:
            rows += fault_rows(root, a, runs)
        if pairs:
            done, errors = _repeat(lambda: overhead(root, pairs, a.overhead_steps), 1, "ours vs HSDP")
            rows.append(done[0] if done else _median_row("nvrx_lab", "none: vs HSDP", [], None, errors))
        if many:
            spec, steps = many_faults(many)
            done, errors = _repeat(lambda: ours(root, None, steps, 0, faults=spec, min_replicas=3), 1,
                                   f"ours {many} faults")
            rows.append(_median_row("nvrx_lab", f"{many} faults", done, None, errors))
        if cases != "none":
            shapes = grid(root, quick=cases == "corners")
    failed = [f"{r['system']} {r['fault']}" for r in rows if r.get("error")]
    failed += [f"grid {r['groups']}x{r['ranks']} batch {r['global_batch']}" for r in shapes if not r["ok"]]
    command = ("python -m nvrx_lab.bench replicas " + shlex.join(argv if argv is not None else sys.argv[1:])).strip()
    p5 = p5_rows()
    print(f"The data plane on p5 (a rank's float32 gradient shard; EFA {EFA_GBPS_PER_GPU:g} Gb/s a "
          f"GPU, one TCP flow {TCP_FLOW_GBPS:g} Gb/s):\n{format_table(p5)}\n")
    print_grid(shapes)
    report("replicas", rows, a.out, command, extra={"p5": p5, "grid": shapes}, columns=[
        "system", "fault", "runs", "survivor_stall_x", "steps_lost", "heal_s", "start_s", "transfer_s", "samples_lost",
        "samples_duplicated", "goodput", "overhead_x", "median_step_s", "hsdp_step_s", "grad_mb", "wall_s"])
    return exit_status(failed)


ROWS = ("faults", "overhead", "many", "grid")
"""The bench's parts: each fault kind and the coordinator's loss (ours and torchft's), ``overhead_x``, the long run
of many faults, the shape grid."""


def fault_rows(root: Path, a, runs: int) -> list[dict]:
    """A fault-free run, then ``runs`` of each fault kind and of the coordinator's loss; torchft's beside them, run for
    run in turn (each pair sees the same box)."""
    peer = _torchft(a)
    clean = {"ours": _repeat(lambda: ours(root, None, a.steps, a.fault_step, dim=a.dim), 1, "ours fault-free")}
    if peer:
        clean["torchft"] = _repeat(lambda: peer("none", root / "tf-none"), 1, "torchft fault-free")
    done = {(s, k): ([], []) for s in clean for k in (*KINDS, "coordinator")}
    for i in range(runs):
        for kind in (*KINDS, "coordinator"):
            _once(done["ours", kind], lambda k=kind: ours(root, k, a.steps, a.fault_step, dim=a.dim), i, f"ours {kind}")
            if peer and kind != "coordinator":  # torchft's Lighthouse has no restart to compare
                _once(done["torchft", kind], lambda k=kind: peer(k, root / f"tf-{k}-{time.monotonic_ns()}"), i,
                      f"torchft {kind}")
    rows = []
    for system, (clean_runs, errors) in clean.items():
        base = clean_runs[0] if clean_runs else None
        name = "nvrx_lab" if system == "ours" else "torchft 0.2.0"
        rows.append(_median_row(name, "none", clean_runs, base, errors))
        for (s, kind), (ok, failed) in done.items():
            if s == system and ok + failed:
                rows.append(_median_row(ok[0]["system"] if ok and s != "ours" else name, kind, ok, base, failed))
    return rows



def _torchft(a):
    """torchft 0.2.0's run at this bench's shape (``fault, out -> row``), or None (said so without the peers extra)."""
    if a.peers == "no":
        return None
    if importlib.util.find_spec("torchft") is None:
        print("[bench replicas] torchft: skipped (torchft not installed; pip install -e '.[peers]')", flush=True)
        return None
    from nvrx_lab.bench._replicas_torchft import run_torchft

    return lambda fault, out: run_torchft(fault, out, steps=a.steps, fault_step=a.fault_step, model=model_args(a.dim))


if __name__ == "__main__":
    sys.exit(main())
