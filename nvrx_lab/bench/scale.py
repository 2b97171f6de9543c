"""Scale model: the control plane at 8 to 4,096 ranks on one box
================================================================

``python -m nvrx_lab.bench scale --ranks 8 64 512 1024 4096``

Simulated ranks (threads, a store client each, one real ``TCPStore``) run the control-plane code
of the real ranks — the in-process restart's store protocol (fault report, the attempt's end,
rendezvous and rank assignment), the heartbeat judge, the checkpoint commit — with the data plane
stubbed (see ``_scale_model.py``; each measurement a module: ``_scale_restart``, ``_scale_heartbeats``,
``_scale_straggler``, ``_scale_commit``). Each row counts every store operation and file system metadata
operation and times what a user waits for:

* ``restart_s`` — one injected exception until every simulated rank has its new assignment; above
  ``--ranks-per-process`` (128) the ranks run in several worker processes (``_scale_procs.py``), as
  real ranks are processes: one interpreter's GIL bounds 1,024 threads woken at once, not the protocol;
* ``store_ops_per_restart`` — store operations of all ranks in that window (target <= 10 N);
* ``heartbeat_store_ops_per_s`` — at ``--heartbeat-interval`` (target <= 2 N / interval);
* ``commit_fs_ops_per_save``, ``idle_step_fs_ops`` — one save of N ranks, and a training step
  while a save is pending (targets <= N + 10 and 0);
* ``straggler_report_ms``, ``straggler_bytes_per_rank`` — one straggler report on each rank: scoring
  the gathered N-rank matrix (the real :class:`~nvrx_lab.straggler.Detector`), and what its all-gather
  brings each rank (3 float64 per rank; the gloo collective itself is not simulated).

``--replica-groups 128 --ranks-per-group 8``: one more row, the replica coordinator's quorum per step with that many
replica groups (``_scale_replicas``: the real coordinator, every rank a real connection): ``quorum_ms`` from the last
group's join to every rank holding the quorum, messages per replica per step, the coordinator's CPU per step.

``--protocols new legacy``: ``legacy`` is the first version (``_scale_legacy.py``), where every
rank polled every rank's keys; it runs up to ``--legacy-max-ranks`` (it is O(N^2) per event).
"""

from __future__ import annotations

import shlex
import sys
import tempfile
import threading
import time

from nvrx_lab.bench import _scale_legacy as legacy
from nvrx_lab.bench._scale_commit import measure_commit
from nvrx_lab.bench._scale_heartbeats import measure_heartbeats
from nvrx_lab.bench._scale_model import Ranks
from nvrx_lab.bench._scale_procs import measure_restart_procs
from nvrx_lab.bench._scale_replicas import measure_replicas
from nvrx_lab.bench._scale_restart import measure_restart
from nvrx_lab.bench._scale_straggler import measure_straggler_report
from nvrx_lab.cli import Parser
from nvrx_lab.inprocess.store import host
from nvrx_lab.net import free_port
from nvrx_lab.observe.table import report


def legacy_restart(ranks: Ranks, timeout: float) -> dict:
    n = ranks.n
    t = time.monotonic()
    ranks.run(lambda r: legacy.rendezvous0(ranks.clients[r], r, n, timeout), timeout)
    rendezvous0_s = time.monotonic() - t
    ranks.reset()
    identity = {r: r for r in range(n)}
    shared = legacy.Restart(threading.Barrier(n))
    ends = ranks.run(lambda r: legacy.restart_rank(ranks.clients[r], r, 0, identity, n - 1, shared, timeout), timeout)
    return {"restart_s": max(ends) - shared.t0[0], "store_ops_per_restart": ranks.ops(), "rendezvous0_s": rendezvous0_s,
            "polls_per_rank": sum(shared.polls) / n}


def legacy_heartbeats(ranks: Ranks, interval: float, sample: int = 4) -> dict:
    """Every rank does the same reads: measure ``sample`` of them, scale to N."""
    for r in range(ranks.n):
        ranks.clients[r].add(f"hb/{r}", 1)
    ranks.reset()
    t = time.monotonic()
    for r in range(min(sample, ranks.n)):
        legacy.heartbeat_ops_per_rank(ranks.clients[r], r, ranks.n)
    per_rank_s = (time.monotonic() - t) / min(sample, ranks.n)
    per_rank = ranks.ops() / min(sample, ranks.n)
    return {"heartbeat_store_ops_per_s": per_rank * ranks.n / interval, "judge_ms": 1000 * per_rank_s}


