"""``python -m nvrx_lab.bench straggler``: is a slow rank named, is a healthy one never, and at what cost?

Every case runs the trainer under torchrun on CPU ranks with ``--straggler-interval`` and reads its
event stream (``straggler`` and ``straggler_scores`` events):

* **detection** — rank 1 slowed 1.5× (``1:S:slow:1.5``, S the first step of a reporting interval):
  is it named, and no other rank, within 2 reports of the fault? ``--trials`` runs (10).
* **false reports** — healthy runs of ``--healthy-steps`` (2,000) on 2 and 4 ranks, on a quiet machine
  and under two busy loops (every rank slowed alike is no straggler): ranks named (want 0).

  Both at ``--interval`` (30 steps, ~0.4 s of compute here): on this 2-core box a healthy rank's
  speed wanders by up to 1.5× for stretches of several steps, and a 10-step mean cannot tell that from a
  rank slowed 1.5× for good (the per-step times of 8,000 healthy steps, replayed in 10-step reports at
  threshold 0.8, named a healthy rank 16 times); the table says which interval each case ran;
* **overhead** — what detection adds to a step at an interval of 10: the timer's hooks (one process,
  steps with and without them alternated, timed in CPU time) plus one report (gather, score, emit: the
  trainer's ``overhead_s``) per 10 steps, against the trainer's median step time; and, for reference,
  the median step time of runs with and without detection, alternated (as noisy as the machine).
* **scale** — the exchange at 1,024 ranks, from its size: each rank gathers ``8 × 3`` bytes per rank.

``--quick``: 3 detection trials, 300 healthy steps, one overhead pair.
"""

from __future__ import annotations

import contextlib
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nvrx_lab.bench._scale_model import measure_straggler_report
from nvrx_lab.cli import Parser
from nvrx_lab.net import free_port_pair
from nvrx_lab.observe.events import last_run, read_events
from nvrx_lab.observe.table import median, report
from nvrx_lab.runner import Torchrun, run, trainer

SMALL = dict(dim=64, n_layers=2, hidden_dim=172, global_batch=4, seq_len=32, log_every=0)
"""A small model: many steps per second, so 2,000 healthy steps take about a minute."""
INTERVAL = 30
"""Steps per report of the detection and false-report cases (``--interval``)."""
OVERHEAD_INTERVAL = 10
"""Steps per report of the overhead case: the issue's figure (a report costs the same at any interval)."""


@contextlib.contextmanager
def busy_loops(n: int):
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"  # ends with its parent, killed too
    procs = [subprocess.Popen([sys.executable, "-c", spin], start_new_session=True) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def train(root: Path, nproc: int, steps: int, load: int = 0, timeout: float = 900, **flags) -> list[dict]:
    metrics = Path(tempfile.mkdtemp(dir=root)) / "m.jsonl"
    cmd = Torchrun.local(nproc, free_port_pair()).argv(trainer(steps=steps, metrics=metrics, **SMALL, **flags))
    with busy_loops(load):
        res = run(cmd, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"exit {res.returncode}: {shlex.join(cmd)}\n{res.output[-3000:]}")
    return last_run(read_events(metrics))


def detection(root: Path, trials: int, interval: int) -> dict:
    """Rank 1 slowed 1.5× from the first step of interval k (k = 3, 4, 5, …): named within 2 reports?"""
    hits, reports, wrong = 0, [], 0
    for i in range(trials):
        fault_step = interval * (3 + i % 3) + 1
        events = train(root, 2, fault_step - 1 + 4 * interval, straggler_interval=interval,
                       faults=f"1:{fault_step}:slow:1.5")
        named = [e for e in events if e["kind"] == "straggler"]
        wrong += sum(1 for e in named if e["rank"] != 1 or e["step"] < fault_step)
        first = min((e["step"] for e in named if e["rank"] == 1 and e["step"] >= fault_step), default=None)
        if first is not None:
            reports.append((first - (fault_step - 1)) // interval)
            hits += reports[-1] <= 2
        print(f"  detection trial {i + 1}/{trials}: fault at {fault_step}, named at {first}", flush=True)
    return {"case": "rank 1 slowed 1.5x", "ranks": 2, "load": "quiet", "interval": interval, "runs": trials,
            "named within 2 reports": f"{hits}/{trials}", "reports to name (median)": median(reports),
            "false reports": wrong}


def healthy(root: Path, nproc: int, steps: int, load: int, interval: int) -> dict:
    events = train(root, nproc, steps, load, straggler_interval=interval)
    scores = [e for e in events if e["kind"] == "straggler_scores"]
    lowest = min((min(e["relative"]["compute"]) for e in scores), default=float("nan"))
    named = [e for e in events if e["kind"] == "straggler"]
    print(f"  healthy {nproc} ranks, {load} busy loops: {steps} steps, {len(named)} named, lowest score {lowest:.2f}",
          flush=True)
    return {"case": f"healthy, {steps} steps", "ranks": nproc, "load": f"{load} busy loops" if load else "quiet",
            "interval": interval, "runs": 1, "false reports": len(named), "lowest score": lowest}


def step_ms(events: list[dict]) -> float:
    return 1e3 * statistics.median(e["step_time"] for e in events if e["kind"] == "step" and e["step"] > 10)


def hook_us(calls: int = 2000, blocks: int = 15) -> tuple[float, int]:
    """CPU time the timer's hooks add to one step of the small model: the extra cost of one module call
    with the hooks installed (a tiny leaf module called ``calls`` times, blocks with and without hooks
    alternated, the fastest block of each kept: preemption only ever adds) times the module calls of one
    training step (every module call passes the process-wide hooks). Returns (µs per step, calls per step)."""
    import torch
    from torch.nn.modules import module as nn_module

    from nvrx_lab.straggler import ComputeTimer
    from nvrx_lab.train.config import TrainConfig
    from nvrx_lab.train.model import Transformer

    torch.manual_seed(0)
    cfg = TrainConfig.from_kwargs(**{k: v for k, v in SMALL.items() if k != "log_every"})
    model = Transformer(cfg.model)
    count = [0]
    handle = nn_module.register_module_forward_pre_hook(lambda m, a: count.__setitem__(0, count[0] + 1))
    model(torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len)))
    handle.remove()
    leaf, x, timer = torch.nn.Linear(8, 8), torch.randn(1, 8), ComputeTimer()
    best = {True: float("inf"), False: float("inf")}
    for i in range(2 * blocks):
        timer.install() if i % 2 else timer.remove()
        t0 = time.thread_time()
        for _ in range(calls):
            leaf(x)
        best[bool(i % 2)] = min(best[bool(i % 2)], time.thread_time() - t0)
        timer.end_step()
        timer.times()
    timer.remove()
    per_call = max(0.0, best[True] - best[False]) / calls
    return 1e6 * per_call * (count[0] + 1), count[0] + 1  # + 1: the optimizer step's pair of hooks


