"""A Llama-style decoder: RMSNorm, rotary embeddings (with Llama 3.1's frequency scaling), grouped-query attention,
SwiGLU, optional tied embeddings.

Sized by :class:`ModelConfig`, whose ``--model`` preset gives every shape field a value the flags may override:
``tiny`` (the default) trains a few steps per second on 2 CPU cores; ``llama3.2-1b``, ``llama3.1-8b`` and
``llama3.1-70b`` are the published shapes (:data:`PRESETS`; their parameter counts are checked against the published
ones on the meta device). Each :class:`Block` is the unit that FSDP2 shards (``fully_shard`` per block, then the
root).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

from nvrx_lab.shapes import PRESETS, PUBLISHED, ModelConfig

__all__ = ["PRESETS", "PUBLISHED", "ModelConfig", "Transformer", "parameter_count"]

ROPE_ORIGINAL_CONTEXT, ROPE_LOW_FREQ, ROPE_HIGH_FREQ = 8192, 1.0, 4.0
"""Llama 3.1's rope scaling: the pretraining context, and the wavelengths (context / factor) between which the
frequencies are blended from unscaled (short wavelengths) to divided by ``rope_scaling`` (long ones)."""


def _shard_of(whole: torch.Tensor, param: DTensor) -> torch.Tensor:
    """This rank's part of ``whole`` as ``param`` lays it out: each ``Shard(d)`` of its mesh cuts dimension d in
    ``torch.chunk``'s pieces (FSDP2's), ``Replicate`` keeps it."""
    part = whole
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            pieces = torch.chunk(part, param.device_mesh.size(mesh_dim), dim=placement.dim)
            index = param.device_mesh.get_local_rank(mesh_dim)
            part = pieces[index] if index < len(pieces) else part.narrow(placement.dim, 0, 0)
    local = param.to_local()
    if part.shape != local.shape:
        raise RuntimeError(f"the shard of {tuple(whole.shape)} for placements {param.placements} is {tuple(part.shape)} "
                           f"here, the parameter's local shape {tuple(local.shape)}")
    return part


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of the model ``cfg`` describes, built on the meta device (no memory: 70B is fine)."""
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(cfg).parameters())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_frequencies(head_dim: int, theta: float, scaling: float = 0.0, device=None) -> torch.Tensor:
    """The rotary embedding's frequencies, with Llama 3.1's scaling when ``scaling`` > 0: wavelengths shorter than
    the pretraining context / 4 are kept, those longer than the context are divided by ``scaling``, and those between
    are blended."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if not scaling:
        return inv
    wavelen = 2 * math.pi / inv
    low, high = ROPE_ORIGINAL_CONTEXT / ROPE_LOW_FREQ, ROPE_ORIGINAL_CONTEXT / ROPE_HIGH_FREQ
    smooth = ((ROPE_ORIGINAL_CONTEXT / wavelen - ROPE_LOW_FREQ) / (ROPE_HIGH_FREQ - ROPE_LOW_FREQ)).clamp(0, 1)
    blended = (1 - smooth) * inv / scaling + smooth * inv
    return torch.where(wavelen < high, inv, torch.where(wavelen > low, inv / scaling, blended))


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None,
                scaling: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, shape (seq_len, head_dim // 2)."""
    inv = rope_frequencies(head_dim, theta, scaling, device)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., ::2], x[..., 1::2]) of x: (batch, heads, seq, head_dim)."""
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal self-attention; ``n_kv_heads`` < ``n_heads`` is grouped-query attention (each key/value head serves
    n_heads / n_kv_heads query heads). One projection makes q, k and v."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.wqkv(x).split([self.n_heads * self.head_dim, *[self.n_kv_heads * self.head_dim] * 2], dim=-1)
        q = q.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = (t.view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2) for t in (k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(y.transpose(1, 2).reshape(b, s, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w_down = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    checkpointing = False
    """Recompute this block's activations in the backward instead of keeping them (activation checkpointing)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Built on the meta device (``with torch.device("meta")``) it holds no memory: shard it, ``to_empty`` it, then
    :meth:`init_weights`, and no rank ever holds the whole model. Built on a real device it initializes itself."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.register_buffer("rope_cos", torch.empty(cfg.seq_len, cfg.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.seq_len, cfg.head_dim // 2), persistent=False)
        if self.embed.weight.device.type != "meta":
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Every parameter from a generator of its own (seeded by ``seed`` and its name), drawn whole on its device
        and cut to this rank's shard when it is one (an FSDP2 ``DTensor``): the same weights at any world size and
        shard layout, and at most one whole parameter in memory at a time (Llama 3.1 8B's embedding: 2.1 GB). Weights
        of linear layers and the embedding are N(0, 0.02), norms 1. The rotary tables are computed here too."""
        for name, param in self.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            g = torch.Generator(device=local.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if param.dim() == 1:
                local.fill_(1.0)
                continue
            whole = torch.empty(param.shape, dtype=local.dtype, device=local.device).normal_(0.0, 0.02, generator=g)
            local.copy_(_shard_of(whole, param) if isinstance(param, DTensor) else whole)
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.seq_len, self.cfg.rope_theta, device=self.rope_cos.device,
                               scaling=self.cfg.rope_scaling)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin)
        return self.head(self.norm(x))
