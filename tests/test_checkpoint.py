"""nvrx_lab.checkpoint in one plain process: consistency, waiting, retention, integrity, bad input."""

from __future__ import annotations

import json
import logging
import os
import pickle
import zlib

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp

from nvrx_lab.checkpoint import (
    AsyncCheckpointer,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    WriterPriority,
    committed_steps,
    step_dir,
)
from nvrx_lab.checkpoint import throttle as throttle_mod
from nvrx_lab.checkpoint.integrity import file_entry
from nvrx_lab.checkpoint.throttle import CHUNK, Throttle, check_bandwidth


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(256, 512, generator=g)  # 512 KiB: the throttled writer is still busy when we mutate
    gen = torch.Generator().manual_seed(seed + 7)
    return {
        "w": w, "tied": w, "wt": w.t(), "cols": w[:, ::3],
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "ints": torch.arange(10, dtype=torch.int32), "flags": torch.tensor([True, False]),
        "empty": torch.zeros(0, 4),
        "nested": {"list": [1, "two", torch.full((3,), 3.0)], "deep": {"x": torch.ones(2, 2)}},
        "rng": torch.get_rng_state(), "gen": gen.get_state(),
        "step": 5, "name": "run-a", "lr": 0.1,
    }


def zeros_like_state(sd: dict) -> dict:
    def z(v):
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: z(x) for k, x in v.items()}
        if isinstance(v, list):
            return [z(x) for x in v]
        return type(v)() if not isinstance(v, str) else ""
    out = {k: z(v) for k, v in sd.items() if k not in ("tied", "wt", "cols")}
    out["tied"], out["wt"], out["cols"] = out["w"], out["w"].t(), out["w"][:, ::3]
    return out


def snapshot(v):
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: snapshot(x) for k, x in v.items()}
    if isinstance(v, list):
        return [snapshot(x) for x in v]
    return v


def assert_same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def mutate(sd: dict) -> None:
    sd["w"].add_(1.0)  # also moves tied, wt, cols
    sd["bf16"].mul_(-2)
    sd["ints"].add_(100)
    sd["flags"].logical_not_()
    sd["nested"]["list"][2].zero_()
    sd["nested"]["list"][0] = 99
    sd["nested"]["deep"]["x"].fill_(7)
    sd["rng"].copy_(torch.randint(0, 255, sd["rng"].shape, dtype=torch.uint8))
    sd["gen"].zero_()
    sd["step"], sd["name"] = 6, "mutated"


@pytest.mark.timeout(60)
def test_async_save_is_a_consistent_snapshot(tmp_path):
    events = []
    sd = make_state()
    expected = snapshot(sd)
    with AsyncCheckpointer(tmp_path, write_bandwidth=1 << 20, emit=lambda k, **f: events.append((k, f))) as ckpt:
        ckpt.async_save(sd, step=1)
        mutate(sd)  # the writer needs ~0.5 s more; the checkpoint must not see this
        assert ckpt.finalize_async_save(blocking=True) == [1]
        assert ckpt.latest_step() == 1
        loaded = zeros_like_state(expected)
        assert ckpt.load(loaded) == 1
    assert_same({k: v for k, v in loaded.items()}, expected)
    assert loaded["tied"] is loaded["w"]
    kinds = [k for k, _ in events]
    assert kinds == ["ckpt_save", "ckpt_commit", "ckpt_load"], kinds
    assert events[1][1]["bytes"] > 0 and events[1][1]["durable_s"] >= events[0][1]["blocking_s"]
    # the folder is a plain DCP checkpoint
    plain = {"w": torch.zeros(256, 512), "bf16": torch.zeros(33, dtype=torch.bfloat16)}
    dcp.load(plain, checkpoint_id=step_dir(tmp_path, 1))
    assert torch.equal(plain["w"], expected["w"]) and torch.equal(plain["bf16"], expected["bf16"])


