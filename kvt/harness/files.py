"""kvt's own files, each format in one place: calibration statistics, fits, MLP checkpoints, mappers and
KV caches, written and read one way; and the short ids that name checkpoints.

    save(path, tensors, FORMAT, {"key": key, ...})                 # safetensors, atomically
    tensors, meta = load(path, FORMAT, "fit checkpoint", "delete it to fit again", key=key)  # None: no file
    save_mapper(mapper, "m.safetensors"); load_mapper("m.safetensors", src_cfg, tgt_cfg, tok_fp)

A file is safetensors (never pickle) whose metadata holds a `format` (the kind of file and its version)
and, where it depends on a pair and its settings, the caller's `key`. Reading refuses, in one line that
ends in what to do, a file that is unreadable or truncated, one of another format or version, and one
made for another key. Statistics checkpoints are what a resumed calibration starts from, so a resumed
run is bit-identical to an unbroken one (harness/calibration.py).
"""
import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field, fields

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

import kvt
from kvt.cache import Cache
from kvt.config import Config, KvtError, check_finite
from kvt.fast import mirror_
from kvt.mapper import Mapper
from kvt.stats import FIELDS, KINDS, SPLITS, Stats, Sums
from kvt.weights import unchecked, write_safetensors


def short_id(obj):
    """8 hex digits naming a JSON-able object (settings, a layer selection): sha256 of its sorted JSON.
    Checkpoint names and keys are made of these, so equal settings find each other's files."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:8]


def save(path, tensors, format, meta=None):
    """Write {name: tensor} to path atomically (weights.write_safetensors), metadata {"format": format, **meta}
    (strings)."""
    write_safetensors({name: t.contiguous() for name, t in tensors.items()}, path,
                      metadata={"format": format, **(meta or {})})


def unreadable(path, what, fix, e):
    return KvtError(f"{path} is not a readable {what} file (unreadable or truncated: {str(e).splitlines()[0]}); {fix}")


def open_(path, format, what, fix, key=None, device="cpu", other="another pair or settings"):
    """(f, meta): the open file (f.get_tensor(name) reads one tensor, so a caller can read a large file
    tensor by tensor) and its metadata, once checked: its format, and with `key` the key it was made for
    (`other` says what another key means)."""
    try:
        f = safe_open(str(path), "pt", device=str(device))
    except (SafetensorError, OSError) as e:
        raise unreadable(path, what, fix, e)
    meta = f.metadata() or {}
    if meta.get("format") != format:
        raise KvtError(f"{path} is not a kvt {what} of this version (format {meta.get('format', 'unknown')}, "
                       f"need {format}); {fix}")
    if key is not None and meta.get("key") != key:
        raise KvtError(f"{what} {path} was made for {other} ({meta.get('key') or 'no key'}, not {key or 'no key'}); "
                       f"{fix}")
    return f, meta


def load(path, format, what, fix, key=None, device="cpu", other="another pair or settings"):
    """({name: tensor}, meta) of a file save wrote, or None when there is no file at path; refuses one
    that open_ refuses."""
    if not path or not os.path.exists(path):
        return None
    f, meta = open_(path, format, what, fix, key, device, other)
    try:
        with f:
            return {name: f.get_tensor(name) for name in f.keys()}, meta
    except (SafetensorError, OSError) as e:
        raise unreadable(path, what, fix, e)


# ---- calibration statistics ------------------------------------------------------------------------------

STATS_FORMAT = "kvt-stats-2"  # 2: fit/val regions of disjoint documents, target-layer lists, centered products


@dataclass
class Resumable(Stats):
    """Statistics as a long run checkpoints them (accumulate_resumable): the sums, their resume point and
    what they are for."""
    seen: int = 0         # calibration sequences accumulated so far, fit then validation (the resume point)
    data: str = ""        # data.Calibration.hash() of the sequences these sums are over
    key: str = ""         # what the caller made them for (pair, settings); a checkpoint must match it
    meta: dict = field(default_factory=dict)

    def plan(self):
        """What the sums cover (a checkpoint for another plan is refused)."""
        return {"scope": self.scope, "src_layers": list(self.src_layers), "tgt_layers": list(self.tgt_layers),
                "bx": self.bx, "by": self.by}


def resumable(stats, key=""):
    """stats (a stats.Stats) as a Resumable marked with key, sharing its tensors; a Resumable as it is."""
    if isinstance(stats, Resumable):
        return stats
    return Resumable(**{f.name: getattr(stats, f.name) for f in fields(Stats)}, key=key)


def save_stats(stats, path):
    """Write stats (stats.Stats) to a safetensors file atomically (save)."""
    check_finite(stats)
    tensors = {f"{name}.{f}": getattr(s, f) for name, s in stats.sums.items() for f in FIELDS}
    save(path, tensors, STATS_FORMAT, {"plan": json.dumps(stats.plan()), "seen": str(stats.seen),
                                       "data": stats.data, "key": stats.key, "xx": "whole"})


def load_stats(path, like=None, device=None):
    """Read stats saved by save_stats. With `like`, refuse a file that covers something else (another
    plan, key or format), and read the sums into like's own tensors (one tensor at a time, so memory
    never holds two copies); returns like. A file without "xx": "whole" in its metadata has each xx made
    whole from its upper part (fast.mirror_): an older kvt's fast path filled only that."""
    names = [f"{k}.{s}" for k in KINDS for s in SPLITS]
    fix = "delete it to recalibrate"
    f, meta = open_(path, STATS_FORMAT, "statistics checkpoint", fix, None if like is None else like.key,
                    device or "cpu")
    with f:
        plan = json.loads(meta["plan"])
        if like is None:
            sums = {name: Sums(*(f.get_tensor(f"{name}.{fld}") for fld in FIELDS)) for name in names}
            stats = Resumable(plan["scope"], plan["src_layers"], plan["tgt_layers"], plan["bx"], plan["by"], sums)
        else:
            if plan != like.plan():
                raise KvtError(f"statistics checkpoint {path} is for another calibration plan ({plan}, not "
                               f"{like.plan()}); {fix}")
            for name in names:
                for fld in FIELDS:
                    getattr(like.sums[name], fld).copy_(f.get_tensor(f"{name}.{fld}"))
            stats = like
    for s in stats.sums.values() if meta.get("xx") != "whole" else ():
        mirror_(s.xx)
    stats.seen, stats.data, stats.key = int(meta["seen"]), meta["data"], meta["key"]
    check_finite(stats)
    return stats


