"""GPU readiness check: ``python -m nvrx_lab.gpucheck`` (about 10 minutes on one H200)
===================================================================================

What the CPU tests cannot show, on one GPU:

a. **async checkpoint** — ~3 GiB of mixed CUDA state (fp32, a bf16 transposed view, int64, bool, a
   0-dim tensor, a tied pair) saved while 200 kernels are still queued, mutated, loaded back:
   bit-exact, three times; prints how long ``async_save`` blocked;
b. **resume** — the trainer on one GPU, 30 steps straight vs 20 + resume to 30: one loss curve, bit
   for bit (read from the metrics event stream);
c. **in-process restart** of a model of several GiB (an exception, then a hang) under torchrun: CUDA
   memory does not grow from attempt to attempt (the ``restart`` events' ``cuda_peak_bytes`` and
   ``cuda_left_bytes``);
d. **poisoned CUDA context** — a device-side assert in attempt 0, without and with
   :class:`~nvrx_lab.inprocess.CudaHealthCheck`: without, the attempts fail until
   ``max_iterations``; with, the rank leaves after the first;
e. **NCCL abort path** — the abort in-process restart runs (``ncclCommAbort`` on every NCCL group): it ran on
   at least one group, the aborted group refuses work instead of hanging, and a new group all-reduces;
f. **replica group abort** — replica groups' replicate group (:mod:`nvrx_lab.gpucheck.replicas`): one member of three
   hangs in a sum, the survivors abort it at once, shrink the group (``ncclCommShrink``) or make a new one, and sum
   again. Needs 3 GPUs (a failed check that says so on fewer); gloo on the CPU with ``--cpu-dry-run``;
g. **throughput** — the 1B-class preset, 20 steps in bf16 with activation checkpointing and async checkpoints
   (:mod:`nvrx_lab.gpucheck.throughput`): tokens per second and MFU against the GPU's bf16 peak.

Prints torch's, CUDA's and NCCL's versions first, then a summary table (versions on its first line); exits 0
when every check passed, 1 otherwise, 2 without a CUDA device (still naming the versions).
``--only a,c`` runs some of them; ``--cpu-dry-run`` runs a-c, f and g tiny on the CPU (to test this script).

``--nccl-allreduce`` is another thing: the EFA gate, one worker of a torchrun across two nodes
(:mod:`nvrx_lab.gpucheck.allreduce`; ``python -m nvrx_lab.eks submit --gate`` runs it as a Job first).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nvrx_lab.gpucheck import allreduce
from nvrx_lab.gpucheck.device import check_device_assert, check_nccl_abort
from nvrx_lab.gpucheck.replicas import check_replica_abort
from nvrx_lab.gpucheck.throughput import check_throughput
from nvrx_lab.observe.events import read_events
from nvrx_lab.runner import run, torchrun, trainer

GiB = 2**30


@dataclass
class Result:
    name: str
    ok: bool
    figures: str = ""
    detail: str = ""
    lines: list[str] = field(default_factory=list)


def trainer_args(*args: str) -> list[str]:
    return trainer(*args, log_every=0).args()


def tail(text: str, n: int = 2500) -> str:
    return text[-n:].strip()


def hint(output: str) -> str:
    """A known cause of a failed trainer run, in words."""
    if "CUBLAS_WORKSPACE_CONFIG" in output:
        return " (deterministic cuBLAS: the trainer must set CUBLAS_WORKSPACE_CONFIG=:4096:8 before CUDA starts)"
    return ""


# -- a. async checkpoint of mixed state ----------------------------------------------------------------
def mixed_state(total_bytes: int, device: torch.device) -> tuple[dict, dict]:
    """(state, owners): the state to save, and the tensors behind its views (to mutate them)."""
    g = torch.Generator(device=device).manual_seed(0)
    cols = 4096

    def rows(share: float, itemsize: int) -> int:
        return max(1, int(total_bytes * share) // (cols * itemsize))

    fp32 = [torch.randn(rows(0.15, 4), cols, device=device, generator=g) for _ in range(4)]
    bf16 = torch.randn(rows(0.1, 2), cols, device=device, generator=g).to(torch.bfloat16)
    tied = torch.randn(rows(0.1, 4), cols, device=device, generator=g)
    state: dict[str, torch.Tensor | int] = {f"fp32_{i}": t for i, t in enumerate(fp32)}
    state.update(bf16_t=bf16.t(),  # a non-contiguous view
                 int64=torch.randint(-2**62, 2**62, (rows(0.1, 8), cols), device=device, generator=g),
                 mask=torch.rand(rows(0.05, 1), cols, device=device, generator=g) > 0.5,
                 scalar=torch.tensor(3.25, device=device), tied_a=tied, tied_b=tied, step=0)
    return state, {"fp32": fp32, "bf16": bf16, "tied": tied}


def queue_kernels(owners: dict, n: int = 200) -> None:
    for i in range(n // 2):  # n small kernels on the big tensors, none waited for
        t = owners["fp32"][i % len(owners["fp32"])]
        t.mul_(0.999).add_(0.5)


def mutate(state: dict, owners: dict) -> None:
    for t in owners["fp32"]:
        t.add_(1.0)
    owners["bf16"].add_(1.0)
    owners["tied"].add_(1.0)
    state["int64"].add_(1)
    state["mask"].logical_not_()
    state["scalar"].add_(1.0)
    state["step"] = -1


def check_checkpoint(work: Path, device: torch.device, gib: float, rounds: int = 3) -> Result:
    from nvrx_lab.checkpoint import AsyncCheckpointer
    from nvrx_lab.checkpoint.staging import shm_dir

    need = int(gib * GiB * 1.1)
    if (free := shutil.disk_usage(shm_dir()).free) < need:
        return Result("a. async checkpoint", False, detail=f"staging needs {need / GiB:.1f} GiB in {shm_dir()}, "
                                                            f"{free / GiB:.1f} GiB free (e.g. docker --shm-size)")
    state, owners = mixed_state(int(gib * GiB), device)
    nbytes = sum(v.numel() * v.element_size() for k, v in state.items() if torch.is_tensor(v) and k != "tied_b")
    blocking, problems = [], []
    with AsyncCheckpointer(work / "ckpt_a", keep_last=1) as ckpt:
        ckpt.start()
        if hasattr(ckpt, "prepare"):
            ckpt.prepare(state)
        for r in range(1, rounds + 1):
            queue_kernels(owners)
            state["step"] = r
            expected = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}  # queued too
            t0 = time.perf_counter()
            ckpt.async_save(state, step=r)
            blocking.append(time.perf_counter() - t0)
            mutate(state, owners)
            ckpt.finalize_async_save(blocking=True)
            ckpt.load(state, step=r)
            if device.type == "cuda":
                torch.cuda.synchronize()
            wrong = [k for k, v in expected.items()
                     if not (torch.equal(state[k], v) if torch.is_tensor(v) else state[k] == v)]
            if state["tied_a"] is not state["tied_b"] or not torch.equal(owners["bf16"].t(), expected["bf16_t"]):
                wrong.append("tied pair or bf16 view no longer backed by their tensors")
            if wrong:
                problems.append(f"round {r}: {wrong}")
    figures = f"{nbytes / GiB:.2f} GiB; async_save blocked " + ", ".join(f"{b * 1e3:.0f}" for b in blocking) + " ms"
    return Result("a. async checkpoint", not problems, figures, "; ".join(problems))


# -- b. resume reproduces the curve ----------------------------------------------------------------------
def losses(path: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_events(path, "step")}


def check_resume(work: Path, device: str, model: list[str], timeout: float) -> Result:
    common = ["--device", device, *model, "--ckpt", "async", "--ckpt-interval", "10"]
    runs = [("straight", ["--steps", "30", "--ckpt-dir", str(work / "b1"), "--metrics", str(work / "b1.jsonl")]),
            ("first 20", ["--steps", "20", "--ckpt-dir", str(work / "b2"), "--metrics", str(work / "b2.jsonl")]),
            ("resume to 30", ["--steps", "30", "--ckpt-dir", str(work / "b2"), "--metrics", str(work / "b2.jsonl")])]
    walls = []
    for name, extra in runs:
        res = run([sys.executable, *trainer_args(*common, *extra)], timeout)
        walls.append(res.wall_s)
        if res.returncode != 0:
            return Result("b. resume", False, detail=f"run '{name}' exited {res.returncode}{hint(res.output)}",
                          lines=[tail(res.output)])
    straight, resumed = losses(work / "b1.jsonl"), losses(work / "b2.jsonl")
    resumes = [e["step"] for e in read_events(work / "b2.jsonl", "resume")]
    differ = [s for s in range(1, 31) if straight.get(s) != resumed.get(s)]
    figures = f"resumed from {resumes}; runs {', '.join(f'{w:.0f}' for w in walls)} s"
    detail = "" if not differ else (f"steps differ: {differ[:5]}, e.g. step {differ[0]}: "
                                    f"{straight.get(differ[0])} vs {resumed.get(differ[0])}")
    return Result("b. resume", not differ and resumes == [20], figures, detail)


# -- c. in-process restart: memory per attempt ------------------------------------------------------------
def check_inprocess_memory(work: Path, device: str, model: list[str], timeout: float) -> Result:
    metrics = work / "c.jsonl"
    res = torchrun(1, *trainer_args("--device", device, "--restart", "inprocess", *model, "--steps", "14",
                                    "--faults", "0:5:exception,0:10:hang", "--soft-timeout", "20", "--hard-timeout",
                                    "90", "--pg-timeout", "150", "--metrics", str(metrics)), timeout=timeout)
    restarts = sorted(read_events(metrics, "restart"), key=lambda e: e["iteration"])
    if res.returncode != 0 or [e["cause"] for e in restarts] != ["exception", "hang"]:
        return Result("c. in-process memory", False, detail=f"exit {res.returncode}, restarts "
                      f"{[(e['iteration'], e['cause']) for e in restarts]}{hint(res.output)}",
                      lines=[tail(res.output)])
    # a restart event has both figures or neither (inprocess.teardown.cuda_memory)
    if device == "cpu" or any(e.get(k) is None for e in restarts for k in ("cuda_peak_bytes", "cuda_left_bytes")):
        return Result("c. in-process memory", device == "cpu", "no CUDA figures (CPU dry run)" if device == "cpu"
                      else "", "" if device == "cpu" else f"restart events lack CUDA figures: {restarts}")
    peaks: list[int] = [e["cuda_peak_bytes"] for e in restarts]
    left: list[int] = [e["cuda_left_bytes"] for e in restarts]
    # the end event's peak too, if the trainer reports it
    peaks += [p for e in read_events(metrics, "end") if (p := e.get("cuda_peak_bytes")) is not None]
    gb = lambda xs: "/".join(f"{x / GiB:.2f}" for x in xs)  # noqa: E731
    figures = f"peak per attempt {gb(peaks)} GiB; left after each restart {gb(left)} GiB"
    grown = [i for i, p in enumerate(peaks[1:], 1) if p > peaks[0] * 1.05 + 64 * 2**20]
    kept = [i for i, x in enumerate(left) if x > max(256 * 2**20, 0.02 * peaks[0])]
    detail = "; ".join(filter(None, [f"attempt(s) {grown} peaked above attempt 0" if grown else "",
                                     f"memory kept after restart(s) {kept}" if kept else ""]))
    return Result("c. in-process memory", not (grown or kept), figures, detail)


# -- main ---------------------------------------------------------------------------------------------
def versions() -> str:
    """torch, its CUDA, and the NCCL it loads (``not in this build`` on a CPU wheel)."""
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError, TypeError):
        nccl = "not in this build"
    return f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}"


def print_table(results: list[Result]) -> None:
    print(f"\n=== gpucheck summary ({versions()}) ===")
    width = max(len(r.name) for r in results)
    for r in results:
        print(f"{r.name:<{width}}  {'PASS' if r.ok else 'FAIL'}  {r.figures}")
        if r.detail:
            print(f"{'':<{width}}        {r.detail}")
    for r in results:
        for ln in r.lines:
            print(f"\n--- {r.name}:\n{ln}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--nccl-allreduce" in argv:  # the EFA gate: one worker of torchrun across nodes (nvrx_lab.gpucheck.allreduce)
        return allreduce.main([a for a in argv if a != "--nccl-allreduce"])
    ap = argparse.ArgumentParser(prog="python -m nvrx_lab.gpucheck", description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="a,b,c,d,e,f,g", help="checks to run, e.g. a,c")
    ap.add_argument("--workdir", default=None, help="folder for checkpoints and metrics (default: a temp folder)")
    ap.add_argument("--ckpt-gib", type=float, default=3.0, help="size of the state of check a")
    ap.add_argument("--cpu-dry-run", action="store_true", help="run a-c tiny on the CPU (tests this script)")
    a = ap.parse_args(argv)
    dry = a.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        print(f"gpucheck: no CUDA device (torch.cuda.is_available() is False; {versions()}); run it on a GPU "
              "machine", file=sys.stderr)
        return 2
    device = torch.device("cpu") if dry else torch.device("cuda", 0)
    name = "cpu" if dry else torch.cuda.get_device_name(0)
    if not dry:
        torch.cuda.set_device(device)
        print(f"gpucheck on {torch.cuda.get_device_name(0)}, {versions()}", flush=True)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="nvrx_gpucheck_"))
    work.mkdir(parents=True, exist_ok=True)
    small = ["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--hidden-dim", "128"]
    resume_model = small if dry else ["--dim", "1024", "--n-layers", "8", "--n-heads", "16", "--hidden-dim", "2752",
                                      "--seq-len", "256"]
    big_model = small if dry else ["--dim", "2048", "--n-layers", "16", "--n-heads", "16", "--hidden-dim", "5504",
                                   "--seq-len", "512"]  # ~0.8 B parameters: ~13 GiB with grads and AdamW
    checks = {"a": lambda: check_checkpoint(work, device, 0.0625 if dry else a.ckpt_gib),
              "b": lambda: check_resume(work, device.type, resume_model, 240),
              "c": lambda: check_inprocess_memory(work, device.type, big_model, 300),
              "d": lambda: Result("d. device-side assert", *check_device_assert(150)),
              "e": lambda: Result("e. NCCL abort path", *check_nccl_abort(120)),
              "f": lambda: Result("f. replica group abort", *check_replica_abort(120, device.type)),
              "g": lambda: Result("g. throughput", *check_throughput(work, device.type, name, 400))}
    results = []
    for key in [k.strip() for k in a.only.split(",") if k.strip()]:
        if key not in checks or (dry and key in "de"):
            print(f"gpucheck: skipping {key!r}" + (" (needs a GPU)" if key in "de" else " (unknown)"), flush=True)
            continue
        t0 = time.monotonic()
        print(f"gpucheck: {key} ...", flush=True)
        try:
            r = checks[key]()
        except Exception as e:  # a check that crashed is a failed check; the others still run
            r = Result(key, False, detail=f"{type(e).__name__}: {e}")
        r.figures = f"{r.figures} [{time.monotonic() - t0:.0f} s]".strip()
        results.append(r)
        print(f"gpucheck: {key} {'PASS' if r.ok else 'FAIL'} {r.figures}", flush=True)
    print_table(results)
    print(f"\nwork folder: {work}")
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
