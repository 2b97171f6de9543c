"""The environment files agree, every layer imports, and CI runs exactly the README's test command."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_lists_the_same_requirements_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = set(project["dependencies"]) | set(project["optional-dependencies"]["test"])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert "python=3.11" in env["dependencies"]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    listed = {r for r in pip if not r.startswith("-e")}
    assert listed == declared, f"only in pyproject: {declared - listed}; only in environment.yml: {listed - declared}"
    assert "-e .[test]" in pip


def test_torch_is_pinned_and_peers_are_optional():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "torch==2.13.0" in project["dependencies"]
    assert not any(_name(d) == "nvidia-resiliency-ext" for d in project["dependencies"])
    peers = project["optional-dependencies"]["peers"]
    assert "nvidia-resiliency-ext==0.4.1" in peers and "torchft==0.2.0" in peers
    assert not any(_name(d) in ("nvidia-resiliency-ext", "torchft") for d in project["dependencies"])


@pytest.mark.parametrize("module", ["nvrx_lab", "nvrx_lab.checkpoint", "nvrx_lab.inprocess", "nvrx_lab.launcher",
                                    "nvrx_lab.eks", "nvrx_lab.train", "nvrx_lab.faults", "nvrx_lab.bench",
                                    "nvrx_lab.observe.report"])
def test_every_part_imports(module):
    importlib.import_module(module)


@pytest.mark.parametrize("layer", ["checkpoint", "inprocess", "launcher", "eks"])
def test_layers_do_not_import_one_another(layer):
    others = {"checkpoint", "inprocess", "launcher", "eks", "train"} - {layer}
    for path in (ROOT / "nvrx_lab" / layer).rglob("*.py"):
        text = path.read_text()
        for other in others:
            assert not re.search(rf"(from|import)\s+nvrx_lab\.{other}\b", text), f"{path} imports nvrx_lab.{other}"
            assert not re.search(rf"from\s+\.\.{other}\b", text), f"{path} imports ..{other}"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make workbook" in readme
    assert re.search(r"^test:", (ROOT / "Makefile").read_text(), re.M)


def test_gpucheck_without_a_gpu_exits_2_naming_the_versions():
    """The one GPU script stays runnable everywhere: without CUDA one line (with torch's and NCCL's versions), exit 2."""
    import subprocess
    import sys

    import torch

    out = subprocess.run([sys.executable, "-m", "nvrx_lab.gpucheck"], capture_output=True, text=True, timeout=120)
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run python -m nvrx_lab.gpucheck itself")
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1, out
    assert f"torch {torch.__version__}" in out.stderr and "NCCL" in out.stderr
