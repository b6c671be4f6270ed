"""Position-free KV capture: run a model, strip RoPE from its cached keys, and lay KV out as fit features.

A cache holds keys after RoPE, so a key depends on its position. The map between two models is fitted
on position-free keys (RoPE stripped; for Qwen3 that is the key after k_norm) and values, which are
position-free already; the target's RoPE is re-applied after mapping (see mapper.py).

Layout used by the fit (stats.py, ridge.py) and by the mapper, with G groups of Bx features per layer:
    head scope:  G = Hkv, Bx = D        (head h of a target layer is predicted from head h of source layers)
    layer scope: G = 1,   Bx = Hkv * D  (every target head is predicted from all heads of source layers)
"""
import torch

from kvt import rope


@torch.no_grad()
def capture(model, ids, mask=None):
    """Run model on ids (B, T); return position-free keys and values, two lists of L tensors (B, Hkv, T, D)."""
    _, cache = model(ids, mask=mask, last=True)                      # logits are not needed here
    keys = [rope.strip(k, cache.positions.to(k.device), model.inv_freq, model.rope_scale) for k in cache.keys]
    return keys, list(cache.values)


def layer_features(x, scope):
    """One layer's KV (B, Hkv, T, D) -> (G, N, Bx) with N = B * T tokens (see the module docstring)."""
    B, Hkv, T, D = x.shape
    if scope == "head":
        return x.transpose(0, 1).reshape(Hkv, B * T, D)                # (Hkv, N, D); a view when B = 1
    return x.transpose(1, 2).reshape(1, B * T, Hkv * D)               # (1, N, Hkv*D)


def features(per_layer, scope):
    """List of L tensors (B, Hkv, T, D) -> (G, N, L, Bx), the layers side by side."""
    return torch.stack([layer_features(x, scope) for x in per_layer], dim=2)


def unfeatures(y, scope, B, T, Hkv, D):
    """One layer's outputs (G, N, By) -> (B, Hkv, T, D), the inverse of layer_features."""
    if scope == "head":
        return y.view(Hkv, B, T, D).transpose(0, 1)               # (B, Hkv, T, D)
    return y.view(B, T, Hkv, D).transpose(1, 2)                   # (B, Hkv, T, D)
