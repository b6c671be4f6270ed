"""Closed-form ridge regression from sufficient statistics: fit, held-out R^2, layer selection, lambda sweep.

Per group, y (O outputs) from x (F features), with a bias by centering (mx = sx/n, my = sy/n):

    C_xx = xx/n - mx mx^T        C_xy = xy/n - mx my^T
    W = (C_xx + lam * m * I)^-1 C_xy        b = my - mx W        m = mean(diag(C_xx))

So W minimizes  mean over tokens of ||y - x W - b||^2 + lam * m * ||W||^2.  How lambda is scaled:
by m, the mean variance of the features, which makes lambda scale-free (multiplying all features by c
leaves every prediction unchanged) and independent of the number of tokens. The default lam = 0.01
(the paper's value) adds 1% of the average feature variance to the diagonal. One Cholesky
factorization per fit, batched over groups and shared by all outputs, on the statistics' device.

R^2 on held-out tokens from their sums alone (the augmented [x, 1] form written out), per output j:

    SSE_j = syy_j - 2 (W^T xy)_jj - 2 b_j sy_j + (W^T xx W)_jj + 2 b_j (sx W)_j + n b_j^2
    SST_j = syy_j - sy_j^2 / n           R^2 = 1 - sum_j SSE_j / sum_j SST_j

pooled over the groups and dims of one target layer (the fraction of its variance explained).
"""
import torch

from kvt.config import KvtError
from kvt.stats import KINDS, blocks, check_finite

LAMBDAS = (1e-6, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # the default sweep


def solve(s, lam):
    """Ridge fit from Sums s: W (G, F, O), b (G, O)."""
    mx, my = s.sx / s.n, s.sy / s.n                                 # (G, F), (G, O)
    cxx = s.gram() / s.n - mx[:, :, None] * mx[:, None, :]           # (G, F, F)
    cxy = s.xy / s.n - mx[:, :, None] * my[:, None, :]               # (G, F, O)
    m = cxx.diagonal(dim1=1, dim2=2).mean(-1)                        # (G,) mean feature variance
    eye = torch.eye(cxx.shape[-1], dtype=cxx.dtype, device=cxx.device)
    chol, info = torch.linalg.cholesky_ex(cxx + (lam * m)[:, None, None] * eye)
    if info.any():
        raise KvtError(f"ridge system is singular at lambda={lam:g} ({int(s.n)} tokens for {cxx.shape[-1]} features); "
                       "raise lambda or calibrate on more tokens")
    W = torch.cholesky_solve(cxy, chol)                              # (G, F, O)
    b = my - (mx[:, None, :] @ W)[:, 0]                              # (G, O)
    return W, b


def sse(s, W, b):
    """Sum of squared residuals y - (x W + b) over the tokens summed in s, per output: (G, O)."""
    fit_y = (W * s.xy).sum(1) + b * s.sy                             # sum_t y_tj (x_t W + b)_j
    fit_fit = (W * (s.gram() @ W)).sum(1) + 2 * b * (s.sx[:, None, :] @ W)[:, 0] + s.n * b * b
    return s.syy - 2 * fit_y + fit_fit


def sst(s):
    """Sum of squares around the mean, per output: (G, O)."""
    return s.syy - s.sy * s.sy / s.n


def _check_held(stats):
    if stats.part("k", "held").n < 1:
        raise KvtError("no held-out calibration tokens; use at least 2 calibration sequences "
                       "(the last 10% are held out)")
    check_finite(stats)


def single_layer_r2(stats, kind, lam=0.01):
    """Held-out R^2 of fitting each target layer from each single source layer: (Ls, Lt), rows in
    stats.src_layers order. One factorization per source layer serves every target layer."""
    _check_held(stats)
    fit, held = stats.part(kind, "fit"), stats.part(kind, "held")
    G, Lt, by = fit.sy.shape[0], stats.n_tgt, stats.by
    total = sst(held).view(G, Lt, by).sum((0, 2))                    # (Lt,)
    r2 = torch.empty(len(stats.src_layers), Lt, dtype=torch.float64)
    for i in range(len(stats.src_layers)):
        fi = blocks([i], stats.bx).to(fit.xx.device)
        W, b = solve(fit.select(fi), lam)                            # (G, Bx, O): all target layers at once
        err = sse(held.select(fi), W, b).view(G, Lt, by).sum((0, 2))  # (Lt,)
        r2[i] = (1 - err / total).cpu()
    return r2


def select_layers(r2, src_layers, k):
    """Per target layer, the k source layers with the best held-out R^2, ascending: LongTensor (Lt, k)."""
    top = r2.topk(min(k, r2.shape[0]), dim=0).indices.T                # (Lt, k) rows of r2
    return torch.tensor(src_layers)[top].sort(dim=1).values


def fit_layers(stats, kind, selected, lam=0.01):
    """Fit every target layer from its selected source layers (Lt, k).

    Returns W (Lt, G, k*Bx, By), b (Lt, G, By) in float64 and the held-out R^2 per target layer (Lt,)."""
    _check_held(stats)
    fit, held = stats.part(kind, "fit"), stats.part(kind, "held")
    where = {l: i for i, l in enumerate(stats.src_layers)}
    Ws, bs, r2 = [], [], []
    for t, layers in enumerate(selected.tolist()):
        fi = blocks([where[l] for l in layers], stats.bx).to(fit.xx.device)
        oi = blocks([t], stats.by).to(fit.xx.device)
        W, b = solve(fit.select(fi, oi), lam)
        h = held.select(fi, oi)
        r2.append(1 - sse(h, W, b).sum() / sst(h).sum())
        Ws.append(W)
        bs.append(b)
    return torch.stack(Ws), torch.stack(bs), torch.stack(r2).cpu()


def sweep(stats, selected, lams=LAMBDAS):
    """Pick lambda by mean held-out R^2 over K and V and all target layers: (best lam, {lam: mean R^2}).

    R^2 is what the statistics alone can score, so it is what a sweep can afford; it is not what decides
    retention (tutorial section 10). Check the chosen lambda with kvt.handoff.diagnose's attention cosine."""
    score = {}
    for lam in lams:
        try:
            score[lam] = torch.cat([fit_layers(stats, kind, selected[kind], lam)[2] for kind in KINDS]).mean().item()
        except KvtError:  # singular at this lambda: skip it
            continue
    if not score:
        raise KvtError(f"every lambda in {list(lams)} gives a singular ridge system; calibrate on more tokens")
    return max(score, key=score.get), score
