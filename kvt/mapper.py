"""The Mapper: per target layer, a linear map (or the MLP) from selected source layers' KV to its KV.

    mapper, report = calibrate(source, target, calib)    # kvt/calibrate.py: statistics -> selection -> ridge
    tgt_cache = mapper.apply(src_cache)                  # strip source RoPE, map, apply target RoPE

For target layer t and kind K (or V), with sel = the k selected source layers (layout in capture.py):
    x = source KV of layers sel, RoPE stripped        (G, N, k * Bx)
    y = x @ W[t] + b[t]                               (G, N, By)   batched over groups
then y is laid back out as (B, Hkv, T, D) and, for keys, rotated by the target's RoPE at the target
positions, in float32 whatever the cache's dtype. Head scope (G = Hkv): head h from head h of the
selected layers; layer scope (G = 1): every head from all heads, also between different KV shapes.
fast.apply is Mapper.apply's twin (tested equal): fewer passes over memory, the cache written in place.
place(layer_devices(target)) puts target layer l's weights where the target keeps layer l, and apply
maps it there. (A mapper as a file: kvt/harness/files.py.)
"""
from dataclasses import dataclass, field

import torch

from kvt import mlp as mlp_
from kvt import rope
from kvt.cache import Cache
from kvt.capture import layer_features, unfeatures
from kvt.config import Config
from kvt.loading import MapperWeights
from kvt.stats import KINDS


@dataclass
class Mapper(MapperWeights):  # to, place, tensors, n_params: the plumbing, kvt/loading.py
    scope: str             # "head" or "layer"
    src_cfg: Config
    tgt_cfg: Config
    layers: dict           # kind -> LongTensor (Lt, k): selected source layers per target layer, ascending
    W: dict                # kind -> (Lt, G, k*Bx, By); after place(), a list of Lt tensors (G, k*Bx, By)
    b: dict                # kind -> (Lt, G, By); after place(), a list of Lt tensors (G, By)
    mlp: dict = field(default_factory=dict)  # kind -> {w0 (Lt, k*Hkv*D, H1), b0 (Lt, H1), ..., w_last (Lt, H, O), ...}
    mapper: str = "ridge"  # calibrate's mapper=: "ridge"; "mlp", the MLP instead (the paper's); "ridge+mlp" (kvt's)
    meta: dict = field(default_factory=dict)  # k, lambda, tokenizer fingerprint, diagnostics...

    @torch.no_grad()
    def apply(self, src_cache, positions=None, devices=None, dtype=None):
        """The target's Cache for a source Cache (post-RoPE keys, as a serving engine holds them).

        positions (B, T) long: where the target's RoPE puts the mapped keys (default: the source's).
        devices: where to map and keep each target layer (e.g. layer_devices(target)); default: where
        place() put the mapper's weights, or else the source cache's device. Positions and mask go to
        devices[0], beside the target's embedding. Computes in float32 (float64 for a float64 mapper)
        and returns the cache in `dtype` (default: the source cache's)."""
        s, t = self.src_cfg, self.tgt_cfg
        B, T = src_cache.positions.shape
        pos = src_cache.positions if positions is None else positions
        devices = [torch.device(d) for d in devices or self.devices(src_cache.keys[0].device)]
        work = torch.promote_types(self.W["k"][0].dtype, torch.float32)       # the map's own precision
        out_dtype = dtype or src_cache.keys[0].dtype
        src_inv, src_scale = rope.frequencies(s)
        tgt_inv, tgt_scale = rope.frequencies(t)
        free = {"k": [rope.strip(k.to(work), src_cache.positions.to(k.device), src_inv, src_scale)
                      for k in src_cache.keys],                                # L x (B, Hkv, T, D), position-free
                "v": [v.to(work) for v in src_cache.values]}
        keys, values = [], []
        for l, d in enumerate(devices):
            for kind, out in (("k", keys), ("v", values)):
                xs = {i: layer_features(free[kind][i].to(d), self.scope) for i in self.layers[kind][l].tolist()}
                y = self.map_layer(kind, l, xs)                                # (G, N, By), N = B * T
                y = unfeatures(y, self.scope, B, T, t.n_kv_heads, t.head_dim)  # (B, Hkv, T, D)
                if kind == "k":
                    y = rope.apply(y, pos.to(d), tgt_inv, tgt_scale)           # the target's RoPE
                out.append(y.to(out_dtype))
        return Cache(keys, values, pos.to(devices[0]).clone(), src_cache.mask.to(devices[0]).clone(),
                     full=src_cache.full)

    def map_layer(self, kind, l, xs):
        """Target layer l's K or V (G, N, By) from the source layers' features xs[src] (G, N, Bx) (a list
        over all source layers, or a dict holding the selected ones), in float32 (float64 for float64
        features): the k selected layers side by side, times W plus b, plus the MLP where there is one."""
        work = torch.promote_types(xs[self.layers[kind][l][0].item()].dtype, torch.float32)
        x = torch.cat([xs[src].to(work) for src in self.layers[kind][l].tolist()], dim=-1)  # (G, N, k*Bx)
        y = 0
        if self.mapper != "mlp":                                               # ridge
            y = x @ self.W[kind][l].to(x) + self.b[kind][l].to(x)[:, None]     # (G, N, k*Bx) @ (G, k*Bx, By)
        if self.mapper != "ridge":                                             # the MLP backstop
            p = {name: w[l].to(x) for name, w in self.mlp[kind].items()}
            G, N = x.shape[:2]
            y = y + mlp_.unflat(mlp_.forward(p, mlp_.flat(x.view(G, N, len(self.layers[kind][l]), -1))), G)
        return y


def from_fits(scope, src_cfg, tgt_cfg, selected, fits, r2_single, meta):
    """(mapper, report) of calibration's fits {kind: {target layer: (W, b, validation R^2, lambda)}} (ridge.fit_layers)
    of the selected source layers (kind -> (Lt, k)): W and b stacked over target layers, each layer's
    lambda and R^2 added to meta. report: r2_single {kind: (C, Lt)} (layer selection's single-layer R^2
    of the C candidates), r2 {kind: (Lt,)} and lambda {kind: [Lt]} of the final fits."""
    layers = range(tgt_cfg.n_layers)
    W = {kind: torch.stack([fits[kind][t][0] for t in layers]) for kind in KINDS}   # (Lt, G, k*Bx, By) float32, CPU
    b = {kind: torch.stack([fits[kind][t][1] for t in layers]) for kind in KINDS}   # (Lt, G, By)
    r2 = {kind: torch.tensor([fits[kind][t][2] for t in layers], dtype=torch.float64) for kind in KINDS}
    lam = {kind: [fits[kind][t][3] for t in layers] for kind in KINDS}
    meta = {**meta, "lambda": lam, "r2": {kind: r2[kind].tolist() for kind in KINDS}}
    return Mapper(scope, src_cfg, tgt_cfg, selected, W, b, meta=meta), {"r2_single": r2_single, "r2": r2, "lambda": lam}
