"""The Mapper: per target layer, a linear map (plus optional MLP) from selected source layers' KV to its KV.

    mapper, report = calibrate(source, target, ids)      # statistics -> layer selection -> ridge
    tgt_cache = mapper.apply(src_cache)                  # strip source RoPE, map, apply target RoPE
    save_mapper(mapper, "m.safetensors"); load_mapper("m.safetensors", src_cfg, tgt_cfg, tok_fp)
    mapper = mapper.place(layer_devices(target))         # a target split across devices (model.place)

For target layer t and kind K (or V), with sel = the k selected source layers (layout in capture.py):
    x = source KV of layers sel, RoPE stripped        (G, N, k * Bx)
    y = x @ W[t] + b[t]                               (G, N, By)   batched over groups
(as k batched matmuls, one per selected layer, so x is never gathered into a copy); then y is laid back
out as (B, Hkv, T, D) and, for keys, rotated by the target's RoPE at the target positions.
Head scope (G = Hkv): head h from head h of the selected layers. Layer scope (G = 1): every head from
all heads of the selected layers, which also maps between different KV shapes.

Across devices: place() puts the weights for target layer l on the device of target layer l; apply
then maps layer l there, moving each source layer's KV at most once to each device that needs it, and
the mapped cache's layer l lives there, where the target's layer l will read it.
"""
import json
import os
from dataclasses import asdict, dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import kvt
from kvt import dist, ridge, rope
from kvt import mlp as mlp_
from kvt.cache import Cache
from kvt.capture import capture, features, layer_features, unfeatures
from kvt.config import Config, KvtError, check_matched_kv
from kvt.stats import (KINDS, accumulate, candidate_layers, describe_plan, diagnostic_start, held_out, memory_plan,
                       new_stats)


