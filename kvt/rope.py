"""Rotary position embeddings as pure functions: frequencies, apply, and strip (its exact inverse).

RoPE rotates each pair of channels (i, i + D/2) of a query or key by the angle pos * inv_freq[i]
("rotate-half" layout, the one Hugging Face checkpoints use). A cached key therefore carries its
position. kvt strips the rotation to fit a position-free map, then re-applies the target's:

    apply(x, p) = (x * cos(p) + rotate_half(x) * sin(p)) * scale
    strip(y, p) = (y * cos(p) - rotate_half(y) * sin(p)) / scale        # rotation by -p (see strip)

`scale` is YaRN's attention factor, which transformers folds into cos and sin (so into cached keys).
Three frequency recipes: default (theta ** -2i/D), llama3 (Llama 3.1/3.2 long-context scaling) and
yarn (Ministral 3). Ministral 3 also multiplies queries by a temperature that grows past
original_max_position_embeddings (query_temperature).
"""
import math

import torch


def frequencies(cfg):
    """(inv_freq (D/2,) float32, scale) for a Config."""
    p, D = cfg.rope, cfg.head_dim
    base = p["rope_theta"]
    inv_freq = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.int64, device="cpu").float() / D)  # (D/2,)
    kind = p.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, p), 1.0
    if kind == "yarn":
        return _yarn(p, base, D)
    raise ValueError(f"rope type {kind!r}")


def _llama3(inv_freq, p):
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between."""
    factor, lo, hi, old = p["factor"], p["low_freq_factor"], p["high_freq_factor"], p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old / wavelen - lo) / (hi - lo)                    # 0 at long wavelengths, 1 at short
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, blended, out)


def _yarn(p, base, D):
    """YaRN: interpolate low frequencies by `factor`, extrapolate high ones, ramp between."""
    factor, old = p["factor"], p["original_max_position_embeddings"]

    def mscale(s, m=1.0):
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    scale = p.get("attention_factor")
    if scale is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        scale = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations):  # the channel whose wavelength fits `rotations` times into `old`
        return D * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(D // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)  # (D/2,)
    extrapolate = 1 - ramp
    pos_freqs = base ** (torch.arange(0, D, 2, dtype=torch.int64, device="cpu").float() / D)   # as transformers rounds it
    return 1.0 / (factor * pos_freqs) * ramp + 1.0 / pos_freqs * extrapolate, float(scale)


def query_temperature(cfg, pos):
    """Ministral 3 scales queries by 1 + beta * log(1 + floor(pos / original_max)); 1 elsewhere.

    pos (B, T) long -> (B, 1, T, 1) float32, or None when the model has no temperature."""
    beta = cfg.rope.get("llama_4_scaling_beta")
    if not beta:
        return None
    old = cfg.rope["original_max_position_embeddings"]
    return (1 + beta * torch.log1p(torch.floor(pos.float() / old)))[:, None, :, None]


def cos_sin(pos, inv_freq, scale, dtype):
    """pos (B, T) or (T,) -> scale * cos, scale * sin of shape (B or 1, 1, T, D), computed in float32."""
    pos = pos if pos.dim() == 2 else pos[None]                         # (B, T)
    angles = pos[..., None].float() * inv_freq.to(pos.device)          # (B, T, D/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]              # (B, 1, T, D)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def rotate_half(x):
    """(x1, x2) -> (-x2, x1) on the two halves of the last dim: the plane (i, i + D/2) turned by 90 degrees."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rotate(x, cos, sin):
    """x (B, H, T, D) rotated by precomputed cos_sin (the model computes them once per forward)."""
    return x * cos + rotate_half(x) * sin


def apply(x, pos, inv_freq, scale=1.0):
    """Rotate x (B, H, T, D) to positions pos (B, T) or (T,)."""
    return rotate(x, *cos_sin(pos, inv_freq, scale, x.dtype))


def strip(y, pos, inv_freq, scale=1.0):
    """Undo apply: rotate y (B, H, T, D) back from positions pos, leaving position-free vectors.

    Each plane of apply is the matrix [[c, -s], [s, c]] (c = scale * cos, s = scale * sin); its inverse
    is [[c, s], [-s, c]] / (c^2 + s^2), exact whatever the rounding of c and s. Computed in float32 for
    bf16 caches and in float64 for float64 ones."""
    work = torch.promote_types(y.dtype, torch.float32)
    cos, sin = cos_sin(pos, inv_freq, scale, work)
    return (rotate(y.to(work), cos, -sin) / (cos * cos + sin * sin)).to(y.dtype)

