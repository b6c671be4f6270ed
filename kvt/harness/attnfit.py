"""The attention-weighted ridge of CacheBridge (arXiv 2609.00891, "Attn-Repair"), head-local: kvt's option.

Head scope (each target KV head h from head h of its layer's k selected source layers), but each
calibration token i counts with a weight w_i in the fit of target layer t, head h and kind (K or V):

    W = (Xc^T D Xc + lam S^2)^-1 Xc^T D Yc      D = diag(w), Xc, Yc centred on the w-weighted means

(ridge.py's standardized form, the weighted means, covariances and variances in place of the plain
ones). The weights say how much the target's own attention output depends on token i. At P = 32
prefix lengths of each calibration sequence, log-spaced from 2 to its length T (boundaries), the
target's query at the prefix's last token, for the query heads u that share KV head h, attends over
the prefix with probabilities a_ui; then

    r_V(i) = sum_u a_ui^2        r_K(i) = sum_u a_ui^2 ||v_i - o_u||^2 ||q_u||^2 / d    (o_u = sum_i a_ui v_i)

(token_weights). kvt's reading of "normalised per (layer, head, K/V, boundary), summed over
boundaries": each boundary's r is divided by its mean over the prefix's tokens (mean 1 there), the
boundaries' r are summed per token (a token before an early boundary is in more prefixes and gathers
more), and that sum is divided by its mean over the sequence: mean 1 over each sequence's T tokens.
Every token is covered (the last boundary is T itself). Then the weights shrink toward uniform:

    w = 1 + alpha (r - 1),   alpha = the largest in [0, 1] with ESS(alpha) = (sum w)^2 / sum w^2 >= min(n, 2p)

p = k * D, the head's input width (ess_alpha). Since r has mean 1 over each sequence, sum w = n for
every alpha and ESS(alpha) = n^2 / (n + alpha^2 (sum r^2 - n)): the rule is a formula, not a search.

Streaming. w is linear in alpha, so every weighted sum is (1 - alpha) (plain sum) + alpha (r-weighted
sum) (blend). The plain sums are calibration's own (stats.py, the head-level first pass, which also
selects the layers); this module streams the r-weighted ones, sum r x x^T, sum r x y^T, sum r x,
sum r y, sum r y^2, and sum r^2 for the ESS rule, in a second pass over the same sequences, in float64,
checkpointed, resumable and data parallel as the first (calibration.weighted_fits runs
calibration.accumulate_resumable with capture_weighted and add_weighted). Their features differ per target layer (its own selected source
layers), so the groups are (target layer, head): G = Lt * Hkv, F = k * D, O = D. Alpha = 0 gives the
plain sums exactly, hence today's fit (tests/test_attnfit.py). The Sums of the r-weighted sums keep
sum r^2 per group in their `n` (sum r is n itself).

Alpha is picked per (target layer, head, kind) on the fit region and applied to the validation
region's sums too; lambda is picked on the weighted validation error, and the R^2 reported is the
plain (unweighted) validation R^2 of that fit, comparable with a uniform fit's.
"""
import math

import torch

from kvt import rope
from kvt.capture import features, layer_features
from kvt.config import KvtError, check_matched_kv, check_sums
from kvt.ridge import LAMBDAS, best_lambda, eigen, sse, sst
from kvt.harness import whiten
from kvt.harness.files import Resumable
from kvt.stats import KINDS, SPLITS, Sums, blocks, groups

BOUNDARIES = 32  # prefix lengths per calibration sequence at which the target's query is taken


def boundaries(T, count=BOUNDARIES):
    """Prefix lengths log-spaced from 2 to T, distinct, ascending, the last T itself."""
    if T < 2:
        raise KvtError(f"attention weights need calibration sequences of at least 2 tokens, not {T}; raise --calib-len")
    lens = torch.logspace(math.log10(2), math.log10(T), count, dtype=torch.float64).round().long()
    return sorted(set(lens.tolist()) | {T})


