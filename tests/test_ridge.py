"""ridge.py against oracles on synthetic data: a planted linear map, lstsq, direct residuals, a direct solve
of the standardized system at every lambda."""
import math

import pytest
import torch

from kvt import ridge
from kvt.config import KvtError
from kvt.stats import Stats, Sums

pytestmark = pytest.mark.usefixtures("one_thread")

f64 = torch.float64


def planted(G=2, N=400, F=12, O=5, noise=0.0, seed=0):
    """x (G, N, F) with non-zero means, y = x A + b (+ noise)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(G, N, F, generator=g, dtype=f64) * torch.linspace(0.5, 3, F, dtype=f64) + 2.0
    A = torch.randn(G, F, O, generator=g, dtype=f64)
    b = torch.randn(G, O, generator=g, dtype=f64)
    y = x @ A + b[:, None] + noise * torch.randn(G, N, O, generator=g, dtype=f64)
    return x, y, A, b


def sums(x, y):
    return Sums.zeros(x.shape[0], x.shape[2], y.shape[2]).add_(x, y)


def assert_close(actual, expected, what, atol):
    err = (actual - expected).abs().max().item()
    assert err <= atol, f"{what}: max abs error {err:.2e} > {atol:.0e}"


def test_planted_map_recovered_to_fp64_precision():
    x, y, A, b = planted()
    for lam in (0.0, 1e-14):
        W, c = ridge.solve(sums(x, y), lam)
        assert_close(W, A, f"W at lambda {lam}", 1e-10)
        assert_close(c, b, f"b at lambda {lam}", 1e-10)


def test_noisy_fit_converges_to_least_squares_as_lambda_goes_to_zero():
    x, y, _, _ = planted(noise=0.3)
    xa = torch.cat([x, torch.ones_like(x[..., :1])], 2)               # (G, N, F+1): the bias as a feature
    oracle = torch.linalg.lstsq(xa, y).solution                        # (G, F+1, O)
    errs = []
    for lam in (1e-2, 1e-4, 1e-6, 0.0):
        W, c = ridge.solve(sums(x, y), lam)
        errs.append(max((W - oracle[:, :-1]).abs().max().item(), (c - oracle[:, -1]).abs().max().item()))
    assert errs[-1] < 1e-10, f"lambda 0 vs lstsq: {errs[-1]:.2e}"
    assert errs == sorted(errs, reverse=True), f"error does not shrink with lambda: {errs}"


def test_lambda_is_per_feature_scale_free():
    """lambda is relative to each feature's own variance: scaling features by different constants leaves
    every prediction unchanged. Guards: lambda scaled by the mean feature variance (one loud feature
    then sets the penalty of all), or not scaled at all."""
    x, y, _, _ = planted(noise=0.3)
    scale = torch.linspace(0.01, 50, x.shape[2], dtype=f64)
    W1, b1 = ridge.solve(sums(x, y), 0.1)
    W2, b2 = ridge.solve(sums(x * scale, y), 0.1)
    assert_close((x * scale) @ W2 + b2[:, None], x @ W1 + b1[:, None], "predictions after scaling features", 1e-9)


def test_a_quiet_informative_layer_beside_a_loud_one_keeps_its_signal():
    """y depends on a quiet feature block (std 0.01); a loud, uninformative block (std 100) sits beside
    it. Fitted together, R^2 stays that of the quiet block alone (with lambda scaled by the mean feature
    variance it fell from 0.9987 to 0.036 at lambda 0.01)."""
    g = torch.Generator().manual_seed(0)
    quiet, loud = 0.01 * torch.randn(1, 2000, 8, generator=g, dtype=f64), 100 * torch.randn(1, 2000, 8, generator=g, dtype=f64)
    y = quiet @ torch.randn(1, 8, 3, generator=g, dtype=f64) * 100 + 0.03 * torch.randn(1, 2000, 3, generator=g, dtype=f64)
    both = torch.cat([quiet, loud], 2)
    def r2(x):
        W, b = ridge.solve(sums(x[:, :1500], y[:, :1500]), 0.01)
        val = sums(x[:, 1500:], y[:, 1500:])
        return 1 - (ridge.sse(val, W, b).sum() / ridge.sst(val).sum()).item()
    alone, together = r2(quiet), r2(both)
    assert alone > 0.99 and together > alone - 0.01, (alone, together)


def test_one_eigendecomposition_serves_every_lambda():
    """weights(eigen(s), lam) equals a direct solve of the standardized normal equations at each lambda.
    Guards: an eigenbasis used the wrong way round (Q vs Q^T), or a standardization not undone."""
    x, y, _, _ = planted(noise=0.3)
    s = sums(x, y)
    mx, my = s.sx / s.n, s.sy / s.n
    cxx = s.gram() / s.n - mx[:, :, None] * mx[:, None, :]
    cxy = s.xy / s.n - mx[:, :, None] * my[:, None, :]
    d = cxx.diagonal(dim1=1, dim2=2).rsqrt()
    eig = ridge.eigen(s)
    for lam in (1e-6, 1e-2, 1.0, 100.0):
        A = cxx * d[:, :, None] * d[:, None, :] + lam * torch.eye(x.shape[2], dtype=f64)
        direct = d[:, :, None] * torch.linalg.solve(A, cxy * d[:, :, None])
        W, b = ridge.weights(eig, lam)
        assert_close(W, direct, f"W at lambda {lam}", 1e-9)
        assert_close(b, my - (mx[:, None] @ direct)[:, 0], f"b at lambda {lam}", 1e-9)


def test_held_out_sse_and_r2_from_statistics_equal_direct_residuals():
    x, y, _, _ = planted(noise=0.5)
    W, b = ridge.solve(sums(x[:, :300], y[:, :300]), 0.01)
    held = sums(x[:, 300:], y[:, 300:])
    resid = y[:, 300:] - (x[:, 300:] @ W + b[:, None])
    assert_close(ridge.sse(held, W, b), (resid ** 2).sum(1), "SSE from sums", 1e-8)
    centered = y[:, 300:] - y[:, 300:].mean(1, keepdim=True)
    assert_close(ridge.sst(held), (centered ** 2).sum(1), "SST from sums", 1e-8)


def layered(Ls=4, Lt=3, G=2, bx=3, by=2, n=300, truth=((1,), (3,), (0, 2)), seed=0):
    """Stats whose target layer t is a noisy linear function of source layers truth[t]."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(G, n, Ls, bx, generator=g, dtype=f64)                # (G, N, Ls, Bx)
    ys = []
    for src in truth:
        y = sum(xs[:, :, s] @ torch.randn(G, bx, by, generator=g, dtype=f64) for s in src)
        ys.append(y + 0.05 * torch.randn(G, n, by, generator=g, dtype=f64))
    y = torch.stack(ys, 2)                                                 # (G, N, Lt, By)
    x = xs.flatten(2)
    parts = {}
    for kind in ("k", "v"):
        parts[f"{kind}.fit"] = sums(x[:, :250], y.flatten(2)[:, :250])
        parts[f"{kind}.val"] = sums(x[:, 250:], y.flatten(2)[:, 250:])
    return Stats("head", list(range(Ls)), list(range(Lt)), bx, by, parts), xs, y


