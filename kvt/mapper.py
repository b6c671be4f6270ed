"""The Mapper: per target layer, a linear map (plus optional MLP) from selected source layers' KV to its KV.

    mapper, report = calibrate(source, target, calib)    # statistics -> layer selection -> ridge (data.Calibration)
    mapper = mapper.place(layer_devices(target))         # each target layer's weights where the target keeps it
    tgt_cache = mapper.apply(src_cache)                  # strip source RoPE, map, apply target RoPE
    save_mapper(mapper, "m.safetensors"); load_mapper("m.safetensors", src_cfg, tgt_cfg, tok_fp)

For target layer t and kind K (or V), with sel = the k selected source layers (layout in capture.py):
    x = source KV of layers sel, RoPE stripped        (G, N, k * Bx)
    y = x @ W[t] + b[t]                               (G, N, By)   batched over groups
then y is laid back out as (B, Hkv, T, D) and, for keys, rotated by the target's RoPE at the target
positions: Mapper.apply, in float32 whatever the cache's dtype. fast.apply (kvt/fast.py) is its twin,
tested equal (tests/test_fast.py): fewer passes over memory, one GEMM per target layer in the mapper's
dtype, the cache written in place (tutorial section 11).
Head scope (G = Hkv): head h from head h of the selected layers. Layer scope (G = 1): every head from
all heads of the selected layers, which also maps between different KV shapes.

Placement: place() puts the weights for target layer l on the device of target layer l (one GPU or
several); apply then maps layer l there, and the mapped cache's layer l lives there, where the
target's layer l will read it. An unplaced mapper stays where it was made (the CPU) and every apply would copy its weights over again.
"""
import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

import kvt
from kvt.harness import attnfit, files as checkpoint, dist
from kvt import ridge, rope
from kvt import mlp as mlp_
from kvt.cache import Cache
from kvt.capture import capture, features, layer_features, unfeatures
from kvt.config import Config, KvtError, check_matched_kv, matched_kv
from kvt.harness.plan import describe_plan, layer_group_bound, memory_plan, sums_bytes
from kvt.stats import KINDS, SAVE_S, accumulate, add_batch, candidate_layers, groups, new_stats
from kvt.weights import comparable, model_fingerprint


@dataclass
class Mapper:
    scope: str             # "head" or "layer"
    src_cfg: Config
    tgt_cfg: Config
    layers: dict           # kind -> LongTensor (Lt, k): selected source layers per target layer, ascending
    W: dict                # kind -> (Lt, G, k*Bx, By); after place(), a list of Lt tensors (G, k*Bx, By)
    b: dict                # kind -> (Lt, G, By); after place(), a list of Lt tensors (G, By)
    mlp: dict = field(default_factory=dict)  # kind -> {w0 (Lt, k*Hkv*D, H1), b0 (Lt, H1), ..., w_last (Lt, H, O), ...}
    mlp_mode: str = ""     # "" ridge only; "replace" MLP only (the paper's); "residual" ridge + MLP (kvt's option)
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
        if self.mlp_mode != "replace":                                         # ridge
            y = x @ self.W[kind][l].to(x) + self.b[kind][l].to(x)[:, None]     # (G, N, k*Bx) @ (G, k*Bx, By)
        if self.mlp_mode:                                                      # the MLP backstop
            p = {name: w[l].to(x) for name, w in self.mlp[kind].items()}
            G, N = x.shape[:2]
            y = y + unflat(mlp_.forward(p, flat(x.view(G, N, len(self.layers[kind][l]), -1))), G)
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

    @property
    def placed(self):
        return isinstance(self.W["k"], list)

    def devices(self, default="cpu"):
        """The device of each target layer's weights: a list once placed, else [default] * Lt."""
        W = self.W["k"]
        return [w.device for w in W] if self.placed else [torch.device(default)] * self.tgt_cfg.n_layers

    def _with(self, fn):
        """A copy with fn applied to every tensor (selections, weights, MLP weights)."""
        return Mapper(self.scope, self.src_cfg, self.tgt_cfg, {k: fn(v) for k, v in self.layers.items()},
                      {k: fn(v) for k, v in self.W.items()}, {k: fn(v) for k, v in self.b.items()},
                      {k: {n: fn(w) for n, w in p.items()} for k, p in self.mlp.items()}, self.mlp_mode,
                      dict(self.meta))


