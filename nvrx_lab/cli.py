"""Command-line flags from a dataclass: one ``--flag`` per field, its help from the field's docstring.

The dataclass stays the single source of truth (the style of torchtitan's job config): a field
``ckpt_interval: int = 10`` followed by a docstring becomes ``--ckpt-interval N`` with that help.

Every nvrx_lab command line parses with :class:`Parser`: argparse without abbreviations (``--ckpt-di``
is never taken for ``--ckpt-dir``, nor ``--name`` for ``--namespace``) and a usage error in one line,
``error: argument --steps: expected an integer, got 'ten' (see python -m nvrx_lab.train --help)``, exit
code 2; the full usage only on ``--help``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import os
import re
import stat
import textwrap
import typing
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar

T = TypeVar("T")

_KINDS = {"int": "an integer", "float": "a number"}


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with ``allow_abbrev=False`` and one-line usage errors (exit 2).

    A parser built elsewhere (``torch.distributed.run``'s) joins as a parent:
    ``Parser(prog=..., parents=[get_args_parser()], add_help=False)``."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = super().parse_known_args(args, namespace)
        self._extras = extras  # what parse_args then calls unrecognized: close matches are suggested
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self._explain(message)} (see {self.prog} --help)\n")

    def _near(self, word: str) -> tuple[list[str], bool]:
        """The flags ``word`` abbreviates (and True), else the one it looks most like, a typo (and False)."""
        longs = [[o for o in a.option_strings if o.startswith("--")] for a in self._actions]
        longer = [next(o for o in names if o.startswith(word)) for names in longs if any(o.startswith(word) for o in names)]
        if longer:
            return longer[:3], True
        return difflib.get_close_matches(word, [o for names in longs for o in names], n=1, cutoff=0.75), False

    def _explain(self, message: str) -> str:
        message = " ".join(message.split())
        if bad := re.fullmatch(r"(argument \S+: )invalid (\w+) value: (.*)", message):  # a type's ValueError
            return f"{bad[1]}expected {_KINDS[bad[2]]}, got {bad[3]}" if bad[2] in _KINDS else f"{bad[1]}bad value {bad[3]}"
        if message.startswith("unrecognized arguments:"):
            for word in (w.split("=")[0] for w in getattr(self, "_extras", []) if w.startswith("--")):
                near, abbreviated = self._near(word)
                if near:
                    why = "flags are never abbreviated: " if abbreviated else ""
                    return f"{message}; {why}did you mean {' or '.join(near)}?"
        return message


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal right under each field) of a dataclass."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def flag_name(f: dataclasses.Field, prefix: str = "") -> str | None:
    """A field's flag without the dashes: ``metadata={"flag": "ckpt-dir"}`` if given (``None``: no flag), else the
    section's prefix and the field's name (``local_ckpt_interval`` -> ``local-ckpt-interval``)."""
    if "flag" in f.metadata:
        return f.metadata["flag"]
    return prefix + f.name.replace("_", "-")


def is_section(kind: Any) -> bool:
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


def leaves(cls: type, prefix: str = "") -> list[tuple[tuple[str, ...], dataclasses.Field, type, str]]:
    """Every flag of ``cls``: (path of field names, field, type, flag), nested sections flattened in field order.
    A field whose type is a dataclass is a section: its fields' flags take the section's ``flag_prefix``
    (``metadata={"flag_prefix": "straggler-"}``), or none."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if is_section(kind):
            for path, leaf, leaf_kind, flag in leaves(kind, prefix + f.metadata.get("flag_prefix", "")):
                out.append(((f.name, *path), leaf, leaf_kind, flag))
        elif (flag := flag_name(f, prefix)) is not None:
            out.append(((f.name,), f, kind, flag))
    return out


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of ``cls`` (and of its sections) to ``parser``; defaults are the dataclass's. A field's
    ``metadata={"parse": fn}`` turns the flag's text into its value (an argparse ``type``: it may raise
    ``argparse.ArgumentTypeError``). A flag the parser has already, from a parent parser (torchrun's
    ``--max-restarts``), keeps that definition and its default; the dataclass's default fills in where it has none."""
    docs: dict[type, dict[str, str]] = {}
    for path, f, kind, flag in leaves(cls):
        owner = _owner(cls, path)
        help_text = docs.setdefault(owner, field_docs(owner)).get(f.name, "")
        default = _default(f)
        kwargs: dict[str, Any] = {"default": default, "dest": flag.replace("-", "_")}
        if (taken := parser._option_string_actions.get("--" + flag)) is not None:  # argparse's table of its flags
            if taken.dest != kwargs["dest"]:
                raise ValueError(f"--{flag} is in the parser already, with dest {taken.dest!r}, not {kwargs['dest']!r}")
            if taken.default is None:  # a parent's own default stays (torchrun's may come from $PET_*)
                parser.set_defaults(**{taken.dest: default})
            continue
        if typing.get_origin(kind) is Literal:
            kwargs.update(choices=typing.get_args(kind), type=type(typing.get_args(kind)[0]))
        elif kind is bool:
            kwargs.update(type=_bool, nargs="?", const=True, metavar="{true,false}")  # a bare --flag is true
        else:
            kwargs["type"] = f.metadata.get("parse", kind)
        shown = "" if default is None and help_text else f" (default: {default!r})"  # None: the doc says whose
        kwargs["help"] = f"{help_text}{shown}" if help_text else f"default: {default!r}"
        parser.add_argument("--" + flag, **kwargs)


