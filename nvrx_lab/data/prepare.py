"""Text to token files: ``python -m nvrx_lab.data prepare TEXT... --out PREFIX``.

Each text file is read as UTF-8 and cut into documents at blank lines (paragraphs), tokenized and written as
Megatron's indexed dataset (``PREFIX.bin``, ``PREFIX.idx``: :func:`~.indexed.write_indexed`). The tokenizer is
byte-level by default (each UTF-8 byte an id, 256 ids, id 0 (NUL, absent from text) ends each document): no
vocabulary file, no download, and the tiny model's vocabulary of 256. A tokenizer of one's own is any callable from
text to ids, named ``MODULE:CALLABLE`` (e.g. a function of one's own that wraps a ``tokenizers`` or ``tiktoken`` file
one has), with its ``--vocab-size`` and, if it has one, its ``--eod`` id.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from .indexed import TokenFile, write_indexed

BYTE_VOCAB, BYTE_EOD = 256, 0


def byte_tokens(text: str) -> list[int]:
    """The byte-level tokenizer: a UTF-8 byte an id."""
    return list(text.encode("utf-8"))


def load_tokenizer(spec: str) -> Callable[[str], list[int]]:
    """``bytes`` or ``MODULE:CALLABLE``; a ``ValueError`` naming what could not be found."""
    if spec == "bytes":
        return byte_tokens
    module, _, name = spec.partition(":")
    if not (module and name):
        raise ValueError(f"--tokenizer {spec!r}: expected 'bytes' or MODULE:CALLABLE (a callable from text to ids)")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--tokenizer {spec!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"--tokenizer {spec!r}: {name} is not callable")
    return fn


def paragraphs(path: Path) -> Iterator[str]:
    """The file's documents: its paragraphs (runs of lines between blank lines), read a line at a time."""
    lines: list[str] = []
    with open(path, encoding="utf-8") as f:
        try:
            for line in f:
                if line.strip():
                    lines.append(line)
                elif lines:
                    yield "".join(lines)
                    lines = []
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e.reason}); convert it, or tokenize it yourself") from None
    if lines:
        yield "".join(lines)


def prepare(texts: list[str | os.PathLike], out: str | os.PathLike, tokenizer: str = "bytes",
            vocab_size: int | None = None, eod: int | None = None) -> TokenFile:
    """Tokenize ``texts`` into ``out`` (``out.bin``, ``out.idx``); the written file."""
    tokenize = load_tokenizer(tokenizer)
    if tokenizer == "bytes":
        vocab_size, eod = vocab_size or BYTE_VOCAB, BYTE_EOD if eod is None else eod
    elif vocab_size is None:
        raise ValueError(f"--tokenizer {tokenizer}: pass its --vocab-size (the ids' dtype depends on it)")
    paths = [Path(t) for t in texts]
    for p in paths:
        if not p.is_file():
            raise ValueError(f"{p}: no such text file")
    end = [] if eod is None else [eod]
    docs = ([*tokenize(doc), *end] for p in paths for doc in paragraphs(p))
    return write_indexed(out, docs, vocab_size)
