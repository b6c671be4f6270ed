"""Handoff: the source prefills a prompt, the mapper hands its KV to the target, the target carries on.

    logits, cache = handoff(source, target, mapper, ids)

The source prefills all prompt tokens but the last; the mapped cache gives the target those T-1 slots;
the target then runs the last prompt token itself, so its first logits are its own forward pass over
mapped context (not a mapped hidden state). Then `target(next_ids, cache=cache)` continues as usual.

Selective recompute (kvt's option, beyond the paper; CacheBlend does it within one model): after
mapping, the target recomputes the K and V of a budget of the mapped slots itself (Recompute: the last
r, a wider handoff, and the first s, attention sinks), keeping the mapped KV elsewhere. The rules that
pick slots by a score: kvt/harness/recompute.py. How good a mapper is: kvt/harness/diagnose.py.
"""
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kvt import fast
from kvt.config import KvtError
from kvt.loading import dtype_device, layer_devices
from kvt.weights import check_pair_weights


@dataclass(frozen=True)
class Recompute:
    """The plain budget: the target recomputes the last `last` and the first `first` mapped slots."""
    last: int = 0       # the last r slots before the final prompt token
    first: int = 0      # the first s slots
    queries = False     # whether choose() reads the source's queries (a rule's, kvt/harness/recompute.py)

    def __bool__(self):
        return bool(self.last or self.first)

    def choose(self, src_cache, cache, ids):
        """Ascending slot numbers (LongTensor) among the n mapped slots of ids (B, n), the prompt before
        its last token; src_cache and cache (the source's, the mapped one, n slots each) are there for
        the rules that score slots."""
        n = ids.shape[1]
        if min(self.last, self.first) < 0:
            raise KvtError(f"recompute budget {self}: counts must be >= 0")
        chosen = set(range(max(0, n - self.last), n)) | set(range(min(self.first, n)))
        return torch.tensor(sorted(chosen), dtype=torch.long)


@torch.no_grad()
def handoff(source, target, mapper, ids, mask=None, recompute=Recompute(), plain=False):
    """ids (B, T) long, mask (B, T) bool (False = left padding) or None; recompute: a Recompute budget
    (or a rule of kvt/harness/recompute.py; batch 1 when it picks slots per row); plain: take_over's.

    Returns the target's logits for the last prompt token (B, 1, V) and its Cache of T slots.
    A mapper fitted on other weights is refused (weights.check_pair_weights; take_over: the target's)."""
    check_pair_weights(mapper, source, None)
    if ids.shape[1] == 1:  # nothing to hand over
        return target(ids, mask=mask)
    _, src_cache = source(ids[:, :-1], mask=None if mask is None else mask[:, :-1], last=True,
                          queries=recompute.queries)
    return take_over(target, mapper, src_cache, ids[:, -1:], None if mask is None else mask[:, -1:],
                     recompute, ids[:, :-1], plain)


@torch.no_grad()
def take_over(target, mapper, src_cache, last_ids, last_mask=None, recompute=Recompute(), prompt_ids=None,
              plain=False):
    """The target's side of a handoff (what kvt.harness.bench times): map the source's cache of the first T - 1
    prompt tokens (prompt_ids (B, T - 1), needed with a budget) into a cache of the target's, recompute
    the slots the `recompute` budget chooses (Recompute.choose) with the target, and run the last prompt
    token (B, 1) on it, appending its K and V after them. Returns (logits (B, 1, V), Cache of T slots).
    plain=True: the plain path (Mapper.apply, Cache.update and Cache.attend); by default the fast twins
    (fast.map_cache with room for the last token: a fast.Reserved, which appends it in place and attends
    to it; its linears in fast.one_row_linears)."""
    check_pair_weights(mapper, None, target)
    dtype, device = dtype_device(target)
    cache = fast.map_cache(mapper, src_cache, layer_devices(target), dtype, room=1, plain=plain)
    slots = recompute.choose(src_cache, cache, prompt_ids) if recompute else []
    if len(slots):
        _, cache = target(prompt_ids[:, slots].to(device), cache=cache, slots=slots.to(device), last=True)
    with fast.one_row_linears(target) if not plain else nullcontext():
        return target(last_ids.to(device), cache=cache, mask=None if last_mask is None else last_mask.to(device))
