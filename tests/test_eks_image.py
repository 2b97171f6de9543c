"""manifests/Dockerfile and its entrypoint: the image installs every package a training pod and the EKS CLI
import (torch stays the base image's), and the entrypoint runs the Job's args as given, argv intact."""

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
    needed = (_imported_distributions() & direct) - {"torch"}
    assert {"boto3", "kubernetes", "kubernetes-validate", "pyyaml"} <= needed  # what the check is about
    missing = needed - _pip_installed()
    assert not missing, f"manifests/Dockerfile does not install {sorted(missing)}, which nvrx_lab imports"
    assert "jsonschema" in _pip_installed()  # nvrx_lab.eks.validate imports it (and referencing) directly


def test_dockerfile_keeps_the_base_images_torch_and_checks_its_version():
    assert "torch" not in _pip_installed(), "torch comes from the base image (built for its CUDA, NCCL, aws-ofi-nccl)"
    assert "-c /tmp/keep-torch.txt" in DOCKERFILE and "torch=={torch.__version__}" in DOCKERFILE
    assert re.search(r"^ARG TORCH_VERSION=\d+\.\d+\.\d+$", DOCKERFILE, re.M)
    base_tag = re.search(r"^ARG BASE_IMAGE=\S+:(\d+\.\d+\.\d+)-", DOCKERFILE, re.M).group(1)
    assert f"ARG TORCH_VERSION={base_tag}" in DOCKERFILE  # pinned to the base image's torch
    assert "import nvrx_lab.train, nvrx_lab.launcher, nvrx_lab.eks, torch" in DOCKERFILE


def test_entrypoint_is_set_and_execs_the_args_as_given(tmp_path):
    assert 'ENTRYPOINT ["/usr/local/bin/nvrx-lab-entrypoint.sh"]' in DOCKERFILE
    assert "COPY manifests/entrypoint.sh /usr/local/bin/nvrx-lab-entrypoint.sh" in DOCKERFILE
    text = ENTRYPOINT.read_text()
    assert 'exec "$@"' in text and not re.search(r"^\s*eval\b", text, re.M)
    assert "source /usr/local/bin/start_cuda_compat.sh" in text  # sourced: its LD_LIBRARY_PATH must stick
    script = '# a comment line, then quotes and arrays\nargs=(--a="x y"  # why\n)\necho "${#args[@]} ${args[0]}"\n'
    out = subprocess.run([str(ENTRYPOINT), "/bin/bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout == "1 --a=x y\n", out