def flat(x):
    """Group layout (G, N, k, Bx) -> all heads of the k layers per token (N, k*Hkv*D), the MLP's input."""
    return x.permute(1, 2, 0, 3).reshape(x.shape[1], -1)            # (N, k, G, Bx) -> (N, k*G*Bx)


def unflat(y, G):
    """(N, Hkv*D) -> group layout (G, N, By)."""
    return y.view(y.shape[0], G, -1).transpose(0, 1)                 # (G, N, By)


# ---- calibration -------------------------------------------------------------------------------------

def target_groups(selected, bx, by, bound):
    """Target layers split into consecutive groups, each the statistics of one layer-scope pass: a group
    grows while its union of selected source layers (both kinds) and its outputs need no more memory
    than `bound` = (source layers, target layers) can (plan.layer_group_bound), so no pass exceeds
    what the plan counted, and most hold more target layers than the bound's."""
    n_tgt = selected["k"].shape[0]
    if bound[1] >= n_tgt:
        return [list(range(n_tgt))]
    budget = sums_bytes(1, bound[0] * bx, bound[1] * by)
    out, union = [], set()
    for t in range(n_tgt):
        mine = set(selected["k"][t].tolist()) | set(selected["v"][t].tolist())
        if out and sums_bytes(1, len(union | mine) * bx, (len(out[-1]) + 1) * by) <= budget:
            out[-1].append(t)
            union |= mine
        else:
            out.append([t])
            union = mine
    return out


def layer_fits(run_pass, src_cfg, tgt_cfg, selected, lams, bound, checkpoint=None, key="", keep_stats=True):
    """Steps 3 and 4 of calibrate on a matched pair in layer scope: layer-level statistics of only the
    selected source layers, one pass per group of target layers (target_groups within `bound`), each
    fitted by ridge as soon as it is complete and then freed. run_pass(name, scope, src_layers,
    tgt_layers, final) accumulates one pass (calibrate's). With `checkpoint`, a group's fits are saved
    (CHECKPOINT.fit-<id of its layers>-<id of the fit>) and reused by a run that needs them, and with
    keep_stats=False its statistics checkpoint is deleted once they are.
    Returns (fits {kind: {target layer: (W, b, R^2, lambda)}}, skipped {kind: {target layer: [lambdas]}})."""
    fits, skipped = {kind: {} for kind in KINDS}, {kind: {} for kind in KINDS}
    G, bx, by = groups(src_cfg, tgt_cfg, "layer")
    for targets in target_groups(selected, bx, by, bound):
        union = sorted({l for kind in KINDS for t in targets for l in selected[kind][t].tolist()})
        plan_id = hashlib.sha256(json.dumps([union, targets]).encode()).hexdigest()[:8]
        fit_id = hashlib.sha256(json.dumps([lams, {kind: selected[kind][targets].tolist() for kind in KINDS}])
                                .encode()).hexdigest()[:8]
        done = checkpoint and f"{checkpoint}.fit-{plan_id}-{fit_id}"   # this group's fits, once made
        got = load_fits(done, key)
        if got is None:
            stats = run_pass(f"pass2-{plan_id}", "layer", union, targets, final=keep_stats)  # named by what it sums
            skip = {kind: {} for kind in KINDS}
            got = ({kind: ridge.fit_layers(stats, kind, selected[kind], lams, skip[kind], host=True)
                    for kind in KINDS}, skip)
            del stats
            if done and dist.rank() == 0:
                save_fits(done, *got, key)
                if not keep_stats and os.path.exists(f"{checkpoint}.pass2-{plan_id}"):
                    os.remove(f"{checkpoint}.pass2-{plan_id}")                   # its fits hold what it gave
        for kind in KINDS:                             # each W left the device as it was fitted
            fits[kind].update(got[0][kind])
            skipped[kind].update(got[1][kind])
    return fits, skipped


