"""The model's presets (``--model``, :data:`nvrx_lab.train.model.PRESETS`): the published Llama shapes, built on the meta
device (no memory: 70B is fine), grouped-query attention and Llama 3.1's rope scaling."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nvrx_lab.train.config import TrainConfig
from nvrx_lab.train.model import PUBLISHED, Attention, ModelConfig, apply_rope, parameter_count, rope_frequencies, rope_tables


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_llama_preset_has_its_published_parameter_count(name):
    """Published to three significant figures (1.24 B, 8.03 B, 70.6 B); 8B and 70B within 0.1 % of them."""
    n = parameter_count(ModelConfig(preset=name))
    assert f"{n / 1e9:.3g}" == f"{PUBLISHED[name] / 1e9:.3g}", n
    if name != "llama3.2-1b":  # 1,235,814,400 (tied embeddings): 1.24 B to three figures, 0.34 % under it
        assert abs(n - PUBLISHED[name]) / PUBLISHED[name] < 1e-3, n


def test_the_default_is_the_tiny_model_and_a_flag_overrides_one_field_of_a_preset():
    tiny = TrainConfig.from_args([]).model
    assert (tiny.preset, tiny.dim, tiny.n_kv_heads, tiny.vocab_size, tiny.tie_embeddings) == ("tiny", 128, 4, 256, True)
    cut = TrainConfig.from_args(["--model", "llama3.1-8b", "--n-layers", "2", "--seq-len", "128"]).model
    assert (cut.dim, cut.n_layers, cut.n_heads, cut.n_kv_heads, cut.hidden_dim, cut.vocab_size, cut.seq_len,
            cut.tie_embeddings, cut.rope_theta, cut.rope_scaling) == (4096, 2, 32, 8, 14336, 128256, 128, False,
                                                                      500000.0, 8.0)
    assert TrainConfig.from_args(["--n-heads", "8"]).model.n_kv_heads == 8  # a head count of one's own: plain MHA
    assert TrainConfig.from_kwargs(model="llama3.1-70b", tie_embeddings=True).model.tie_embeddings is True


@pytest.mark.parametrize("fields,message", [
    (dict(n_kv_heads=3), "--n-kv-heads 3 must divide --n-heads 4"),
    (dict(rope_scaling=-1.0), "--rope-scaling must be >= 0 (0: none)"),
    (dict(dim=0), "--dim must be >= 1, got 0"),
    (dict(preset="llama3"), "--model 'llama3': expected one of tiny, llama3.2-1b, llama3.1-8b, llama3.1-70b"),
])
def test_a_shape_that_cannot_be_built_names_its_flag(fields, message):
    with pytest.raises(ValueError) as e:
        ModelConfig(**fields)
    assert message in str(e.value)


def test_grouped_query_attention_shares_each_key_value_head_among_its_query_heads():
    """Against attention written out by hand with each kv head repeated for its n_heads / n_kv_heads query heads
    (Llama's ``repeat_kv``): the same output."""
    torch.manual_seed(0)
    cfg = ModelConfig(dim=64, n_heads=8, n_kv_heads=2, seq_len=16)
    attn = Attention(cfg)
    x = torch.randn(2, 16, 64)
    cos, sin = rope_tables(cfg.head_dim, 16, cfg.rope_theta)
    q, k, v = attn.wqkv(x).split([8 * 8, 2 * 8, 2 * 8], dim=-1)
    q = apply_rope(q.view(2, 16, 8, 8).transpose(1, 2), cos, sin)
    k = apply_rope(k.view(2, 16, 2, 8).transpose(1, 2), cos, sin).repeat_interleave(4, dim=1)
    v = v.view(2, 16, 2, 8).transpose(1, 2).repeat_interleave(4, dim=1)
    want = attn.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 16, 64))
    assert torch.allclose(attn(x, cos, sin), want, atol=1e-6)
    assert attn.wqkv.weight.shape == ((8 + 2 * 2) * 8, 64)


def test_llama_31_rope_scaling_keeps_the_fast_frequencies_and_divides_the_slow_ones():
    """Llama 3.1 8B (head 128, theta 500,000, factor 8): wavelengths under 8192 / 4 tokens unchanged, over 8192 divided
    by 8, the ones between blended; the frequencies still fall monotonically."""
    plain, scaled = rope_frequencies(128, 500000.0), rope_frequencies(128, 500000.0, 8.0)
    wavelen = 2 * math.pi / plain
    assert torch.equal(scaled[wavelen < 2048], plain[wavelen < 2048]) and scaled[0] == 1.0
    assert torch.allclose(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)
    between = (wavelen >= 2048) & (wavelen <= 8192)
    assert between.any() and ((scaled[between] < plain[between]) & (scaled[between] > plain[between] / 8)).all()
    assert (scaled[1:] < scaled[:-1]).all()