def overhead(root: Path, pairs: int, steps: int) -> dict:
    off, on, report_ms = [], [], []
    for _ in range(pairs):
        off.append(step_ms(train(root, 2, steps)))
        events = train(root, 2, steps, straggler_interval=OVERHEAD_INTERVAL)
        on.append(step_ms(events))
        spent = max(e["overhead_s"] for e in events if e["kind"] == "straggler_scores")
        report_ms.append(1e3 * spent / (steps // OVERHEAD_INTERVAL))
    hooks, _ = hook_us()
    total = 100 * (hooks / 1e3 + median(report_ms) / OVERHEAD_INTERVAL) / median(on)
    print(f"  overhead: hooks {hooks:.0f} us/step, report {median(report_ms):.2f} ms; step {median(off):.2f} ms off, "
          f"{median(on):.2f} ms on", flush=True)
    return {"case": "overhead", "ranks": 2, "load": "quiet", "interval": OVERHEAD_INTERVAL, "runs": 2 * pairs,
            "step ms off": median(off), "step ms on": median(on), "hooks us/step": hooks,
            "report ms": median(report_ms), "overhead %": total}


def scale_row(ranks: int = 1024) -> dict:
    """One report at ``ranks`` ranks, as the scale model prices it (``python -m nvrx_lab.bench scale``)."""
    cost = measure_straggler_report(ranks)
    gathered = cost["straggler_bytes_per_rank"]
    return {"case": f"exchange at {ranks} ranks (model)", "ranks": ranks, "load": "-", "interval": OVERHEAD_INTERVAL,
            "runs": 0, "report ms": cost["straggler_report_ms"], "bytes per rank per report": gathered,
            "bytes per rank per step": gathered / OVERHEAD_INTERVAL}


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m nvrx_lab.bench straggler", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 detection trials, 300 healthy steps, one overhead pair")
    parser.add_argument("--trials", type=int, default=10, help="detection runs (default 10)")
    parser.add_argument("--healthy-steps", type=int, default=2000, help="steps of each healthy run (default 2000)")
    parser.add_argument("--interval", type=int, default=INTERVAL,
                        help=f"steps per report of the detection and healthy runs (default {INTERVAL})")
    parser.add_argument("--out", default="build/bench/straggler.json")
    args = parser.parse_args(argv)
    if args.interval < 1:
        parser.error(f"--interval must be >= 1 step, got {args.interval}")
    trials, steps, pairs = (3, 300, 1) if args.quick else (args.trials, args.healthy_steps, 3)
    with tempfile.TemporaryDirectory(prefix="nvrx-straggler-") as tmp:
        root = Path(tmp)
        rows = [detection(root, trials, args.interval)]
        rows += [healthy(root, n, steps, load, args.interval) for n in (2, 4) for load in (0, 2)]
        rows += [overhead(root, pairs, 300), scale_row()]
    command = ("python -m nvrx_lab.bench straggler " + shlex.join(argv if argv is not None else sys.argv[1:])).strip()
    report("straggler", rows, args.out, command, columns=[
        "case", "ranks", "load", "interval", "runs", "named within 2 reports", "reports to name (median)", "false reports",
        "lowest score", "step ms off", "step ms on", "hooks us/step", "report ms", "overhead %",
        "bytes per rank per report"])
    return 0
