"""The in-process restart's store protocol at small N (issue 11): O(1) operations per rank per
event, a rank dying during the rendezvous, two faults at once, the heartbeat judge, a dead store
host. Real ``TCPStore`` servers and clients; simulated ranks are threads, as in ``bench scale``."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from nvrx_lab.bench._scale_model import CountingClient, Ranks
from nvrx_lab.inprocess import rendezvous
from nvrx_lab.inprocess.interrupt import MainThreadInterrupter
from nvrx_lab.inprocess.monitor import MonitorThread, ThreadSettings
from nvrx_lab.inprocess.monitor_process import Judge, Progress
from nvrx_lab.inprocess.rank_assignment import FillGaps, ShiftRanks
from nvrx_lab.inprocess.store import Decision, RestartStore, connect, encode_decision, host
from nvrx_lab.inprocess.watch import KeyWatch
from nvrx_lab.net import free_port, wait_for


@pytest.fixture
def store_port():
    port = free_port()
    server = host(port)
    yield port
    del server


def join_all(ranks: Ranks, n: int, previous: dict, policy=None, who=None, timeout: float = 20.0) -> list:
    policy = policy or ShiftRanks()
    who = list(previous) if who is None else who

    def one(i: int):
        if i not in who:
            return None
        s = ranks.stores[i]
        return rendezvous.join(s, n, i, previous, policy, len(previous), lambda key: s.wait(key, timeout))

    return ranks.run(one, timeout + 5)


@pytest.mark.timeout(60)
def test_rendezvous_decides_once_with_constant_operations_per_rank(store_port):
    ranks = Ranks(8, store_port)
    identity = {r: r for r in range(8)}
    results = join_all(ranks, 0, identity)
    assert all(r == identity for r in results)
    # arrive (append + add), read the death counter, wait, read the decision; the deciders a few more
    per_rank = sorted(sum(c.calls.values()) for c in ranks.clients)
    assert per_rank[0] == 5 and per_rank[-1] <= 10 and sum(per_rank) <= 8 * 6, per_rank
    assert not any(c.calls["check"] > 1 for c in ranks.clients)  # nobody loops over the others' keys


@pytest.mark.timeout(120)
def test_the_first_protocols_poll_reads_every_ranks_keys_whatever_the_polls_count():
    """What notebook 07 compares: the first protocol's operations a rank per rendezvous poll grow with N (2 N + 1
    keys a poll), however many times the threads happened to poll."""
    from nvrx_lab.bench.scale import legacy_restart

    per_poll = {}
    for n in (8, 32):
        port = free_port()
        server = host(port)
        ranks = Ranks(n, port)
        row = legacy_restart(ranks, timeout=30)
        ranks.join(10)
        del server
        assert row["polls_per_rank"] >= 1, row
        per_poll[n] = row["store_ops_per_restart"] / n / row["polls_per_rank"]
    assert per_poll[32] > 1.5 * per_poll[8], per_poll


def test_a_decision_reads_as_the_assignment_it_encodes():
    """Spares are ``None``, ranks outside the attempt are not keys, and a rank reads its own entry directly."""
    assignment = {0: 1, 2: 0, 3: None, 5: 2}
    decision = Decision(encode_decision(assignment))
    assert decision == assignment and dict(decision) == assignment and len(decision) == 4
    assert decision[3] is None and 3 in decision and 1 not in decision and 6 not in decision and -1 not in decision
    with pytest.raises(KeyError):
        decision[4]
    assert sorted(decision) == [0, 2, 3, 5] and decision.get(4, "absent") == "absent"
    assert len(encode_decision({r: r for r in range(4096)})) == 4 * 4096  # 16 KB at 4,096 ranks
    assert Decision(encode_decision({})) == {}  # every member dead: an empty attempt
    first = {0: 0, 1: 1, 2: 2, 3: None}  # the policies see the previous decision as the loop hands it to them
    for policy in (ShiftRanks(spares=1), FillGaps(spares=1)):
        assert policy([0, 2, 3], Decision(encode_decision(first)), 4) == policy([0, 2, 3], first, 4)


@pytest.mark.timeout(60)
def test_a_rank_dying_during_the_rendezvous_is_decided_without_it(store_port):
    """Ranks 0-2 arrive and wait; rank 3 never comes. Its death notice completes the set."""
    ranks = Ranks(4, store_port)
    previous = {0: 0, 1: 1, 2: 2, 3: 3}
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=join_all(ranks, 1, previous, FillGaps(), who=[0, 1, 2])))
    t.start()
    announcer = RestartStore(connect("127.0.0.1", store_port))
    wait_for(lambda: len(announcer.arrived(1)) == 3, 10, "three arrivals")
    time.sleep(0.2)
    assert t.is_alive()  # incomplete: they wait (on one key each, not polling)
    announcer.decide_members(0, {0: 0, 1: 1, 2: 2, 3: 3})  # attempt 0's decision
    announcer.announce_death(3, "dead", "killed", time.time())
    assert rendezvous.help_decide(announcer, FillGaps(), 4) is not None
    t.join(10)
    assert not t.is_alive()
    assert out["r"][:3] == [{0: 0, 1: 1, 2: 2}] * 3


@pytest.mark.timeout(60)
def test_two_faults_at_once_end_the_attempt_once_and_both_are_recorded(store_port):
    stores = [RestartStore(connect("127.0.0.1", store_port)) for _ in range(3)]
    go = threading.Barrier(2)

    def report(r):
        go.wait()
        stores[r].report_fault(0, r, "exception", f"boom on {r}")

    threads = [threading.Thread(target=report, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    stores[2].wait(stores[2].end_key(0), 5)
    assert stores[2].end(0) == "fault"
    assert sorted(f["rank"] for f in stores[2].faults(0)) == [0, 1]
    stores[2].mark_done(0, 2, active=1)  # a late "done" does not turn a failed attempt into a success
    assert stores[2].end(0) == "fault"


@pytest.mark.timeout(60)
def test_the_last_rank_done_ends_the_attempt_as_done(store_port):
    stores = [RestartStore(connect("127.0.0.1", store_port)) for _ in range(3)]
    for r in range(3):
        assert not stores[r].client.check([stores[r].end_key(4)])
        stores[r].mark_done(4, r, active=3)
    assert stores[0].end(4) == "done"


@pytest.mark.timeout(60)
def test_heartbeats_are_judged_once_by_the_store_host(store_port):
    ranks = Ranks(6, store_port)
    judge = Judge(6, interval=0.0, timeout=0.3, policy=ShiftRanks())
    host_store = RestartStore(CountingClient(connect("127.0.0.1", store_port)))
    assert judge.tick(host_store) == []  # nobody beat yet: nothing judged
    for r in range(6):
        ranks.stores[r].beat(r)
    ranks.reset()
    judge.tick(host_store)
    host_store.client.calls.clear()
    t0 = time.monotonic()
    declared = []
    while time.monotonic() - t0 < 5 and not declared:
        for r in range(5):  # rank 5 and its monitor process are gone (a lost node)
            ranks.stores[r].beat(r)
        declared = judge.tick(host_store)
        time.sleep(0.05)
    assert declared == [5]
    assert all(set(c.calls) == {"add"} for c in ranks.clients[:5])  # ranks only beat: they read nothing
    assert host_store.client.calls["multi_get"] >= 1 and host_store.client.calls["check"] == 0  # one read a tick
    notice = host_store.deaths([5])[5]
    assert notice["cause"] == "dead" and "judged by the store host" in notice["detail"]
    assert host_store.faults(0)[0]["rank"] == 5 and host_store.end(0) == "fault"


class LookedAt(Progress):
    """A shared page that counts how often the monitor thread looks at the monitor process's last beat."""

    looks = 0

    @property
    def last_beat(self) -> float:
        self.looks += 1
        return super().last_beat


