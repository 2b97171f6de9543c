"""The launcher's c10d rendezvous: a keep-alive of a fraction of a second and a shorter poll while a round forms
(:func:`nvrx_lab.launcher.rounds.handler`, the rules in :func:`nvrx_lab.sizing.timing`)."""

from __future__ import annotations

import subprocess
import sys
import threading
from datetime import timedelta

import pytest

from nvrx_lab.net import free_port
from nvrx_lab.sizing import for_nodes, problem, store_mbps, timing


@pytest.mark.parametrize(("conf", "said"), [
    ({"keep_alive_interval": "x"}, "keep_alive_interval takes seconds > 0"),
    ({"keep_alive_interval": "0"}, "keep_alive_interval=0,"),
    ({"keep_alive_max_attempt": "0.5"}, "keep_alive_max_attempt a whole number >= 1"),
    ({"poll_interval": "2"}, "poll_interval seconds from 0.01 to 1"),
    ({"keep_alive_interval": "0.1", "poll_interval": "0.2"}, "(0.3 s) must be at least 2 x poll_interval (0.4 s)"),
])
def test_bad_rendezvous_timing_is_refused_naming_the_keys(conf, said):
    with pytest.raises(ValueError) as err:
        timing(conf)
    assert str(err.value).startswith("--rdzv-conf keep_alive_interval=") and said in str(err.value), str(err.value)


def test_timing_defaults_are_torchs_and_fractions_are_kept():
    assert timing({}) == (5.0, 3, 1.0)
    assert timing({"keep_alive_interval": "0.5", "poll_interval": "0.2"}) == (0.5, 3, 0.2)


def test_a_jobs_timing_follows_its_size_within_the_stores_budget():
    assert for_nodes(17) == (0.5, 0.2)  # the real job: 16 nodes and a spare
    keep, poll = for_nodes(2048)
    assert poll == 1.0 and store_mbps(2048, keep) <= 200 < store_mbps(2048, keep - 0.1)
    assert problem(17, *for_nodes(17)) is None
    field, said = problem(1024, 1.0, 1.0)
    assert field == "rdzv_keep_alive_s" and "273 MB/s" in said
    assert problem(2048, 6.0, 1.0) is None  # torch's own one-second poll is never refused


def test_the_launcher_says_bad_rendezvous_timing_in_one_line_and_exits_2():
    out = subprocess.run([sys.executable, "-m", "nvrx_lab.launcher", "--standalone", "--nproc-per-node", "1",
                          "--rdzv-conf", "keep_alive_interval=0.1", "-m", "nvrx_lab.train", "--steps", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: --rdzv-conf keep_alive_interval=0.1,keep_alive_max_attempt=3,poll_interval=1.0: a node beats once a poll "
        "while a round forms, so keep_alive_interval x keep_alive_max_attempt (0.3 s) must be at least 2 x poll_interval "
        "(2 s), or live nodes are dropped"], out.stderr


def _params(port: int, is_host: bool, **conf):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="t", min_nodes=2, max_nodes=2,
                                is_host=str(is_host).lower(), join_timeout="30", read_timeout="30", **conf)


@pytest.mark.timeout(120)
def test_two_nodes_meet_with_a_fractional_keep_alive_and_a_short_poll(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from nvrx_lab.launcher import rounds

    monkeypatch.setattr(dynamic_rendezvous, "_delay", dynamic_rendezvous._delay)  # poll_every's change undone after
    port = free_port()
    conf = {"keep_alive_interval": "0.5", "poll_interval": "0.2"}
    host = rounds.handler(_params(port, True, **conf))
    other = rounds.handler(_params(port, False, **conf))
    for h in (host, other):
        assert h._settings.keep_alive_interval == timedelta(seconds=0.5) and h._state_holder._cache_duration == 0.2
    assert dynamic_rendezvous._delay.torch_delay is not dynamic_rendezvous._delay  # the one-second poll replaced
    results = {}
    threads = [threading.Thread(target=lambda h=h, i=i: results.__setitem__(i, h.next_rendezvous()))
               for i, h in enumerate((host, other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted((r.rank, r.world_size) for r in results.values()) == [(0, 2), (1, 2)]
    for h in (other, host):
        h.shutdown()


def test_a_torch_without_the_settings_the_poll_changes_is_said(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from nvrx_lab.launcher.rounds import poll_every

    monkeypatch.delattr(dynamic_rendezvous, "_delay")
    with pytest.raises(RuntimeError, match="poll_interval: this torch's c10d handler has no _delay"):
        poll_every(object(), 0.2)
