"""Index 0 replaced: completion index 0 hosts the rendezvous store, and its node goes. The other pods' launchers wait
the short ``rejoin_read_timeout`` (not the first start's 600 s), wait for the replacement's store, and rejoin in
their pods: no failed pod, no retry of ``backoffLimit``, training resumed from the checkpoint."""

from __future__ import annotations

import pytest

from nvrx_lab.eks import JobSpec, render
from nvrx_lab.eks.local import LocalJob, LocalOptions
from nvrx_lab.net import wait_for
from nvrx_lab.observe.events import read_events

TINY = ("--seq-len", "16", "--dim", "32", "--n-layers", "1", "--n-heads", "2", "--hidden-dim", "64", "--log-every", "1")


def _steps(events, after: float = 0.0) -> list[int]:
    return [e["step"] for e in read_events(events) if e["kind"] == "step" and e["rank"] == 0 and e["t"] > after] \
        if events.exists() else []


@pytest.mark.timeout(480)
def test_the_other_pods_rejoin_a_replaced_index_0_in_place(tmp_path):
    s = JobSpec(name="rejoin", image="i", nodes=2, mode="ft_launcher", steps=80, global_batch=16, ckpt_interval=5,
                train_extra=(*TINY, "--step-sleep", "0.1"), initial_heartbeat_timeout=60, heartbeat_timeout=30,
                monitor_interval=0.2, section_timeouts={"checkpoint": 30}, rdzv_rejoin_read_timeout=20)
    with LocalJob(render(s), LocalOptions(workdir=tmp_path, timeout_s=420)) as job:
        events = job.run.local_path("/fsx/rejoin/metrics.jsonl")
        wait_for(lambda: max(_steps(events), default=0) >= 12, 200, "step 12", interval=0.1)  # two cold starts
        lost = job.lose_node(0)  # with 0.1 s steps, seconds before the last step whatever the box's load
        assert max(_steps(events)) < 70, "index 0 was lost too near the end to be rejoined"
        wait_for(job.poll, 240, "the Job to end", interval=0.1)
    run = job.run
    assert run.ok, f"{run.status}\n{run.log(1)[-3000:]}"
    assert [len(p.logs) for p in run.pods] == [2, 1] and run.failures == 0  # index 1's pod never failed
    log = run.log(1)
    assert "RENDEZVOUS the store at rejoin-0.rejoin:29400 stopped answering" not in log  # names are mapped locally
    said = [line for line in log.splitlines() if "RENDEZVOUS the store at" in line]
    assert len(said) == 2 and "stopped answering" in said[0] and "answers again after" in said[1], said
    back = _steps(events, after=lost)
    assert back and back[-1] == 80
    first = min(e["t"] for e in read_events(events) if e["kind"] == "step" and e["t"] > lost)
    assert first - lost < 120, first - lost  # the replacement's cold start (9-18 s here), not a 600 s read
    print(f"index 0 lost: training again after {first - lost:.1f} s; {said}")


def test_the_store_reads_shorter_once_a_rendezvous_completed():
    from datetime import timedelta
    from types import SimpleNamespace

    from torch.distributed import PrefixStore, TCPStore

    from nvrx_lab.launcher.rejoin import shorten_after_rendezvous

    store = TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=600), wait_for_workers=False)
    handler = SimpleNamespace(next_rendezvous=lambda: SimpleNamespace(store=PrefixStore("torch.rendezvous.x.0", store)))
    shorten_after_rendezvous(handler, 20)
    assert store.timeout == timedelta(seconds=600)  # a first start dials for 600 s
    handler.next_rendezvous()
    assert store.timeout == timedelta(seconds=20)  # the round's PrefixStore passes it on to the backend's store


def test_a_rejoin_timeout_longer_than_the_first_start_is_refused():
    with pytest.raises(ValueError, match=r"JobSpec.rdzv_rejoin_read_timeout: 700 s is longer than rdzv_read_timeout "
                                         r"\(600 s\); allowed: 1..600"):
        JobSpec(name="a", image="i", rdzv_rejoin_read_timeout=700)
