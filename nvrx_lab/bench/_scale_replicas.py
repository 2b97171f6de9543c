"""The replica coordinator at scale: one quorum per step for R replica groups of K ranks (``bench scale``).

The real coordinator (``python -m nvrx_lab.replicas.coordinator``, its own process) and R × K simulated ranks, each
a real TCP connection speaking the real protocol (:mod:`nvrx_lab.replicas.client`'s messages: ``hello``, then per
step one ``join`` from each group's rank 0 and one quorum answer to every rank), spread over a few worker processes
(``python -m nvrx_lab.bench._scale_replicas``: one selector loop each, no threads). The data plane is left out: a
group's rank 0 joins the next step the moment each of its ranks has the quorum. Per step it times the last join
sent → the last rank holding the new quorum (``quorum_ms``, what every replica waits for at a step boundary), counts
the messages per replica (``msgs_in_per_replica_step``, ``msgs_out_per_replica_step``), and reads the coordinator's
CPU time per step (``coordinator_cpu_ms_per_step``: its work per quorum, O(R) if it is O(1) per replica).
"""

from __future__ import annotations

import json
import selectors
import socket
import subprocess
import sys
import time

from nvrx_lab.net import accepting, free_port, wait_for
from nvrx_lab.observe.table import median, p95
from nvrx_lab.replicas.protocol import VERSION


def measure_replicas(groups: int, ranks: int, steps: int, processes: int, timeout: float) -> dict:
    """Run the coordinator and ``groups`` × ``ranks`` simulated ranks for ``steps`` quorums; one ``bench scale`` row."""
    import psutil

    port = free_port()
    coord = subprocess.Popen([sys.executable, "-m", "nvrx_lab.replicas.coordinator", "--port", str(port), "--replicas",
                              str(groups), "--beat-timeout", "3600"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    workers: list[subprocess.Popen] = []
    try:
        wait_for(lambda: accepting("127.0.0.1", port) or coord.poll() is not None, 60, "the coordinator to listen",
                 interval=0.01)
        if coord.poll() is not None:
            raise RuntimeError(f"the coordinator exited {coord.returncode}: {coord.stderr.read().decode()[-500:]}")
        cpu0 = sum(psutil.Process(coord.pid).cpu_times()[:2])
        bounds = [groups * i // processes for i in range(processes + 1)]
        workers = [subprocess.Popen([sys.executable, "-m", "nvrx_lab.bench._scale_replicas", str(port), str(lo), str(hi),
                                     str(ranks), str(steps), str(timeout)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                   for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]
        outs = []
        for w in workers:
            out, err = w.communicate(timeout=timeout + 30)
            if w.returncode != 0:
                raise RuntimeError(f"a simulated-rank process failed ({w.returncode}): {err.decode()[-800:]}")
            outs.append(json.loads(out))
        cpu = sum(psutil.Process(coord.pid).cpu_times()[:2]) - cpu0
    finally:
        for p in (*workers, coord):
            if p.poll() is None:
                p.kill()
                p.wait()
    per_step = [(max(o["sent"][s] for o in outs), max(o["got"][s] for o in outs)) for s in range(1, steps)]
    waits = [1e3 * (got - sent) for sent, got in per_step]  # step 0 also waits for every hello: left out
    n = groups * steps
    return {"replica_groups": groups, "ranks_per_group": ranks, "quorum_ms": median(waits),
            "quorum_p95_ms": p95(waits),
            "msgs_in_per_replica_step": sum(o["joins"] for o in outs) / n,
            "msgs_out_per_replica_step": sum(o["quorums"] for o in outs) / n,
            "coordinator_cpu_ms_per_step": 1e3 * cpu / steps, "quorum_steps": steps}


def _worker(port: int, lo: int, hi: int, ranks: int, steps: int, timeout: float) -> dict:
    """Groups ``lo..hi-1``: connect every rank, say hello, then join ``steps`` steps; the moments of the last join
    sent and the last quorum received per step."""
    sel = selectors.DefaultSelector()
    socks: dict[tuple[int, int], socket.socket] = {}
    for g in range(lo, hi):
        for r in range(ranks):
            s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall((json.dumps({"op": "hello", "version": VERSION, "replica": g, "rank": r, "ranks": ranks}) + "\n").encode())
            s.setblocking(False)
            socks[g, r] = s
            sel.register(s, selectors.EVENT_READ, [(g, r), b""])
    sent, got = [0.0] * steps, [0.0] * steps
    have: dict[int, int] = {g: 0 for g in range(lo, hi)}  # ranks of the group holding the current step's quorum
    step = {g: 0 for g in range(lo, hi)}
    joins = quorums = 0

    def join(g: int, done: int | None) -> None:
        nonlocal joins
        socks[g, 0].setblocking(True)
        socks[g, 0].sendall((json.dumps({"op": "join", "step": step[g], "done": done}) + "\n").encode())
        socks[g, 0].setblocking(False)
        sent[step[g]] = max(sent[step[g]], time.time())
        joins += 1

    for g in range(lo, hi):
        join(g, None)
    deadline = time.monotonic() + timeout
    while any(step[g] < steps for g in step):
        if time.monotonic() > deadline:
            raise TimeoutError(f"groups {lo}..{hi - 1}: steps {sorted(set(step.values()))} after {timeout} s")
        for key, _ in sel.select(timeout=1.0):
            (g, r), buf = key.data
            data = key.fileobj.recv(1 << 16)
            if not data:
                raise ConnectionError(f"the coordinator closed rank {r} of group {g}")
            *lines, key.data[1] = (buf + data).split(b"\n")
            for line in lines:
                msg = json.loads(line)
                if msg.get("op") != "quorum":  # the welcome
                    continue
                quorums += 1
                got[step[g]] = max(got[step[g]], time.time())
                have[g] += 1
                if have[g] == ranks:  # every rank has the quorum: the group computes (nothing here) and joins the next
                    have[g] = 0
                    step[g] += 1
                    if step[g] < steps:
                        join(g, step[g] - 1)
    for s in socks.values():
        s.close()
    return {"sent": sent, "got": got, "joins": joins, "quorums": quorums}


if __name__ == "__main__":
    port_, lo_, hi_, ranks_, steps_, timeout_ = sys.argv[1:7]
    print(json.dumps(_worker(int(port_), int(lo_), int(hi_), int(ranks_), int(steps_), float(timeout_))))
