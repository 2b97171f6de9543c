"""The trainer on real text (``--data``, nvrx_lab.data): the loss falls on a prepared text, a stopped and resumed run
reproduces the uninterrupted curve bit for bit (the position is the data's state), on another world size too, and
a checkpoint of one dataset is not resumed on another."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nvrx_lab.data.prepare import prepare
from nvrx_lab.data.tokens import TokenDataset
from nvrx_lab.observe.events import read_events

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["-m", "nvrx_lab.train", "--log-every", "0", "--global-batch", "4", "--seq-len", "64", "--ckpt", "sync",
        "--ckpt-interval", "3"]


def _text(tmp_path) -> str:
    """The README and the results, tokenized by bytes: about 80,000 tokens of English and Markdown."""
    return str(prepare([ROOT / "README.md", ROOT / "docs" / "results.md"], tmp_path / "text").path.with_suffix(""))


def _run(cmd: list[str], steps: int, ckpt: Path, metrics: Path) -> subprocess.CompletedProcess:
    res = subprocess.run([*cmd, "--steps", str(steps), "--ckpt-dir", str(ckpt), "--metrics", str(metrics)],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return res


def losses(path) -> list[float]:
    return [e["loss"] for e in read_events(path, "step")]


@pytest.mark.timeout(300)
def test_the_trainer_learns_real_text_and_its_checkpoint_refuses_synthetic_tokens(tmp_path):
    data = _text(tmp_path)
    _run([sys.executable, *ARGS, "--data", data], 6, tmp_path / "a", tmp_path / "m.jsonl")
    curve = losses(tmp_path / "m.jsonl")
    assert len(curve) == 6 and sum(curve[-2:]) < sum(curve[:2]), curve  # it learns the text
    res = subprocess.run([sys.executable, *ARGS, "--steps", "12", "--ckpt-dir", str(tmp_path / "a")],
                         capture_output=True, text=True, timeout=180)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1, res.stderr[-2000:]  # one line, before anything is written
    assert "holds the record of another run: --data '' (synthetic tokens) (the run has " in errors[0], errors


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_on_real_text_resumes_its_curve_bit_for_bit(tmp_path):
    """The data position is the data's whole state: 6 steps, then a resume to 9, is the 9-step run's curve exactly."""
    data = _text(tmp_path)
    one = [sys.executable, *ARGS, "--data", data]
    _run(one, 9, tmp_path / "a", tmp_path / "whole.jsonl")
    _run(one, 6, tmp_path / "b", tmp_path / "parts.jsonl")
    _run(one, 9, tmp_path / "b", tmp_path / "parts.jsonl")
    whole = losses(tmp_path / "whole.jsonl")
    assert len(whole) == 9 and losses(tmp_path / "parts.jsonl") == whole


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_ranks_on_real_text_resume_bit_for_bit_and_on_one_rank_closely(torchrun, tmp_path):
    data = _text(tmp_path)
    args = [*ARGS, "--data", data]
    for steps, ckpt, metrics in ((9, "a", "whole"), (6, "b", "parts"), (9, "b", "parts")):
        res = torchrun(2, *args, "--steps", str(steps), "--ckpt-dir", str(tmp_path / ckpt), "--metrics",
                       str(tmp_path / f"{metrics}.jsonl"))
        assert res.returncode == 0, res.stdout[-3000:]
    whole = losses(tmp_path / "whole.jsonl")
    assert losses(tmp_path / "parts.jsonl") == whole
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    shutil.rmtree(tmp_path / "c" / "step_00000009")
    _run([sys.executable, *ARGS, "--data", data], 9, tmp_path / "c", tmp_path / "one.jsonl")
    assert losses(tmp_path / "one.jsonl") == pytest.approx(whole[6:], rel=1e-4)


@pytest.mark.timeout(300)
def test_replica_groups_on_real_text_name_the_samples_they_trained_each_once(tmp_path):
    """Two replica groups on real text, one lost to an exception at step 3 and healed: the ledger names every
    committed sample by its id in the token file, each once, and they are the dataset's own batches."""
    data = _text(tmp_path)
    out = tmp_path / "replicas"
    res = subprocess.run([sys.executable, "-m", "nvrx_lab.replicas.local", "--replicas", "2", "--nproc", "1", "--out",
                          str(out), "--timeout", "200", "--", "--log-every", "0", "--global-batch", "4", "--seq-len", "64",
                          "--data", data, "--steps", "6", "--faults", "1:3:exception"],
                         capture_output=True, text=True, timeout=260)
    said = res.stdout + res.stderr
    assert res.returncode == 0, said[-3000:]
    assert "ledger: 6 committed steps, 0 samples lost, 0 duplicated (every row exactly once); 24 samples by id, 0 in two " \
           "steps" in said, said[-3000:]
    committed = {e["step"]: e for e in read_events(out / "coordinator.jsonl", "quorum") if e["committed"] is not None}
    trained = {i for p in out.glob("replica*.jsonl") for e in read_events(p, "ledger") for i in e["samples"]}
    expected = TokenDataset(data, 64, 4)
    assert len(committed) > 0 and trained == {i for step in range(6) for i in expected.sample_ids(step)}
