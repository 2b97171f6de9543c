"""Hot spare nodes (``JobSpec.spare_nodes``): the Job runs ``nodes + spare_nodes`` pods, torch's c10d rendezvous
admits ``nodes`` and holds the rest (its redundancy list); a lost node's place is taken by the spare while
Kubernetes is still placing the lost pod's replacement, which then waits as the next spare."""

from __future__ import annotations

import re

import pytest

from nvrx_lab.eks import JobSpec, render
from nvrx_lab.eks.kueue import kueue_objects
from nvrx_lab.eks.local import LocalJob, LocalOptions
from nvrx_lab.eks.local_roles import describe, node_ranks, pod_with, waiting
from nvrx_lab.eks.render import find
from nvrx_lab.net import wait_for
from nvrx_lab.observe.events import read_events

TINY = ("--seq-len", "16", "--dim", "32", "--n-layers", "1", "--n-heads", "2", "--hidden-dim", "64", "--log-every", "1")
REPLACE_AFTER_S = 60.0
"""The lost pod's replacement starts this long after the loss (EKS: minutes to place and start it)."""


def spec(**kw) -> JobSpec:
    return JobSpec(**{"name": "spares", "image": "i", "nodes": 2, "spare_nodes": 1, "workload": "job", **kw})


def _steps(events, after: float = 0.0) -> list[dict]:
    return [e for e in read_events(events) if e["kind"] == "step" and e["rank"] == 0 and e["t"] > after] \
        if events.exists() else []


def test_spares_render_as_more_pods_than_nodes_and_a_success_policy_for_the_nodes():
    ms = render(spec(nodes=16, spare_nodes=2))
    job = find(ms, "Job")[0]["spec"]
    assert (job["completions"], job["parallelism"]) == (18, 18)
    assert job["successPolicy"] == {"rules": [{"succeededCount": 16}]}  # the spares still waiting are stopped
    env = {e["name"]: e.get("value") for e in job["template"]["spec"]["containers"][0]["env"]}
    assert env["NNODES"] == "16"  # the rendezvous admits 16: --nnodes=16, min = max
    assert "successPolicy" not in find(render(spec(spare_nodes=0)), "Job")[0]["spec"]
    pod = job["template"]["spec"]
    quota = kueue_objects(spec(nodes=16, spare_nodes=2), pod)[1]["spec"]["resourceGroups"][0]["flavors"][0]["resources"]
    assert {r["name"]: r["nominalQuota"] for r in quota}["nvidia.com/gpu"] == str(18 * 8)  # the spares' GPUs queued too


@pytest.mark.parametrize("bad, said", [
    (dict(spare_nodes=-1), "JobSpec.spare_nodes: must be an integer >= 0, got -1"),
    (dict(spare_nodes=1, mode="baseline"), "JobSpec.spare_nodes: 1 with mode 'baseline': spares wait in the launcher's "
                                          "rendezvous; allowed: 0 here, or mode ft_launcher / ft_launcher+inprocess"),
    (dict(spare_nodes=1, mode="replicas"), "JobSpec.spare_nodes: 1 with mode 'replicas'"),
])
def test_spares_outside_the_launchers_rendezvous_are_refused_naming_the_field(bad, said):
    with pytest.raises(ValueError, match="^" + re.escape(said)):
        spec(**bad)


@pytest.mark.timeout(300)
def test_a_spare_takes_a_lost_nodes_place_before_its_replacement_pod_starts(tmp_path):
    # node rank 1's worker holds at step 12 (a pause fault) until its node is lost: no run is too fast for the loss.
    # Which pod holds node rank 1 and which waits as the spare is the rendezvous's choice (arrival): read from the run.
    s = spec(mode="ft_launcher", steps=60, global_batch=16, ckpt_interval=5, faults="1:12:pause:600", train_extra=TINY,
             initial_heartbeat_timeout=60, heartbeat_timeout=30, monitor_interval=0.2, section_timeouts={"checkpoint": 30})
    options = LocalOptions(workdir=tmp_path, timeout_s=280, replace_after_s=REPLACE_AFTER_S)
    with LocalJob(render(s), options) as job:
        events = job.run.local_path("/fsx/spares/metrics.jsonl")
        wait_for(lambda: job.poll() or (events.exists() and read_events(events, "fault")), 150, "the hold at step 12",
                 interval=0.1)
        roles = node_ranks(job, events, nproc=1)
        assert sorted(roles.values()) == [0, 1], roles
        lost_pod, [spare] = pod_with(roles, 1), waiting(roles, 3)
        print(f"roles in the first round: {describe(roles, 3)}; losing pod {lost_pod}")
        lost = job.lose_node(lost_pod)
        wait_for(lambda: job.poll() or bool(_steps(events, lost)), 60, "training after the loss", interval=0.1)
        back = _steps(events, lost)[0]["t"] - lost
        wait_for(job.poll, 200, "the Job to end", interval=0.1)
    run = job.run
    assert run.status == "Succeeded" and run.failures == 0, f"{run.status} {run.reason}\n{run.log(0)[-3000:]}"
    assert back < REPLACE_AFTER_S / 2, back  # the spare, not the replacement (which starts after 60 s)
    assert _steps(events)[-1]["step"] == 60
    spare_log = run.log(spare)  # a later round, whichever: the lost node's keep-alive may expire before or after a round
    assert re.search(r"rendezvous: admitted as node 1 of 2 in round [1-9]\d*, .* taking a lost node's place", spare_log)
    assert run.pods[spare].returncodes[-1] == 0  # it trained to the end
    print(f"node rank 1 lost with pod {lost_pod}: training again after {back:.1f} s on pod {spare}, the spare")
