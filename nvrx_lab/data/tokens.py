"""A token file as the trainer's data: samples by global index, so the position is the whole data state.

The file's tokens are one stream (documents back to back, as Megatron's GPT dataset and nanoGPT read them), cut into
``samples = (tokens - 1) // seq_len`` samples of ``seq_len + 1`` tokens (inputs and their next-token targets), sample
``i`` starting at token ``i * seq_len``. Global sample ``g`` is sample ``order(g // samples)[g % samples]``: each epoch
in an order drawn from ``(seed, epoch)``. The global batch at ``position`` is global samples ``position * batch`` to
``(position + 1) * batch - 1``: a pure function of ``(seed, position)``, as :class:`~nvrx_lab.train.data.SyntheticTokens`'
is, so a resumed job that restores the position continues the same stream on any world size, and a row of a global
batch is a real sample (its global index is what the replica groups' ledger counts).
"""

from __future__ import annotations

import os

import torch

from .indexed import TokenFile, open_tokens


class BatchStream:
    """A stream of global batches (``global_batch_at(position)``, ``position``, ``global_batch``): the rows of each rank,
    shared by :class:`TokenDataset` and the synthetic tokens (:class:`nvrx_lab.train.data.SyntheticTokens`)."""

    def next_batch(self, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) of the current position; advances the position."""
        if self.global_batch % world_size:
            raise ValueError(f"global_batch={self.global_batch} is not divisible by world_size={world_size}")
        rows = self.global_batch // world_size
        toks = self.global_batch_at(self.position)[rank * rows:(rank + 1) * rows]
        self.position += 1
        return toks[:, :-1], toks[:, 1:]

    def sample_ids(self, position: int) -> list[int]:
        """The ids of the samples in the batch at ``position``, row by row (here: position x global batch + row)."""
        return list(range(position * self.global_batch, (position + 1) * self.global_batch))


class TokenDataset(BatchStream):
    """Batches of real tokens from a :class:`~.indexed.TokenFile` (the interface of ``SyntheticTokens``)."""

    def __init__(self, source: TokenFile | str | os.PathLike, seq_len: int, global_batch: int, seed: int = 0,
                 vocab_size: int | None = None):
        self.file = source if isinstance(source, TokenFile) else open_tokens(source)
        self.seq_len, self.global_batch, self.seed, self.vocab_size = seq_len, global_batch, seed, vocab_size
        self.samples = (len(self.file) - 1) // seq_len
        if self.samples < 1:
            raise ValueError(f"--data {self.file.path}: {len(self.file)} tokens, fewer than one sample of --seq-len "
                             f"{seq_len} + 1")
        self.position = 0
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its order), the last one asked for

    def order(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s order of the samples (a permutation drawn from the seed and the epoch)."""
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(self.samples, generator=g))
        return self._order[1]

    def sample_ids(self, position: int) -> list[int]:
        """The global sample indices of the batch at ``position`` (epoch x samples + index in the file)."""
        first = position * self.global_batch
        return [g // self.samples * self.samples + int(self.order(g // self.samples)[g % self.samples])
                for g in range(first, first + self.global_batch)]

    def global_batch_at(self, position: int) -> torch.Tensor:
        """Tokens of shape (global_batch, seq_len + 1) for ``position``; an id outside the model's vocabulary is a
        ``ValueError`` naming the file and the id."""
        n, tokens = self.seq_len + 1, self.file.tokens
        rows = [tokens[s * self.seq_len:s * self.seq_len + n].to(torch.int64)
                for s in (i % self.samples for i in self.sample_ids(position))]
        batch = torch.stack(rows)
        if self.vocab_size is not None and int(batch.max()) >= self.vocab_size:
            raise ValueError(f"--data {self.file.path}: token id {int(batch.max())} at position {position} is outside "
                             f"the model's vocabulary of {self.vocab_size} (--vocab-size, or --model)")
        return batch

    def state_dict(self) -> dict:
        return {"seed": self.seed, "position": self.position,
                "dataset": {"tokens": len(self.file), "seq_len": self.seq_len, "name": self.file.path.name}}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"data seed in checkpoint is {state['seed']}, this run uses seed={self.seed}")
        mine, saved = self.state_dict()["dataset"], state.get("dataset")
        if saved is None:
            raise ValueError(f"the checkpoint was trained on synthetic tokens; this run reads --data {self.file.path}")
        if (saved["tokens"], saved["seq_len"]) != (mine["tokens"], mine["seq_len"]):
            raise ValueError(f"the checkpoint was trained on {saved['name']} ({saved['tokens']} tokens, --seq-len "
                             f"{saved['seq_len']}); this run reads {mine['name']} ({mine['tokens']} tokens, --seq-len "
                             f"{mine['seq_len']}): resume on the same data, or pass a new --ckpt-dir")
        self.position = int(state["position"])
