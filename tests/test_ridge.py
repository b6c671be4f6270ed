"""ridge.py against oracles on synthetic data: a planted linear map, lstsq, direct residuals."""
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


def test_lambda_is_scale_free():
    """lambda is relative to the mean feature variance: scaling x leaves predictions unchanged."""
    x, y, _, _ = planted(noise=0.3)
    W1, b1 = ridge.solve(sums(x, y), 0.1)
    W2, b2 = ridge.solve(sums(7.0 * x, y), 0.1)
    assert_close(7.0 * x @ W2 + b2[:, None], x @ W1 + b1[:, None], "predictions after scaling x by 7", 1e-9)


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
        parts[f"{kind}.held"] = sums(x[:, 250:], y.flatten(2)[:, 250:])
    return Stats("head", list(range(Ls)), Lt, bx, by, parts), xs, y


def test_single_layer_r2_equals_brute_force_and_selection_finds_planted_layers():
    stats, xs, y = layered()
    r2 = ridge.single_layer_r2(stats, "k", lam=0.01)                       # (Ls, Lt)
    for s in range(4):
        for t in range(3):
            W, b = ridge.solve(sums(xs[:, :250, s], y[:, :250, t]), 0.01)
            pred = xs[:, 250:, s] @ W + b[:, None]
            true = y[:, 250:, t]
            direct = 1 - ((true - pred) ** 2).sum() / ((true - true.mean(1, keepdim=True)) ** 2).sum()
            assert abs(r2[s, t] - direct) < 1e-9, f"R^2[{s},{t}] {r2[s, t]:.6f} vs direct {direct:.6f}"
    sel = ridge.select_layers(r2, stats.src_layers, k=1)
    assert sel[:2, 0].tolist() == [1, 3]
    assert ridge.select_layers(r2, stats.src_layers, k=2)[2].tolist() == [0, 2]


def test_fit_layers_and_sweep():
    stats, _, _ = layered()
    selected = {kind: torch.tensor([[1, 2], [0, 3], [0, 2]]) for kind in ("k", "v")}
    W, b, r2 = ridge.fit_layers(stats, "k", selected["k"], 0.01)
    assert W.shape == (3, 2, 2 * 3, 2) and b.shape == (3, 2, 2) and r2.shape == (3,)
    assert (r2 > 0.95).all(), f"held-out R^2 of the planted fits: {r2.tolist()}"
    best, scores = ridge.sweep(stats, selected, lams=(1e-4, 1e-2, 10.0))
    assert best != 10.0 and scores[10.0] < scores[best]


def test_nan_in_statistics_is_a_one_line_error():
    stats, _, _ = layered()
    stats.part("v", "fit").xx[0, 0, 0] = float("nan")
    with pytest.raises(KvtError) as e:
        ridge.fit_layers(stats, "k", torch.tensor([[0], [1], [2]]))
    assert "NaN" in str(e.value) and "\n" not in str(e.value)


def test_singular_system_is_a_one_line_error():
    x = torch.ones(1, 10, 4, dtype=f64)                                    # constant features: zero covariance
    with pytest.raises(KvtError) as e:
        ridge.solve(sums(x, x[..., :2]), 0.0)
    assert "singular" in str(e.value) and "\n" not in str(e.value)
