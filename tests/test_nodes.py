"""Multi-node restarts on one box: the rendered launcher Job's pods as local process trees (one agent per
"node", one rendezvous endpoint), a whole node lost (its agent and workers SIGKILLed) and replaced as the Job
controller replaces a pod. The benchmark (``python -m nvrx_lab.bench nodes``) runs 4 nodes x 2 workers and
every fault kind; this is its smallest case: 2 nodes x 1 worker, one node loss."""

import pytest

from nvrx_lab.bench import nodes
from nvrx_lab.observe.events import read_events
from nvrx_lab.reliability.trainer import curve_problem


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_lost_node_is_replaced_and_training_resumes_with_nothing_left_running(tmp_path):
    a = nodes.parse(["--nodes", "2", "--nproc", "1", "--node", "1", "--kinds", "node-loss", "--faults-per-kind", "1",
                     "--first-step", "3", "--gap", "3", "--ckpt-interval", "2", "--job-timeout", "120",
                     "--rdzv-conf", "keep_alive_interval=1"])  # a dead node leaves the rendezvous after 3 s, not 15
    job = nodes.run_job("launcher", "node-loss", a, tmp_path / "job")  # every process of the Job killed on the way out
    log = "\n".join(job["restart_log"])
    assert job["error"] is None, job["error"]
    assert job["left"] == [], f"processes of the Job left running: {job['left']}"
    assert job["injected"] == 1 and all(r is not None for r in job["recovery"]), (job["recovery"], log)
    assert "node 0 attempt 0: [nvrx-lab-launch] worker group failed" in log, log  # the survivor restarted its workers
    assert job["pod_failures"] == 0, log  # only the lost pod was replaced
    assert curve_problem(read_events(job["events"]), nodes.fault_steps(a)[-1] + a.gap) is None  # one loss curve


@pytest.mark.parametrize("rank", [0, 1])
def test_rank0_agent_republishes_the_bootstrap_address_in_every_round_for_a_joining_node(rank):
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

    from nvrx_lab.launcher.rounds import republish_bootstrap

    class Handler:  # torch's c10d handler publishes MASTER_ADDR/PORT in its first round only
        def next_rendezvous(self):
            return RendezvousInfo(store, rank, 4, RendezvousStoreInfo("10.0.0.1", 29500))

    store, handler = dist.HashStore(), Handler()
    republish_bootstrap(handler)
    info = handler.next_rendezvous()
    assert info.rank == rank
    if rank == 0:  # a node in its first round reads these in this round's store (RendezvousStoreInfo.build)
        assert RendezvousStoreInfo.build(1, store, None) == RendezvousStoreInfo("10.0.0.1", 29500)
    else:
        assert not store.check([RendezvousStoreInfo.MASTER_ADDR_KEY])
