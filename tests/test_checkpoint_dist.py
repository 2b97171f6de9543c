"""Real processes: 2 FSDP2 ranks save (sync + async), then 3 ranks and 1 plain process load (resharding)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from nvrx_lab.checkpoint import AsyncCheckpointer, step_dir
from nvrx_lab.runner import Torchrun, Worker, run

WORKER = Path(__file__).parent / "workers" / "ckpt_fsdp.py"


def torchrun(nproc: int, *args: str, timeout: float = 100) -> str:
    res = run(Torchrun.local(nproc, nnodes=1).argv(Worker.of(WORKER, *args)), timeout)
    assert not res.timed_out and res.returncode == 0, res.output[-4000:]
    return res.output


@pytest.fixture(scope="module")
def saved_by_two_ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fsdp2")
    out = torchrun(2, "save", str(out_dir))
    assert out.count("SAVE_OK") == 2, out[-4000:]
    return out_dir


@pytest.mark.timeout(150)
def test_two_ranks_to_three_ranks(saved_by_two_ranks):
    out = torchrun(3, "load", str(saved_by_two_ranks))
    assert out.count("LOAD_OK") == 3, out[-4000:]


@pytest.mark.timeout(150)
def test_two_ranks_to_one_plain_process(saved_by_two_ranks):
    root = saved_by_two_ranks / "ckpt"
    assert sorted(p.name for p in step_dir(root, 2).iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "nvrx_commit.json"]
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 8))
    state = {"model": model.state_dict(), "meta": {"step": 0, "name": ""}}
    with AsyncCheckpointer(root, start_writer=False) as ckpt:
        assert ckpt.latest_step() == 2
        assert ckpt.load(state) == 2
    ref = torch.load(saved_by_two_ranks / "ref.pt", weights_only=True)
    for k, v in ref["model"].items():
        assert torch.equal(model.state_dict()[k], v), k
    assert state["meta"] == {"step": 2, "name": "fsdp"}


@pytest.mark.timeout(150)
def test_a_plan_is_reused_until_one_ranks_state_changes_its_structure(tmp_path):
    out = torchrun(2, "plans", str(tmp_path))
    assert out.count("PLANS_OK") == 2, out[-4000:]
