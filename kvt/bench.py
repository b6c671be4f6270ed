"""Prefill against transfer, timed: how long the target takes to read a context itself, and how long the
handoff that replaces it takes (the source's cache mapped, then the target's last prompt token).

    rows = prefill_vs_transfer(source, target, mapper, lengths=[512, 1024, 2048])
    # [{"tokens": 512, "target_prefill_s": .., "transfer_s": .., "speedup": .., "speedup_per_round": ..}, ...]

Honest by construction (gpt-fast's habits): each function runs once to warm up caches, the allocator and
kernels; the device is synchronized before every clock read; a time is the median of `repeats` runs; and
the two sides are timed in one process, in turn within each round, so a shared host that slows down for a
while slows both alike. Timing needs no trained weights: the models and the mapper may be random.
kvt/harness/bench.py builds the full table on these (the map alone, copy rates, the roofline, recompute).
"""
import math
import statistics
import time

import torch

from kvt.handoff import Recompute, take_over
from kvt.loading import layer_devices


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class Timing(float):
    """A median time in seconds (it is that float) that also keeps every run, the fastest and the slowest."""
    def __new__(cls, times):
        t = super().__new__(cls, statistics.median(times))
        t.times, t.min, t.max = list(times), min(times), max(times)
        return t


def median_times(fns, device, repeats):
    """The median wall time of each of fns, taken in turn: a warm-up round, then `repeats` rounds that run
    each fn once. A shared host whose speed drifts during a run then moves them all alike, so their ratios
    hold where their absolute times do not. Returns a Timing per fn."""
    times = [[] for _ in fns]
    for i in range(repeats + 1):
        for fn, ts in zip(fns, times):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            if i:  # round 0 warms up caches, allocator and kernels
                ts.append(time.perf_counter() - start)
    return [Timing(ts) for ts in times]


def median_time(fn, device, repeats):
    """Median wall time of fn() over `repeats` runs, after one warm-up run (a Timing: .min, .max too)."""
    return median_times([fn], device, repeats)[0]


def per_round(a, b):
    """a / b round by round: (median, min, max) of a.times[i] / b.times[i], for two Timings taken in turn
    by median_times. A shared host that slows down for a while slows both runs of a round alike, where
    a / b, the ratio of the two medians, may divide a run taken in a slow spell by one taken in a fast one."""
    ratios = [x / y for x, y in zip(a.times, b.times, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def token_ids(lengths, vocab_size, device, seed=0):
    """(1, max(lengths)) random token ids. The context of length n is its first n tokens, so the cache of
    the longest context, cropped, is the cache of every shorter one (a causal model's KV at t sees <= t)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, max(lengths)), generator=g).to(device)


def transfer_step(target, mapper, cache, ids, n, frac=0.0, plain=False):
    """The timed part of a handoff of ids[:, :n]: handoff.take_over on the source's cache of the first
    n - 1 tokens (a crop of `cache`), the target recomputing the last `frac` of those slots (if any) and
    running token n itself (plain: take_over's). Returns its logits and cache."""
    budget = Recompute(last=math.ceil(frac * (n - 1)))               # the last slots: recompute's cost, timed
    return take_over(target, mapper, cache.crop(0, n - 1), ids[:, n - 1:n], recompute=budget, prompt_ids=ids[:, :n - 1],
                     plain=plain)


def time_side_by_side(target, mapper, cache, ids, n, repeats=3, also=(), plain=False):
    """(target prefill, transfer, *also) Timings of a context of n tokens, taken in turn in the same rounds
    (median_times): the target's own prefill of ids[:, :n], the transfer from the source's `cache`
    (transfer_step), then each function of `also` (kvt/harness/bench.py times the map alone and more)."""
    prefill = lambda: target(ids[:, :n], last=True)                                  # noqa: E731
    transfer = lambda: transfer_step(target, mapper, cache, ids, n, plain=plain)     # noqa: E731
    return median_times([prefill, transfer, *also], next(target.parameters()).device, repeats)


@torch.no_grad()
def prefill_vs_transfer(source, target, mapper, lengths=(512, 1024, 2048), repeats=3, plain=False):
    """One row per context length: the target's prefill and the transfer that replaces it (medians, in
    seconds), the speedup prefill / transfer (the ratio of the medians) and the same ratio per round
    (median, min, max). The source reads the longest context once; each length's handoff maps its crop."""
    device = next(target.parameters()).device
    ids = token_ids(lengths, source.config.vocab_size, device)
    _, cache = source(ids[:, :-1], last=True)                    # the source's cache of all but the last token
    mapper = mapper if mapper.placed else mapper.place(layer_devices(target))
    rows = []
    for n in lengths:
        prefill, transfer = time_side_by_side(target, mapper, cache, ids, n, repeats, plain=plain)
        rows.append({"tokens": n, "target_prefill_s": prefill, "transfer_s": transfer, "speedup": prefill / transfer,
                     "speedup_per_round": per_round(prefill, transfer)})
    return rows
