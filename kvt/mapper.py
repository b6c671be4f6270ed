"""The Mapper: per target layer, a linear map (plus optional MLP) from selected source layers' KV to its KV.

    mapper, report = calibrate(source, target, ids)      # statistics -> layer selection -> ridge
    tgt_cache = mapper.apply(src_cache)                  # strip source RoPE, map, apply target RoPE
    save_mapper(mapper, "m.safetensors"); load_mapper("m.safetensors", src_cfg, tgt_cfg, tok_fp)

For target layer t and kind K (or V), with sel = the k selected source layers (layout in capture.py):
    x = source KV of layers sel, RoPE stripped        (G, N, k * Bx)
    y = x @ W[t] + b[t]                               (G, N, By)   batched over groups
(as k batched matmuls, one per selected layer, so x is never gathered into a copy); then y is laid back
out as (B, Hkv, T, D) and, for keys, rotated by the target's RoPE at the target positions.
Head scope (G = Hkv): head h from head h of the selected layers. Layer scope (G = 1): every head from
all heads of the selected layers, which also maps between different KV shapes.
"""
import json
import os
from dataclasses import asdict, dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import kvt
from kvt import ridge, rope
from kvt import mlp as mlp_
from kvt.cache import Cache
from kvt.capture import capture, features, layer_features, unfeatures
from kvt.config import Config, KvtError, check_matched_kv
from kvt.stats import KINDS, accumulate, describe_plan, held_out, memory_plan, new_stats


@dataclass
class Mapper:
    scope: str             # "head" or "layer"
    src_cfg: Config
    tgt_cfg: Config
    layers: dict           # kind -> LongTensor (Lt, k): selected source layers per target layer, ascending
    W: dict                # kind -> (Lt, G, k*Bx, By)
    b: dict                # kind -> (Lt, G, By)
    mlp: dict = field(default_factory=dict)  # kind -> {w1 (Lt, k*Hkv*D, Hd), b1 (Lt, Hd), w2 (Lt, Hd, O), b2 (Lt, O)}
    mlp_mode: str = ""     # "" ridge only; "residual" ridge + MLP; "replace" MLP only
    meta: dict = field(default_factory=dict)  # k, lambda, tokenizer fingerprint, diagnostics...

    @torch.no_grad()
    def apply(self, src_cache, positions=None):
        """The target's Cache for a source Cache (post-RoPE keys, as a serving engine holds them).

        positions (B, T) long: where the target's RoPE puts the mapped keys (default: the source's).
        Computes in the mapper's dtype (float32 unless moved with .to) on the cache's device and
        returns the cache in the source cache's dtype."""
        s, t = self.src_cfg, self.tgt_cfg
        B, T = src_cache.positions.shape
        pos = src_cache.positions if positions is None else positions
        dtype = self.W["k"].dtype
        inv, scale = rope.frequencies(s)
        cos, sin = rope.cos_sin(src_cache.positions, inv, 1 / scale, dtype)   # (B, 1, T, D), once for all layers
        keys = [rope.rotate(k.to(dtype), cos, -sin) for k in src_cache.keys]  # = rope.strip: rotate by -position
        xs = {"k": [layer_features(k, self.scope) for k in keys],             # Ls x (G, N, Bx)
              "v": [layer_features(v.to(dtype), self.scope) for v in src_cache.values]}
        out = {kind: [unfeatures(self.map_layer(kind, l, xs[kind]), self.scope, B, T, t.n_kv_heads, t.head_dim)
                      for l in range(t.n_layers)] for kind in KINDS}           # Lt x (B, Hkv, T, D)
        inv, scale = rope.frequencies(t)
        cos, sin = rope.cos_sin(pos, inv, scale, dtype)
        keys = [rope.rotate(k, cos, sin).to(src_cache.keys[0].dtype) for k in out["k"]]   # the target's RoPE
        values = [v.contiguous().to(src_cache.values[0].dtype) for v in out["v"]]
        return Cache(keys, values, pos.clone(), src_cache.mask.clone())

    def map_layer(self, kind, l, xs):
        """Target layer l's K or V from the source layers' features xs, Ls x (G, N, Bx): (G, N, By)."""
        sel = self.layers[kind][l].tolist()
        y = 0
        if self.mlp_mode != "replace":
            W, b = self.W[kind][l].to(xs[0]), self.b[kind][l].to(xs[0])    # (G, k*Bx, By), (G, By)
            bx = W.shape[1] // len(sel)
            for i, src in enumerate(sel):  # x @ W + b as a sum over the selected layers: no gathered copy of x
                w = W[:, i * bx:(i + 1) * bx]                               # (G, Bx, By): this layer's rows
                y = torch.baddbmm(b[:, None, :], xs[src], w) if i == 0 else y.baddbmm_(xs[src], w)
        if self.mlp_mode:
            p = {name: w[l].to(xs[0]) for name, w in self.mlp[kind].items()}
            x = torch.stack([xs[src] for src in sel], 2)                    # (G, N, k, Bx)
            y = y + unflat(mlp_.forward(p, flat(x)), x.shape[0])
        return y

    def n_params(self):
        return sum(t.numel() for t in self.tensors().values() if t.is_floating_point())

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self.tensors().values() if t.is_floating_point())

    def tensors(self):
        """Every tensor, by the name it has in a saved file."""
        out = {}
        for kind in KINDS:
            out.update({f"{kind}.layers": self.layers[kind], f"{kind}.W": self.W[kind], f"{kind}.b": self.b[kind]})
            out.update({f"{kind}.mlp.{name}": w for name, w in self.mlp.get(kind, {}).items()})
        return out

    def to(self, device=None, dtype=None):
        """A copy with weights on device / in dtype (selections stay integer)."""
        def move(x):
            return x.to(device=device, dtype=dtype if x.is_floating_point() else None)
        return Mapper(self.scope, self.src_cfg, self.tgt_cfg, {k: move(v) for k, v in self.layers.items()},
                      {k: move(v) for k, v in self.W.items()}, {k: move(v) for k, v in self.b.items()},
                      {k: {n: move(w) for n, w in p.items()} for k, p in self.mlp.items()}, self.mlp_mode,
                      dict(self.meta))