@dataclass
class Mapper:
    scope: str             # "head" or "layer"
    src_cfg: Config
    tgt_cfg: Config
    layers: dict           # kind -> LongTensor (Lt, k): selected source layers per target layer, ascending
    W: dict                # kind -> (Lt, G, k*Bx, By); after place(), a list of Lt tensors (G, k*Bx, By)
    b: dict                # kind -> (Lt, G, By); after place(), a list of Lt tensors (G, By)
    mlp: dict = field(default_factory=dict)  # kind -> {w1 (Lt, k*Hkv*D, Hd), b1 (Lt, Hd), w2 (Lt, Hd, O), b2 (Lt, O)}
    mlp_mode: str = ""     # "" ridge only; "residual" ridge + MLP; "replace" MLP only
    meta: dict = field(default_factory=dict)  # k, lambda, tokenizer fingerprint, diagnostics...

    @torch.no_grad()
    def apply(self, src_cache, positions=None, devices=None):
        """The target's Cache for a source Cache (post-RoPE keys, as a serving engine holds them).

        positions (B, T) long: where the target's RoPE puts the mapped keys (default: the source's).
        devices: where to map and keep each target layer (e.g. layer_devices(target)); default: where
        place() put the mapper's weights, or else the source cache's device. Positions and mask go to
        devices[0], beside the target's embedding. Computes in the mapper's dtype (float32 unless moved
        with .to) and returns the cache in the source cache's dtype."""
        s, t = self.src_cfg, self.tgt_cfg
        B, T = src_cache.positions.shape
        pos = src_cache.positions if positions is None else positions
        devices = [torch.device(d) for d in devices or self.devices(src_cache.keys[0].device)]
        dtype, out_dtype = self.W["k"][0].dtype, src_cache.keys[0].dtype
        src_rope = rotation(s, src_cache.positions, dtype, inverse=True)     # device -> (cos, sin), = rope.strip
        xs = {"k": [layer_features(rope.rotate(k.to(dtype), *src_rope(k.device)), self.scope)
                    for k in src_cache.keys],                                # Ls x (G, N, Bx), on the source's devices
              "v": [layer_features(v.to(dtype), self.scope) for v in src_cache.values]}
        tgt_rope = rotation(t, pos, dtype)
        keys, values = [None] * t.n_layers, [None] * t.n_layers
        for d in dict.fromkeys(devices):                                     # each device once, in layer order
            here = [l for l in range(t.n_layers) if devices[l] == d]
            for kind, out in (("k", keys), ("v", values)):
                need = sorted({src for l in here for src in self.layers[kind][l].tolist()})
                x = {src: xs[kind][src].to(d) for src in need}               # each source layer moved once to d
                for l in here:
                    y = unfeatures(self.map_layer(kind, l, x), self.scope, B, T, t.n_kv_heads, t.head_dim)
                    y = rope.rotate(y, *tgt_rope(d)) if kind == "k" else y.contiguous()  # the target's RoPE on keys
                    out[l] = y.to(out_dtype)                                 # (B, Hkv, T, D)
        return Cache(keys, values, pos.to(devices[0]).clone(), src_cache.mask.to(devices[0]).clone())

    def map_layer(self, kind, l, xs):
        """Target layer l's K or V from the source layers' features xs[src] (G, N, Bx) (a list over all
        source layers, or a dict holding the selected ones): (G, N, By)."""
        sel = self.layers[kind][l].tolist()
        x0 = xs[sel[0]]
        y = 0
        if self.mlp_mode != "replace":
            W, b = self.W[kind][l].to(x0), self.b[kind][l].to(x0)           # (G, k*Bx, By), (G, By)
            bx = W.shape[1] // len(sel)
            for i, src in enumerate(sel):  # x @ W + b as a sum over the selected layers: no gathered copy of x
                w = W[:, i * bx:(i + 1) * bx]                               # (G, Bx, By): this layer's rows
                y = torch.baddbmm(b[:, None, :], xs[src], w) if i == 0 else y.baddbmm_(xs[src], w)
        if self.mlp_mode:
            p = {name: w[l].to(x0) for name, w in self.mlp[kind].items()}
            x = torch.stack([xs[src] for src in sel], 2)                    # (G, N, k, Bx)
            y = y + unflat(mlp_.forward(p, flat(x)), x.shape[0])
        return y

    def n_params(self):
        return sum(t.numel() for t in self._floats())

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self._floats())

    def _floats(self):
        """Every floating-point weight tensor (per layer once placed)."""
        for t in self.tensors().values():
            yield from [x for x in (t if isinstance(t, list) else [t]) if x.is_floating_point()]

    def tensors(self):
        """Every tensor, by the name it has in a saved file (per-layer lists once placed; .to() stacks them)."""
        out = {}
        for kind in KINDS:
            out.update({f"{kind}.layers": self.layers[kind], f"{kind}.W": self.W[kind], f"{kind}.b": self.b[kind]})
            out.update({f"{kind}.mlp.{name}": w for name, w in self.mlp.get(kind, {}).items()})
        return out

    def to(self, device=None, dtype=None):
        """A copy with weights on device / in dtype (selections stay integer); a placed mapper is
        gathered back into stacked tensors (on device, or the device of its first layer)."""
        def move(x):
            if isinstance(x, list):
                x = torch.stack([w.to(device or x[0].device) for w in x])
            return x.to(device=device, dtype=dtype if x.is_floating_point() else None)
        return self._with(move)

    def place(self, devices):
        """A copy with the weights for target layer l on devices[l] (pass layer_devices(target)), so
        that apply maps each target layer where the target keeps it."""
        assert len(devices) == self.tgt_cfg.n_layers, "one device per target layer"
        def split(x):
            return x if not x.is_floating_point() else [x[l].to(d) for l, d in enumerate(devices)]
        return self.to()._with(split)

    def devices(self, default="cpu"):
        """The device of each target layer's weights: a list once placed, else [default] * Lt."""
        W = self.W["k"]
        return [w.device for w in W] if isinstance(W, list) else [torch.device(default)] * self.tgt_cfg.n_layers

    def _with(self, fn):
        """A copy with fn applied to every tensor (selections, weights, MLP weights)."""
        return Mapper(self.scope, self.src_cfg, self.tgt_cfg, {k: fn(v) for k, v in self.layers.items()},
                      {k: fn(v) for k, v in self.W.items()}, {k: fn(v) for k, v in self.b.items()},
                      {k: {n: fn(w) for n, w in p.items()} for k, p in self.mlp.items()}, self.mlp_mode,
                      dict(self.meta))


def rotation(cfg, pos, dtype, inverse=False):
    """device -> (cos, sin) of cfg's RoPE at positions pos (B, T), computed once and copied once to
    each device asked for; inverse: the rotation by -position that strips RoPE (rope.strip)."""
    inv, scale = rope.frequencies(cfg)
    cos, sin = rope.cos_sin(pos, inv, 1 / scale if inverse else scale, dtype)   # (B, 1, T, D)
    sin = -sin if inverse else sin
    made = {}

    def on(device):
        if device not in made:
            made[device] = cos.to(device), sin.to(device)
        return made[device]
    return on


def flat(x):
    """Group layout (G, N, k, Bx) -> all heads of the k layers per token (N, k*Hkv*D), the MLP's input."""
    return x.permute(1, 2, 0, 3).reshape(x.shape[1], -1)            # (N, k, G, Bx) -> (N, k*G*Bx)


def unflat(y, G):
    """(N, Hkv*D) -> group layout (G, N, By)."""
    return y.view(y.shape[0], G, -1).transpose(0, 1)                 # (G, N, By)


# ---- calibration -------------------------------------------------------------------------------------