@pytest.mark.timeout(60)
def test_the_monitor_thread_beats_only_when_its_monitor_process_has_stopped(store_port):
    """One beat a rank reaches the store: the monitor process's, noted in the shared page. The thread stands in
    once those notes are two intervals old (the process is gone), so a rank looks dead only when both stop."""
    client = CountingClient(connect("127.0.0.1", store_port))
    page, interrupter = LookedAt(), MainThreadInterrupter()
    monitor = MonitorThread(RestartStore(client), 3, interrupter, lambda state: None,
                            ThreadSettings(soft_timeout=60.0, heartbeat_interval=0.05, interval=0.005), page=page)
    page._put("beat", time.monotonic() + 3600)  # the monitor process beats (its last beat never gets old here)
    monitor.start()
    try:
        wait_for(lambda: page.looks >= 3, 30, "the monitor thread to look at the process's beats 3 times")
        assert client.calls["add"] == 0
        page._put("beat", time.monotonic())  # the process's last beat: it stops
        wait_for(lambda: client.calls["add"] >= 3, 5, "the monitor thread's beats once the process stopped")
    finally:
        monitor.stop()
        interrupter.restore()
        page.close()
    assert monitor.error is None and int(RestartStore(connect("127.0.0.1", store_port)).client.get("hb/3")) >= 3