def flat(x):
    """Group layout (G, N, k, Bx) -> all heads of the k layers per token (N, k*Hkv*D), the MLP's input."""
    return x.permute(1, 2, 0, 3).reshape(x.shape[1], -1)            # (N, k, G, Bx) -> (N, k*G*Bx)


def unflat(y, G):
    """(N, Hkv*D) -> group layout (G, N, By)."""
    return y.view(y.shape[0], G, -1).transpose(0, 1)                 # (G, N, By)


# ---- calibration -------------------------------------------------------------------------------------

def calibrate(source, target, ids, scope="head", k=8, lam=0.01, lams=None, batch_size=1, checkpoint=None,
              stats_device=None, tokenizer="", progress=True, products=torch.float64):
    """Fit a ridge Mapper from source to target on calibration ids (n, T), the last 10% held out.

    1. statistics over all source layers (head-level when the pair has matched KV);
    2. per target layer and kind, the k source layers with the best held-out single-layer R^2;
    3. layer scope on a matched pair: a second pass accumulating only the union of the selected layers;
    4. ridge per target layer at `lam` (or the best of the sweep `lams` on held-out R^2).
    checkpoint: a path prefix; each pass's statistics are saved there and resumed from.
    products: dtype of the per-batch statistics products (float64, or float32 for speed; see stats.py).
    Returns (mapper, report): report["r2_single"][kind] (Ls, Lt) held-out R^2 of single-layer fits,
    report["r2"][kind] (Lt,) of the final fits, report["lambda"], report["sweep"] {lambda: mean R^2}."""
    src_cfg, tgt_cfg = source.config, target.config
    check_matched_kv(src_cfg, tgt_cfg, scope)
    matched = (src_cfg.n_kv_heads, src_cfg.head_dim) == (tgt_cfg.n_kv_heads, tgt_cfg.head_dim)
    device = stats_device or next(source.parameters()).device
    if progress:
        plan = memory_plan(src_cfg, tgt_cfg, scope, k, batch_tokens=ids.shape[1] * batch_size)
        print(f"calibration memory plan ({scope} scope, k={k}):\n{describe_plan(plan)}")
    stats = new_stats(src_cfg, tgt_cfg, "head" if matched else "layer", device=device)
    stats = accumulate(source, target, ids, stats, batch_size, checkpoint and f"{checkpoint}.pass1",
                       progress=progress, products=products)
    r2_single = {kind: ridge.single_layer_r2(stats, kind, lam) for kind in KINDS}
    selected = {kind: ridge.select_layers(r2_single[kind], stats.src_layers, k) for kind in KINDS}
    if scope == "layer" and matched:
        union = sorted(set(torch.cat([selected[kind].flatten() for kind in KINDS]).tolist()))
        stats = new_stats(src_cfg, tgt_cfg, "layer", union, device=device)
        stats = accumulate(source, target, ids, stats, batch_size, checkpoint and f"{checkpoint}.pass2",
                           progress=progress, products=products)
    scores = {}
    if lams:
        lam, scores = ridge.sweep(stats, selected, lams)
    fits = {kind: ridge.fit_layers(stats, kind, selected[kind], lam) for kind in KINDS}
    meta = {"k": min(k, src_cfg.n_layers), "lambda": lam, "tokenizer": tokenizer,
            "calib_sequences": len(ids), "calib_len": ids.shape[1],
            "r2": {kind: fits[kind][2].tolist() for kind in KINDS}}
    mapper = Mapper(scope, src_cfg, tgt_cfg, selected, {kind: fits[kind][0].float().cpu() for kind in KINDS},
                    {kind: fits[kind][1].float().cpu() for kind in KINDS}, meta=meta)
    report = {"r2_single": r2_single, "r2": {kind: fits[kind][2] for kind in KINDS}, "lambda": lam, "sweep": scores}
    return mapper, report