def _owner(cls: type, path: tuple[str, ...]) -> type:
    """The dataclass that declares the last field of ``path``."""
    for name in path[:-1]:
        cls = typing.get_type_hints(cls)[name]
    return cls


def build(cls: type[T], flat: dict[str, Any]) -> T:
    """``cls`` from flag-named values (``{"ckpt_dir": ...}``); what ``flat`` leaves out keeps its default."""
    values: dict[str, Any] = {}
    for path, _, _, flag in leaves(cls):
        key = flag.replace("-", "_")
        if key in flat:
            node = values
            for name in path[:-1]:
                node = node.setdefault(name, {})
            node[path[-1]] = flat[key]
    return _make(cls, values)


def _make(cls: type[T], values: dict[str, Any]) -> T:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in values:
            value = values[f.name]
            kwargs[f.name] = _make(hints[f.name], value) if is_section(hints[f.name]) and isinstance(value, dict) else value
    return cls(**kwargs)  # type: ignore[call-arg]


def dataclass_from_args(cls: type[T], args: argparse.Namespace) -> T:
    return build(cls, vars(args))


def parse_dataclass(cls: type[T], argv: list[str] | None = None, prog: str | None = None, description: str | None = None) -> T:
    """``cls`` from a command line; a value its ``__post_init__`` refuses is a usage error too (one line, exit 2)."""
    parser = Parser(prog=prog, description=description)
    add_dataclass_args(parser, cls)
    args = parser.parse_args(argv)
    try:
        return dataclass_from_args(cls, args)
    except (TypeError, ValueError) as e:
        parser.error(str(e))


class Settings:
    """A dataclass of settings, loadable three ways alike (as NVRx's ``FaultToleranceConfig`` is): from keyword
    arguments named after its flags (:meth:`from_kwargs`), a YAML file of the same keys (:meth:`from_yaml_file`)
    and a command line (:meth:`from_args`). A bad key or value is a ``ValueError`` that names it."""

    @classmethod
    def flags(cls) -> list[str]:
        """Every key it takes, as its flag is written without dashes: ``ckpt_interval`` for ``--ckpt-interval``."""
        return [flag.replace("-", "_") for *_, flag in leaves(cls)]

    @classmethod
    def from_kwargs(cls: type[T], **kwargs: Any) -> T:
        known = cls.flags()  # type: ignore[attr-defined]
        for key in kwargs:
            if key not in known:
                near = difflib.get_close_matches(key, known, n=1)
                raise ValueError(f"{cls.__name__}: unknown setting {key!r}" + (f"; did you mean {near[0]!r}?" if near else
                                 f"; valid: {', '.join(known)}"))
        return build(cls, kwargs)

    @classmethod
    def from_yaml_file(cls: type[T], path: str | os.PathLike) -> T:
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise ValueError(f"{path}: cannot read: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
        try:
            return cls.from_kwargs(**{str(k).replace("-", "_"): v for k, v in data.items()})  # type: ignore[attr-defined]
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def from_args(cls: type[T], argv: list[str] | None = None, prog: str | None = None) -> T:
        return parse_dataclass(cls, argv, prog=prog, description=(cls.__doc__ or "").split("\n")[0])


def check_writable(path: str | os.PathLike, flag: str, folder: bool = False) -> None:
    """Raise ``ValueError`` (``flag path: why; what to do``) unless ``path`` can be written, or created with its
    missing parents. A file's folder must be writable too: its writer puts files beside it (``.part`` files
    renamed into place, ``run.json``). Asked with ``access(2)``, so nothing is written: the kernel's answer
    for this user, root and read-only mounts included."""
    shown, path = path, Path(os.path.abspath(path))
    if os.path.exists(path) and os.path.isdir(path) != folder:
        raise ValueError(f"{flag} {shown} is a {'file' if folder else 'folder'}; pass a {'folder' if folder else 'file path'}")
    if not folder and os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {shown}: {_denied(path)}; pass a path you can write, or make it writable")
    where = path if folder else path.parent
    while not os.path.lexists(where):  # the nearest existing folder is where the missing ones would be made
        where = where.parent
    if not os.path.isdir(where):
        raise ValueError(f"{flag} {shown} cannot be created: {where} is a file, not a folder; pass a path under a "
                         "folder, or move that file away")
    if not os.access(where, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {shown} cannot be written: {_denied(where)}; pass a {'folder' if folder else 'path'} "
                         f"you can write to, or make {where} writable")


def make_folder(path: str | os.PathLike, flag: str, value: str | os.PathLike | None = None) -> Path:
    """Create the folder ``path`` and its missing parents: the one place the trainer makes a folder a flag names
    (``value``: the flag's own value when ``path`` is its file's folder). An ``OSError`` (``/proc`` or ``/sys``, which
    ``access(2)`` lets root pass; a full disk; a race) becomes one ``ValueError`` naming the flag, not a traceback."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        what = f"{flag} {path}" if value is None else f"{flag} {value}: its folder {path}"
        raise ValueError(f"{what} cannot be created: {e.strerror or e}; pass a path you can write to") from None
    return Path(path)


def _denied(path: Path) -> str:
    """Why this user cannot write ``path``, in a few words."""
    if os.statvfs(path).f_flag & os.ST_RDONLY:
        return f"{path} is on a read-only file system"
    st = path.stat()
    return (f"{path} is not writable by uid {os.getuid()} (mode {stat.S_IMODE(st.st_mode):04o}, "
            f"owner uid {st.st_uid})")
