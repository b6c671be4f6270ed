"""Streamed sufficient statistics for the ridge fit, with checkpoint/resume.

The closed-form fit of y from x (ridge.py) needs only sums over tokens, never the tokens themselves:

    xx = sum x x^T   xy = sum x y^T   sx = sum x   sy = sum y   syy = sum y^2 (per output dim)   n

per group g (a KV head in head scope, the whole layer in layer scope; see capture.py). Features x are
the position-free K (or V) of a list of source layers, concatenated layer by layer (F = layers * Bx);
outputs y are those of a list of target layers (all of them unless the statistics are split by
target-layer groups, mapper.calibrate), concatenated (O = layers * By). Any sub-fit (one source layer,
or the k selected ones, onto one target layer) reads its blocks out of these sums, so one pass over
the calibration data serves layer selection and the final fit. Sums are plain tensors: two statistics
objects add by tensor addition, and a checkpoint is those tensors in a safetensors file, so a resumed
calibration is bit-identical to an unbroken one.

This file is the plain path: each batch's products in float64 (Sums.add_), added. Its fast twin,
fast.add_batch (kvt/fast.py, tested equal in tests/test_fast.py), centers the features and takes
float32 products of the upper part of xx only; the caller picks one by passing it as `add`.

Two splits: "fit" (calibration's fit region) and "val" (its validation region, data.Calibration),
kept as separate sums; layer selection and lambda are chosen on "val". Diagnostics use a third region
that never reaches the statistics.

Data parallel (torchrun, dist.py): each rank streams its share of the batches into its own sums, and
the ranks' sums are added with all_reduce at every checkpoint and at the end.
"""
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from kvt.harness import files as checkpoint, dist
from kvt.capture import capture, features
from kvt.config import KvtError, check_matched_kv

KINDS = ("k", "v")
SPLITS = ("fit", "val")
FIELDS = ("xx", "xy", "sx", "sy", "syy", "n")
FORMAT = "kvt-stats-2"  # 2: fit/val regions of disjoint documents, target-layer lists, centered products


@dataclass
class Sums:
    """Sums over tokens for one kind (K or V) and one split; G groups, F features, O outputs.

    xx = sum x x^T is symmetric: gram() reads only its upper part (the fast twin, fast.add_fast_,
    accumulates only that: about half the work)."""
    xx: torch.Tensor   # (G, F, F)  sum x x^T (fast.add_fast_: its upper part)
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
        """The full symmetric sum x x^T (G, F, F) from its upper part (the fast path fills only that)."""
        return self.xx.triu() + self.xx.triu(1).transpose(1, 2)

    def __add__(self, other):
        return Sums(*(getattr(self, f) + getattr(other, f) for f in FIELDS))

    def select(self, fi, oi=slice(None)):
        """The sums of a sub-fit, in float64 whatever the sums' dtype: feature indices fi (ascending, so
        xx keeps its upper part), output indices oi (default all outputs)."""
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
    seen: int = 0         # calibration sequences accumulated so far, fit then validation (the resume point)
    data: str = ""        # data.Calibration.hash() of the sequences these sums are over
    key: str = ""         # what the caller made them for (pair, settings); a checkpoint must match it
    meta: dict = field(default_factory=dict)

    def __add__(self, other):
        return Stats(self.scope, self.src_layers, self.tgt_layers, self.bx, self.by,
                     {name: s + other.sums[name] for name, s in self.sums.items()},
                     self.seen + other.seen, self.data, self.key)

    def part(self, kind, split):
        return self.sums[f"{kind}.{split}"]

    def plan(self):
        """What the sums cover (a checkpoint for another plan is refused)."""
        return {"scope": self.scope, "src_layers": list(self.src_layers), "tgt_layers": list(self.tgt_layers),
                "bx": self.bx, "by": self.by}