@pytest.mark.timeout(60)
def test_save_in_flight_waits_and_same_step_refused(tmp_path):
    events = []
    sd = make_state()
    with AsyncCheckpointer(tmp_path, write_bandwidth=2 << 20, emit=lambda k, **f: events.append((k, f))) as ckpt:
        pid = ckpt.start().writer_pid  # writer up: a save in flight is being written, not held
        ckpt.async_save(sd, step=1)
        with pytest.raises(ValueError, match="step 1 is already being written"):
            ckpt.async_save(sd, step=1)
        ckpt.async_save(sd, step=2)  # waits for step 1's write (one staging buffer, one writer)
        assert ckpt.writer_pid == pid  # the same persistent writer
        ckpt.finalize_async_save(blocking=True)
        region = ckpt._buffer.path
        assert region and not os.path.exists(region), "the staging region is unlinked once the writer mapped it"
    saves = [f for k, f in events if k == "ckpt_save"]
    assert saves[1]["wait_s"] > 0.1
    assert [f["step"] for k, f in events if k == "ckpt_commit"] == [1, 2]


@pytest.mark.timeout(60)
def test_no_save_is_dropped_while_the_writer_starts(tmp_path, capsys):
    """A writer that takes ~2 s to start (a clean interpreter): the first save is held, not dropped, and
    the next waits for it, saying so in one console line (issue #32: the README's runs skipped every save
    while a replaced worker's writer started, and restarted from step 0)."""
    events = []
    sd = make_state()
    with AsyncCheckpointer(tmp_path, fork_writer=False, emit=lambda k, **f: events.append((k, f))) as ckpt:
        ckpt.async_save(sd, step=1)
        assert not ckpt._writer.ready, "this test needs a save issued while the writer starts"
        for step in (2, 3):
            ckpt.async_save(sd, step=step)
        ckpt.finalize_async_save(blocking=True)
    saves = [f for k, f in events if k == "ckpt_save"]
    assert saves[0]["blocking_s"] < 1.0 and saves[1]["wait_s"] > 0.1, saves  # held, then waited for
    assert [f["step"] for k, f in events if k == "ckpt_commit"] == [1, 2, 3]
    assert not [k for k, _ in events if k == "ckpt_skip"]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "waited" in ln]
    assert len(lines) == 1 and "the save of step 2 waited" in lines[0] and "held, not dropped" in lines[0], lines
    assert committed_steps(tmp_path) == [1, 2, 3] and not [p for p in os.listdir(tmp_path) if p.startswith(".")]


@pytest.mark.timeout(60)
def test_a_forked_writer_makes_the_first_saves_wait_for_nothing(tmp_path):
    events = []
    sd = make_state()
    with AsyncCheckpointer(tmp_path, emit=lambda k, **f: events.append((k, f))) as ckpt:
        assert ckpt._writer.forked
        for step in (1, 2):
            ckpt.async_save(sd, step=step)
        ckpt.finalize_async_save(blocking=True)
    assert [f["step"] for k, f in events if k == "ckpt_commit"] == [1, 2]


def test_sync_save_retention_and_resave(tmp_path):
    sd = make_state()
    with AsyncCheckpointer(tmp_path, keep_last=2, start_writer=False) as ckpt:
        for step in (10, 20, 30):
            sd["step"] = step
            ckpt.save(sd, step=step)
        assert committed_steps(tmp_path) == [20, 30]
        ckpt.save(sd, step=30)  # re-saving a committed step replaces it atomically
        assert committed_steps(tmp_path) == [20, 30]
        assert ckpt.writer_pid is None  # sync saves need no writer
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]
    with pytest.raises(ValueError, match="keep_last"):
        AsyncCheckpointer(tmp_path, keep_last=0, start_writer=False)


