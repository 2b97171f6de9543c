"""The trainer: runs on 2 gloo ranks, reproduces its loss curve bit for bit, rejects bad flags clearly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import in_process

from nvrx_lab.observe.events import read_events
from nvrx_lab.train.main import main as train_main

SMALL = ["--steps", "8", "--log-every", "0", "--global-batch", "4", "--seq-len", "32"]


def losses(path) -> list[float]:
    return [e["loss"] for e in read_events(path, "step")]


@pytest.mark.timeout(150)
def test_two_ranks_reproduce_the_loss_curve_bit_for_bit_and_hsdp_trains_it_too(torchrun, tmp_path):
    curves = []
    for run in range(2):
        metrics = tmp_path / f"run{run}.jsonl"
        res = torchrun(2, "-m", "nvrx_lab.train", *SMALL, "--metrics", str(metrics))
        assert res.returncode == 0, res.stdout[-3000:]
        curves.append(losses(metrics))
    metrics = tmp_path / "hsdp.jsonl"  # HSDP (a 2-D mesh: replicated twice, sharded over one rank) trains the same
    res = torchrun(2, "-m", "nvrx_lab.train", *SMALL, "--replicate", "2", "--metrics", str(metrics))
    assert res.returncode == 0, res.stdout[-3000:]
    assert losses(metrics) == pytest.approx(curves[0], rel=1e-6, abs=0)
    assert len(curves[0]) == 8
    assert curves[0] == curves[1]  # exact float equality, not approx
    assert curves[0][-1] < curves[0][0]  # it learns
    steps = read_events(tmp_path / "run0.jsonl", "step")
    assert [e["step"] for e in steps] == list(range(1, 9))
    assert all(e["rank"] == 0 and e["tokens_per_s"] > 0 for e in steps)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("flags", [
    pytest.param([], marks=pytest.mark.slow),
    pytest.param(["--ckpt", "async", "--ckpt-interval", "3", "--local-ckpt-interval", "2"], marks=pytest.mark.slow),
    ["--restart", "inprocess", "--ckpt", "async", "--ckpt-interval", "3", "--faults", "1:5:exception"],
], ids=["plain", "async+local", "inprocess-restarted"])
def test_no_group_thread_outlives_the_trainer(torchrun, tmp_path, flags):
    """When ``main`` returns, every process group is destroyed and its threads joined (the last attempt's and
    a restarted one's): none is left to abort the interpreter's exit."""
    dirs = ["--ckpt-dir", str(tmp_path / "ckpt"), "--local-ckpt-dir", str(tmp_path / "shm")]
    res = torchrun(2, str(Path(__file__).parent / "workers" / "exit_threads.py"), *SMALL, *dirs, *flags, timeout=180)
    assert res.returncode == 0, res.stdout[-3000:]
    lines = [json.loads(line.split(" ", 1)[1]) for line in res.stdout.splitlines() if line.startswith("THREADS ")]
    assert sorted(line["rank"] for line in lines) == [0, 1], res.stdout[-3000:]
    for line in lines:
        assert line["rc"] == 0 and not [t for t in line["threads"] if "gloo" in t], line


def test_single_process_matches_the_two_rank_curve_closely(tmp_path):
    """A world of one (no torchrun) trains on the same global batches; only summation order differs."""
    metrics = tmp_path / "m.jsonl"
    res = subprocess.run([sys.executable, "-m", "nvrx_lab.train", *SMALL, "--metrics", str(metrics)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    one = losses(metrics)
    assert len(one) == 8 and one[-1] < one[0]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--global-batch", "3"], "--global-batch 3 does not divide by the world size 2"),
        (["--steps", "-1"], "--steps must be >= 0"),
        (["--replicate", "3"], "--replicate 3 does not divide the world size 2: HSDP shards over world/N ranks; pass a "
                               "divisor of 2"),
        (["--replicate", "0"], "--replicate must be >= 1 (1: FSDP over every rank), got 0"),
        (["--model", "llama3.1-8b", "--n-kv-heads", "5"], "--n-kv-heads 5 must divide --n-heads 32"),
    ],
)
def test_bad_config_names_the_flag(flags, message, monkeypatch, capsys):
    """Rank 0 of two, as torchrun starts it (the flags are checked before any group is made; ``--device tpu`` and the
    parser's other cases: ``test_cli_errors.py``)."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    res = in_process(train_main, *SMALL, *flags, capsys=capsys)
    assert res.returncode == 2
    assert f"error: {message}" in res.stderr


def test_help_lists_every_field_with_its_docstring():
    res = subprocess.run([sys.executable, "-m", "nvrx_lab.train", "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0
    text = " ".join(res.stdout.split())  # argparse wraps lines
    assert "--global-batch" in text and "must divide by the world size" in text