def test_single_layer_r2_equals_brute_force_and_selection_finds_planted_layers():
    """Guards: R^2 of a source/target pair not at its best lambda, rows or columns swapped."""
    stats, xs, y = layered()
    lams = (1e-4, 1.0, 30.0)
    r2 = ridge.single_layer_r2(stats, "k", lams)                           # (Ls, Lt)
    for s in range(4):
        for t in range(3):
            direct = []
            for lam in lams:
                W, b = ridge.solve(sums(xs[:, :250, s], y[:, :250, t]), lam)
                pred = xs[:, 250:, s] @ W + b[:, None]
                true = y[:, 250:, t]
                direct.append(1 - ((true - pred) ** 2).sum() / ((true - true.mean(1, keepdim=True)) ** 2).sum())
            assert abs(r2[s, t] - max(direct)) < 1e-9, f"R^2[{s},{t}] {r2[s, t]:.6f} vs direct {max(direct):.6f}"
    sel = ridge.select_layers(r2, stats.src_layers, k=1)
    assert sel[:2, 0].tolist() == [1, 3]
    assert ridge.select_layers(r2, stats.src_layers, k=2)[2].tolist() == [0, 2]


def test_fit_layers_picks_the_lambda_with_the_best_validation_error():
    """Guards: lambda picked on the fit split (it would always take the smallest), or the worst one."""
    stats, _, _ = layered(n=270)                                           # 250 fit tokens, 20 validation tokens
    selected = torch.tensor([[1, 2], [0, 3], [0, 2]])
    fits = ridge.fit_layers(stats, "k", selected, ridge.LAMBDAS)
    for t, (W, b, r2, lam) in fits.items():
        assert W.shape == (2, 2 * 3, 2) and b.shape == (2, 2)
        fi = torch.cat([torch.arange(l * 3, l * 3 + 3) for l in selected[t].tolist()])
        oi = torch.arange(t * 2, t * 2 + 2)
        fit, val = stats.part("k", "fit").select(fi, oi), stats.part("k", "val").select(fi, oi)
        errs = {l: ridge.sse(val, *ridge.solve(fit, l)).sum().item() for l in ridge.LAMBDAS}
        assert lam == min(errs, key=errs.get), (t, lam, errs)
        assert abs(r2 - (1 - errs[lam] / ridge.sst(val).sum().item())) < 1e-9
    assert fits[0][2] > 0.95 and fits[1][2] > 0.95, "validation R^2 of the planted fits"