# ---- fits of a layer-level pass -------------------------------------------------------------------------

FITS_FORMAT = "kvt-fits-1"


def save_fits(path, fits, skipped, key):
    """Write one layer-level pass's fits ({kind: {target layer: (W, b, R^2, lambda)}}, float32 on the CPU)
    and its skipped lambdas ({kind: {target layer: [lambdas]}}) atomically, marked with `key`."""
    tensors = {f"{kind}.{name}.{t}": x for kind, by in fits.items() for t, f in by.items()
               for name, x in (("W", f[0]), ("b", f[1]))}
    info = {kind: {t: [f[2], f[3], skipped[kind].get(t)] for t, f in by.items()} for kind, by in fits.items()}
    save(path, tensors, FITS_FORMAT, {"key": key, "fits": json.dumps(info)})


def load_fits(path, key):
    """(fits, skipped) as save_fits wrote them, or None when there is no such file; refuses one made for
    another key, or unreadable, in one line."""
    got = load(path, FITS_FORMAT, "fit checkpoint", "delete it to fit again", key)
    if got is None:
        return None
    t, meta = got
    info = json.loads(meta["fits"])
    fits = {kind: {int(l): (t[f"{kind}.W.{l}"], t[f"{kind}.b.{l}"], r2, lam) for l, (r2, lam, _) in by.items()}
            for kind, by in info.items()}
    skipped = {kind: {int(l): bad for l, (_, _, bad) in by.items() if bad} for kind, by in info.items()}
    return fits, skipped


# ---- MLP checkpoints ------------------------------------------------------------------------------------

MLP_FORMAT = "kvt-mlp-checkpoint-1"


def save_mlp_checkpoint(path, p, key):
    """Write one MLP's weights ({"w0": ..., "b0": ...}) atomically, marked with `key`."""
    save(path, p, MLP_FORMAT, {"key": key})


def load_mlp_checkpoint(path, key):
    """One MLP that calibration saved as it finished ({"w0": ..., "b0": ...}), or None if there is none;
    refuses one made for other settings, or unreadable, in one line."""
    fix = f"delete the {os.path.basename(str(path)).rsplit('-', 1)[0]}-* files to train again"
    got = load(path, MLP_FORMAT, "MLP checkpoint", fix, key, other="another pair, mapper or settings")
    return None if got is None else got[0]


# ---- mappers --------------------------------------------------------------------------------------------

MAPPER_FORMAT = "kvt-mapper-2"  # 2: disjoint calibration regions, standardized ridge with per-layer lambda, MLP w0.. names


def save_mapper(mapper, path, dtype=torch.float32):
    """Write a mapper as safetensors with its pair's metadata, atomically; dtype=torch.bfloat16 halves it."""
    tensors = {name: t.to(dtype) if t.is_floating_point() else t for name, t in mapper.to("cpu").tensors().items()}
    meta = {"kvt_version": kvt.__version__, "scope": mapper.scope, "mapper": mapper.mapper,
            "src_config": json.dumps(asdict(mapper.src_cfg)), "tgt_config": json.dumps(asdict(mapper.tgt_cfg)),
            "src_fingerprint": mapper.src_cfg.fingerprint(), "tgt_fingerprint": mapper.tgt_cfg.fingerprint(),
            "tokenizer": str(mapper.meta.get("tokenizer", "")), "meta": json.dumps(mapper.meta)}
    save(path, tensors, MAPPER_FORMAT, meta)


