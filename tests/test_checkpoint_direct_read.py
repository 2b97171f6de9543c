"""Loading reads tensors straight into the state's memory, and falls back to DCP's path item by item."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType

from nvrx_lab.checkpoint.integrity import SafeLoadPlanner, SafeReader


def load(folder, target, monkeypatch) -> list:
    """``target`` loaded with our reader; returns the items that went DCP's way."""
    through_dcp = []
    inner = FileSystemReader.read_data

    def spy(self, plan, planner):
        through_dcp.extend(plan.items)
        return inner(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", spy)
    dcp.load(target, storage_reader=SafeReader(folder), planner=SafeLoadPlanner(), no_dist=True)
    return through_dcp


def test_every_kind_of_tensor_is_read_in_place_and_equal(tmp_path, monkeypatch):
    torch.manual_seed(0)
    state = {"w": torch.randn(64, 32), "half": torch.randn(7).to(torch.bfloat16), "scalar": torch.tensor(3.5),
             "ints": torch.arange(12).reshape(3, 4)[:, 1:3], "empty": torch.empty(0, 4),
             "flags": torch.tensor([True, False]), "step": 17}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    target = {k: torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    memory = {k: v.data_ptr() for k, v in target.items() if isinstance(v, torch.Tensor)}
    through_dcp = load(tmp_path, target, monkeypatch)
    assert all(i.type == LoadItemType.BYTE_IO for i in through_dcp), through_dcp  # only "step"
    for k, v in state.items():
        assert torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v, k
        if isinstance(v, torch.Tensor):
            assert target[k].data_ptr() == memory[k], k  # in place


def test_what_cannot_be_placed_goes_dcps_way_and_loads_all_the_same(tmp_path, monkeypatch):
    """A non-contiguous destination, another dtype's storage: DCP's path, the same values."""
    torch.manual_seed(1)
    state = {"w": torch.randn(8, 6), "v": torch.randn(5)}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    target = {"w": torch.zeros(6, 8).t(), "v": torch.zeros(5)}  # "w" is a transposed view
    through_dcp = load(tmp_path, target, monkeypatch)
    assert [i.dest_index.fqn for i in through_dcp] == ["w"]
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["v"], state["v"])