def token_weights(q, k, v, lengths):
    """r_K, r_V (B, Hkv, T) float64 of one target layer from its post-RoPE queries q (B, H, T, D), keys
    k and values v (B, Hkv, T, D), over the prefixes of `lengths` (see the module docstring): each
    prefix's r at mean 1 over its tokens, summed over prefixes, the sum at mean 1 over the sequence."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    q, k, v = q.double(), k.double(), v.double()
    rk = torch.zeros(B, Hkv, T, dtype=torch.float64, device=q.device)
    rv = torch.zeros_like(rk)
    for L in lengths:
        qu = q[:, :, L - 1].reshape(B, Hkv, H // Hkv, D)                   # (B, Hkv, U, D): heads sharing h
        a = (qu @ k[:, :, :L].transpose(-1, -2) * D ** -0.5).softmax(-1)  # (B, Hkv, U, L)
        o = a @ v[:, :, :L]                                                # (B, Hkv, U, D)
        dist = (v[:, :, None, :L] - o[:, :, :, None]).pow(2).sum(-1)       # (B, Hkv, U, L)  ||v_i - o_u||^2
        qq = qu.pow(2).sum(-1, keepdim=True)                               # (B, Hkv, U, 1)  ||q_u||^2
        a2 = a * a
        for r, new in ((rv, a2.sum(2)), (rk, (a2 * dist * qq).sum(2) / D)):   # (B, Hkv, L)
            r[:, :, :L] += new / new.mean(-1, keepdim=True).clamp_min(1e-300)  # mean 1 over the prefix
    return rk / rk.mean(-1, keepdim=True), rv / rv.mean(-1, keepdim=True)


@torch.no_grad()
def capture_weighted(model, ids, mask=None):
    """capture.capture plus each layer's token weights, from the same forward pass: (position-free keys,
    values, r_K, r_V), four lists of L tensors ((B, Hkv, T, D) twice, then (B, Hkv, T) twice)."""
    _, cache = model(ids, mask=mask, queries=True, last=True)
    lengths = boundaries(ids.shape[1])
    r = [token_weights(q, k, v, lengths) for q, k, v in zip(cache.queries, cache.keys, cache.values)]
    keys = [rope.strip(k, cache.positions.to(k.device), model.inv_freq, model.rope_scale) for k in cache.keys]
    return keys, list(cache.values), [x[0] for x in r], [x[1] for x in r]


def new_weighted_stats(src_cfg, tgt_cfg, selected, device=None, key=""):
    """Zero r-weighted sums for a head-scope fit of every target layer from its selected source layers
    (selected: kind -> (Lt, k)); groups (target layer, head), sum r^2 per group in each Sums' n."""
    check_matched_kv(src_cfg, tgt_cfg, "head")
    G, bx, by = groups(src_cfg, tgt_cfg, "head")
    Lt, k = selected["k"].shape
    sums = {}
    for name in (f"{kind}.{s}" for kind in KINDS for s in SPLITS):
        s = Sums.zeros(Lt * G, k * bx, by, device)
        s.n = torch.zeros(Lt * G, dtype=torch.float64, device=device)      # sum r^2 per group
        sums[name] = s
    src = sorted({l for kind in KINDS for l in selected[kind].flatten().tolist()})
    return Resumable("head", src, list(range(Lt)), bx, by, sums, key=key,
                 meta={"selected": {kind: selected[kind].tolist() for kind in KINDS}})


def add_weighted(stats, stream):
    """stats.add_batches' twin for the r-weighted sums: each batch of source KV (capture) and target KV
    with its weights (capture_weighted) added to its split, in float64. Returns stats."""
    for split, src_kv, tgt_kvr in stream:
        device = stats.part("k", split).xx.device
        for i, kind in enumerate(KINDS):
            sel = stats.meta["selected"][kind]                              # (Lt, k) source layers, ascending
            x = torch.cat([features([src_kv[i][l].to(device) for l in row], "head").flatten(2) for row in sel])
            y = torch.cat([layer_features(t.to(device), "head") for t in tgt_kvr[i]])    # (Lt*G, N, D)
            r = torch.cat([layer_features(t.to(device)[..., None], "head")[..., 0] for t in tgt_kvr[2 + i]])  # (Lt*G, N)
            add_r_(stats.sums[f"{kind}.{split}"], x, y, r)                 # x: (Lt*G, N, k*D)
    return stats


