"""Closed-form ridge regression from sufficient statistics: fit, validation R^2, layer selection, lambda.

Per group, y (O outputs) from x (F features), with a bias by centering (mx = sx/n, my = sy/n):

    C_xx = xx/n - mx mx^T       C_xy = xy/n - mx my^T       S = diag(C_xx)^(1/2)  (each feature's std)
    W = S^-1 (S^-1 C_xx S^-1 + lam I)^-1 S^-1 C_xy          b = my - mx W

Ridge on standardized features: W minimizes the mean of ||y - x W - b||^2 plus lam * sum_j var(x_j)
||W_j||^2, so a quiet but informative source layer beside a loud one keeps its signal, and scaling a
feature changes no prediction. Constant features get zero weight.

Lambda (the paper gives none) is picked per target layer and kind on validation sums from LAMBDAS: one
eigendecomposition R = Q diag(e) Q^T of the standardized matrix serves every lambda,
W(lam) = S^-1 Q diag(1 / (e + lam)) Q^T S^-1 C_xy. Batched over groups, on the statistics' device.

R^2 on validation tokens from their sums alone (the augmented [x, 1] form written out), per output j:

    SSE_j = syy_j - 2 (W^T xy)_jj - 2 b_j sy_j + (W^T xx W)_jj + 2 b_j (sx W)_j + n b_j^2
    SST_j = syy_j - sy_j^2 / n           R^2 = 1 - sum_j SSE_j / sum_j SST_j

pooled over the groups and dims of one target layer (the fraction of its variance explained).
"""
import torch

from kvt.config import KvtError, check_sums, solvable
from kvt.stats import KINDS, blocks

LAMBDAS = tuple(10.0 ** e for e in range(-6, 3))  # 1e-6 .. 100: the grid each target layer picks from


def eigen(s):
    """The fit of Sums s, ready for any lambda: (e (G, F), Q (G, F, F), A = Q^T S^-1 C_xy (G, F, O),
    1/std (G, F), mx (G, F), my (G, O)); see the module docstring."""
    mx, my = s.sx / s.n, s.sy / s.n                                  # (G, F), (G, O)
    cxx = s.gram().div_(s.n).sub_(mx[:, :, None] * mx[:, None, :])   # (G, F, F); in place: F x F matrices
    cxy = s.xy / s.n - mx[:, :, None] * my[:, None, :]               # (G, F, O)   are the fit's largest
    var = cxx.diagonal(dim1=1, dim2=2).clone()                       # (G, F)
    live = var > 1e-12 * var.amax(-1, keepdim=True).clamp_min(1e-300)
    inv_std = torch.where(live, var.clamp_min(1e-300).rsqrt(), torch.zeros_like(var))  # constant features: 0
    R = cxx.mul_(inv_std[:, :, None]).mul_(inv_std[:, None, :])      # (G, F, F) correlation matrix, in cxx's place
    e, Q = torch.linalg.eigh(R)                                      # R = Q diag(e) Q^T
    del R, cxx
    return e, Q, Q.transpose(1, 2) @ (cxy * inv_std[:, :, None]), inv_std, mx, my


def weights(eig, lam):
    """W (G, F, O), b (G, O) at one lambda from eigen()'s output."""
    e, Q, A, inv_std, mx, my = eig
    if (e + lam).min() <= 0:
        raise KvtError(f"ridge system is singular at lambda={lam:g}; use a larger --lam or calibrate on more tokens")
    W = inv_std[:, :, None] * (Q @ (A / (e + lam)[:, :, None]))     # (G, F, O)
    b = my - (mx[:, None, :] @ W)[:, 0]                              # (G, O)
    return W, b


def solve(s, lam):
    """Ridge fit from Sums s at one lambda: W (G, F, O), b (G, O)."""
    return weights(eigen(s), lam)


def sse(s, W, b):
    """Sum of squared residuals y - (x W + b) over the tokens summed in s, per output: (G, O)."""
    fit_y = (W * s.xy).sum(1) + b * s.sy                             # sum_t y_tj (x_t W + b)_j
    fit_fit = (W * (s.gram() @ W)).sum(1) + 2 * b * (s.sx[:, None, :] @ W)[:, 0] + s.n * b * b
    return s.syy - 2 * fit_y + fit_fit


def sst(s):
    """Sum of squares around the mean, per output: (G, O)."""
    return s.syy - s.sy * s.sy / s.n


