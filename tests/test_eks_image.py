"""manifests/Dockerfile and its entrypoint: the image runs the torch the tests run (pyproject.toml's pin), installs
every package a training pod and the EKS CLI import, and the entrypoint sets up CUDA forward compatibility when
the node's driver is older than the image's CUDA, then runs the Job's args as given, argv intact."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "manifests" / "Dockerfile").read_text()
ENTRYPOINT = ROOT / "manifests" / "entrypoint.sh"


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower().replace("_", "-")


def _pip_installed() -> set[str]:
    """Requirement names in the Dockerfile's ``pip install`` commands (quoted requirements only)."""
    run = DOCKERFILE.replace("\\\n", " ")
    names = set()
    for cmd in re.findall(r"pip install([^&\n]*)", run):
        names |= {_name(r) for r in re.findall(r'"([^"]+)"', cmd)}
    return names


def _imported_distributions() -> set[str]:
    """Distributions whose modules a pod imports: the trainer, the launcher and the EKS CLI."""
    code = ("import importlib.metadata as md, json, sys\n"
            "import nvrx_lab.train, nvrx_lab.launcher.__main__, nvrx_lab.eks.__main__\n"
            "tops = {m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)\n"
            "pd = md.packages_distributions()\n"
            "print(json.dumps(sorted({d for t in tops for d in pd.get(t, [])})))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return {_name(d) for d in json.loads(out.stdout.splitlines()[-1])}


def test_dockerfile_installs_every_direct_dependency_a_pod_imports():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    direct = {_name(d) for d in project["dependencies"]}
    needed = (_imported_distributions() & direct) - {"torch"}  # torch: test_the_image_runs_the_torch_the_tests_run
    assert {"boto3", "kubernetes", "kubernetes-validate", "pyyaml"} <= needed  # what the check is about
    missing = needed - _pip_installed()
    assert not missing, f"manifests/Dockerfile does not install {sorted(missing)}, which nvrx_lab imports"
    assert "jsonschema" in _pip_installed()  # nvrx_lab.eks.validate imports it (and referencing) directly


def _torch_pin() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (pin,) = [d.replace(" ", "") for d in project["dependencies"] if _name(d) == "torch"]
    assert pin.startswith("torch=="), f"pyproject.toml must pin one torch version, got {pin!r}"
    return pin.removeprefix("torch==")


def test_the_image_runs_the_torch_the_tests_run():
    """One torch: the Dockerfile's TORCH_VERSION is pyproject.toml's pin and the torch this suite runs on; the image
    installs exactly it, and its build fails on another torch or on a CUDA other than the base image's."""
    import torch

    pin = _torch_pin()
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(pin)}$", DOCKERFILE, re.M), \
        f"manifests/Dockerfile: ARG TORCH_VERSION must be pyproject.toml's torch=={pin}"
    assert torch.__version__.split("+")[0] == pin, f"this suite runs torch {torch.__version__}, pyproject.toml pins {pin}"
    assert '"torch==${TORCH_VERSION}"' in DOCKERFILE and "-c /tmp/keep-torch.txt" in DOCKERFILE
    assert "['project']['dependencies']" in DOCKERFILE  # the build reads the pin back from pyproject.toml
    assert "torch.version.cuda == cuda" in DOCKERFILE  # the wheel's CUDA is the base image's
    cuda = re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:(\d+)\.(\d+)\.\d+-\w+-ubuntu", DOCKERFILE, re.M)
    assert cuda, "the base is an nvidia/cuda image (CUDA user space and its compat libraries)"
    assert re.search(r"efa_installer\.sh -y --skip-kmod", DOCKERFILE) and "/opt/amazon/ofi-nccl/lib" in DOCKERFILE
    assert "import os, torch, nvrx_lab.train, nvrx_lab.launcher.agent, nvrx_lab.eks, nvrx_lab.eks.torchrun" in DOCKERFILE


def test_the_launcher_starts_on_the_tested_torch():
    """The launcher's agent passes every torchelastic argument the pinned torch takes (``shutdown_timeout`` is one
    torch added after 2.9): start it for real, one worker, and see the worker's exit come back."""
    out = subprocess.run([sys.executable, "-m", "nvrx_lab.launcher", "--standalone", "--nproc-per-node", "1",
                          "--no-standby", "--max-restarts", "0", "--monitor-interval", "0.2", "--no-python",
                          "/bin/sh", "-c", "exit 0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_entrypoint_is_set_and_execs_the_args_as_given(tmp_path):
    assert 'ENTRYPOINT ["/usr/local/bin/nvrx-lab-entrypoint.sh"]' in DOCKERFILE
    assert "COPY manifests/entrypoint.sh /usr/local/bin/nvrx-lab-entrypoint.sh" in DOCKERFILE
    text = ENTRYPOINT.read_text()
    assert 'exec "$@"' in text and not re.search(r"^\s*eval\b", text, re.M)
    script = '# a comment line, then quotes and arrays\nargs=(--a="x y"  # why\n)\necho "${#args[@]} ${args[0]}"\n'
    out = subprocess.run([str(ENTRYPOINT), "/bin/bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout == "1 --a=x y\n", out


def _entrypoint_env(tmp_path, node_driver: str, compat_driver: str | None) -> subprocess.CompletedProcess:
    """Run the entrypoint with a stand-in ``nvidia-smi`` reporting ``node_driver`` and compat libraries of
    ``compat_driver``; the args print LD_LIBRARY_PATH."""
    bin_dir, compat = tmp_path / "bin", tmp_path / "compat"
    bin_dir.mkdir(exist_ok=True)
    compat.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho {node_driver}\necho {node_driver}\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    for old in compat.iterdir():
        old.unlink()
    if compat_driver:
        (compat / f"libcuda.so.{compat_driver}").write_text("")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "NVRX_CUDA_COMPAT_DIR": str(compat), "LD_LIBRARY_PATH": "/usr/lib/x"}
    return subprocess.run([str(ENTRYPOINT), "/bin/sh", "-c", 'echo "LD=$LD_LIBRARY_PATH"'], env=env, capture_output=True,
                          text=True, timeout=30)


def test_entrypoint_puts_the_compat_libraries_first_only_for_an_older_driver(tmp_path):
    compat = tmp_path / "compat"
    older = _entrypoint_env(tmp_path, "570.172.08", "580.95.05")
    assert older.returncode == 0 and f"LD={compat}:/usr/lib/x" in older.stdout, older
    assert "node driver 570.172.08 is older than the image's CUDA (580.95.05)" in older.stdout
    for newer in ("580.95.05", "590.10.2", "1000.1"):  # the same, or newer (version order, not string order)
        out = _entrypoint_env(tmp_path, newer, "580.95.05")
        assert "LD=/usr/lib/x\n" in out.stdout and "natively" in out.stdout, out
    missing = _entrypoint_env(tmp_path, "570.1", None)
    assert "LD=/usr/lib/x\n" in missing.stdout and "cuda-compat: not used" in missing.stdout


def test_the_build_fails_when_nccls_ofi_plugin_misses_a_library():
    """Every ``libnccl-net*.so`` of aws-ofi-nccl is ``ldd``-checked in the build: a ``not found`` line (but the
    driver's libcuda, mounted at run time) fails it, instead of 128 ranks failing at NCCL's start."""
    run = next(block for block in DOCKERFILE.split("\nRUN ") if "efa_installer.sh" in block)
    assert 'ldd "$so" | grep \'not found\' | grep -v \'libcuda\\.so\'' in run and "exit 1" in run
    assert run.index("efa_installer.sh") < run.index("ldd")
