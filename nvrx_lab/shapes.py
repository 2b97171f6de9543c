"""The model's shapes, torch-free: the ``--model`` presets (:data:`PRESETS`, Meta's published configurations) and
:class:`ModelConfig`, which the trainer builds its model from (:mod:`nvrx_lab.train.model`) and the EKS layer sizes
its pods from (:mod:`nvrx_lab.sizing`, without importing torch). :func:`parameters` counts a shape's parameters by
arithmetic (the trainer's model built on the meta device has exactly as many: ``tests/test_train_sizing.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=4, hidden_dim=344, seq_len=64,
                 tie_embeddings=True, rope_theta=10000.0, rope_scaling=0.0),
    "llama3.2-1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden_dim=8192,
                        seq_len=8192, tie_embeddings=True, rope_theta=500000.0, rope_scaling=32.0),
    "llama3.1-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336,
                        seq_len=8192, tie_embeddings=False, rope_theta=500000.0, rope_scaling=8.0),
    "llama3.1-70b": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, hidden_dim=28672,
                         seq_len=8192, tie_embeddings=False, rope_theta=500000.0, rope_scaling=8.0),
}
"""The shapes of Meta's published configurations (``params.json``): Llama 3.2 1B (the 1B class, one GPU; tied
embeddings), Llama 3.1 8B and 70B (untied); vocabulary 128,256, rope theta 500,000, the SwiGLU widths given, and
Llama 3.1's sequence length of 8,192."""
PUBLISHED = {"llama3.2-1b": 1.24e9, "llama3.1-8b": 8.03e9, "llama3.1-70b": 70.6e9}
"""Parameters, as published (model cards)."""
@dataclass
class ModelConfig:
    preset: Literal["tiny", "llama3.2-1b", "llama3.1-8b", "llama3.1-70b"] = field(default="tiny",
                                                                                  metadata={"flag": "model"})
    """The model's shape: tiny (2 CPU cores), llama3.2-1b (one GPU), llama3.1-8b, llama3.1-70b (the published
    shapes); every field below left unset takes the preset's value."""
    vocab_size: int | None = field(default=None, metadata={"parse": int})
    """Vocabulary of the tokens and the model (the preset's: tiny 256, Llama 128,256)."""
    dim: int | None = field(default=None, metadata={"parse": int})
    """Model width (the preset's)."""
    n_layers: int | None = field(default=None, metadata={"parse": int})
    """Transformer blocks, each one FSDP unit (the preset's)."""
    n_heads: int | None = field(default=None, metadata={"parse": int})
    """Attention heads; dim / n_heads must be even (the preset's)."""
    n_kv_heads: int | None = field(default=None, metadata={"parse": int})
    """Key/value heads (grouped-query attention; must divide n_heads; the preset's, or n_heads with --n-heads)."""
    hidden_dim: int | None = field(default=None, metadata={"parse": int})
    """SwiGLU hidden width (the preset's)."""
    seq_len: int | None = field(default=None, metadata={"parse": int})
    """Tokens per sequence; the rotary tables cover this many positions (the preset's: tiny 64, Llama 8,192)."""
    tie_embeddings: bool | None = field(default=None, metadata={"parse": lambda text: _bool(text)})
    """Share the input embedding with the output head (the preset's: tiny and 1B yes, 8B and 70B no)."""
    rope_theta: float | None = field(default=None, metadata={"parse": float})
    """Base of the rotary embedding's frequencies (the preset's: tiny 10,000, Llama 500,000)."""
    rope_scaling: float | None = field(default=None, metadata={"parse": float})
    """Llama 3.1's rope frequency scaling factor (the preset's: 8 for 3.1, 32 for 3.2 1B; 0: none)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"--model {self.preset!r}: expected one of {', '.join(PRESETS)}")
        preset = dict(PRESETS[self.preset])
        if self.n_heads is not None and self.n_kv_heads is None:
            preset["n_kv_heads"] = self.n_heads  # a head count of one's own: plain multi-head attention
        for f in fields(self):
            if getattr(self, f.name) is None:
                setattr(self, f.name, preset[f.name])
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"--dim {self.dim} / --n-heads {self.n_heads} must give an even head size")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"--n-kv-heads {self.n_kv_heads} must divide --n-heads {self.n_heads}")
        if self.rope_scaling < 0 or self.rope_theta <= 0:
            raise ValueError(f"--rope-scaling must be >= 0 (0: none) and --rope-theta > 0, got {self.rope_scaling} "
                             f"and {self.rope_theta}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def _bool(text: str) -> bool:
    from nvrx_lab.cli import _bool as parse

    return parse(text)


def units(cfg: ModelConfig) -> tuple[int, int]:
    """Parameters of the root's own FSDP unit (the embedding, the head unless tied, the final norm) and of a block."""
    attn = cfg.dim * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim + cfg.n_heads * cfg.head_dim * cfg.dim
    block = attn + 3 * cfg.dim * cfg.hidden_dim + 2 * cfg.dim
    return cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2) + cfg.dim, block


def parameters(cfg: ModelConfig) -> int:
    """Parameters of the whole model: the root's and every block's."""
    root, block = units(cfg)
    return root + cfg.n_layers * block
