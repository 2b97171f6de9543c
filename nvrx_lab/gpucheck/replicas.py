"""Check f of :mod:`nvrx_lab.gpucheck`: the replicate group's abort on NCCL (:mod:`nvrx_lab.replicas.group`).

Three members, one GPU each (``cuda:R``; gloo on the CPU with ``--cpu-dry-run``), meet in a quorum's group and sum.
In the second quorum member 2 hangs (it never issues its part); past their patience the survivors abort the sum, as
the coordinator's word does, and must be out of it at once, not after NCCL's timeout. The third quorum is the
survivors alone: their group is the old one shrunk (``ncclCommShrink``, ``SHRINK_ABORT``) where the backend can, else
a new one, and it sums again. Each member is a clean interpreter of this module (``--member R``) and prints one JSON
line; :func:`check_replica_abort` starts them and reads the lines.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import torch

MEMBERS = (0, 1, 2)
HUNG = 2
PATIENCE_S = 1.0


def member(replica: int, port: int, device: str) -> int:
    from nvrx_lab.replicas.group import ReplicaGroup, StepAborted, open_store
    from nvrx_lab.replicas.protocol import Quorum

    dev = torch.device(device, replica) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store, row = open_store("127.0.0.1", port, timeout=60), {"gpucheck_worker": "replica-abort", "replica": replica}
    aborted = threading.Event()
    group = ReplicaGroup(store, Quorum(1, 1, MEMBERS, None), replica, 0, dev, timeout_s=120).connect(aborted.is_set)
    x = torch.full((1 << 20,), float(replica + 1), device=dev)
    group.all_reduce([x], aborted.is_set, 60, aborted.set)
    row["sum_1"] = float(x[0])
    if replica == HUNG:
        time.sleep(60)  # hung: never issues its part of quorum 2's sum (the parent kills it)
        return 0
    t0 = time.monotonic()
    try:
        group.all_reduce([x], aborted.is_set, PATIENCE_S, aborted.set)  # past patience: the coordinator aborts
    except StepAborted as e:
        row.update(abort_s=round(time.monotonic() - t0 - PATIENCE_S, 3), abort=str(e)[:160])
    aborted.clear()
    survivors = Quorum(3, 1, tuple(m for m in MEMBERS if m != HUNG), None)
    t0, shrink = time.monotonic(), group.can_shrink(survivors)
    if shrink:
        new = group.shrink(survivors, replica).ready(aborted.is_set)  # begun by shrink(), met here (as connect() does)
    else:
        group.close()
        new = ReplicaGroup(store, survivors, replica, 0, dev, timeout_s=120).connect(aborted.is_set)
    row.update(how="shrunk" if shrink else "made", group_s=round(time.monotonic() - t0, 3))
    y = torch.full((1 << 20,), float(replica + 1), device=dev)
    new.all_reduce([y], aborted.is_set, 60, aborted.set)
    row["sum_3"] = float(y[0])
    new.close()
    if dev.type == "cuda":
        row["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    print(json.dumps(row), flush=True)
    os._exit(0)  # the aborted group's pending part waits on the hung member: its destructor would join it


def check_replica_abort(timeout: float, device: str) -> tuple[bool, str, str, list[str]]:
    """(ok, figures, problems, output lines): three members, member 2 hung in the second sum."""
    import torch.distributed as dist

    if device == "cuda" and torch.cuda.device_count() < len(MEMBERS):
        return False, "", (f"needs {len(MEMBERS)} GPUs (one a member: NCCL refuses two ranks of a group on one "
                           f"GPU), found {torch.cuda.device_count()}: not run"), []
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [subprocess.Popen([sys.executable, "-m", "nvrx_lab.gpucheck.replicas", "--member", str(r), "--port",
                               str(store.port), "--device", device], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in MEMBERS]
    outputs = []
    try:
        for r, p in enumerate(procs):
            if r == HUNG:
                continue
            try:
                outputs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                return False, "", f"member {r} did not finish in {timeout:.0f} s (an abort that hangs?)", []
    finally:
        for p in procs:
            p.kill()
            p.wait()
    rows = [json.loads(ln) for out in outputs for ln in out.splitlines() if ln.startswith('{"gpucheck_worker"')]
    if len(rows) != len(MEMBERS) - 1:
        return False, "", f"{len(rows)} of {len(MEMBERS) - 1} survivors reported", [o[-1500:] for o in outputs]
    want_1, want_3 = float(sum(m + 1 for m in MEMBERS)), float(sum(m + 1 for m in MEMBERS if m != HUNG))
    problems = [msg for bad, msg in (
        (any(r["sum_1"] != want_1 for r in rows), f"the first sum is not {want_1}"),
        (any("abort_s" not in r for r in rows), "a survivor's sum was not aborted"),
        (any(r["sum_3"] != want_3 for r in rows), f"the survivors' sum is not {want_3}"),
    ) if bad]
    figures = (f"abort {max(r.get('abort_s', float('nan')) for r in rows):.3f} s past patience; survivors' group "
               f"{rows[0]['how']} in {max(r['group_s'] for r in rows):.3f} s; sums {rows[0]['sum_1']:g}, "
               f"{rows[0]['sum_3']:g}" + (f" (NCCL {rows[0]['nccl']})" if "nccl" in rows[0] else " (gloo)"))
    return not problems, figures, "; ".join(problems), []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nvrx_lab.gpucheck.replicas", description=__doc__.split("\n")[0])
    ap.add_argument("--member", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    a = ap.parse_args(argv)
    return member(a.member, a.port, a.device)


if __name__ == "__main__":
    sys.exit(main())
