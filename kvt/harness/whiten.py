"""The whitened key fit (the query-covariance fit of puneethgv/kvxfer), head-local and attention-weighted:
kvt's option, `--token-weights whitened`, beside attnfit.py's attention-weighted fit.

A predicted key's error matters through the logits it feeds. For target layer t and KV head h, a key
off by e moves the logit of a query q that reads head h by q^T e / sqrt(D); over the queries of the
heads sharing h, the mean squared logit error is e^T M e / D with M = E[q q^T], the queries' second
moment (query_metrics: position-free queries, the target's RoPE stripped, as the map predicts keys;
treating the relative rotation between a query and a key as the identity, exact for RoPE's slow
planes). So the key fit measures its error in M instead of the identity:

    W, b = argmin  mean_i w_i ||(x_i W + b - y_i) M^(1/2)||^2 + lam sum_j var(x_j) ||W_j||^2

w_i the attention weights of attnfit.py, the regulariser ridge.py's standardized one, M scaled to
trace D (so M = I is the plain fit and lambda keeps its meaning). With M = U diag(m) U^T and W' = W U
the output directions decouple: column c of W' is a plain ridge at lambda lam / m_c (whitened_weights),
so the directions the queries read strongly are shrunk less, those they ignore more. Had the regulariser
been measured in M too (lam sum_j var(x_j) ||W_j M^(1/2)||^2), every m_c would cancel and W would be
the plain ridge's exactly: an output-side metric changes a ridge solution only through its regulariser
(tutorial.md, "Measuring the keys' error where the queries read it"). Lambda is picked on the
weighted validation error in the identity metric, as attnfit picks it (the sums keep only the
diagonal of sum y y^T). Values keep attnfit's fit.
"""
import torch
from tqdm import tqdm

from kvt import rope
from kvt.config import solvable
from kvt.ridge import sse


@torch.no_grad()
def query_metrics(model, seqs, batch_size=8):
    """M (L, Hkv, D, D) float64: per layer and KV head, the second moment of the position-free queries of
    the heads sharing it over every token of seqs (N, T), scaled to trace D."""
    cfg = model.config
    L, Hkv, D, U = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    M = torch.zeros(L, Hkv, D, D, dtype=torch.float64)
    for i in tqdm(range(0, len(seqs), batch_size), desc="query metrics", leave=False):
        _, cache = model(seqs[i:i + batch_size], queries=True, last=True)
        for l, q in enumerate(cache.queries):                                   # (B, H, T, D)
            q = rope.strip(q.double(), cache.positions.to(q.device), model.inv_freq, model.rope_scale)
            q = q.reshape(q.shape[0], Hkv, U, q.shape[2], D).transpose(0, 1).reshape(Hkv, -1, D)  # (Hkv, B*U*T, D)
            M[l] += (q.transpose(1, 2) @ q).cpu()                              # (Hkv, D, D)
    trace = M.diagonal(dim1=-2, dim2=-1).sum(-1)                               # (L, Hkv)
    return M * (D / trace.clamp_min(1e-300))[..., None, None]


def whitened_weights(eig, lam, metric):
    """ridge.weights with the output metric (G, O, O) (see the module docstring): W (G, F, O), b (G, O)
    from ridge.eigen's output at one lambda; metric = I gives ridge.weights' exactly."""
    e, Q, A, inv_std, mx, my = eig
    m, U = torch.linalg.eigh(metric.to(A))                                     # (G, O), (G, O, O)
    lam_c = lam / m.clamp_min(1e-12)                                           # (G, O): each direction's lambda
    Wr = inv_std[:, :, None] * (Q @ ((A @ U) / (e[:, :, None] + lam_c[:, None, :])))  # (G, F, O), rotated outputs
    W = Wr @ U.transpose(1, 2)                                                 # back to the outputs' axes
    return W, my - (mx[:, None, :] @ W)[:, 0]


def best_lambda(eig, val, lams, t, metric, skipped=None):
    """ridge.best_lambda with whitened_weights: (validation error, lambda, W, b) of the solvable lambda with
    the smallest error on the validation sums val (identity metric; ties keep the smaller lambda)."""
    best = None
    for lam in solvable(eig, lams, f"target layer {t}", skipped, t):
        W, b = whitened_weights(eig, lam, metric)
        err = sse(val, W, b).sum().item()
        if best is None or err < best[0]:
            best = (err, lam, W, b)
    return best
