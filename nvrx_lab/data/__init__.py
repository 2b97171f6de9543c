"""Real token data: memory-mapped token files, read by global sample index so the position is the data's whole state.

* :mod:`.indexed` — the files: Megatron-LM's indexed dataset (``PREFIX.bin`` of token ids, ``PREFIX.idx``: the dtype
  and each document's length and offset) and nanoGPT's flat ``.bin`` (uint16 or uint32 ids, no index).
* :mod:`.tokens` — :class:`~.tokens.TokenDataset`: the token stream cut into samples of ``seq_len + 1`` tokens, each
  epoch in a seeded order; the global batch at a position is a pure function of ``(seed, position)``, as the
  synthetic tokens' is, so a resume on any world size continues the same stream.
* :mod:`.prepare` — ``python -m nvrx_lab.data prepare``: text files to an indexed dataset with a byte-level tokenizer
  (no download), or a tokenizer of one's own (any callable from text to ids).
"""
