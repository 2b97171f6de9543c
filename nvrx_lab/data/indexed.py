"""Token files as Megatron-LM and nanoGPT write them, memory-mapped (nothing is read until a sample asks for it).

* **Megatron's indexed dataset** (``MMapIndexedDataset``, index version 1): ``PREFIX.bin`` holds the documents' token
  ids back to back; ``PREFIX.idx`` is the magic ``MMIDIDX\\0\\0``, the version (``<Q``), a dtype code (``<B``), the
  sequence count and the document-index count (``<Q`` each), then each sequence's length (int32), its byte offset in
  the ``.bin`` (int64) and the document index (int64: where each document starts, in sequences, and the count last).
  :func:`write_indexed` writes one sequence a document.
* **nanoGPT's flat file**: a ``.bin`` of token ids and nothing else (uint16 for GPT-2's vocabulary); its dtype is not in
  the file, so it is given: ``PATH.bin:uint16`` or ``:uint32``.
"""

from __future__ import annotations

import mmap
import os
import struct
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
CODES = {1: torch.uint8, 2: torch.int8, 3: torch.int16, 4: torch.int32, 5: torch.int64, 8: torch.uint16}
"""Megatron's dtype codes for token ids (6 and 7 are floating point: not tokens)."""
FLAT = {"uint16": torch.uint16, "uint32": torch.uint32}


@dataclass
class TokenFile:
    """Every token id of a file as one 1-D tensor over the mapped file (``tokens``), and what it was read from."""

    path: Path
    tokens: torch.Tensor
    documents: int
    """Documents in the file (1 for a flat file: it does not say)."""
    layout: str
    """``megatron`` or ``nanogpt``."""

    def __len__(self) -> int:
        return self.tokens.numel()


def open_tokens(spec: str | os.PathLike) -> TokenFile:
    """``PREFIX`` or ``PREFIX.bin`` beside ``PREFIX.idx`` (Megatron), or ``FILE.bin:uint16|uint32`` (nanoGPT); a
    ``ValueError`` naming the path and what would be valid for anything else."""
    text = str(spec)
    path, _, dtype = text.rpartition(":") if text.rsplit(":", 1)[-1] in FLAT else (text, "", "")
    path = Path(path)
    prefix = path.with_suffix("") if path.suffix == ".bin" else path
    if dtype:
        return TokenFile(path, _map(path, FLAT[dtype], 0), 1, "nanogpt")
    if prefix.with_suffix(".idx").is_file():
        return _megatron(prefix)
    if path.is_file():
        raise ValueError(f"--data {text}: no index beside it ({prefix.with_suffix('.idx')}); a flat nanoGPT file says "
                         f"its dtype: {text}:uint16 or {text}:uint32")
    raise ValueError(f"--data {text}: no such file (expected PREFIX with PREFIX.bin and PREFIX.idx, or FILE.bin:uint16)")


def _megatron(prefix: Path) -> TokenFile:
    idx, data = prefix.with_suffix(".idx"), prefix.with_suffix(".bin")
    raw = idx.read_bytes()
    head = len(MAGIC) + 8 + 1 + 8 + 8
    if len(raw) < head or raw[:len(MAGIC)] != MAGIC:
        raise ValueError(f"--data {prefix}: {idx} is not a Megatron indexed dataset's index (no {MAGIC!r} magic)")
    version, code, count, doc_count = struct.unpack_from("<QBQQ", raw, len(MAGIC))
    if version != VERSION or code not in CODES:
        raise ValueError(f"--data {prefix}: {idx} has index version {version} and dtype code {code}; readable: "
                         f"version {VERSION}, codes {sorted(CODES)}")
    if len(raw) != head + count * 12 + doc_count * 8:
        raise ValueError(f"--data {prefix}: {idx} is {len(raw)} bytes, its header says {head + count * 12 + doc_count * 8} "
                         "(a partial copy?)")
    dtype = CODES[code]
    sizes = torch.frombuffer(bytearray(raw[head:head + 4 * count]), dtype=torch.int32).to(torch.int64)
    itemsize = dtype.itemsize
    want = int(sizes.sum()) * itemsize
    have = data.stat().st_size if data.is_file() else -1
    if have != want:
        raise ValueError(f"--data {prefix}: {data} holds {max(have, 0)} bytes, its index says {want}"
                         + (" (missing)" if have < 0 else " (a partial copy, or another file's index?)"))
    return TokenFile(data, _map(data, dtype, want), max(doc_count - 1, 0), "megatron")


def _map(path: Path, dtype: torch.dtype, size: int) -> torch.Tensor:
    """The file's ids as a tensor over a private (copy-on-write) mapping: pages are read when a sample touches them."""
    size = size or path.stat().st_size
    if size % dtype.itemsize or size == 0:
        raise ValueError(f"--data {path}: {size} bytes is not a whole number of {dtype} ids")
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mapped, dtype=dtype, count=size // dtype.itemsize)


def write_indexed(prefix: str | os.PathLike, documents: Iterable[Sequence[int]], vocab_size: int) -> TokenFile:
    """Write ``documents`` (token ids each) as Megatron's ``PREFIX.bin`` and ``PREFIX.idx``, uint16 if ``vocab_size``
    fits, else int32; both appear only once whole (written aside, then renamed). An id outside the vocabulary is a
    ``ValueError`` and nothing is left behind."""
    prefix = Path(prefix)
    dtype, code, typecode = (torch.uint16, 8, "H") if vocab_size <= 1 << 16 else (torch.int32, 4, "i")
    sizes: list[int] = []
    parts = {suffix: prefix.with_suffix(suffix + ".part") for suffix in (".bin", ".idx")}
    try:
        with open(parts[".bin"], "wb") as out:
            for doc in documents:
                ids = array(typecode)
                try:
                    ids.extend(doc)
                except OverflowError:
                    ids = array("q", doc)
                if ids and (min(ids) < 0 or max(ids) >= vocab_size):
                    raise ValueError(f"document {len(sizes)}: a token id outside 0..{vocab_size - 1} "
                                     f"({min(ids)}..{max(ids)}); raise --vocab-size")
                out.write(ids.tobytes())
                sizes.append(len(ids))
        offsets = [0]
        for n in sizes[:-1]:
            offsets.append(offsets[-1] + n * dtype.itemsize)
        docs = list(range(len(sizes) + 1))
        parts[".idx"].write_bytes(MAGIC + struct.pack("<QBQQ", VERSION, code, len(sizes), len(docs))
                                  + struct.pack(f"<{len(sizes)}i", *sizes) + struct.pack(f"<{len(sizes)}q", *offsets)
                                  + struct.pack(f"<{len(docs)}q", *docs))
        for suffix, part in parts.items():
            os.replace(part, prefix.with_suffix(suffix))
    finally:
        for part in parts.values():
            part.unlink(missing_ok=True)
    return open_tokens(prefix)
