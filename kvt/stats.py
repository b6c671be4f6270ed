"""Streamed sufficient statistics for the ridge fit: sums over tokens, never the tokens themselves.

The closed-form fit of y from x (ridge.py) needs only, per group (a KV head, or the layer; capture.py),

    xx = sum x x^T   xy = sum x y^T   sx = sum x   sy = sum y   syy = sum y^2 (per output dim)   n

Features x: the position-free K (or V) of a list of source layers side by side (F = layers * Bx);
outputs y: those of a list of target layers (O = layers * By). Any sub-fit (one source layer, or the
k selected ones, onto one target layer) reads its blocks out of these sums, so one pass over the data
serves layer selection and the final fit. "fit" and "val" (data.Calibration's regions) are kept apart.

    stats = accumulate(source, target, calib, new_stats(source.config, target.config, "head"))

The plain path: each batch's products in float64 (Sums.add_). Its twin fast.add_batches (tested equal)
centers the features and takes float32 products; the caller passes one as `add` (fast.adder).
"""
from dataclasses import dataclass

import torch

from kvt.capture import capture, features
from kvt.config import KvtError, check_matched_kv

KINDS = ("k", "v")
SPLITS = ("fit", "val")
FIELDS = ("xx", "xy", "sx", "sy", "syy", "n")


@dataclass
class Sums:
    """Sums over tokens for one kind (K or V) and one split; G groups, F features, O outputs."""
    xx: torch.Tensor   # (G, F, F)  sum x x^T
    xy: torch.Tensor   # (G, F, O)
    sx: torch.Tensor   # (G, F)
    sy: torch.Tensor   # (G, O)
    syy: torch.Tensor  # (G, O)
    n: torch.Tensor    # ()  number of tokens

    @staticmethod
    def zeros(G, F, O, device=None, dtype=torch.float64):
        shapes = [(G, F, F), (G, F, O), (G, F), (G, O), (G, O), ()]
        return Sums(*(torch.zeros(s, dtype=dtype, device=device) for s in shapes))

    def add_(self, x, y):
        """Add tokens x (G, N, F) and y (G, N, O): their products in the sums' dtype (float64), summed."""
        x, y = x.to(self.xx.dtype), y.to(self.xx.dtype)
        self.xx += x.transpose(1, 2) @ x                                   # (G, F, N) @ (G, N, F)
        self.xy += x.transpose(1, 2) @ y                                   # (G, F, N) @ (G, N, O)
        self.sx += x.sum(1)
        self.sy += y.sum(1)
        self.syy += (y * y).sum(1)
        self.n += x.shape[1]
        return self

    def gram(self):
        """sum x x^T (G, F, F): a copy, which the caller may change in place."""
        return self.xx.clone()

    def __add__(self, other):
        return Sums(*(getattr(self, f) + getattr(other, f) for f in FIELDS))

    def select(self, fi, oi=slice(None)):
        """The sums of a sub-fit, in float64 whatever the sums' dtype: feature indices fi (ascending),
        output indices oi (default all outputs)."""
        assert bool((fi[1:] > fi[:-1]).all()), "feature indices must ascend"
        return Sums(*(t.double() for t in (self.xx[:, fi][:, :, fi], self.xy[:, fi][:, :, oi], self.sx[:, fi],
                                           self.sy[:, oi], self.syy[:, oi], self.n)))

    def tensors(self):
        return [getattr(self, f) for f in FIELDS]


def blocks(idx, size):
    """Block numbers [i, j, ...] -> element indices [i*size .. i*size+size-1, j*size ..] (LongTensor)."""
    idx = torch.as_tensor(idx, dtype=torch.long)
    return (idx[:, None] * size + torch.arange(size)).flatten()


@dataclass
class Stats:
    """Everything calibration accumulates: Sums for K and V, fit and validation splits, and what they cover."""
    scope: str            # "head" or "layer"
    src_layers: list      # source layers whose KV make up the features, in feature order
    tgt_layers: list      # target layers whose KV make up the outputs, in output order
    bx: int               # features per source layer per group: D (head scope) or Hkv*D (layer scope)
    by: int               # outputs per target layer per group
    sums: dict            # "k.fit", "k.val", "v.fit", "v.val" -> Sums

    def part(self, kind, split):
        return self.sums[f"{kind}.{split}"]


