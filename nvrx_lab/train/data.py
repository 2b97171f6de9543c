"""The trainer's data: synthetic, deterministic tokens whose position is part of the training state, or a token file
(``--data``: :class:`nvrx_lab.data.tokens.TokenDataset`, the same interface; :func:`token_source` picks).

Each global batch is a pure function of ``(seed, position)``: a resumed job that restores
``position`` continues the same stream, on any world size, because every rank generates the
whole global batch and takes its own rows. The tokens follow a noisy affine recurrence, so a
model can learn them and the loss curve goes down.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nvrx_lab.data.tokens import BatchStream

if TYPE_CHECKING:
    from nvrx_lab.data.tokens import TokenDataset
    from nvrx_lab.train.config import TrainConfig


def token_source(cfg: TrainConfig) -> SyntheticTokens | TokenDataset:
    """``--data``'s token file, read by global sample index, else synthetic tokens."""
    if cfg.data:
        from nvrx_lab.data.tokens import TokenDataset

        return TokenDataset(cfg.data, cfg.model.seq_len, cfg.global_batch, seed=cfg.seed,
                            vocab_size=cfg.model.vocab_size)
    return SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_len, cfg.global_batch, seed=cfg.seed)


class SyntheticTokens(BatchStream):
    def __init__(self, vocab_size: int, seq_len: int, global_batch: int, seed: int = 0, noise: float = 0.1):
        self.vocab_size, self.seq_len, self.global_batch = vocab_size, seq_len, global_batch
        self.seed, self.noise = seed, noise
        self.position = 0

    def global_batch_at(self, position: int) -> torch.Tensor:
        """Tokens of shape (global_batch, seq_len + 1) for ``position``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + position)
        v, n = self.vocab_size, self.seq_len + 1
        start = torch.randint(0, v, (self.global_batch,), generator=g)
        mult = torch.randint(1, 4, (self.global_batch,), generator=g) * 2 + 1  # 3, 5 or 7: a per-row rule
        toks = torch.empty(self.global_batch, n, dtype=torch.long)
        toks[:, 0] = start
        for i in range(1, n):
            toks[:, i] = (toks[:, i - 1] * mult + 1) % v
        flip = torch.rand(self.global_batch, n, generator=g) < self.noise
        return torch.where(flip, torch.randint(0, v, (self.global_batch, n), generator=g), toks)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"data seed in checkpoint is {state['seed']}, this run uses seed={self.seed}")
        if "dataset" in state:
            raise ValueError(f"the checkpoint was trained on --data {state['dataset']['name']}; this run trains on "
                             "synthetic tokens (pass the same --data)")
        self.position = int(state["position"])