def sample_features(source, target, ids, max_bytes=2 * 2**30, scope="head", seed=0):
    """Position-free K and V of a seeded random sample of the tokens of ids, within max_bytes (float32).

    Returns {kind: (x (G, N, Ls, Bx), y (G, N, Lt, By))} of source and target: the stored features the
    MLP trains on. Memory is bounded by sampling tokens evenly from every sequence."""
    s, t = source.config, target.config
    per_token = 4 * 2 * (s.n_layers * s.n_kv_heads * s.head_dim + t.n_layers * t.n_kv_heads * t.head_dim)
    per_seq = max(1, min(ids.shape[1], max_bytes // per_token // len(ids)))
    g = torch.Generator().manual_seed(seed)
    device = next(source.parameters()).device
    parts = {kind: ([], []) for kind in KINDS}
    for seq in ids:
        pick = torch.randperm(ids.shape[1], generator=g)[:per_seq].to(device)  # tokens kept from this sequence
        src, tgt = capture(source, seq[None].to(device)), capture(target, seq[None].to(device))
        for i, kind in enumerate(KINDS):
            parts[kind][0].append(features(src[i], scope)[:, pick].float())
            parts[kind][1].append(features(tgt[i], scope)[:, pick].float())
    return {kind: (torch.cat(xs, 1), torch.cat(ys, 1)) for kind, (xs, ys) in parts.items()}


def add_mlp(mapper, source, target, ids, residual=True, hidden=1024, max_bytes=2 * 2**30, progress=True,
            **train_kw):
    """The MLP backstop on top of (residual=True) or instead of a fitted Mapper; returns a new Mapper.

    Trains one MLP per target layer and kind (mlp.train; train_kw go there) on a bounded sample of the
    tokens of ids (n, T); the last 10% of sequences are held out for early stopping, as in calibration."""
    n_fit = len(ids) - held_out(len(ids))
    fit = sample_features(source, target, ids[:n_fit], max_bytes, mapper.scope)
    held = sample_features(source, target, ids[n_fit:], max_bytes // 10 + 1, mapper.scope)
    out = mapper.to()
    out.mlp_mode, out.mlp = "residual" if residual else "replace", {}
    for kind in KINDS:
        params = []
        for l in range(mapper.tgt_cfg.n_layers):
            p, loss = mlp_.train(*_mlp_data(mapper, kind, l, *fit[kind], residual),
                                 *_mlp_data(mapper, kind, l, *held[kind], residual), hidden=hidden, **train_kw)
            if progress:
                print(f"mlp {kind} layer {l}: held-out loss {loss:.4f} (fraction of variance left)")
            params.append(p)
        out.mlp[kind] = {name: torch.stack([p[name] for p in params]).cpu() for name in params[0]}
    return out


def _mlp_data(mapper, kind, l, xs, ys, residual):
    """MLP inputs (N, k*Hkv*D) and targets (N, Hkv*D) for target layer l from sampled features
    xs (G, N, Ls, Bx) and ys (G, N, Lt, By); residual: targets minus the ridge map's prediction."""
    y = ys[:, :, l]                                                     # (G, N, By)
    if residual:
        y = y - mapper.map_layer(kind, l, list(xs.unbind(2)))
    return flat(xs[:, :, mapper.layers[kind][l]]), y.transpose(0, 1).reshape(y.shape[1], -1)


# ---- files ---------------------------------------------------------------------------------------------

def save_mapper(mapper, path, dtype=torch.float32):
    """Write a mapper as safetensors with its pair's metadata, atomically; dtype=torch.bfloat16 halves it."""
    tensors = {name: (t.to(dtype) if t.is_floating_point() else t).contiguous().cpu()
               for name, t in mapper.tensors().items()}
    meta = {"format": "kvt-mapper", "kvt_version": kvt.__version__, "scope": mapper.scope, "mlp": mapper.mlp_mode,
            "src_config": json.dumps(asdict(mapper.src_cfg)), "tgt_config": json.dumps(asdict(mapper.tgt_cfg)),
            "src_fingerprint": mapper.src_cfg.fingerprint(), "tgt_fingerprint": mapper.tgt_cfg.fingerprint(),
            "tokenizer": str(mapper.meta.get("tokenizer", "")), "k": str(mapper.meta.get("k", "")),
            "lambda": str(mapper.meta.get("lambda", "")), "meta": json.dumps(mapper.meta)}
    save_file(tensors, f"{path}.tmp", metadata=meta)
    os.replace(f"{path}.tmp", path)


def load_mapper(path, src_cfg=None, tgt_cfg=None, tokenizer=None, dtype=torch.float32, device="cpu"):
    """Read a mapper; refuse one fitted for another source, target or tokenizer (fingerprints)."""
    if not os.path.exists(path):
        raise KvtError(f"no mapper at {path}; calibrate one first")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != "kvt-mapper":
        raise KvtError(f"{path} is not a kvt mapper file; calibrate one with run.py")
    for what, cfg, key in (("source", src_cfg, "src_fingerprint"), ("target", tgt_cfg, "tgt_fingerprint")):
        if cfg is not None and cfg.fingerprint() != meta[key]:
            raise KvtError(f"mapper {path} was fitted for another {what} model (fingerprint {meta[key]}, this "
                           f"one {cfg.fingerprint()}); recalibrate for this pair or pass its own mapper")
    if tokenizer and meta["tokenizer"] and tokenizer != meta["tokenizer"]:
        raise KvtError(f"mapper {path} was fitted with another tokenizer ({meta['tokenizer']}, this one "
                       f"{tokenizer}); recalibrate for this pair")
    t = load_file(str(path), device=str(device))
    t = {name: x.to(dtype) if x.is_floating_point() else x for name, x in t.items()}
    mlp = {kind: {name.split(".")[-1]: x for name, x in t.items() if name.startswith(f"{kind}.mlp.")}
           for kind in KINDS}
    return Mapper(meta["scope"], Config(**json.loads(meta["src_config"])), Config(**json.loads(meta["tgt_config"])),
                  {kind: t[f"{kind}.layers"] for kind in KINDS}, {kind: t[f"{kind}.W"] for kind in KINDS},
                  {kind: t[f"{kind}.b"] for kind in KINDS}, {k: v for k, v in mlp.items() if v}, meta["mlp"],
                  json.loads(meta["meta"]))