def calibrate(source, target, calib, scope="layer", k=8, lam=None, batch_size=1, checkpoint=None, key="",
              stats_device=None, tokenizer="", progress=True, stats_dtype=torch.float64,
              candidates=None, group=None, keep_stats=True, save_s=SAVE_S, select=None, weights="uniform",
              add=add_batch):
    """Fit a ridge Mapper from source to target on a data.Calibration (fit and validation regions).

    1. statistics over the candidate source layers (head-level when the pair has matched KV);
    2. per target layer and kind, the k candidates with the best validation single-layer R^2;
    3. layer scope on a matched pair: layer-level passes accumulating only the selected layers, one per
       group of target layers (target_groups; `group` bounds a pass's memory, see plan.py);
    4. ridge per target layer and kind at `lam`, or (lam=None) at the lambda of ridge.LAMBDAS with the
       best validation R^2.
    checkpoint: a path prefix; each pass's statistics are saved there (CHECKPOINT.pass1, and
    CHECKPOINT.pass2-<id of its layers>) every `save_s` seconds and once complete, and resumed from, or
    reused by a calibration that needs the same sums (another lambda, k or mapper); refused if made for
    another `key` (run.py passes what the sums depend on: both checkpoints' weights, the calibration
    tokens, the statistics' dtype). With keep_stats=False a layer-level pass is not saved complete: its
    fits are (CHECKPOINT.fit-<id>-<id of the fit>, a few hundred MiB), and its statistics checkpoint is
    deleted, so the disk holds the first pass and at most one other (the caller deletes the rest once
    the mapper is saved).
    stats_dtype: dtype of the sums (float32 halves their memory); candidates: how many source layers,
    spread evenly, to select from (default all).
    select: the layer-selection rule of step 2, a function (stats, kind, k, lams) -> LongTensor (Lt, k) of
    source layer numbers per target layer, ascending, read from the first pass's statistics (fit and
    validation parts, stats.src_layers); default the paper's top-k by single-layer R^2 (ridge.select_layers).
    weights: "uniform" (the paper's) or "attention" (CacheBridge's attention-weighted ridge, head scope
    only): step 4 is attnfit.weighted_fits, a second pass streaming the r-weighted sums of each target
    layer's selected layers (checkpointed as CHECKPOINT.attn-<id of the selection>), blended into the fit.
    add: how a batch of the passes of steps 1 and 3 is added (stats.add_batch; run.py passes its fast
    twin, fast.add_batch).
    Data parallel under torchrun: every rank calls this with the same calib and gets the same mapper.
    Returns (mapper, report): report["r2_single"][kind] (C, Lt) validation R^2 of single-layer fits of the
    C candidates, report["r2"][kind] (Lt,) and report["lambda"][kind] (Lt,) of the final fits."""
    src_cfg, tgt_cfg = source.config, target.config
    check_matched_kv(src_cfg, tgt_cfg, scope)
    if weights not in ("uniform", "attention"):
        raise KvtError(f"token weights {weights!r} are not known; use 'uniform' or 'attention'")
    if weights == "attention" and scope != "head":
        raise KvtError("the attention-weighted fit (--token-weights attention) is head-local; use it with --scope head")
    matched = matched_kv(src_cfg, tgt_cfg)
    device = stats_device or next(source.parameters()).device
    lams = ridge.LAMBDAS if lam is None else (lam,)
    k = min(k, len(candidate_layers(src_cfg.n_layers, candidates)))
    if progress and dist.rank() == 0:
        plan = memory_plan(src_cfg, tgt_cfg, scope, k, calib.fit.shape[1] * batch_size, candidates, stats_dtype, group,
                           device)
        print(f"calibration memory plan ({scope} scope, k={k}):\n{describe_plan(plan)}")

    def run_pass(name, scope_, src_layers=None, tgt_layers=None, final=True):
        stats = new_stats(src_cfg, tgt_cfg, scope_, src_layers, tgt_layers, device, stats_dtype, key)
        return accumulate(source, target, calib, stats, batch_size, checkpoint and f"{checkpoint}.{name}",
                          save_s=save_s, final=final, progress=progress, add=add)

    skipped = {"select": {kind: {} for kind in KINDS}, "fit": {kind: {} for kind in KINDS}}  # singular lambdas
    # 1. statistics over the candidate source layers, head-level where the pair has matched KV
    stats = run_pass("pass1", "head" if matched else "layer", candidate_layers(src_cfg.n_layers, candidates))
    # 2. per target layer and kind, the k source layers with the best validation single-layer R^2
    r2_single = {kind: ridge.single_layer_r2(stats, kind, lams, skipped["select"][kind]) for kind in KINDS}
    selected = {kind: select(stats, kind, k, lams) if select else       # default: the paper's top-k
                ridge.select_layers(r2_single[kind], stats.src_layers, k) for kind in KINDS}
    # 3. and 4. ridge per target layer and kind (in layer scope on a matched pair: over new layer-level
    # statistics of the selected layers only)
    if scope == "layer" and matched:
        del stats                                      # free the first pass before the next allocates
        bound = layer_group_bound(src_cfg, tgt_cfg, k, group, candidates)
        fits, skipped["fit"] = layer_fits(run_pass, src_cfg, tgt_cfg, selected, lams, bound, checkpoint, key, keep_stats)
    elif weights == "attention":                       # kvt's option: a second, attention-weighted pass
        fits, alphas = attnfit.weighted_fits(source, target, calib, stats, selected, lams, skipped["fit"], batch_size,
                                             checkpoint, key, save_s, progress)
    else:
        fits = {kind: ridge.fit_layers(stats, kind, selected[kind], lams, skipped["fit"][kind], host=True)
                for kind in KINDS}
    layers = range(tgt_cfg.n_layers)
    W = {kind: torch.stack([fits[kind][t][0] for t in layers]) for kind in KINDS}   # (Lt, G, k*Bx, By) float32, CPU
    b = {kind: torch.stack([fits[kind][t][1] for t in layers]) for kind in KINDS}   # (Lt, G, By)
    r2 = {kind: torch.tensor([fits[kind][t][2] for t in layers], dtype=torch.float64) for kind in KINDS}
    lam_used = {kind: [fits[kind][t][3] for t in layers] for kind in KINDS}
    meta = {"k": k, "lambda": lam_used, "tokenizer": tokenizer, "calib_sequences": len(calib.fit),
            "calib_len": calib.fit.shape[1], "calib": calib.hash(), "r2": {kind: r2[kind].tolist() for kind in KINDS},
            **weights_meta(source, target)}
    if weights == "attention":
        meta["weights"] = "attention"
        meta["alpha"] = {kind: [alphas[kind][t] for t in layers] for kind in KINDS}   # per target layer, per head
    if any(layers_ for step in skipped.values() for layers_ in step.values()):
        meta["lambda_skipped"] = skipped               # {step: {kind: {layer: [lambdas]}}}
        if dist.rank() == 0:
            print(f"warning: ridge skipped lambdas whose system is singular: {skipped_text(skipped)}")
    mapper = Mapper(scope, src_cfg, tgt_cfg, selected, W, b, meta=meta)
    report = {"r2_single": r2_single, "r2": r2, "lambda": lam_used}
    return mapper, report