HOST = """
import sys, time
from nvrx_lab.inprocess.store import host
server = host(int(sys.argv[1]))
print("up", flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_a_dead_store_host_ends_every_wait_with_an_error():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", HOST, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        watch = KeyWatch(RestartStore(connect("127.0.0.1", port, timeout=2)))
        watch.start()
        handle = watch.watch("it/0/end", timeout=30)
        time.sleep(0.2)
        t0 = time.monotonic()
        proc.kill()
        assert handle.event.wait(20), "the wait outlived the store host"
        assert handle.error is not None, "a wait on a dead host must fail, not return"
        print(f"the wait failed {time.monotonic() - t0:.1f} s after the host died: {handle.error}")
        watch.close()
        assert not watch.is_alive()
    finally:
        proc.kill()
        proc.wait(10)


WRITER = """
import sys, time
from nvrx_lab.inprocess.monitor_process import Progress
page, end = Progress(int(sys.argv[1])), time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    page.write(armed=False)
    page.write(armed=True)  # progress first, then armed
"""


@pytest.mark.timeout(60)
def test_the_monitor_never_reads_half_a_progress_write():
    """A rank writes its progress page while its monitor process reads it: an armed page must never come
    with a progress time older than the arming (pack_into's zero-fill once read as 0, and a healthy rank
    was killed for "no progress for 36,000 s")."""
    page = Progress()
    t0 = time.monotonic()
    page.write(progress=t0, armed=False)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(page.fd), "3"], pass_fds=(page.fd,))
    try:
        wait_for(lambda: page.read()[0] > t0, 30, "the writer's first write")
        reads, torn = 0, []
        while writer.poll() is None:
            progress, _, armed, _ = page.read()
            reads += 1
            if armed and not t0 < progress <= time.monotonic():
                torn.append(progress)
        assert reads > 10_000 and not torn, f"{len(torn)} of {reads} reads saw an armed page with progress {torn[:3]}"
    finally:
        writer.kill()
        writer.wait(10)
        page.close()


@pytest.mark.timeout(120)
def test_a_restart_spread_over_processes_counts_as_in_one():
    """bench scale's restart with its simulated ranks in 3 worker processes (as at 1,024 ranks) takes the same
    store operations as all of them in one process."""
    from nvrx_lab.bench._scale_procs import measure_restart_procs
    from nvrx_lab.bench._scale_restart import measure_restart

    spread = measure_restart_procs(9, 3, timeout=60)
    port = free_port()
    server = host(port)
    try:
        together = measure_restart(Ranks(9, port), timeout=60)
    finally:
        del server
    assert spread["processes"] == 3 and spread["store_ops_per_restart"] == together["store_ops_per_restart"]
    assert 0 < spread["restart_s"] < 60


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", ["new", pytest.param("legacy", marks=pytest.mark.slow)])
def test_a_scale_row_that_times_out_is_an_error_and_the_bench_exits_1_cleanly(tmp_path, protocol):
    """Its simulated ranks are left blocked in store calls: the bench closes the store, joins them and exits 1
    (a thread left in a store call would abort the interpreter at exit: "terminate called", rc -6)."""
    out = tmp_path / "scale.json"
    res = subprocess.run([sys.executable, "-m", "nvrx_lab.bench", "scale", "--ranks", "8", "--protocols", protocol,
                          "--timeout", "1e-6", "--out", str(out)], capture_output=True, text=True, timeout=100)
    assert res.returncode == 1, res.stderr[-3000:]
    assert f"FAILED: 8 ranks, {protocol}: TimeoutError" in res.stderr and "terminate called" not in res.stderr
    assert '"error"' in out.read_text()


SLOW_MODULE = """
import signal, threading, time
signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)  # the monitor's interrupt, mid-import
time.sleep(0.05)
DONE = True
"""


def test_an_interrupt_during_an_import_waits_for_the_import_and_says_so(tmp_path, monkeypatch, capfd):
    """Raised inside an import, the interrupt left torch._dynamo half-initialised and every later attempt failed on it
    (a loaded box took over the soft timeout to import it in the first step): it waits for the import, and the
    re-sent one (the monitor re-sends every 0.2 s while armed) raises after it."""
    import importlib
    import signal
    import sys
    import threading

    from nvrx_lab.inprocess.interrupt import RankShouldRestart

    (tmp_path / "nvrx_slow_module.py").write_text(SLOW_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    interrupter = MainThreadInterrupter()
    interrupter.armed = True
    try:
        module = importlib.import_module("nvrx_slow_module")
        assert module.DONE and sys.modules["nvrx_slow_module"] is module, "the import finished whole"
        with pytest.raises(RankShouldRestart):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
            time.sleep(1)
    finally:
        interrupter.restore()
        sys.modules.pop("nvrx_slow_module", None)
    assert "interrupt deferred until the main thread has imported nvrx_slow_module" in capfd.readouterr().err
