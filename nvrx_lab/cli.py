"""Command-line flags from a dataclass: one ``--flag`` per field, its help from the field's docstring.

The dataclass stays the single source of truth (the style of torchtitan's job config): a field
``ckpt_interval: int = 10`` followed by a docstring becomes ``--ckpt-interval N`` with that help.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any, Literal, TypeVar

T = TypeVar("T")


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


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of ``cls`` to ``parser``; defaults are the dataclass's."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        kwargs: dict[str, Any] = {"default": default, "dest": f.name}
        if typing.get_origin(kind) is Literal:
            kwargs.update(choices=typing.get_args(kind), type=type(typing.get_args(kind)[0]))
        elif kind is bool:
            kwargs.update(type=_bool, nargs="?", const=True, metavar="{true,false}")  # a bare --flag is true
        else:
            kwargs["type"] = kind
        help_text = docs.get(f.name, "")
        kwargs["help"] = f"{help_text} (default: {default!r})" if help_text else f"default: {default!r}"
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def dataclass_from_args(cls: type[T], args: argparse.Namespace) -> T:
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})  # type: ignore[call-arg]


def parse_dataclass(cls: type[T], argv: list[str] | None = None, prog: str | None = None, description: str | None = None) -> T:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_dataclass_args(parser, cls)
    return dataclass_from_args(cls, parser.parse_args(argv))