FITS = "kvt-fits-1"


def save_fits(path, fits, skipped, key):
    """Write one layer-level pass's fits ({kind: {target layer: (W, b, R^2, lambda)}}, float32 on the CPU)
    and its skipped lambdas ({kind: {target layer: [lambdas]}}) atomically, marked with `key`."""
    tensors = {f"{kind}.{name}.{t}": x for kind, by in fits.items() for t, f in by.items()
               for name, x in (("W", f[0]), ("b", f[1]))}
    info = {kind: {t: [f[2], f[3], skipped[kind].get(t)] for t, f in by.items()} for kind, by in fits.items()}
    checkpoint.save(path, tensors, FITS, {"key": key, "fits": json.dumps(info)})


def load_fits(path, key):
    """(fits, skipped) as save_fits wrote them, or None when there is no such file; refuses one made for
    another key, or unreadable, in one line."""
    got = checkpoint.load(path, FITS, "fit checkpoint", "delete it to fit again", key)
    if got is None:
        return None
    t, meta = got
    info = json.loads(meta["fits"])
    fits = {kind: {int(l): (t[f"{kind}.W.{l}"], t[f"{kind}.b.{l}"], r2, lam) for l, (r2, lam, _) in by.items()}
            for kind, by in info.items()}
    skipped = {kind: {int(l): bad for l, (_, _, bad) in by.items() if bad} for kind, by in info.items()}
    return fits, skipped