def test_nan_in_statistics_is_a_one_line_error():
    stats, _, _ = layered()
    stats.part("v", "fit").xx[0, 0, 0] = float("nan")
    with pytest.raises(KvtError) as e:
        ridge.fit_layers(stats, "k", torch.tensor([[0], [1], [2]]))
    stats.part("v", "fit").xx[0, 0, 0] = 0.0
    stats.part("k", "val").n.zero_()
    with pytest.raises(KvtError, match="no validation tokens"):
        ridge.fit_layers(stats, "k", torch.tensor([[0], [1], [2]]))
    assert "NaN" in str(e.value) and "\n" not in str(e.value)


def test_singular_system_is_a_one_line_error():
    x = torch.ones(1, 10, 4, dtype=f64)                                    # constant features: zero covariance
    with pytest.raises(KvtError) as e:
        ridge.solve(sums(x, x[..., :2]), 0.0)
    assert "singular" in str(e.value) and "\n" not in str(e.value)


def rank_deficient(eps=3e-3):
    """layered() stats whose source layer 1 has a duplicated feature (4 = 3) and rounding pushed past it:
    the correlation of 3 and 4 is 1 + eps, so the standardized matrix has an eigenvalue near -eps and
    every lambda up to eps is singular there."""
    stats, _, _ = layered()
    for split in ("fit", "val"):
        s = stats.part("k", split)
        g = s.gram()
        g[:, 4, :], s.xy[:, 4], s.sx[:, 4] = g[:, 3, :], s.xy[:, 3], s.sx[:, 3]
        g[:, :, 4] = g[:, :, 3]
        var = g[:, 3, 3] / s.n - (s.sx[:, 3] / s.n) ** 2
        g[:, 3, 4] = g[:, 4, 3] = g[:, 3, 3] + eps * s.n * var
        s.xx.copy_(g)
    return stats


def test_a_singular_lambda_is_skipped_and_named_not_fatal():
    """A rank-deficient fit singular at the smallest lambdas picks among the others and names the ones it
    skipped; only a fit singular at every lambda fails. Guards: the whole fit aborting at the first
    singular lambda (`ridge system is singular at lambda=1e-06`, seen on a rank-deficient toy run)."""
    stats = rank_deficient()
    selected = torch.tensor([[1, 2], [0, 3], [0, 2]])                      # target 0 reads source layer 1
    skipped, skipped_single = {}, {}
    fits = ridge.fit_layers(stats, "k", selected, ridge.LAMBDAS, skipped)
    assert skipped == {0: [1e-6, 1e-5, 1e-4, 1e-3]}, skipped
    assert fits[0][3] >= 1e-2 and math.isfinite(fits[0][2]) and torch.isfinite(fits[0][0]).all()
    r2 = ridge.single_layer_r2(stats, "k", ridge.LAMBDAS, skipped_single)
    assert skipped_single == {1: [1e-6, 1e-5, 1e-4, 1e-3]} and torch.isfinite(r2).all()
    with pytest.raises(KvtError) as e:
        ridge.fit_layers(stats, "k", selected, (1e-6, 1e-4))
    assert "target layer 0 is singular at every lambda (1e-06, 0.0001)" in str(e.value) and "\n" not in str(e.value)
