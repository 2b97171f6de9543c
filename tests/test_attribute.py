"""Fault attribution (``nvrx_lab.observe.attribute``): each category from hand-written evidence, a hang named by real
flight-recorder dumps, the trainer's ``crash`` event, and every injected fault of a goodput study attributed right."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ROOT, in_process, run_group

from nvrx_lab.observe.attribute import attribute, attribute_events, main, read_stream


def start(t: float, rank: int, node: int = 0, host: str = "h0", world_size: int = 2, **fields) -> dict:
    return {"t": t, "kind": "start", "rank": rank, "world_size": world_size, "node": node, "host": host, **fields}


def crash(t: float, rank: int, error: str, message: str, peer_lost: bool = False, step: int | None = None) -> dict:
    return {"t": t, "kind": "crash", "rank": rank, "error": error, "message": message, "step": step, "peer_lost": peer_lost}


def failure(t: float, rank: int, reason: str, restart_count: int = 1, **fields) -> dict:
    return {"t": t, "kind": "launcher_failure", "rank": rank, "reason": reason, "restart_count": restart_count,
            "detail": fields.pop("detail", reason), **fields}


def restart(t: float, rank: int, cause: str, fault_rank: int, detail: str, iteration: int = 0, **fields) -> dict:
    return {"t": t, "kind": "restart", "rank": rank, "iteration": iteration, "cause": cause, "fault_rank": fault_rank,
            "detail": detail, "t_fault": fields.pop("t_fault", t - 0.5), "detect_s": 0.1, **fields}


def two_ranks(t: float = 0.0) -> list[dict]:
    return [start(t, 0), start(t, 1)]


def only(events: list[dict], folder: Path | None = None):
    (v,) = attribute_events(events, folder)
    return v


PEER = "Connection closed by peer [127.0.0.1]:1234"


def test_an_exception_under_the_launcher_names_the_rank_that_raised_not_the_peer():
    v = only(two_ranks() + [crash(5.0, 1, "InjectedFault", "injected exception on rank 1 at step 7", step=7),
                            crash(5.1, 0, "RuntimeError", PEER, peer_lost=True),
                            failure(5.3, 0, "exit", exit_code=1), failure(5.3, 1, "exit", exit_code=1)])
    assert (v.rank, v.node, v.host, v.category, v.t) == (1, 0, "h0", "exception", 5.0)
    assert v.detail.startswith("InjectedFault: injected exception") and "(step 7)" in v.detail
    assert v.via == "launcher restart 1" and len(v.evidence) == 4
    assert "fault 1 at" in v.headline(1) and "rank 1 (node 0, host h0): exception InjectedFault" in v.headline(1)


@pytest.mark.parametrize("error, message", [("MemoryError", "injected memory exhaustion"),
                                            ("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB")])
def test_out_of_memory(error, message):
    v = only(two_ranks() + [crash(5.0, 1, error, message), failure(5.3, 1, "exit", exit_code=1)])
    assert (v.rank, v.category) == (1, "oom") and v.detail.startswith(error)
    w = only(two_ranks() + [restart(6.0, r, "exception", 1, f"{error}: {message}") for r in (0, 1)])
    assert (w.rank, w.category, w.via) == (1, "oom", "in-process restart (attempt 0)")


def test_a_signal_beats_the_peers_exit_codes():
    v = only(two_ranks() + [crash(5.0, 0, "RuntimeError", PEER, peer_lost=True),
                            failure(5.2, 1, "signal", detail="killed by SIGKILL", exit_code=-9, signal="SIGKILL", detect_s=0.2),
                            failure(5.2, 0, "exit", exit_code=1)])
    assert (v.rank, v.category, v.detail) == (1, "killed", "by SIGKILL") and v.t == pytest.approx(5.0)


def test_a_whole_node_lost_at_once():
    starts = [start(0.0, r, node=r // 2, host=f"h{r // 2}", world_size=4) for r in range(4)]
    lost = [failure(5.0, r, "signal", exit_code=-9, signal="SIGKILL") for r in (2, 3)]
    v = only(starts + lost + [failure(5.0, r, "exit", exit_code=1) for r in (0, 1)])
    assert (v.category, v.node, v.host) == ("node_lost", 1, "h1") and v.rank in (2, 3)
    dead = [restart(6.0, r, "dead", 2, "process exited", reports=[["dead", 2], ["dead", 3]]) for r in (0, 1)]
    assert (only(starts + dead).category, only(starts + dead).node) == ("node_lost", 1)
    store = {"t": 5.0, "kind": "launcher_rendezvous", "rank": -1, "host": "h1",
             "line": "RENDEZVOUS the store at h0:29400 stopped answering (DistNetworkError): its node is gone"}
    gone = starts + [store] + [failure(5.1, r, "exit", exit_code=1) for r in (2, 3)]
    assert (only(gone).category, only(gone).node, only(gone).host) == ("node_lost", 0, "h0")


def test_a_rank_gone_without_a_word_under_torchrun():
    pod = {"t": 6.0, "kind": "pod_restart", "rank": 0, "reason": "job exited 1", "restart_count": 1}
    v = only(two_ranks() + [crash(5.0, 0, "RuntimeError", PEER, peer_lost=True), pod])
    assert (v.rank, v.category, v.via) == (1, "killed", "pod restart 1")


def test_a_collective_timeout_is_a_hang_on_the_rank_that_did_not_time_out():
    msg = "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation to complete"
    pod = {"t": 9.0, "kind": "pod_restart", "rank": 0, "reason": "job exited 1", "restart_count": 1}
    v = only(two_ranks() + [crash(8.0, 0, "RuntimeError", msg), pod])
    assert (v.rank, v.category) == (1, "hang") and "rank 0: RuntimeError: Timed out waiting 5000ms" in v.detail
    every = [crash(8.0, r, "DistBackendError", "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)")
             for r in (0, 1)]
    assert (only(two_ranks() + every).category, only(two_ranks() + every).via) == ("nccl_timeout", "crash (not restarted)")


def test_a_hang_without_dumps_keeps_the_first_reports_rank_and_says_it_is_unsure():
    v = only(two_ranks() + [restart(9.0, r, "hang", 1, "no ping for 3.01 s (soft_timeout 3.0 s)") for r in (0, 1)])
    assert (v.rank, v.category, v.collective, v.sure) == (1, "hang", None, False) and "no ping" in v.detail
    assert "no dump tells the hung rank from those waiting for it" in v.detail
    hung = [failure(9.0, r, "hang", detect_s=3.0) for r in (0, 1)]
    counted = [{"t": 9.1, "kind": "trace_dump", "rank": r, "ok": True, "path": f"gone/rank_{r}", "entries": 230 - r}
               for r in (0, 1)]  # the files replaced since: the counts the events kept still tell
    w = only(two_ranks() + hung + counted)
    assert (w.rank, w.sure) == (1, True)
    assert "trace dumps: rank 1 recorded 229 collectives, the others up to 230" in w.evidence[-1]


def test_torchruns_log_names_a_killed_rank():
    log = ["[0]:", "time      : 2026-12-06_19:25:11", "host      : localhost", "rank      : 1 (local_rank: 1)",
           "exitcode  : -9 (pid: 9569)  (SIGKILL)", "error_file: <N/A>", "traceback : Signal 9 (SIGKILL) received by PID 9569"]
    pod = {"t": 6.0, "kind": "pod_restart", "rank": 0, "reason": "job exited 1", "restart_count": 1, "job_log": log}
    v = only(two_ranks() + [pod])  # its peer was stopped by torchrun before it noticed: no crash event at all
    assert (v.rank, v.category, v.detail) == (1, "killed", "by SIGKILL (torchrun's root cause)")
    assert "torchrun's root cause: rank      : 1 (local_rank: 1)" in v.evidence
    bare = only(two_ranks() + [{**pod, "job_log": []}])
    assert (bare.rank, bare.category, bare.sure) == (None, "exit", False) and "silent: ranks [0, 1]" in bare.detail


def test_health_checks():
    bad = {"t": 3.0, "kind": "health", "rank": -1, "check": "nic", "status": "failed", "evidence": "port 1 DOWN",
           "host": "h1"}
    ok = {**bad, "check": "disk", "status": "ok", "evidence": "fine"}
    starts = [start(1.0, r, node=r, host=f"h{r}") for r in (0, 1)]
    v = only(starts + [ok, bad])
    assert (v.category, v.rank, v.node, v.host, v.detail) == ("health", None, 1, "h1", "nic: port 1 DOWN")
    w = only(starts + [restart(9.0, 0, "unhealthy", 1, "health check failed: HealthCheckError: CUDA device unhealthy")])
    assert (w.category, w.rank, w.node) == ("health", 1, 1)


def test_two_layers_reporting_one_fault_make_one_verdict():
    both = two_ranks() + [restart(5.2, 0, "dead", 1, "process exited without finishing (killed?)", t_fault=5.0),
                          failure(5.1, 1, "signal", exit_code=-9, signal="SIGKILL", detect_s=0.1),
                          failure(5.1, 0, "exit", exit_code=1)]
    v = only(both)
    assert (v.rank, v.category) == (1, "killed") and "in-process restart" in v.via and "launcher restart 1" in v.via


def test_the_injectors_confession_is_never_read():
    confession = {"t": 4.9, "kind": "fault", "rank": 0, "fault": "hang", "target": 0, "step": 7}
    assert attribute_events(two_ranks() + [confession]) == []
    v = only(two_ranks() + [confession, crash(5.0, 1, "InjectedFault", "boom"), failure(5.3, 1, "exit", exit_code=1)])
    assert (v.rank, v.category) == (1, "exception")


# -- flight-recorder dumps: two gloo ranks, rank 0 waits in an all_reduce rank 1 never enters --------------------------
DUMPER = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace
    rank, folder = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), 2), rank=rank, world_size=2)
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    dist.barrier()
    if rank == 0:
        dist.all_reduce(t, async_op=True)  # rank 1 never enters it
    data = _dump_fr_trace()
    os.makedirs(os.path.join(folder, "nccl-trace"), exist_ok=True)
    with open(os.path.join(folder, "nccl-trace", f"rank_{rank}"), "wb") as f:
        f.write(data)
    sys.stdout.flush()
    os._exit(0)  # rank 0's collective never ends
""")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fr")
    (folder / "dumper.py").write_text(DUMPER)
    procs = [subprocess.Popen([sys.executable, str(folder / "dumper.py"), str(r), str(folder)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    return folder


def test_a_launcher_hang_named_by_the_flight_recorder(dumps):
    t = time.time()
    ev = two_ranks(t - 30) + [failure(t, r, "hang", detail="missed heartbeats for 3.1 s", detect_s=3.1) for r in (0, 1)]
    ev += [{"t": t + 0.1, "kind": "trace_dump", "rank": r, "ok": True, "path": str(dumps / "nccl-trace" / f"rank_{r}"),
            "entries": 5 - r} for r in (0, 1)]
    v = only(ev, dumps)
    assert (v.rank, v.category, v.collective) == (1, "hang", "gloo:all_reduce #5"), v.evidence
    assert "(the first report named rank 0, which waits in gloo:all_reduce #5 for rank 1)" in v.evidence
    fr = [e for e in v.evidence if e.startswith("flight recorder")]  # (completed: as far as gloo's thread had marked)
    assert fr[0].startswith("flight recorder rank 0: process group 0 entered #5 (gloo:all_reduce)"), fr
    assert fr[1].startswith("flight recorder rank 1: process group 0 entered #4 (gloo:barrier)"), fr
    assert fr[0].endswith("waits in #5") and fr[1].endswith("never entered #5"), fr
    moved = [{**e, "path": f"elsewhere/{Path(e['path']).name}"} if e["kind"] == "trace_dump" else e for e in ev]
    assert only(moved, dumps).collective == "gloo:all_reduce #5"  # found by name beside the stream
    older = [{**e, "t": e["t"] - 60} for e in ev]  # the dumps were written after this fault: not its evidence
    assert only(older, dumps).collective is None


def test_an_in_process_collective_timeout_is_the_hang_the_aborts_dumps_name(dumps, tmp_path):
    t = time.time()
    said = "DistBackendError: Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE)"
    ev = two_ranks(t - 30) + [restart(t, r, "exception", 0, said, t_fault=t - 0.5,
                                      trace_dump=str(dumps / "nccl-trace" / f"rank_{r}")) for r in (0, 1)]
    v = only(ev, dumps)
    assert (v.rank, v.category, v.collective) == (1, "hang", "gloo:all_reduce #5") and "Watchdog" in v.detail
    bare = only([{**e, "trace_dump": None} if e["kind"] == "restart" else e for e in ev], tmp_path)
    assert (bare.rank, bare.category) == (0, "nccl_timeout")  # no dump anywhere: the rank that timed out, as reported


def test_dumps_nobody_named_are_found_beside_the_stream(dumps):
    t = time.time()
    msg = "Timed out waiting 5000ms for recv operation to complete"
    pod = {"t": t, "kind": "pod_restart", "rank": 0, "reason": "job exited 1", "restart_count": 1}
    v = only(two_ranks(t - 30) + [crash(t - 1, 0, "RuntimeError", msg), pod], dumps)
    assert (v.rank, v.category, v.collective) == (1, "hang", "gloo:all_reduce #5")


def test_the_observe_layer_never_imports_torch(dumps):
    code = ("import sys; from nvrx_lab.observe.attribute import attribute; attribute(sys.argv[1]); "
            "assert 'torch' not in sys.modules")
    (dumps / "events.jsonl").write_text(json.dumps(start(time.time(), 0)) + "\n")
    subprocess.run([sys.executable, "-c", code, str(dumps)], check=True, timeout=60, cwd=ROOT)


# -- the command ----------------------------------------------------------------------------------------------------
def test_the_command_prints_a_block_per_fault_and_json(tmp_path, capsys):
    ev = two_ranks() + [crash(5.0, 1, "InjectedFault", "boom"), failure(5.3, 1, "exit", exit_code=1)]
    run_dir = tmp_path / "run" / "faults-0"
    run_dir.mkdir(parents=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev) + '{"t": 6.0, "kind": "st')  # torn
    (run_dir / "faults_fired.jsonl").write_text('{"id": "1:5:exception", "t": 4.0, "rank": 1}\n')  # not a stream
    res = in_process(main, str(tmp_path / "run"), capsys=capsys)
    assert res.returncode == 0, res
    lines = res.stdout.splitlines()
    assert lines[0] == "faults-0/events.jsonl: 1 fault" and len(lines) == 4
    assert "fault 1 at" in lines[1] and "rank 1 (node 0, host h0): exception InjectedFault: boom" in lines[1]
    assert lines[2].lstrip().split(" ", 1)[1].startswith("crash rank 1: error=InjectedFault")
    res = in_process(main, str(tmp_path / "run"), "--json", capsys=capsys)
    (v,) = json.loads(res.stdout)
    assert (v["rank"], v["category"], v["stream"]) == (1, "exception", "faults-0/events.jsonl")


def test_a_bad_run_dir_is_one_error_line(tmp_path, capsys):
    for path in (tmp_path / "missing", tmp_path):
        res = in_process(main, str(path), capsys=capsys)
        assert res.returncode == 2 and res.stdout == ""
        assert res.stderr.startswith("error: RUN_DIR ") and str(path) in res.stderr and res.stderr.count("\n") == 1


def test_torn_and_foreign_lines_are_skipped(tmp_path):
    path = tmp_path / "e.jsonl"
    path.write_bytes(b'{"t": 1.0, "kind": "start", "rank": 0}\n[1, 2]\n\xff\xfe\n{"t": "x", "kind": "a"}\n{"t": 2.0, "ki')
    assert read_stream(path) == [{"t": 1.0, "kind": "start", "rank": 0}]


# -- the trainer's side: where each rank runs, and the exception that ends it ---------------------------------------
@pytest.mark.timeout(150)
def test_the_trainer_says_where_it_runs_and_why_it_crashed(tmp_path):
    metrics = tmp_path / "events.jsonl"
    res = run_group([sys.executable, "-m", "nvrx_lab.train", "--steps", "4", "--faults", "0:3:oom", "--metrics",
                     str(metrics), "--log-every", "0"], timeout=120)
    assert res.returncode == 1 and "MemoryError: injected memory exhaustion" in res.stdout  # the traceback, as before
    (s,) = read_events_of(metrics, "start")
    assert (s["node"], s["host"]) == (0, socket.gethostname())
    (c,) = read_events_of(metrics, "crash")
    assert (c["error"], c["step"], c["peer_lost"]) == ("MemoryError", 3, False)
    assert c["message"] == "injected memory exhaustion on rank 0 at step 3"
    (v,) = attribute(tmp_path)
    assert (v.rank, v.node, v.category, v.via) == (0, 0, "oom", "crash (not restarted)")


def read_events_of(path: Path, kind: str) -> list[dict]:
    return [e for e in read_stream(path) if e["kind"] == kind]


# -- the goodput study: every injected fault attributed right -----------------------------------------------------
EXPECTED = {"exception": "exception", "sigkill": "killed", "hang": "hang", "oom": "oom"}


@pytest.mark.timeout(360)
def test_every_fault_of_a_goodput_study_is_attributed_right(tmp_path):
    """Both restart layers, the four fault kinds (sigkill last: in-process, the survivors go on without rank 1)."""
    cmd = [sys.executable, "-m", "nvrx_lab.bench", "goodput", "--steps", "60", "--faults", "4", "--ckpt-interval", "10",
           "--modes", "launcher", "inprocess", "--kinds", "exception", "hang", "oom", "sigkill", "--ideal-step-s", "0.05",
           "--workdir", str(tmp_path / "study"), "--out", str(tmp_path / "goodput.json")]
    res = run_group(cmd, timeout=330)
    assert res.returncode == 0, res.stdout[-3000:]
    verdicts = attribute(tmp_path / "study")
    streams = sorted((tmp_path / "study").rglob("events.jsonl"))
    assert len(streams) == 4  # each mode's run with faults and its fault-free twin
    for stream in streams:
        faults = sorted(read_events_of(stream, "fault"), key=lambda e: e["t"])
        mine = [v for v in verdicts if (tmp_path / "study" / v.stream) == stream]
        assert len(mine) == len(faults) == (4 if "faults-" in str(stream) else 0), (stream, mine)
        for f, v in zip(faults, mine, strict=True):
            said = f"{stream.parent.parent.name}: {f['fault']} on rank {f['target']} -> {v.headline(0)}"
            assert (v.rank, v.node, v.host, v.category, v.sure) == (f["target"], 0, socket.gethostname(),
                                                                    EXPECTED[f["fault"]], True), said
            if f["fault"] == "exception":
                assert v.detail.startswith("InjectedFault: injected exception"), said
            if f["fault"] == "hang":  # the dumps name the collective rank 0 waits in
                assert v.collective and v.collective.startswith("gloo:"), said