def skipped_text(skipped):
    """One line: which lambdas were skipped where (calibrate's meta["lambda_skipped"])."""
    where = {"select": "source layer", "fit": "target layer"}
    return "; ".join(f"{kind.upper()} {where[step]} {l} at {', '.join(f'{lam:g}' for lam in lams)}"
                     for step, kinds in skipped.items() for kind, by in kinds.items() for l, lams in by.items())


def sample_features(source, target, ids, max_bytes=2 * 2**30, scope="head", seed=0, progress=False):
    """Position-free K and V of a seeded random sample of the tokens of ids, within max_bytes (float32).

    Returns {kind: (x (G, N, Ls, Bx), y (G, N, Lt, By))} of source and target: the stored features the
    MLP trains on. Memory is bounded by sampling tokens evenly from every sequence."""
    s, t = source.config, target.config
    per_token = 4 * 2 * (s.n_layers * s.n_kv_heads * s.head_dim + t.n_layers * t.n_kv_heads * t.head_dim)
    per_seq = max(1, min(ids.shape[1], max_bytes // per_token // len(ids)))
    g = torch.Generator().manual_seed(seed)
    device, tgt_device = next(source.parameters()).device, next(target.parameters()).device
    parts = {kind: ([], []) for kind in KINDS}
    for seq in tqdm(ids, desc="MLP training features", unit="seq", disable=not progress):
        pick = torch.randperm(ids.shape[1], generator=g)[:per_seq].to(device)  # tokens kept from this sequence
        src, tgt = capture(source, seq[None].to(device)), capture(target, seq[None].to(tgt_device))
        for i, kind in enumerate(KINDS):  # layers of a model split across devices come to `device`
            parts[kind][0].append(features([x.to(device) for x in src[i]], scope)[:, pick].float())
            parts[kind][1].append(features([y.to(device) for y in tgt[i]], scope)[:, pick].float())
    return {kind: (torch.cat(xs, 1), torch.cat(ys, 1)) for kind, (xs, ys) in parts.items()}


MLP_MODES = {"replace": mlp_.PAPER_HIDDEN, "residual": (1024,)}  # mode -> default hidden sizes


def add_mlp(mapper, source, target, calib, mode="replace", hidden=None, max_bytes=2 * 2**30, progress=True,
            checkpoint=None, key="", **train_kw):
    """The MLP backstop on a fitted Mapper (its layer selection); returns a new Mapper.

    mode="replace" (the paper's, `--mapper mlp`): the MLP, two hidden layers of 1,024 units, replaces
    ridge. mode="residual" (kvt's option, `--mapper ridge+mlp`): one hidden layer of 1,024 units on top
    of ridge. hidden overrides the sizes. Trains one MLP per target layer and kind (mlp.train; train_kw
    go there) on a bounded sample of calib.fit's tokens, stopping early on calib.val; calib.diag stays
    unseen for diagnostics (kvt.handoff.diagnose).

    checkpoint: a path prefix; each MLP is saved as it finishes (CHECKPOINT-k3.safetensors, ...), marked
    with `key` (what the caller made it for), and a run that finds them trains only the rest: on a real
    pair the MLPs take hours. The sample is seeded, so a resumed run draws the same tokens."""
    if mode not in MLP_MODES:
        raise KvtError(f"MLP mode {mode!r} is not known; use one of {', '.join(MLP_MODES)}")
    hidden = MLP_MODES[mode] if hidden is None else hidden
    data = {}  # the sampled features, drawn when the first MLP that is not checkpointed needs them
    out = mapper.to()
    out.mlp_mode, out.mlp = mode, {}
    for kind in KINDS:
        params = []
        for l in range(mapper.tgt_cfg.n_layers):
            path = checkpoint and f"{checkpoint}-{kind}{l}.safetensors"
            p = load_mlp_checkpoint(path, key)
            if p is None:
                if not data:
                    data["fit"] = sample_features(source, target, calib.fit, max_bytes, mapper.scope, progress=progress)
                    data["val"] = sample_features(source, target, calib.val, max_bytes // 10 + 1, mapper.scope,
                                                  progress=progress)
                p, loss = mlp_.train(*_mlp_data(mapper, kind, l, *data["fit"][kind], mode),
                                     *_mlp_data(mapper, kind, l, *data["val"][kind], mode), hidden=hidden, **train_kw)
                if path and dist.rank() == 0:                             # every rank trains the same MLP
                    save_mlp_checkpoint(path, p, key)
                if progress:
                    print(f"mlp ({mode}) {kind} layer {l}: validation loss {loss:.4f} (fraction of variance left)")
            params.append(p)
        out.mlp[kind] = {name: torch.stack([p[name] for p in params]).cpu() for name in params[0]}
    out.meta["mlp_hidden"] = list(hidden) if not isinstance(hidden, int) else [hidden]
    return out


MLP_CHECKPOINT = "kvt-mlp-checkpoint-1"


def save_mlp_checkpoint(path, p, key):
    """Write one MLP's weights ({"w0": ..., "b0": ...}) atomically, marked with `key`."""
    checkpoint.save(path, p, MLP_CHECKPOINT, {"key": key})


def load_mlp_checkpoint(path, key):
    """One MLP that add_mlp saved as it finished ({"w0": ..., "b0": ...}), or None if there is none;
    refuses one made for other settings, or unreadable, in one line."""
    fix = f"delete the {os.path.basename(str(path)).rsplit('-', 1)[0]}-* files to train again"
    got = checkpoint.load(path, MLP_CHECKPOINT, "MLP checkpoint", fix, key, other="another pair, mapper or settings")
    return None if got is None else got[0]


def _mlp_data(mapper, kind, l, xs, ys, mode):
    """MLP inputs (N, k*Hkv*D) and targets (N, Hkv*D) for target layer l from sampled features
    xs (G, N, Ls, Bx) and ys (G, N, Lt, By); residual: targets minus the ridge map's prediction."""
    y = ys[:, :, l]                                                     # (G, N, By)
    if mode == "residual":
        y = y - mapper.map_layer(kind, l, list(xs.unbind(2)))
    return flat(xs[:, :, mapper.layers[kind][l]]), y.transpose(0, 1).reshape(y.shape[1], -1)


# ---- files ---------------------------------------------------------------------------------------------

FORMAT = "kvt-mapper-2"  # 2: disjoint calibration regions, standardized ridge with per-layer lambda, MLP w0.. names


def save_mapper(mapper, path, dtype=torch.float32):
    """Write a mapper as safetensors with its pair's metadata, atomically; dtype=torch.bfloat16 halves it."""
    tensors = {name: t.to(dtype) if t.is_floating_point() else t for name, t in mapper.to("cpu").tensors().items()}
    meta = {"kvt_version": kvt.__version__, "scope": mapper.scope, "mlp": mapper.mlp_mode,
            "src_config": json.dumps(asdict(mapper.src_cfg)), "tgt_config": json.dumps(asdict(mapper.tgt_cfg)),
            "src_fingerprint": mapper.src_cfg.fingerprint(), "tgt_fingerprint": mapper.tgt_cfg.fingerprint(),
            "tokenizer": str(mapper.meta.get("tokenizer", "")), "meta": json.dumps(mapper.meta)}
    checkpoint.save(path, tensors, FORMAT, meta)


def load_mapper(path, src_cfg=None, tgt_cfg=None, tokenizer=None, dtype=torch.float32, device="cpu", key=None):
    """Read a mapper; refuse one fitted for another source, target or tokenizer (fingerprints), for
    other weights, data or settings (`key`, what the caller made it from: meta["key"]), one written by
    another version of kvt, and a file that is not a mapper, each with one line."""
    got = checkpoint.load(path, FORMAT, "mapper", "delete it and calibrate again", device=device)
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
    recorded = [json.loads(meta["meta"]).get(entry) for entry in ("src_weights", "tgt_weights")]
    if not all(map(comparable, recorded)):
        what = ("no fingerprint of its pair's weights (an older kvt made it)" if None in recorded else
                "an older fingerprint of its pair's weights (kvt 0.2.0's, of 4 rows a tensor)")
        print(f"warning: mapper {path} records {what}, so they cannot be checked; calibrate again to have "
              "them checked", file=sys.stderr)
    made_from = json.loads(meta["meta"]).get("key")
    if key is not None and made_from != key:
        raise KvtError(f"mapper {path} was made from other weights, data or settings ({made_from}, not {key}); "
                       "delete it to calibrate again")
    t = {name: x.to(dtype) if x.is_floating_point() else x for name, x in t.items()}
    mlp = {kind: {name.split(".")[-1]: x for name, x in t.items() if name.startswith(f"{kind}.mlp.")}
           for kind in KINDS}
    return Mapper(meta["scope"], Config(**json.loads(meta["src_config"])), Config(**json.loads(meta["tgt_config"])),
                  {kind: t[f"{kind}.layers"] for kind in KINDS}, {kind: t[f"{kind}.W"] for kind in KINDS},
                  {kind: t[f"{kind}.b"] for kind in KINDS}, {k: v for k, v in mlp.items() if v}, meta["mlp"],
                  json.loads(meta["meta"]))


# ---- the weights a mapper was fitted on ----------------------------------------------------------------

def weights_meta(source, target):
    """What calibrate records of its pair's weights (meta["src_weights"], meta["tgt_weights"]): their
    fingerprints (weights.weights_fingerprint), which check_pair_weights compares with the models it meets."""
    return {"src_weights": model_fingerprint(source), "tgt_weights": model_fingerprint(target)}


def check_pair_weights(mapper, source, target, name="the mapper"):
    """Refuse, in one line naming the side, models whose weights are not those the mapper was fitted on:
    one config fits a base and its instruct model, a model and its fine-tune, a function-preserving twin,
    and the configs' fingerprints tell none of them apart. source, target: kvt or transformers models
    (None: not checked). A mapper that records no fingerprints, or an older scheme's (an older file), is
    not checked here; load_mapper said so when it read it."""
    for side, model, entry in (("source", source, "src_weights"), ("target", target, "tgt_weights")):
        made = mapper.meta.get(entry)
        if model is None or not comparable(made):
            continue
        have = model_fingerprint(model)
        if have != made:
            raise KvtError(f"{name} was fitted on other {side} weights (fingerprint {made}, this {side}'s {have}; one "
                           "config, other weights: a base and an instruct model, a fine-tune, or source and target "
                           f"swapped?); pass the {side} it was fitted on, or calibrate a mapper for these models")