def flip_byte(path, offset=None):
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_checkpoint_of_the_previous_format_zlib_crc32_still_verifies_and_loads(tmp_path):
    """Format /1 listed zlib's CRC32 of every 16 MiB chunk; a job upgraded mid-run resumes from it."""
    sd = make_state()
    ckpt = AsyncCheckpointer(tmp_path, start_writer=False)
    ckpt.save(sd, step=1)
    folder = step_dir(tmp_path, 1)
    manifest = json.loads((folder / "nvrx_commit.json").read_text())
    manifest["format"] = "nvrx_lab.checkpoint/1"
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        del entry["crc32c_chunks"]
        entry["crc32_chunks"] = [zlib.crc32(data[i:i + entry["chunk_bytes"]]) for i in range(0, len(data), entry["chunk_bytes"])]
    (folder / "nvrx_commit.json").write_text(json.dumps(manifest))
    fresh = AsyncCheckpointer(tmp_path, start_writer=False)
    assert fresh.latest_step() == 1
    got = zeros_like_state(sd)
    fresh.load(got, step=1)
    assert_same(got, sd)
    flip_byte(folder / "__0_0.distcp")
    with pytest.raises(CheckpointCorruptError, match="CRC32 mismatch"):
        AsyncCheckpointer(tmp_path, start_writer=False).load(zeros_like_state(sd), step=1)
    del manifest["files"]["__0_0.distcp"]["crc32_chunks"]
    (folder / "nvrx_commit.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorruptError, match=r"__0_0.distcp: no checksum in entry"):
        AsyncCheckpointer(tmp_path, start_writer=False).load(zeros_like_state(sd), step=1)


def test_corruption_falls_back_and_load_names_the_file(tmp_path, caplog):
    sd = make_state()
    events = []
    ckpt = AsyncCheckpointer(tmp_path, keep_last=5, start_writer=False, emit=lambda k, **f: events.append((k, f)))
    for step in (1, 2, 3, 4):
        ckpt.save(sd, step=step)
    assert ckpt.latest_step() == 4
    flip_byte(step_dir(tmp_path, 4) / "__0_0.distcp")
    with caplog.at_level(logging.WARNING):
        assert ckpt.latest_step() == 3
    assert "step 4 skipped" in caplog.text and "CRC32C mismatch" in caplog.text
    shard3 = step_dir(tmp_path, 3) / "__0_0.distcp"
    os.truncate(shard3, shard3.stat().st_size - 100)
    assert ckpt.latest_step() == 2
    (step_dir(tmp_path, 2) / ".metadata").unlink()
    assert ckpt.latest_step() == 1
    assert [f["step"] for k, f in events if k == "ckpt_fallback"] == [4, 3, 2]
    with pytest.raises(CheckpointCorruptError, match="CRC32C") as e:
        ckpt.load(zeros_like_state(sd), step=4)
    assert e.value.path.endswith("step_00000004/__0_0.distcp") and e.value.step == 4
    with pytest.raises(CheckpointCorruptError, match="truncated") as e:
        ckpt.load(zeros_like_state(sd), step=3)
    assert e.value.path.endswith("__0_0.distcp")
    with pytest.raises(CheckpointCorruptError, match="missing") as e:
        ckpt.load(zeros_like_state(sd), step=2)
    assert e.value.path.endswith("step_00000002/.metadata")
    target = zeros_like_state(sd)
    assert ckpt.load(target) == 1
    assert torch.equal(target["w"], sd["w"])
    ckpt.close()


def test_crafted_metadata_is_refused(tmp_path):
    sd = {"w": torch.ones(3)}
    with AsyncCheckpointer(tmp_path, start_writer=False) as ckpt:
        ckpt.save(sd, step=1)
        folder = step_dir(tmp_path, 1)
        marker = tmp_path / "pwned"

        class Evil:
            def __reduce__(self):
                return (os.system, (f"touch {marker}",))

        (folder / ".metadata").write_bytes(pickle.dumps(Evil()))
        manifest = json.loads((folder / "nvrx_commit.json").read_text())
        manifest["files"][".metadata"] = file_entry(folder / ".metadata")  # a consistent, malicious checkpoint
        (folder / "nvrx_commit.json").write_text(json.dumps(manifest))
        assert ckpt.latest_step() == 1
        with pytest.raises(CheckpointError, match="refusing to unpickle global posix.system"):
            ckpt.load({"w": torch.zeros(3)})
    assert not marker.exists()


def test_bad_directories_give_clear_errors(tmp_path):
    missing = tmp_path / "nope"
    ckpt = AsyncCheckpointer(missing, start_writer=False)
    assert ckpt.latest_step() is None
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        ckpt.load({"w": torch.zeros(1)})
    assert not missing.exists()  # nothing written by a failed load
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointNotFoundError, match="is empty"):
        AsyncCheckpointer(empty, start_writer=False).load({})
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.pt").write_bytes(b"x")
    with pytest.raises(CheckpointNotFoundError, match="not a checkpoint directory.*model.pt"):
        AsyncCheckpointer(other, start_writer=False).load({})
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="afile"):
        AsyncCheckpointer(tmp_path / "afile", start_writer=False)
    good = AsyncCheckpointer(tmp_path / "good", start_writer=False)
    good.save({"w": torch.ones(2)}, step=3)
    with pytest.raises(CheckpointNotFoundError, match=r"step 7 .*committed steps .*\[3\]"):
        good.load({"w": torch.zeros(2)}, step=7)
    with pytest.raises(CheckpointError, match="step_00000003"):  # another model's state
        good.load({"layer.weight": torch.zeros(2)})
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(ValueError, match="step must be an int"):
            good.save({"w": torch.ones(2)}, step=bad)
    with pytest.raises(ValueError, match="write_bandwidth"):
        AsyncCheckpointer(tmp_path / "x", write_bandwidth=-1, start_writer=False)


