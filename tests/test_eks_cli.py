"""``python -m nvrx_lab.eks`` on bad input: one line on stderr naming the file, flag or field and what is
allowed, a non-zero exit, and nothing written."""

from __future__ import annotations

import pytest

from nvrx_lab.eks.__main__ import main as eks_main


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one line, no traceback
    return err


@pytest.mark.parametrize("text, expected", [
    ("- a\n- b\n", "document 1 is a list, not a Kubernetes object"),
    ("just a string\n", "document 1 is a str, not a Kubernetes object"),
    ("apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n---\n42\n", "document 2 is a int"),
    ("key: [unclosed\n", "not YAML"),
    ("", "no Kubernetes objects"),
])
def test_validate_rejects_what_is_not_a_kubernetes_object(tmp_path, capsys, text, expected):
    f = tmp_path / "x.yaml"
    f.write_text(text)
    assert eks_main(["validate", str(f)]) == 2
    err = _one_line_error(capsys)
    assert f"{f}: " in err and expected in err


def test_validate_missing_file_is_one_line(tmp_path, capsys):
    assert eks_main(["validate", str(tmp_path / "nope.yaml")]) == 2
    err = _one_line_error(capsys)
    assert "nope.yaml: cannot read it (No such file or directory)" in err


def test_render_into_an_existing_file_writes_nothing(tmp_path, capsys):
    target = tmp_path / "manifests"
    target.write_text("not a directory")
    assert eks_main(["render", "--out", str(target)]) == 2
    assert "is a file; allowed: a directory" in _one_line_error(capsys)
    assert target.read_text() == "not a directory" and [p.name for p in tmp_path.iterdir()] == ["manifests"]
    assert eks_main(["render", "--out", str(target / "sub")]) == 2  # a file on the way there
    assert [p.name for p in tmp_path.iterdir()] == ["manifests"]


def test_render_bad_namespace_names_the_allowed_form(tmp_path, capsys):
    assert eks_main(["render", "--out", str(tmp_path / "m"), "--namespace", "My_NS"]) == 2
    err = _one_line_error(capsys)
    assert "JobSpec.namespace: 'My_NS'" in err
    assert "lower-case letters, digits and '-', starting and ending with a letter or digit, at most 63" in err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("given, missing", [
    (["--fsx-id", "fs-0123456789abcdef0"], "--fsx-dns and --fsx-mount-name"),
    (["--fsx-id", "fs-0123456789abcdef0", "--fsx-dns", "fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com"],
     "--fsx-mount-name"),
    (["--fsx-mount-name", "abcdefgh"], "--fsx-id and --fsx-dns"),
])
def test_render_fsx_flags_come_together(tmp_path, capsys, given, missing):
    assert eks_main(["render", "--out", str(tmp_path / "m"), *given]) == 2
    err = _one_line_error(capsys)
    assert f"also needs {missing}" in err and "all three FSx flags together" in err
    assert not (tmp_path / "m").exists()


def test_render_with_all_three_fsx_flags_uses_them(tmp_path):
    fsx = ["--fsx-id", "fs-0fedcba9876543210", "--fsx-dns", "fs-0fedcba9876543210.fsx.us-east-1.amazonaws.com",
           "--fsx-mount-name", "zyxwvuts"]
    assert eks_main(["render", "--out", str(tmp_path), *fsx]) == 0
    text = (tmp_path / "fsx-storage.yaml").read_text()
    assert "fs-0fedcba9876543210" in text and "zyxwvuts" in text and "abcdefgh" not in text
    assert not list(tmp_path.glob(".*.tmp"))


def test_render_puts_every_job_in_a_kueue_queue_and_sizes_them_for_a_model(tmp_path):
    assert eks_main(["render", "--out", str(tmp_path), "--queue-name", "p5", "--model", "llama3.1-8b",
                     "--data", "/fsx/data/llama3"]) == 0
    jobs = sorted(tmp_path.glob("job*.yaml"))
    assert jobs and all("kueue.x-k8s.io/queue-name: p5" in p.read_text() for p in jobs)
    assert "--model=llama3.1-8b" in (tmp_path / "job-ft-launcher.yaml").read_text()
    assert eks_main(["render", "--out", str(tmp_path / "bad"), "--queue-name", "team a"]) == 2
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("argv, expected", [
    (["render", "--name", "Bad_Name"], "render: unrecognized arguments: --name Bad_Name"),  # never taken as --namespace
    (["render", "--names", "x"], "render: unrecognized arguments: --names x"),
    (["render", "--nodes", "two"], "render: argument --nodes: invalid int value: 'two'"),
    (["render", "--out"], "render: argument --out: expected one argument"),
    (["submit", "--cluster", "c"], "submit: the following arguments are required: --region, --name, --image"),
    (["rendr"], "argument {render,validate,submit,delete}: invalid choice: 'rendr'"),
    ([], "the following arguments are required: {render,validate,submit,delete}"),
])
def test_a_usage_error_is_one_line_and_flags_are_never_abbreviated(tmp_path, capsys, monkeypatch, argv, expected):
    monkeypatch.chdir(tmp_path)
    assert eks_main(argv) == 2
    err = _one_line_error(capsys)
    assert expected in err and "usage:" not in err and err.rstrip().endswith("(see --help)")
    assert list(tmp_path.iterdir()) == []  # nothing rendered


def test_help_still_shows_the_usage(capsys):
    with pytest.raises(SystemExit) as ex:
        eks_main(["render", "--help"])
    assert ex.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m nvrx_lab.eks render")


def test_a_file_system_error_is_one_line_naming_the_path(capsys):
    """(/proc refuses every mkdir, also to root, as CI runs.)"""
    assert eks_main(["render", "--out", "/proc/nvrx-lab-no/such"]) == 1
    assert _one_line_error(capsys) == "error: /proc/nvrx-lab-no: No such file or directory\n"
