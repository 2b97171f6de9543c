"""Multi-node restarts on one box: the rendered launcher Job's pods as local process trees (one agent per
"node", one rendezvous endpoint), a whole node lost (its agent and workers SIGKILLed) and replaced as the Job
controller replaces a pod. The benchmark (``python -m nvrx_lab.bench nodes``) runs 4 nodes x 2 workers and
every fault kind; this is its smallest case: 2 nodes x 1 worker, one node loss."""

import re

import pytest

from nvrx_lab.bench import nodes
from nvrx_lab.eks.local_roles import pod_with, waiting
from nvrx_lab.observe.events import read_events
from nvrx_lab.reliability.trainer import curve_problem


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_lost_node_is_replaced_and_training_resumes_with_nothing_left_running(tmp_path):
    a = nodes.parse(["--nodes", "2", "--nproc", "1", "--node", "1", "--kinds", "node-loss", "--faults-per-kind", "1",
                     "--first-step", "3", "--gap", "3", "--ckpt-interval", "2", "--job-timeout", "120"])
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


@pytest.mark.timeout(240)
def test_a_repeat_offender_leaves_on_its_health_check_and_a_spare_takes_its_place(tmp_path):
    """Node rank 1's GPU fails a few steps into its first attempt and takes its RDMA port down (its own sysfs tree): at
    the next round its launcher leaves with exit 5 before its workers start, the hot spare is admitted in its place,
    and nothing strikes again (its replacement pod lands on a healthy node); the Job succeeds with one pod failure.
    Which pod trains as node rank 1 and which waits as the spare is the rendezvous's choice (arrival): the roles are
    read from the run, never assumed from the pods' indexes."""
    a = nodes.parse(["--nodes", "2", "--nproc", "1", "--node", "1", "--kinds", "repeat+checks", "--faults-per-kind", "3",
                     "--faults-per-job", "3", "--first-step", "4", "--gap", "6", "--ckpt-interval", "3",
                     "--job-timeout", "200"])
    job = nodes.run_job("launcher", "repeat+checks", a, tmp_path / "job")
    log = "\n".join(job["restart_log"])
    assert job["error"] is None and job["left"] == [], job["error"]
    roles = job["roles"]  # pod -> node rank in the first round; the pod it left out waited as the spare
    assert sorted(roles.values()) == [0, 1], (roles, log)
    bad, [spare] = pod_with(roles, 1), waiting(roles, 3)
    assert f"node {bad} attempt 0: [nvrx-lab-launch] rendezvous: admitted as node 1 of 2 in round 0" in log, log
    said = f"roles {roles}, exits {job['exits']}, pod failures {job['pod_failures']}\n{log}"
    assert job["injected"] == 1 and job["unhealthy_exits"] == 1 and job["pod_failures"] == 1, said
    assert f"node {bad} attempt 0: [nvrx-lab-launch] health check failed: nic: 1 port(s) not active" in log, log
    # a later round, whichever: the lost node's keep-alive may expire before or after the survivor's first new round
    assert re.search(rf"node {spare} attempt 0: \[nvrx-lab-launch\] rendezvous: admitted as node 1 of 2 in round [1-9]", log), log
    assert curve_problem(read_events(job["events"]), nodes.fault_steps(a)[-1] + a.gap) is None  # one loss curve


def test_a_nodes_own_sysfs_tree_comes_from_its_environment_unless_the_flag_says():
    from nvrx_lab.launcher.cli import parse

    _, config = parse(["--nproc-per-node", "1", "/bin/true"], environ={"NVRX_LAB_HEALTH_SYSFS": "/node/sys"})
    assert config.health_sysfs == "/node/sys"
    _, config = parse(["--nproc-per-node", "1", "--health-sysfs", "/flag/sys", "/bin/true"],
                      environ={"NVRX_LAB_HEALTH_SYSFS": "/node/sys"})
    assert config.health_sysfs == "/flag/sys"