def new_stats(src_cfg, tgt_cfg, scope, src_layers=None, tgt_layers=None, device=None, dtype=torch.float64, key=""):
    """Zero statistics for a pair; src_layers and tgt_layers default to every layer of each model."""
    src_layers = list(range(src_cfg.n_layers)) if src_layers is None else sorted(src_layers)
    tgt_layers = list(range(tgt_cfg.n_layers)) if tgt_layers is None else sorted(tgt_layers)
    G, bx, by = groups(src_cfg, tgt_cfg, scope)
    F, O = len(src_layers) * bx, len(tgt_layers) * by
    sums = {f"{k}.{s}": Sums.zeros(G, F, O, device, dtype) for k in KINDS for s in SPLITS}
    return Stats(scope, src_layers, tgt_layers, bx, by, sums, key=key)


def candidate_layers(n_layers, count=None):
    """`count` source layers spread evenly from the first to the last (all of them when count is None):
    fewer candidates for layer selection make smaller statistics."""
    if count is None or count >= n_layers:
        return list(range(n_layers))
    if count < 2:
        raise KvtError(f"--candidates {count}: layer selection needs at least 2 candidate source layers")
    return [i * (n_layers - 1) // (count - 1) for i in range(count)]


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


def add_batch(stats, split, src_kv, tgt_kv, pending=None):
    """Add one batch of captured KV to a split: Sums.add_ (float64 products). pending: the caller's dict of
    what an adder holds back until a flush point (fast.add_batch's); this one holds nothing back."""
    for name, x, y in batch_features(stats, split, src_kv, tgt_kv):
        stats.sums[name].add_(x, y)


def flush(pending):
    """Add what each of an adder's pending objects holds back to its sums (flush_(); fast.Pending)."""
    for p in pending:
        p.flush_()


SAVE_S = 600.0     # seconds between statistics checkpoints: a pass of a large pair is tens of GiB to write


def accumulate(source, target, calib, stats, batch_size=1, path=None, every=20, save_s=SAVE_S, final=True,
               progress=True, add=add_batch, capture_target=capture):
    """Stream every not-yet-seen sequence of calib.fit, then of calib.val, through both models into
    stats (in place); calib is a data.Calibration. Every `every` rounds what is pending is added to the
    sums (a flush point, the same with or without a checkpoint). With `path`, the statistics are saved
    there at the first flush point `save_s` seconds after the last save (0: at every flush point) and,
    with `final`, once complete; a run that finds a checkpoint resumes from it (one made for other data,
    another plan or another key is refused). Saves land on flush points only, so a resumed run adds in
    the order an unbroken one does: bit-identical sums. final=False leaves the complete sums unsaved (a
    caller that saves what it fits from them instead; the last checkpoint stays for it to delete), and
    deletes a checkpoint before writing the next, so the disk never holds two of them.
    add, capture_target: what one batch adds and how the target's side of it is captured (default:
    add_batch, capture; fast.add_batch is add's fast twin, attnfit.py passes its weighted twins).

    Data parallel under torchrun (dist.py; every rank calls this with the same calib and stats): the
    batches are dealt out in rounds, one batch per rank, and the ranks' sums are all-reduced at every
    checkpoint and at the end, so every rank returns the statistics over all the sequences, equal to one
    process's up to float32 rounding (each rank holds its own batches' pending products). The
    invariant: the ranks' sums add up to the statistics of the first stats.seen sequences (what stats
    held on entry counts once, on rank 0). A checkpoint holds those totals and a resume point between
    rounds, so it resumes with any number of ranks. Returns stats."""
    if path and Path(path).exists():
        load_stats(path, like=stats)                    # into stats' own tensors: no second copy
    stats.data = stats.data or calib.hash()
    if stats.data != calib.hash():
        raise KvtError(f"statistics {path or ''} were accumulated over other calibration sequences; delete the "
                       "file or use the same corpus, --calib-seqs, --calib-len and seed")
    if dist.rank() > 0:
        zero_(stats)
    ids = torch.cat([calib.fit, calib.val])
    n, n_fit = len(ids), len(calib.fit)
    starts = [*range(0, n_fit, batch_size), *range(n_fit, n, batch_size)]  # batches never straddle splits
    todo = [(s, min(s + batch_size, n_fit if s < n_fit else n)) for s in starts if s >= stats.seen]
    rounds = [todo[i:i + dist.world()] for i in range(0, len(todo), dist.world())]
    devices = [next(m.parameters()).device for m in (source, target)]      # where each model's input goes
    device = stats.part("k", "fit").xx.device
    desc = f"calibration stats ({stats.scope}, {len(stats.src_layers)} source x {len(stats.tgt_layers)} target layers)"
    pending, saved = {}, time.monotonic()
    for i, batches in enumerate(tqdm(rounds, desc=desc, disable=not progress or dist.rank() > 0)):
        for s, e in dist.shard(batches):                                     # this rank's batch, if any
            src, tgt = capture(source, ids[s:e].to(devices[0])), capture_target(target, ids[s:e].to(devices[1]))
            add(stats, "fit" if s < n_fit else "val", src, tgt, pending)
        stats.seen = batches[-1][1]
        done = stats.seen == n
        if (i + 1) % every == 0 or done:                  # a flush point, with or without a path, so that a
            flush(pending.values())                       # resumed run adds in the order an unbroken one does
        else:
            continue
        due = torch.tensor([float(time.monotonic() - saved >= save_s)], device=device)
        if path and (final if done else dist.all_reduce_(due).item() > 0):   # any rank's clock: all save
            saved = time.monotonic()
            all_reduce_(stats)
            if dist.rank() == 0:
                if not final and Path(path).exists():     # the disk holds one checkpoint of a pass whose
                    os.remove(path)                       # result the caller keeps, not two while rewriting
                save_stats(stats, path)
            else:
                zero_(stats)                              # the totals count once: on rank 0
    flush(pending.values())
    return all_reduce_(stats)                             # every rank: the sums over all the sequences


def all_reduce_(stats):
    """Sum every rank's statistics, in place, in their own dtype (float64 by default). Returns stats."""
    for s in stats.sums.values():
        for t in s.tensors():
            dist.all_reduce_(t)
    return stats


def zero_(stats):
    for s in stats.sums.values():
        for t in s.tensors():
            t.zero_()


def save_stats(stats, path):
    """Write stats to a safetensors file atomically (checkpoint.save)."""
    check_finite(stats)
    tensors = {f"{name}.{f}": getattr(s, f) for name, s in stats.sums.items() for f in FIELDS}
    checkpoint.save(path, tensors, FORMAT, {"plan": json.dumps(stats.plan()), "seen": str(stats.seen),
                                            "data": stats.data, "key": stats.key})


def load_stats(path, like=None, device=None):
    """Read stats saved by save_stats. With `like`, refuse a file that covers something else (another
    plan, key or format), and read the sums into like's own tensors (one tensor at a time, so memory
    never holds two copies); returns like."""
    names = [f"{k}.{s}" for k in KINDS for s in SPLITS]
    fix = "delete it to recalibrate"
    f, meta = checkpoint.open_(path, FORMAT, "statistics checkpoint", fix, None if like is None else like.key,
                               device or "cpu")
    with f:
        plan = json.loads(meta["plan"])
        if like is None:
            sums = {name: Sums(*(f.get_tensor(f"{name}.{fld}") for fld in FIELDS)) for name in names}
            stats = Stats(plan["scope"], plan["src_layers"], plan["tgt_layers"], plan["bx"], plan["by"], sums)
        else:
            if plan != like.plan():
                raise KvtError(f"statistics checkpoint {path} is for another calibration plan ({plan}, not "
                               f"{like.plan()}); {fix}")
            for name in names:
                for fld in FIELDS:
                    getattr(like.sums[name], fld).copy_(f.get_tensor(f"{name}.{fld}"))
            stats = like
    stats.seen, stats.data, stats.key = int(meta["seen"]), meta["data"], meta["key"]
    check_finite(stats)
    return stats


def check_finite(stats):
    """NaN or inf in the sums means a model produced non-finite KV: refuse to fit on it."""
    for name, s in stats.sums.items():
        for f in FIELDS:
            if not torch.isfinite(getattr(s, f)).all():
                raise KvtError(f"calibration statistics {name}.{f} contain NaN/inf: a model produced non-finite KV; "
                               "run the models in float32 (--dtype float32) and recalibrate")
