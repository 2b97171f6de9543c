"""The model built shard by shard on the meta device (no rank holds the whole model; the same weights at any world
size), what its state weighs on a rank (the trainer's ``MODEL`` line, :mod:`nvrx_lab.train.sizing`) checked against a
measured run, and the precision and memory flags (bf16 compute with fp32 reduce, activation checkpointing)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from nvrx_lab.gpucheck.throughput import model_flops_per_token, peak_flops
from nvrx_lab.observe.events import read_events
from nvrx_lab.shapes import PRESETS, parameters, units
from nvrx_lab.sizing import CHECKPOINT, state_size
from nvrx_lab.train.model import ModelConfig, Transformer, parameter_count

TINY = ["-m", "nvrx_lab.train", "--log-every", "0", "--global-batch", "4", "--steps", "2"]


def test_the_state_of_llama_8b_on_16_p5_nodes_by_arithmetic():
    """Llama 3.1 8B over 128 GPUs in bf16 with async checkpoints: 16 bytes a parameter sharded, 12 staged; the root
    (untied embedding and head, 2 x 128,256 x 4,096) is the unit gathered whole."""
    cfg = ModelConfig(preset="llama3.1-8b")
    size = state_size(cfg, 128, bf16=True, staged=True)
    n = parameter_count(cfg)
    assert size.weights == pytest.approx(4 * n / 128) and size.optimizer == pytest.approx(8 * n / 128)
    assert size.staging == pytest.approx(12 * n / 128) and size.checkpoint == CHECKPOINT * n == pytest.approx(96.4e9, rel=1e-3)
    root, block = units(cfg)
    assert root == 2 * 128256 * 4096 + 4096 and block * 32 + root == n
    assert size.transient == (root + 2 * block) * 2 + root * (2 + 4)
    line = size.line("llama3.1-8b", 128)
    assert line.startswith("MODEL llama3.1-8b: 8.03 B parameters sharded over 128 ranks; each rank holds 1.76 GB of state")
    assert "a checkpoint is 96.4 GB" in line
    tied = units(ModelConfig(preset="llama3.2-1b"))[0]
    assert tied == 128256 * 2048 + 2048  # a tied head is the embedding: counted once
    with pytest.raises(ValueError, match="shards must be >= 1, got 0"):
        state_size(cfg, 0)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_torch_free_count_is_the_models_own(preset):
    """:func:`nvrx_lab.shapes.parameters` (arithmetic, what the EKS layer sizes pods by) equals the parameters of the
    trainer's model built on the meta device; the EKS layer keeps the trainer's number of kept checkpoints."""
    from nvrx_lab.eks.sizing import KEEP
    from nvrx_lab.train.config import TrainConfig

    cfg = ModelConfig(preset=preset)
    assert parameters(cfg) == parameter_count(cfg)
    assert KEEP == TrainConfig().checkpoint.storage.keep_last


@pytest.mark.timeout(300)
def test_one_and_two_ranks_start_from_the_same_weights_and_rank_0_says_the_size(torchrun, tmp_path):
    """Each rank draws only its shards, from a generator per parameter: the first step's loss (the weights before any
    update) is the same on one process and on two ranks (the two ranks' sum of two halves rounds differently, no
    more)."""
    one = subprocess.run([sys.executable, *TINY, "--metrics", str(tmp_path / "one.jsonl")], capture_output=True,
                         text=True, timeout=180)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    assert "[nvrx_lab] MODEL tiny: 428,672 parameters sharded over 1 rank; each rank holds 6.86 MB" in one.stdout
    two = torchrun(2, *TINY, "--metrics", str(tmp_path / "two.jsonl"), timeout=180)
    assert two.returncode == 0, two.stdout[-3000:]
    assert two.stdout.count("MODEL tiny: 428,672 parameters sharded over 2 ranks") == 1  # rank 0 only
    first = [read_events(tmp_path / f"{n}.jsonl", "step")[0]["loss"] for n in ("one", "two")]
    assert first[1] == pytest.approx(first[0], rel=1e-6)


def test_each_parameter_has_its_own_draw_and_the_seed_changes_them_all():
    """Whole on one process: two parameters of one shape are not the same draw, and another seed changes every one."""
    a, b = (Transformer(ModelConfig(), seed=s) for s in (0, 1))
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert not torch.equal(pa["blocks.0.mlp.w_gate.weight"], pa["blocks.0.mlp.w_up.weight"])
    assert all(not torch.equal(pa[n], pb[n]) for n in pa if pa[n].dim() > 1)
    assert pa["embed.weight"].std().item() == pytest.approx(0.02, rel=0.05)


@pytest.mark.timeout(300)
def test_bf16_compute_and_activation_checkpointing_train_on_two_ranks(torchrun, tmp_path):
    """bf16 compute with an fp32 reduce (gloo here, NCCL on a GPU) and recomputed blocks: the loss falls, and the
    checkpoint keeps fp32 weights."""
    res = torchrun(2, *TINY, "--steps", "6", "--precision", "bf16", "--activation-checkpointing", "true",
                   "--ckpt", "sync", "--ckpt-interval", "6", "--ckpt-dir", str(tmp_path / "ckpt"),
                   "--metrics", str(tmp_path / "m.jsonl"), timeout=240)
    assert res.returncode == 0, res.stdout[-3000:]
    curve = [e["loss"] for e in read_events(tmp_path / "m.jsonl", "step")]
    assert len(curve) == 6 and curve[-1] < curve[0] - 0.1, curve
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(next((tmp_path / "ckpt").glob("step_*")))).read_metadata()
    dtypes = {str(m.properties.dtype) for k, m in meta.state_dict_metadata.items() if k.startswith("model.")}
    assert dtypes == {"torch.float32"}, dtypes


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_printed_state_is_within_10_percent_of_the_measured_peak(torchrun, tmp_path):
    """A 384 M-parameter cut of Llama 3.2 1B (its vocabulary and width, 2 blocks) on two ranks: each rank's peak
    resident memory above what it held before the model was built is within 10 % of the estimate (state + what the
    model holds whole while it computes); activations at a batch of one 64-token sequence are small beside it."""
    res = torchrun(2, "-m", "nvrx_lab.train", "--model", "llama3.2-1b", "--n-layers", "2", "--seq-len", "64",
                   "--global-batch", "2", "--steps", "2", "--log-every", "0", "--metrics", str(tmp_path / "m.jsonl"),
                   timeout=800)
    assert res.returncode == 0, res.stdout[-3000:]
    for e in read_events(tmp_path / "m.jsonl", "memory"):
        measured = e["rss_peak"] - e["rss_before"]
        assert abs(measured - e["estimated_peak"]) / measured < 0.10, e


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compiled_blocks_train_the_eager_curve(tmp_path):
    """``--compile``: each block through torch.compile (inductor; the first step pays the compilation) follows the
    eager run's curve."""
    curves = []
    for name, extra in (("eager", []), ("compiled", ["--compile", "true"])):
        res = subprocess.run([sys.executable, *TINY, "--steps", "3", *extra, "--metrics", str(tmp_path / f"{name}.jsonl")],
                             capture_output=True, text=True, timeout=800)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        curves.append([e["loss"] for e in read_events(tmp_path / f"{name}.jsonl", "step")])
    assert len(curves[1]) == 3 and curves[1] == pytest.approx(curves[0], rel=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpuchecks_throughput_check_runs_on_the_cpu(tmp_path):
    """``gpucheck --cpu-dry-run --only g``: the tiny model in bf16 with activation checkpointing and two async saves;
    the figures line, without an MFU (no peak for a CPU), and the FLOPs arithmetic of Llama 3.1 8B at 8,192 tokens."""
    res = subprocess.run([sys.executable, "-m", "nvrx_lab.gpucheck", "--cpu-dry-run", "--only", "g", "--workdir",
                          str(tmp_path)], capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert re.search(r"g\. throughput  PASS  [\d,]+ tokens/s .* MFU: no bf16 peak known for 'cpu'", res.stdout), res.stdout
    cfg = ModelConfig(preset="llama3.1-8b")
    assert model_flops_per_token(cfg) == 6 * parameter_count(cfg) + 12 * 32 * 4096 * 8192
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops("Tesla T4") is None
