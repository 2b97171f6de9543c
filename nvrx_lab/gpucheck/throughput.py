"""gpucheck g: the 1B-class preset (``--model llama3.2-1b``) trained for 20 steps in bf16 on one GPU, with activation
checkpointing and an async checkpoint every 10 steps: its tokens per second and its model FLOPs utilization.

MFU counts the model's own FLOPs, 6 a parameter a token (forward and backward) plus attention's 12 x layers x width x
sequence a token (PaLM's appendix B), against the GPU's dense bf16 peak; the recomputed forward of activation
checkpointing is not counted (it is work the hardware does, not the model). Steps after the first three are timed
(the first ones warm up the allocator and kernels).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from nvrx_lab.checkpoint.commit import committed_steps
from nvrx_lab.observe.events import read_events
from nvrx_lab.runner import run, trainer
from nvrx_lab.train.model import ModelConfig, parameter_count

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}
"""Dense bf16 tensor-core peak FLOP/s by GPU (NVIDIA's data sheets; H100/H200 SXM)."""
WARM_STEPS = 3


def _shape(cfg: ModelConfig, name: str) -> int:
    """A shape of ``cfg``, which ``ModelConfig.__post_init__`` filled from its preset when left unset."""
    value = getattr(cfg, name)
    if not isinstance(value, int):
        raise TypeError(f"ModelConfig.{name} is {value!r}: not resolved from preset {cfg.preset!r}")
    return value


def model_flops_per_token(cfg: ModelConfig) -> float:
    """6 N + 12 L d s: forward and backward of every parameter, and attention's scores and mixing."""
    return 6 * parameter_count(cfg) + 12 * _shape(cfg, "n_layers") * _shape(cfg, "dim") * _shape(cfg, "seq_len")


def peak_flops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in device_name), None)


def check_throughput(work: Path, device: str, device_name: str, timeout: float) -> tuple[bool, str, str, list[str]]:
    """(ok, figures, problems, output lines)."""
    cfg = ModelConfig(preset="llama3.2-1b", seq_len=2048) if device == "cuda" else ModelConfig(preset="tiny")
    batch = 8 if device == "cuda" else 4
    model = ["--model", cfg.preset, "--seq-len", str(cfg.seq_len), "--global-batch", str(batch)] if device == "cuda" \
        else ["--model", cfg.preset, "--global-batch", str(batch)]
    metrics, ckpt = work / "g.jsonl", work / "g-ckpt"
    res = run([sys.executable, *trainer("--device", device, *model, "--precision", "bf16", "--activation-checkpointing",
                                        "true", "--steps", "20", "--ckpt", "async", "--ckpt-interval", "10",
                                        "--ckpt-dir", str(ckpt), "--metrics", str(metrics), log_every=5).args()], timeout)
    steps = read_events(metrics, "step") if metrics.exists() else []
    if res.returncode != 0 or len(steps) != 20:
        return False, "", f"exit {res.returncode}, {len(steps)} of 20 steps", [res.output[-2500:]]
    step_s = statistics.median(e["step_time"] for e in steps[WARM_STEPS:])
    tokens_s = batch * _shape(cfg, "seq_len") / step_s
    peak = peak_flops(device_name)
    mfu = f"MFU {tokens_s * model_flops_per_token(cfg) / peak:.1%} of {peak / 1e12:.0f} TFLOP/s" if peak else \
        f"MFU: no bf16 peak known for {device_name!r}"
    saved = committed_steps(ckpt)
    problems = "" if saved == [10, 20] else f"committed checkpoints {saved}, expected [10, 20]"
    figures = f"{tokens_s:,.0f} tokens/s ({step_s * 1e3:.0f} ms a step), {mfu}, loss {steps[0]['loss']:.2f} -> " \
              f"{steps[-1]['loss']:.2f}"
    return not problems, figures, problems, []
