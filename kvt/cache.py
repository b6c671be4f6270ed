"""The KV cache: plain data, passed in and out of the model, never hidden inside it.

For every layer l it holds keys[l] and values[l] of shape (B, Hkv, T, D). Keys are stored AFTER RoPE,
as a serving engine stores them, so each key carries its position; `positions` records those
positions and `mask` which slots hold real tokens (False marks left padding). A transfer produces
exactly this object for the target model, which then simply continues from it.
"""
from dataclasses import dataclass

import torch


@dataclass
class Cache:
    keys: list          # L x (B, Hkv, T, D), post-RoPE
    values: list        # L x (B, Hkv, T, D)
    positions: torch.Tensor  # (B, T) long
    mask: torch.Tensor       # (B, T) bool, True = real token
    queries: list | None = None  # L x (B, H, T, D) post-RoPE queries, only when asked for (diagnostics)

    def __len__(self):
        return self.positions.shape[1]

    @property
    def next_positions(self):
        """(B,) the position the next token of each row takes: the count of real tokens so far."""
        return self.mask.sum(1)

    def _map(self, fn, time_fn=None):
        """A new Cache with fn applied to every tensor (keys/values/queries on dim 0 and 2, the rest on 0/1)."""
        queries = None if self.queries is None else [fn(q) for q in self.queries]
        return Cache([fn(k) for k in self.keys], [fn(v) for v in self.values],
                     (time_fn or fn)(self.positions), (time_fn or fn)(self.mask), queries)

    def select(self, idx):
        """Rows idx of the batch."""
        return self._map(lambda t: t[idx])

    def expand(self, n):
        """A batch-1 cache repeated n times (views, no copy): one context, n continuations."""
        assert self.positions.shape[0] == 1, "expand needs a batch-1 cache"
        return self._map(lambda t: t.expand(n, *t.shape[1:]))

    def crop(self, t0, t1):
        """Time slots [t0, t1)."""
        return self._map(lambda t: t[:, :, t0:t1], time_fn=lambda t: t[:, t0:t1])

    def to(self, device=None, dtype=None):
        def move(t):
            return t.to(device=device, dtype=dtype if t.is_floating_point() else None)
        return self._map(move)


def empty(n_layers, batch, device=None):
    """A cache with no slots yet."""
    none = torch.empty(batch, 0, dtype=torch.long, device=device)
    return Cache([None] * n_layers, [None] * n_layers, none, none.bool())
