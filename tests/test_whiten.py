"""whiten.py, the whitened (query-metric) key fit: its closed form equals a dense solve of its objective,
the identity metric gives the plain ridge, a metric measured in the regulariser too cancels, and the
query metrics are the queries' second moment."""
import pytest
import torch
from conftest import calib_of, tiny_config

import kvt
from kvt import ridge, rope
from kvt.harness import whiten
from kvt.harness.calibration import CalibrationOptions
from kvt.harness.calibration import calibrate as run_calibration
from kvt.stats import Sums

pytestmark = pytest.mark.usefixtures("one_thread")
f64 = torch.float64


def problem(G=2, N=60, F=6, O=4, seed=0):
    """Sums of a random weighted problem (weights w with sum n, as attnfit's blend gives) and its parts."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(G, N, F, generator=g, dtype=f64) * torch.linspace(0.5, 3, F, dtype=f64)
    y = x @ torch.randn(G, F, O, generator=g, dtype=f64) + 0.5 * torch.randn(G, N, O, generator=g, dtype=f64) + 1.0
    w = torch.rand(G, N, generator=g, dtype=f64) + 0.2
    w = w * N / w.sum(1, keepdim=True)                                        # sum w = n, per group
    s = Sums.zeros(G, F, O)
    xw = x * w[..., None]
    s.xx, s.xy, s.sx, s.sy = xw.transpose(1, 2) @ x, xw.transpose(1, 2) @ y, xw.sum(1), (y * w[..., None]).sum(1)
    s.syy, s.n = (y * y * w[..., None]).sum(1), torch.tensor(float(N), dtype=f64)
    A = torch.randn(G, O, O, generator=g, dtype=f64)
    M = A @ A.transpose(1, 2) + 0.1 * torch.eye(O, dtype=f64)
    M = M * O / M.diagonal(dim1=1, dim2=2).sum(-1)[:, None, None]
    return s, x, y, w, M


def dense(x, y, w, M, lam):
    """The objective's normal equations solved densely per group, W column-major vectorised:
    (M kron C_xx + I kron lam S^2) vec W = vec(C_xy M), with the w-weighted means and covariances."""
    out = []
    for g in range(x.shape[0]):
        n = w[g].sum()
        mx, my = (w[g] @ x[g]) / n, (w[g] @ y[g]) / n
        xc, yc = x[g] - mx, y[g] - my
        cxx, cxy = (xc * w[g, :, None]).T @ xc / n, (xc * w[g, :, None]).T @ yc / n
        F, O = cxy.shape
        S2 = torch.diag(cxx.diagonal())
        lhs = torch.kron(M[g].T.contiguous(), cxx) + torch.kron(torch.eye(O, dtype=f64), lam * S2)
        vecW = torch.linalg.solve(lhs, (cxy @ M[g]).T.reshape(-1))
        W = vecW.reshape(O, F).T
        out.append((W, my - mx @ W))
    return torch.stack([o[0] for o in out]), torch.stack([o[1] for o in out])


@pytest.mark.parametrize("lam", [1e-3, 0.1, 10.0])
def test_whitened_weights_equal_a_dense_solve_of_the_objective(lam):
    """Guards: the eigenbasis of M applied on the wrong side (U^T for U), lambda multiplied by m_c instead
    of divided, the rotation not undone, or the bias taken before the rotation back."""
    s, x, y, w, M = problem()
    W, b = whiten.whitened_weights(ridge.eigen(s), lam, M)
    Wd, bd = dense(x, y, w, M, lam)
    assert (W - Wd).abs().max() < 1e-9, f"W {(W - Wd).abs().max():.2e} from the dense solve"
    assert (b - bd).abs().max() < 1e-9
    Wp, _ = ridge.weights(ridge.eigen(s), lam)
    assert (W - Wp).abs().max() > 1e-3, "the metric must change this fit"


def test_the_identity_metric_is_the_plain_ridge_and_a_metric_in_the_regulariser_cancels():
    """M = I gives ridge.weights; and the objective with lam sum var_j ||W_j M^(1/2)||^2 (the metric in the
    regulariser too) has the plain ridge's solution for any M: the dense normal equations
    (M kron (C_xx + lam S^2)) vec W = vec(C_xy M). Guards the tutorial's claim (section 8b)."""
    s, x, y, w, M = problem(seed=1)
    eye = torch.eye(4, dtype=f64).expand(2, 4, 4)
    W, b = whiten.whitened_weights(ridge.eigen(s), 0.1, eye)
    Wp, bp = ridge.weights(ridge.eigen(s), 0.1)
    assert (W - Wp).abs().max() < 1e-12 and (b - bp).abs().max() < 1e-12
    n = w[0].sum()
    mx, my = (w[0] @ x[0]) / n, (w[0] @ y[0]) / n
    xc, yc = x[0] - mx, y[0] - my
    cxx, cxy = (xc * w[0, :, None]).T @ xc / n, (xc * w[0, :, None]).T @ yc / n
    lhs = torch.kron(M[0].T.contiguous(), cxx + 0.1 * torch.diag(cxx.diagonal()))
    Wm = torch.linalg.solve(lhs, (cxy @ M[0]).T.reshape(-1)).reshape(4, 6).T
    assert (Wm - Wp[0]).abs().max() < 1e-9, "a metric in both the loss and the regulariser must cancel"


def test_query_metrics_are_the_position_free_queries_second_moment():
    """Guards: queries of one KV head's group mixed with another's (the heads sharing h are consecutive),
    RoPE left on, or the scale not trace D."""
    model = kvt.build_model(tiny_config(n_layers=2), seed=0)
    ids = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(2))
    M = whiten.query_metrics(model, ids, batch_size=2)
    _, cache = model(ids, queries=True, last=True)
    q = rope.strip(cache.queries[1].double(), cache.positions, model.inv_freq, model.rope_scale)  # (B, H, T, D)
    h = 1                                                                     # KV head 1: query heads 2, 3
    rows = torch.cat([q[b, u] for b in range(3) for u in (2, 3)])              # (B * 2 * T, D)
    want = rows.T @ rows
    want = want * 16 / want.trace()
    assert (M[1, h] - want).abs().max() < 1e-10
    assert abs(M[0, 0].trace().item() - 16) < 1e-10


def test_whitened_calibration_changes_the_keys_only():
    """End to end (--token-weights whitened): the values are the attention-weighted fit's exactly, the keys
    not. Guards the metric applied to the values, or not reaching the key fit at all."""
    cfg = tiny_config(n_layers=3, max_seq_len=256)
    source, target = kvt.build_model(cfg, seed=0, std=0.1), kvt.build_model(cfg, seed=1, std=0.1)
    c = calib_of(torch.randint(0, 128, (12, 40), generator=torch.Generator().manual_seed(0)), val=3, diag=1)
    att, _ = run_calibration(source, target, c, scope="head", k=2, lam=1e-2,
                             options=CalibrationOptions(progress=False, weights="attention"))
    wht, _ = run_calibration(source, target, c, scope="head", k=2, lam=1e-2,
                             options=CalibrationOptions(progress=False, weights="whitened"))
    assert torch.equal(wht.W["v"], att.W["v"]) and wht.meta["weights"] == "whitened"
    assert (wht.W["k"] - att.W["k"]).abs().max() > 1e-4
