"""``python -m nvrx_lab.data prepare TEXT... --out PREFIX`` (text to an indexed token file) and
``python -m nvrx_lab.data info PATH`` (what a token file holds, and its samples at a sequence length)."""

from __future__ import annotations

import sys

from nvrx_lab.cli import Parser


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="python -m nvrx_lab.data", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="text files to PREFIX.bin and PREFIX.idx (Megatron's indexed dataset)")
    prep.add_argument("texts", nargs="+", metavar="TEXT", help="UTF-8 text files; each paragraph a document")
    prep.add_argument("--out", required=True, metavar="PREFIX", help="where to write PREFIX.bin and PREFIX.idx")
    prep.add_argument("--tokenizer", default="bytes",
                      help="bytes (a UTF-8 byte an id, 256 ids; the default) or MODULE:CALLABLE from text to ids")
    prep.add_argument("--vocab-size", type=int, default=None, help="ids of the tokenizer (bytes: 256)")
    prep.add_argument("--eod", type=int, default=None, help="the id that ends each document (bytes: 0; else none)")
    info = sub.add_parser("info", help="what a token file holds")
    info.add_argument("path", help="PREFIX (Megatron) or FILE.bin:uint16|uint32 (nanoGPT)")
    info.add_argument("--seq-len", type=int, default=64, help="samples at this sequence length (default 64)")
    a = ap.parse_args(argv)
    from .indexed import open_tokens
    from .prepare import prepare

    try:
        if a.command == "prepare":
            f = prepare(a.texts, a.out, a.tokenizer, a.vocab_size, a.eod)
        else:
            f = open_tokens(a.path)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    samples = (len(f) - 1) // (a.seq_len if a.command == "info" else 64)
    print(f"{f.path}: {len(f):,} tokens ({f.tokens.dtype}), {f.documents:,} documents, {f.layout} layout; "
          f"{samples:,} samples at --seq-len {a.seq_len if a.command == 'info' else 64}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