def new_stats(src_cfg, tgt_cfg, scope, src_layers=None, tgt_layers=None, device=None, dtype=torch.float64):
    """Zero statistics for a pair; src_layers and tgt_layers default to every layer of each model."""
    src_layers = list(range(src_cfg.n_layers)) if src_layers is None else sorted(src_layers)
    tgt_layers = list(range(tgt_cfg.n_layers)) if tgt_layers is None else sorted(tgt_layers)
    G, bx, by = groups(src_cfg, tgt_cfg, scope)
    F, O = len(src_layers) * bx, len(tgt_layers) * by
    sums = {f"{k}.{s}": Sums.zeros(G, F, O, device, dtype) for k in KINDS for s in SPLITS}
    return Stats(scope, src_layers, tgt_layers, bx, by, sums)


def layers_used(selected, targets=None):
    """The source layers that target layers `targets` (default all) select for K or V (selected: kind ->
    (Lt, k)), ascending: those a second, layer-level pass sums over."""
    rows = range(len(selected["k"])) if targets is None else targets
    return sorted({l for kind in KINDS for t in rows for l in selected[kind][t].tolist()})


def groups(src_cfg, tgt_cfg, scope):
    """(G, Bx, By) of a scope; head scope needs matched KV heads and head dim."""
    if scope == "head":
        check_matched_kv(src_cfg, tgt_cfg, scope)
        return src_cfg.n_kv_heads, src_cfg.head_dim, tgt_cfg.head_dim
    if scope == "layer":
        return 1, src_cfg.n_kv_heads * src_cfg.head_dim, tgt_cfg.n_kv_heads * tgt_cfg.head_dim
    raise KvtError(f"scope {scope!r} is not known; use 'head' or 'layer'")


def batch_features(stats, split, src_kv, tgt_kv):
    """(sums name, x (G, N, Ls*Bx), y (G, N, Lt*By)) for K and V of one batch of captured KV (capture()'s
    (keys, values) of source and target) in a split, on the statistics' device (layers of models split
    across devices, loading.place, are brought there)."""
    device = stats.part("k", split).xx.device
    for i, kind in enumerate(KINDS):
        x = features([src_kv[i][l].to(device) for l in stats.src_layers], stats.scope)  # (G, N, Ls, Bx)
        y = features([tgt_kv[i][l].to(device) for l in stats.tgt_layers], stats.scope)  # (G, N, Lt, By)
        yield f"{kind}.{split}", x.flatten(2), y.flatten(2)


def add_batches(stats, stream):
    """Add every (split, source KV, target KV) of `stream` (as batches() yields them) to stats, batch by
    batch: Sums.add_, float64 products. Returns stats. fast.add_batches is its twin."""
    for split, src_kv, tgt_kv in stream:
        for name, x, y in batch_features(stats, split, src_kv, tgt_kv):
            stats.sums[name].add_(x, y)
    return stats


def batches(source, target, calib, batch_size=1):
    """(split, source KV, target KV) of each batch of calib.fit, then of calib.val (a data.Calibration;
    batches never straddle the two): capture() of both models, each on its own device."""
    on = [next(m.parameters()).device for m in (source, target)]     # where each model's input goes
    for split in SPLITS:
        ids = getattr(calib, split)                                     # (S, T) token ids
        for s in range(0, len(ids), batch_size):
            batch = ids[s:s + batch_size]
            yield split, capture(source, batch.to(on[0])), capture(target, batch.to(on[1]))


def accumulate(source, target, calib, stats, batch_size=1, add=add_batches):
    """Stream every sequence of calib.fit, then of calib.val, through both models into stats (in place):
    add(stats, batches) adds them (add_batches, float64 products; fast.add_batches, its twin). Returns stats."""
    return add(stats, batches(source, target, calib, batch_size))