def load_mapper(path, src_cfg=None, tgt_cfg=None, tokenizer=None, dtype=torch.float32, device="cpu", key=None):
    """Read a mapper; refuse one fitted for another source, target or tokenizer (fingerprints), for
    other weights, data or settings (`key`, what the caller made it from: meta["key"]), one written by
    another version of kvt, and a file that is not a mapper, each with one line."""
    got = load(path, MAPPER_FORMAT, "mapper", "delete it and calibrate again", device=device)
    if got is None:
        raise KvtError(f"no mapper at {path}; calibrate one first")
    t, meta = got
    for what, cfg, entry in (("source", src_cfg, "src_fingerprint"), ("target", tgt_cfg, "tgt_fingerprint")):
        if cfg is not None and cfg.fingerprint() != meta[entry]:
            raise KvtError(f"mapper {path} was fitted for another {what} model (fingerprint {meta[entry]}, this "
                           f"one {cfg.fingerprint()}); recalibrate for this pair or pass its own mapper")
    if tokenizer and meta["tokenizer"] and tokenizer != meta["tokenizer"]:
        raise KvtError(f"mapper {path} was fitted with another tokenizer ({meta['tokenizer']}, this one "
                       f"{tokenizer}); recalibrate for this pair")
    inner = json.loads(meta["meta"])
    if unchecked(inner):                           # said once, here: check_pair_weights does not say it again
        print(f"warning: mapper {path} {unchecked(inner)}", file=sys.stderr)
        inner["unchecked_warned"] = True
    made_from = inner.get("key")
    if key is not None and made_from != key:
        raise KvtError(f"mapper {path} was made from other weights, data or settings ({made_from}, not {key}); "
                       "delete it to calibrate again")
    t = {name: x.to(dtype) if x.is_floating_point() else x for name, x in t.items()}
    form = meta.get("mapper") or {"": "ridge", "replace": "mlp", "residual": "ridge+mlp"}.get(meta.get("mlp"))  # older files
    mlp = {kind: {name.split(".")[-1]: x for name, x in t.items() if name.startswith(f"{kind}.mlp.")}
           for kind in KINDS}
    return Mapper(meta["scope"], Config(**json.loads(meta["src_config"])), Config(**json.loads(meta["tgt_config"])),
                  {kind: t[f"{kind}.layers"] for kind in KINDS}, {kind: t[f"{kind}.W"] for kind in KINDS},
                  {kind: t[f"{kind}.b"] for kind in KINDS}, {k: v for k, v in mlp.items() if v}, form,
                  inner)


# ---- a cache as a file: what a serving engine saves for another to load (kvt/integrations/serving.py) -----

KV_FORMAT = "kvt-kv-1"


def save_kv(path, cache, ids, model_fingerprint, tokenizer_fingerprint, weights_fingerprint=None, weights_digest=None):
    """Write a batch-1 Cache of T slots (keys after RoPE, positions 0..T-1) and its T token ids (list of
    int) as safetensors, atomically, with the source model's config, tokenizer and weights fingerprints
    (weights.folder_fingerprint or model_fingerprint, and the digest of every value: folder_digest or
    model_digest; a target's connector maps only a file whose weights are the mapper's source's)."""
    tensors = {"ids": torch.tensor(ids, dtype=torch.long), "positions": cache.positions[0].cpu().contiguous()}
    for l, (k, v) in enumerate(zip(cache.keys, cache.values)):
        tensors[f"k.{l}"], tensors[f"v.{l}"] = k[0].cpu().contiguous(), v[0].cpu().contiguous()  # (Hkv, T, D)
    weights = {k: v for k, v in (("weights", weights_fingerprint), ("digest", weights_digest)) if v}
    write_safetensors(tensors, path, {"format": KV_FORMAT, "model": model_fingerprint,
                                      "tokenizer": tokenizer_fingerprint, "layers": str(len(cache.keys)), **weights})


def kv_header(path):
    """(metadata dict, token ids LongTensor (T,)) of a KV file, without reading its KV; KvtError if it is none."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            ids = f.get_tensor("ids") if "ids" in f.keys() else None
    except (SafetensorError, OSError) as e:
        raise KvtError(f"{path} is not a readable KV file ({str(e).splitlines()[0]}); save it again from the source")
    if meta.get("format") != KV_FORMAT or ids is None:
        raise KvtError(f"{path} is not a kvt KV file (format {meta.get('format', 'unknown')}, need {KV_FORMAT}); "
                       "save it with kvt.harness.files.save_kv or the connector's source side")
    return meta, ids


def load_kv(path, n=None):
    """The batch-1 Cache of the first n slots (default all) of a KV file."""
    meta, _ = kv_header(path)
    t = load_file(str(path))
    L = int(meta["layers"])
    n = n or t["positions"].shape[0]
    keys = [t[f"k.{l}"][None, :, :n] for l in range(L)]                       # L x (1, Hkv, n, D)
    values = [t[f"v.{l}"][None, :, :n] for l in range(L)]
    return Cache(keys, values, t["positions"][None, :n], torch.ones(1, n, dtype=torch.bool), full=True)