def measure(n: int, protocol: str, a) -> dict:
    row: dict = {"ranks": n, "protocol": protocol}
    port = free_port()
    server = host(port)
    ranks = None
    try:
        t = time.monotonic()
        ranks = Ranks(n, port)
        row["connect_s"] = time.monotonic() - t
        if protocol == "new":
            procs = -(-n // a.ranks_per_process)
            row.update(measure_restart_procs(n, procs, a.timeout) if procs > 1 else measure_restart(ranks, a.timeout))
            row.update(measure_heartbeats(ranks, a.heartbeat_interval))
            row.update(measure_straggler_report(n))
            with tempfile.TemporaryDirectory(prefix="nvrx_scale_", dir=a.workdir) as root:
                row.update(measure_commit(ranks, root, a.timeout))
        else:
            if n <= a.legacy_max_ranks:
                row.update(legacy_restart(ranks, a.timeout))
            row.update(legacy_heartbeats(ranks, a.heartbeat_interval))
        if "store_ops_per_restart" in row:
            row["ops_per_rank"] = row["store_ops_per_restart"] / n
    finally:
        del server  # a timed-out row's ranks are blocked in store calls: without the store they fail and end
        if ranks is not None and ranks.join(30):
            print(f"[scale] {n} ranks: simulated ranks still blocked 30 s after the store closed", file=sys.stderr)
    return row


def replica_row(a) -> dict:
    """The replica coordinator's row (a failure is the row's error, never a silent nan)."""
    n, t = a.replica_groups * a.ranks_per_group, time.monotonic()
    row: dict = {"ranks": n, "protocol": f"replicas {a.replica_groups}x{a.ranks_per_group}"}
    try:
        row.update(measure_replicas(a.replica_groups, a.ranks_per_group, a.replica_steps,
                                    processes=max(1, -(-n // a.ranks_per_process)), timeout=a.timeout))
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    row["wall_s"] = time.monotonic() - t
    print(f"[scale] {n:5d} ranks {row['protocol']}: quorum {row.get('quorum_ms', float('nan')):.2f} ms (p95 "
          f"{row.get('quorum_p95_ms', float('nan')):.2f}), {row.get('msgs_in_per_replica_step', '-')} message(s) in and "
          f"{row.get('msgs_out_per_replica_step', '-')} out per replica per step, coordinator CPU "
          f"{row.get('coordinator_cpu_ms_per_step', float('nan')):.2f} ms per step {row.get('error', '')}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = Parser(prog="python -m nvrx_lab.bench scale", description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512, 1024, 4096])
    ap.add_argument("--protocols", nargs="+", default=["new", "legacy"], choices=["new", "legacy"])
    ap.add_argument("--legacy-max-ranks", type=int, default=512, help="largest N the legacy restart runs at")
    ap.add_argument("--heartbeat-interval", type=float, default=0.5, help="s (the Wrapper's default)")
    ap.add_argument("--ranks-per-process", type=int, default=128,
                    help="the new protocol's restart runs its simulated ranks in processes of this many threads "
                         "(one interpreter's GIL, not the protocol, bounds a restart of 1,024 threads)")
    ap.add_argument("--timeout", type=float, default=300.0, help="bound on each measured phase, s")
    ap.add_argument("--workdir", default=None, help="folder for the simulated saves (default: the system's temp)")
    ap.add_argument("--replica-groups", type=int, default=128, help="replica groups of the coordinator's row (0: none)")
    ap.add_argument("--ranks-per-group", type=int, default=8)
    ap.add_argument("--replica-steps", type=int, default=30, help="quorums the coordinator's row times")
    ap.add_argument("--out", default="build/bench/scale.json")
    a = ap.parse_args(argv)
    if min(a.ranks) < 2:
        ap.error(f"--ranks must be >= 2, got {a.ranks}")
    if a.replica_groups < 0 or a.ranks_per_group < 1 or a.replica_steps < 3:
        ap.error(f"--replica-groups must be >= 0 (0: no row), --ranks-per-group >= 1 and --replica-steps >= 3, got "
                 f"{a.replica_groups}, {a.ranks_per_group} and {a.replica_steps}")
    rows = []
    for n in a.ranks:
        for protocol in a.protocols:
            t = time.monotonic()
            try:
                row = measure(n, protocol, a)
            except Exception as e:  # a row that fails says why; it is never a silent nan
                row = {"ranks": n, "protocol": protocol, "error": f"{type(e).__name__}: {e}"[:300]}
            row["wall_s"] = time.monotonic() - t
            rows.append(row)
            if "restart_s" in row:
                restart = f"restart {row['restart_s']:.3f} s, {row['store_ops_per_restart']} store ops"
            elif protocol == "legacy" and n > a.legacy_max_ranks:
                restart = f"restart not run (O(N^2): above --legacy-max-ranks {a.legacy_max_ranks})"
            else:
                restart = "restart -"
            print(f"[scale] {n:5d} ranks {protocol:6s} {restart}; heartbeats {row.get('heartbeat_store_ops_per_s', '-')}"
                  f" ops/s; commit {row.get('commit_fs_ops_per_save', '-')} fs ops, idle step "
                  f"{row.get('idle_step_fs_ops', '-')} {row.get('error', '')}", flush=True)
    if a.replica_groups:
        rows.append(replica_row(a))
    report("scale", rows, a.out, "python -m nvrx_lab.bench scale " + shlex.join(argv),
           extra={"heartbeat_interval_s": a.heartbeat_interval},
           columns=["ranks", "protocol", "restart_s", "store_ops_per_restart", "ops_per_rank",
                    "polls_per_rank", "heartbeat_store_ops_per_s", "judge_ms", "commit_fs_ops_per_save", "idle_step_fs_ops",
                    "straggler_report_ms", "straggler_bytes_per_rank", "rendezvous0_s", "processes", "connect_s",
                    "quorum_ms", "quorum_p95_ms", "msgs_in_per_replica_step", "msgs_out_per_replica_step",
                    "coordinator_cpu_ms_per_step", "wall_s", "error"])
    failed = [r for r in rows if "error" in r]
    for r in failed:
        print(f"[scale] FAILED: {r['ranks']} ranks, {r['protocol']}: {r['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