def single_layer_r2(stats, kind, lams=LAMBDAS, skipped=None):
    """Validation R^2 of fitting each target layer of stats from each single source layer, at the best
    lambda of `lams` for that pair of layers: (Ls, Lt), rows in stats.src_layers order, columns in
    stats.tgt_layers order. One eigendecomposition per source layer serves every target layer and lambda.
    Lambdas at which a source layer's system is singular are skipped (and listed in `skipped`, a dict
    source layer -> lambdas, when given); a layer singular at every lambda is an error."""
    check_sums(stats)                                                 # val tokens, finite sums (config.py)
    fit, val = stats.part(kind, "fit"), stats.part(kind, "val")
    G, Lt, by = fit.sy.shape[0], len(stats.tgt_layers), stats.by
    total = sst(val).view(G, Lt, by).sum((0, 2))                     # (Lt,)
    r2 = torch.empty(len(stats.src_layers), Lt, dtype=torch.float64)
    for i in range(len(stats.src_layers)):
        fi = blocks([i], stats.bx).to(fit.xx.device)
        eig, v = eigen(fit.select(fi)), val.select(fi)              # all target layers at once
        good = solvable(eig, lams, f"source layer {stats.src_layers[i]}", skipped, stats.src_layers[i])
        err = torch.stack([sse(v, *weights(eig, lam)).view(G, Lt, by).sum((0, 2)) for lam in good])  # (lams, Lt)
        r2[i] = (1 - err.amin(0) / total).cpu()
    return r2


def select_layers(r2, src_layers, k):
    """Per target layer, the k source layers with the best validation R^2, ascending: LongTensor (Lt, k)."""
    top = r2.topk(min(k, r2.shape[0]), dim=0).indices.T                # (Lt, k) rows of r2
    return torch.tensor(src_layers)[top].sort(dim=1).values


def pick_layers(stats, k, lams=LAMBDAS, skipped=None):
    """Step 2 of calibration, per kind: (r2 {kind: (Ls, Lt) single_layer_r2}, selected {kind: (Lt, k) the
    k source layers of stats.src_layers with the best validation R^2 per target layer, select_layers});
    skipped: {kind: {}} or None, for the lambdas skipped as singular."""
    r2 = {kind: single_layer_r2(stats, kind, lams, skipped and skipped[kind]) for kind in KINDS}
    return r2, {kind: select_layers(r2[kind], stats.src_layers, k) for kind in KINDS}


def fit_layers(stats, kind, selected, lams=LAMBDAS, skipped=None, host=False):
    """Fit each target layer of stats.tgt_layers from its selected source layers (selected: (L_tgt, k)
    source layer numbers for every target layer), at the lambda of `lams` with the best validation R^2.
    Lambdas at which a layer's system is singular are skipped (and listed in `skipped`, a dict target
    layer -> lambdas, when given); a layer singular at every lambda is an error.

    Returns {target layer: (W (G, k*Bx, By), b (G, By), validation R^2, lambda)}: W and b in float64 on
    the statistics' device, or with host=True in float32 on the CPU as each is fitted (the mapper's
    form), so that the device holds no fitted weights beside the statistics."""
    check_sums(stats)                                                 # val tokens, finite sums (config.py)
    fit, val = stats.part(kind, "fit"), stats.part(kind, "val")
    where = {l: i for i, l in enumerate(stats.src_layers)}
    out = {}
    for j, t in enumerate(stats.tgt_layers):
        fi = blocks([where[l] for l in selected[t].tolist()], stats.bx).to(fit.xx.device)
        oi = blocks([j], stats.by).to(fit.xx.device)
        v = val.select(fi, oi)
        err, lam, W, b = best_lambda(eigen(fit.select(fi, oi)), v, lams, t, skipped)
        W, b = (W.float().cpu(), b.float().cpu()) if host else (W, b)
        out[t] = (W, b, 1 - err / sst(v).sum().item(), lam)
    return out


def best_lambda(eig, val, lams, t, skipped=None):
    """(validation error, lambda, W, b) of the solvable lambda with the smallest error on the validation
    sums val (ties keep the smaller lambda), from one eigendecomposition of target layer t's fit sums;
    refuses a layer no lambda solves, and records the lambdas skipped in skipped[t]."""
    best = None
    for lam in solvable(eig, lams, f"target layer {t}", skipped, t):
        W, b = weights(eig, lam)
        err = sse(val, W, b).sum().item()
        if best is None or err < best[0]:
            best = (err, lam, W, b)
    return best