def test_one_bandwidth_rule_none_or_zero_is_no_cap():
    for no_cap in (None, 0, 0.0):
        assert check_bandwidth(no_cap) is None and Throttle(no_cap).bandwidth is None
    assert check_bandwidth(1 << 20) == float(1 << 20)
    for bad in (-1, float("nan"), "3", True):
        with pytest.raises(ValueError, match="--ckpt-write-bandwidth must be .*> 0.*0 .*no cap"):
            check_bandwidth(bad, "--ckpt-write-bandwidth")
        with pytest.raises(ValueError, match="write_bandwidth"):
            Throttle(bad)


def test_throttle_banks_no_more_than_one_chunk_of_unused_bandwidth(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(throttle_mod.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(throttle_mod.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    t = Throttle(CHUNK)  # one chunk per second
    clock[0] += 50.0  # planning before the first byte is not credit
    t.wait(CHUNK)
    assert clock[0] == pytest.approx(151.0)
    clock[0] += 10.0  # the writer was starved for 10 s mid-file
    for _ in range(4):
        t.wait(CHUNK)
    assert clock[0] == pytest.approx(161.0 + 3.0), "one chunk of credit, then the cap again"


@pytest.mark.timeout(120)
def test_the_writer_yields_to_training_with_lower_cpu_and_io_priority(tmp_path):
    me = psutil.Process()
    with AsyncCheckpointer(tmp_path / "low", writer_priority=WriterPriority(nice=10, ionice="best-effort:7")) as low, \
            AsyncCheckpointer(tmp_path / "same", writer_priority=WriterPriority(nice=0, ionice="none",
                                                                              policy="normal")) as same:
        low_writer, same_writer = psutil.Process(low.start().writer_pid), psutil.Process(same.start().writer_pid)
        assert low_writer.nice() == me.nice() + 10 and same_writer.nice() == me.nice()
        assert os.sched_getscheduler(low_writer.pid) == os.SCHED_BATCH, "the default: its wake-ups never preempt"
        assert os.sched_getscheduler(same_writer.pid) == os.sched_getscheduler(0)
        try:
            me.ionice()
        except (OSError, psutil.Error):
            pytest.skip("no ioprio_get here: the CPU priority above is what this box can show")
        assert tuple(low_writer.ionice()) == (psutil.IOPRIO_CLASS_BE, 7)
        assert tuple(same_writer.ionice()) == tuple(me.ionice())
    for bad, field in ((20, "nice"), (-1, "nice"), ("rt", "ionice"), ((-2,), "cpus"), ("fifo", "policy")):
        with pytest.raises(ValueError, match=f"writer-{field} must be"):
            WriterPriority(**{field: bad})
