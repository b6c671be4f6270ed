"""Handoff: the source prefills a prompt, the mapper hands its KV to the target, the target carries on.

    logits, cache = handoff(source, target, mapper, ids)

The source prefills all prompt tokens but the last; the mapped cache gives the target those T-1 slots;
the target then runs the last prompt token itself, so its first logits are its own forward pass over
mapped context (not a mapped hidden state). Then `target(next_ids, cache=cache)` continues as usual.

Selective recompute (kvt's option, beyond the paper; CacheBlend does it within one model): after
mapping, the target recomputes the K and V of a budget of the mapped slots itself, layer by layer,
each recomputed token attending to the mapped slots and the recomputed ones before it, and keeps the
mapped KV elsewhere. Recompute(last=r) takes the r slots before the final token (a wider handoff),
first=s the first s (attention sinks), frac=f the f*(T-1) slots the source attended to most while
finishing the prompt (attention_mass), or with by="suffix" the last f*(T-1) (the baseline for it).
Recomputing every slot is the target's own prefill.

plain=True runs the plain path (Mapper.apply, then Cache.update's concatenation and Cache.attend); by
default the map is its fast twin, whose cache appends the last token in place (fast.map_cache). How
good a mapper is, and whether to use it: kvt/harness/diagnose.py.
"""
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kvt import fast
from kvt.config import KvtError
from kvt.loading import layer_devices
from kvt.weights import check_pair_weights


def _dtype_device(model):
    p = next(model.parameters())
    return p.dtype, p.device


@dataclass(frozen=True)
class Recompute:
    """Which mapped slots the target recomputes itself (see the module docstring)."""
    last: int = 0       # the last r slots before the final prompt token
    first: int = 0      # the first s slots
    frac: float = 0.0   # this fraction of the slots, chosen by `by`:
    by: str = "attention"  # those the source attended to most, or "suffix": the last ones

    def __bool__(self):
        return bool(self.last or self.first or self.frac)

    def slots(self, n, scores=None):
        """Ascending slot numbers (LongTensor) among n mapped slots; scores (n,): the source's attention
        mass per slot, needed when frac > 0 and by == "attention"."""
        if min(self.last, self.first, self.frac) < 0 or self.frac > 1 or self.by not in ("attention", "suffix"):
            raise KvtError(f"recompute budget {self}: counts must be >= 0, the fraction within [0, 1], "
                           f"and by 'attention' or 'suffix'")
        chosen = set(range(max(0, n - self.last), n)) | set(range(min(self.first, n)))
        m = round(self.frac * n)
        if m and self.by == "suffix":
            chosen |= set(range(n - m, n))
        elif m:
            chosen |= set(scores.topk(m).indices.tolist())
        return torch.tensor(sorted(chosen), dtype=torch.long)


def attention_mass(cache, window=32):
    """(T,) the attention each slot of a batch-1 cache (made with queries=True) receives from the last
    `window` queries, summed over layers and heads: where the model looked while finishing the prompt."""
    T = cache.keys[0].shape[2]
    total = torch.zeros(T, device=cache.keys[0].device)
    for q, k in zip(cache.queries, cache.keys):                         # (1, H, T, D), (1, Hkv, T, D)
        q = q[:, :, -window:].float()                                   # (1, H, w, D): the last queries
        k = k.float().repeat_interleave(q.shape[1] // k.shape[1], 1)     # (1, H, T, D)
        scores = q @ k.transpose(2, 3) / q.shape[-1] ** 0.5              # (1, H, w, T)
        later = torch.arange(T, device=q.device)[None] > torch.arange(T - q.shape[2], T, device=q.device)[:, None]
        total += scores.masked_fill(later, float("-inf")).softmax(-1).sum((0, 1, 2)).to(total.device)
    return total


@torch.no_grad()
def handoff(source, target, mapper, ids, mask=None, recompute=Recompute(), plain=False):
    """ids (B, T) long, mask (B, T) bool (False = left padding) or None; recompute: a Recompute budget
    (batch 1 when it selects by attention); plain: take_over's.

    Returns the target's logits for the last prompt token (B, 1, V) and its Cache of T slots.
    A mapper fitted on other weights is refused (weights.check_pair_weights; take_over: the target's)."""
    check_pair_weights(mapper, source, None)
    if ids.shape[1] == 1:  # nothing to hand over
        return target(ids, mask=mask)
    _, src_cache = source(ids[:, :-1], mask=None if mask is None else mask[:, :-1], last=True,
                          queries=recompute.frac > 0 and recompute.by == "attention")
    slots = None
    if recompute:
        scores = attention_mass(src_cache) if recompute.frac > 0 and recompute.by == "attention" else None
        slots = recompute.slots(ids.shape[1] - 1, scores)
    return take_over(target, mapper, src_cache, ids[:, -1:], None if mask is None else mask[:, -1:],
                     slots, None if slots is None else ids[:, slots], plain)


@torch.no_grad()
def take_over(target, mapper, src_cache, last_ids, last_mask=None, slots=None, slot_ids=None, plain=False):
    """The target's side of a handoff (what kvt.harness.bench times): map the source's cache of the first T - 1
    prompt tokens into a cache of the target's, recompute `slots` (their
    token ids slot_ids (B, n)) with the target when given, and run the last prompt token (B, 1) on it,
    appending its K and V after them. Returns (logits (B, 1, V), Cache of T slots). plain=True: the plain
    path (Mapper.apply, Cache.update and Cache.attend); by default the fast twins (fast.map_cache with
    room for the last token: a fast.Reserved, which appends it in place and attends to it; its linears in
    fast.one_row_linears)."""
    check_pair_weights(mapper, None, target)
    dtype, device = _dtype_device(target)
    cache = fast.map_cache(mapper, src_cache, layer_devices(target), dtype, room=1, plain=plain)
    if slots is not None and len(slots):
        _, cache = target(slot_ids.to(device), cache=cache, slots=slots.to(device), last=True)
    with fast.one_row_linears(target) if not plain else nullcontext():
        return target(last_ids.to(device), cache=cache, mask=None if last_mask is None else last_mask.to(device))