def calibrate(source, target, ids, scope="head", k=8, lam=0.01, lams=None, batch_size=1, checkpoint=None,
              stats_device=None, tokenizer="", progress=True, products=torch.float64, stats_dtype=torch.float64,
              candidates=None):
    """Fit a ridge Mapper from source to target on calibration ids (n, T), the last 10% held out.

    1. statistics over the candidate source layers (head-level when the pair has matched KV);
    2. per target layer and kind, the k candidates with the best held-out single-layer R^2;
    3. layer scope on a matched pair: a second pass accumulating only the union of the selected layers;
    4. ridge per target layer at `lam` (or the best of the sweep `lams` on held-out R^2).
    checkpoint: a path prefix; each pass's statistics are saved there and resumed from.
    products: dtype of the per-batch statistics products (float64, or float32 for speed; see stats.py).
    stats_dtype: dtype of the sums (float32 halves their memory); candidates: how many source layers,
    spread evenly, to select from (default all; fewer make smaller statistics). Data parallel under
    torchrun: every rank calls this with the same ids and gets the same mapper (see stats.accumulate).
    Returns (mapper, report): report["r2_single"][kind] (C, Lt) held-out R^2 of single-layer fits of the
    C candidates, report["r2"][kind] (Lt,) of the final fits, report["lambda"], report["sweep"]."""
    src_cfg, tgt_cfg = source.config, target.config
    check_matched_kv(src_cfg, tgt_cfg, scope)
    matched = (src_cfg.n_kv_heads, src_cfg.head_dim) == (tgt_cfg.n_kv_heads, tgt_cfg.head_dim)
    device = stats_device or next(source.parameters()).device
    if progress and dist.rank() == 0:
        plan = memory_plan(src_cfg, tgt_cfg, scope, k, ids.shape[1] * batch_size, candidates, stats_dtype)
        print(f"calibration memory plan ({scope} scope, k={k}):\n{describe_plan(plan)}")
    stats = new_stats(src_cfg, tgt_cfg, "head" if matched else "layer",
                      candidate_layers(src_cfg.n_layers, candidates), device, stats_dtype)
    stats = accumulate(source, target, ids, stats, batch_size, checkpoint and f"{checkpoint}.pass1",
                       progress=progress, products=products)
    r2_single = {kind: ridge.single_layer_r2(stats, kind, lam) for kind in KINDS}
    selected = {kind: ridge.select_layers(r2_single[kind], stats.src_layers, k) for kind in KINDS}
    if scope == "layer" and matched:
        union = sorted(set(torch.cat([selected[kind].flatten() for kind in KINDS]).tolist()))
        del stats                                      # free the first pass before the second allocates
        stats = new_stats(src_cfg, tgt_cfg, "layer", union, device, stats_dtype)
        stats = accumulate(source, target, ids, stats, batch_size, checkpoint and f"{checkpoint}.pass2",
                           progress=progress, products=products)
    scores = {}
    if lams:
        lam, scores = ridge.sweep(stats, selected, lams)
    fits = {kind: ridge.fit_layers(stats, kind, selected[kind], lam) for kind in KINDS}
    meta = {"k": min(k, len(r2_single["k"])), "lambda": lam, "tokenizer": tokenizer,
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
    device, tgt_device = next(source.parameters()).device, next(target.parameters()).device
    parts = {kind: ([], []) for kind in KINDS}
    for seq in ids:
        pick = torch.randperm(ids.shape[1], generator=g)[:per_seq].to(device)  # tokens kept from this sequence
        src, tgt = capture(source, seq[None].to(device)), capture(target, seq[None].to(tgt_device))
        for i, kind in enumerate(KINDS):  # layers of a model split across devices come to `device`
            parts[kind][0].append(features([x.to(device) for x in src[i]], scope)[:, pick].float())
            parts[kind][1].append(features([y.to(device) for y in tgt[i]], scope)[:, pick].float())
    return {kind: (torch.cat(xs, 1), torch.cat(ys, 1)) for kind, (xs, ys) in parts.items()}


def add_mlp(mapper, source, target, ids, residual=True, hidden=1024, max_bytes=2 * 2**30, progress=True,
            **train_kw):
    """The MLP backstop on top of (residual=True) or instead of a fitted Mapper; returns a new Mapper.

    Trains one MLP per target layer and kind (mlp.train; train_kw go there) on a bounded sample of the
    tokens of ids (n, T). Early stopping uses the first half of calibration's held-out sequences (the last
    10%), so the second half stays unseen for diagnostics (kvt.handoff.diagnose; see run.py)."""
    n_fit = len(ids) - held_out(len(ids))
    stop = max(n_fit + 1, diagnostic_start(len(ids)))           # early stopping: held out, not diagnostics
    fit = sample_features(source, target, ids[:n_fit], max_bytes, mapper.scope)
    held = sample_features(source, target, ids[n_fit:stop], max_bytes // 10 + 1, mapper.scope)
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
    tensors = {name: (t.to(dtype) if t.is_floating_point() else t).contiguous()
               for name, t in mapper.to("cpu").tensors().items()}
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