def add_r_(s, x, y, r):
    """Add tokens x (G, N, F), y (G, N, O) with weights r (G, N) to r-weighted Sums s, in float64:
    sum r x x^T, sum r x y^T, sum r x, sum r y, sum r y^2, and sum r^2 (in s.n)."""
    x, y, r = x.double(), y.double(), r.double()
    xr, yr = x * r[..., None], y * r[..., None]
    s.xx += xr.transpose(1, 2) @ x                                         # (G, F, N) @ (G, N, F)
    s.xy += xr.transpose(1, 2) @ y                                         # (G, F, N) @ (G, N, O)
    s.sx += xr.sum(1)
    s.sy += yr.sum(1)
    s.syy += (yr * y).sum(1)
    s.n += (r * r).sum(1)
    return s


def ess_alpha(n, rr, p):
    """alpha (G,): the largest in [0, 1] with ESS(alpha) = n^2 / (n + alpha^2 (rr - n)) >= min(n, 2p),
    for n tokens, rr = sum r^2 (G,) of weights r with mean 1, p the input width. Uniform r (rr = n):
    every alpha keeps ESS = n, and alpha is 1 (w = r = 1)."""
    n = float(n)
    m = min(n, 2.0 * p)
    spread = (rr - n).clamp_min(0)                                         # sum (r - 1)^2
    a = torch.sqrt(n * (n - m) / (m * spread.clamp_min(1e-300)))
    return torch.where(spread > 0, a, torch.ones_like(a)).clamp(max=1.0)


def blend(plain, rsums, alpha):
    """The w-weighted Sums, w = 1 + alpha (r - 1), from plain Sums and r-weighted Sums (G groups, alpha
    (G,)): (1 - alpha) plain + alpha r-weighted, n the token count (sum w = n). alpha = 0: plain exactly."""
    def mix(p, r):
        a = alpha.view(-1, *[1] * (p.dim() - 1)).to(p)
        return (1 - a) * p + a * r
    return Sums(mix(plain.xx, rsums.xx), mix(plain.xy, rsums.xy), mix(plain.sx, rsums.sx), mix(plain.sy, rsums.sy),
                mix(plain.syy, rsums.syy), plain.n)


def group_rows(s, rows):
    """Sums of the groups `rows` (a slice) of s."""
    return Sums(*(t[rows] for t in s.tensors()))


def fit_layers(stats, wstats, kind, selected, lams=LAMBDAS, skipped=None, host=False, alphas=None, metric=None):
    """ridge.fit_layers, attention-weighted: each target layer of stats (head scope, its plain sums)
    from its selected source layers (selected (Lt, k), those of wstats), its sums blended with wstats'
    r-weighted ones at each head's ESS alpha, lambda picked on the weighted validation error. The same
    return value; alphas, when given (a dict), gets target layer -> [alpha per head]. metric (Lt, Hkv,
    D, D), when given: each head's error measured in it (whiten.py, the whitened key fit)."""
    check_sums(stats)
    fit, val = stats.part(kind, "fit"), stats.part(kind, "val")
    wfit, wval = wstats.part(kind, "fit"), wstats.part(kind, "val")
    where = {l: i for i, l in enumerate(stats.src_layers)}
    G = fit.sy.shape[0]
    out = {}
    for j, t in enumerate(stats.tgt_layers):
        if selected[t].tolist() != wstats.meta["selected"][kind][t]:
            raise KvtError(f"attention-weighted sums were made for another layer selection of target layer {t}; "
                           "delete their checkpoint to calibrate again")
        fi = blocks([where[l] for l in selected[t].tolist()], stats.bx).to(fit.xx.device)
        oi = blocks([j], stats.by).to(fit.xx.device)
        rows = slice(t * G, (t + 1) * G)
        p, pv = fit.select(fi, oi), val.select(fi, oi)
        a = ess_alpha(p.n.item(), group_rows(wfit, rows).n, len(fi))
        s, v = blend(p, group_rows(wfit, rows), a), blend(pv, group_rows(wval, rows), a)
        if metric is None:
            _, lam, W, b = best_lambda(eigen(s), v, lams, t, skipped)     # on the weighted validation error
        else:
            _, lam, W, b = whiten.best_lambda(eigen(s), v, lams, t, metric[t], skipped)
        r2 = 1 - sse(pv, W, b).sum().item() / sst(pv).sum().item()         # plain validation R^2
        W, b = (W.float().cpu(), b.float().cpu()) if host else (W, b)
        out[t] = (W, b, r2, lam)
        if alphas is not None:
            alphas[t] = a.tolist()
    return out
