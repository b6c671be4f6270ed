"""The KV cache: plain data, passed in and out of the model, never hidden inside it.

For every layer l it holds keys[l] and values[l] of shape (B, Hkv, T, D), each head contiguous, the
order the mapper reads. Keys are stored AFTER RoPE, as a serving engine stores them, so each key
carries its position; `positions` records those positions and `mask` which slots hold real tokens
(False marks left padding). A transfer produces exactly this object for the target model.

The cache owns its writes and the attention over them: a forward step asks for the cache it will
return (grow), each attention layer hands it that step's keys and values (update: torch.cat after the
cached ones, so the cache the step started from is left as it was; or, for a recompute, in place at
given slots) and attends over them (attend).
(kvt/fast.py's Reserved appends in place into free slots it owns, as gpt-fast does.)
"""
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kvt.views import CacheViews


@dataclass
class Cache(CacheViews):  # select, expand, crop, to: copies and views for the harness, kvt/views.py
    keys: list          # L x (B, Hkv, T, D), post-RoPE
    values: list        # L x (B, Hkv, T, D)
    positions: torch.Tensor  # (B, T) long
    mask: torch.Tensor       # (B, T) bool, True = real token
    queries: list | None = None  # L x (B, H, T, D) post-RoPE queries, only when asked for (diagnostics)
    full: bool = False  # known to hold no padding (mask all True), so decode needs no attention mask

    def __len__(self):
        return self.positions.shape[1]

    def grow(self, positions, mask, full):
        """The cache a forward step returns: positions and mask (B, S) of every slot, the cached ones and
        the step's; its layers, this cache's until update() extends them (new lists: this one stays as it is)."""
        return replace(self, keys=list(self.keys), values=list(self.values), positions=positions, mask=mask,
                       queries=None, full=full)

    def update(self, l, k, v, slots=None):
        """Layer l after this step: its keys and values k, v (B, Hkv, T, D) after the cached ones, or (slots
        (T,), a recompute) written over the cached ones there, in place. Returns the layer's (B, Hkv, S, D)."""
        if slots is not None:
            self.keys[l][:, :, slots], self.values[l][:, :, slots] = k, v
        elif self.keys[l] is not None:
            self.keys[l], self.values[l] = torch.cat([self.keys[l], k], dim=2), torch.cat([self.values[l], v], dim=2)
        else:
            self.keys[l], self.values[l] = k, v
        return self.keys[l], self.values[l]

    def attend(self, q, k, v, attn_mask, causal):
        """Scaled dot-product attention of q (B, H, T, D) over a layer's k, v (B, Hkv, S, D), each KV head
        shared by H / Hkv query heads (GQA). attn_mask: bool (B, 1, T, S), True = attend, or None: causal
        (a plain prefill) or every slot (one new token). Returns (B, H, T, D)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal,
                                              enable_gqa=q.shape[1] != k.shape[1])


def empty(n_layers, batch, device=None):
    """A cache with no slots yet."""
    none = torch.empty(batch, 0, dtype=torch.long, device=device)
    return Cache([None] * n_layers, [None] * n_layers, none, none.bool(), full=True)
