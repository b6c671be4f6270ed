"""attnfit.py, the attention-weighted head-local ridge: uniform weights give today's fit exactly, a weighted
fit equals a dense weighted least-squares solve, the ESS rule picks the alpha its formula gives, and the
token weights are the attention sensitivities the docstring writes."""
import pytest
import torch

import kvt
from kvt.harness import attnfit
from kvt import ridge
from kvt.config import KvtError
from kvt.harness.calibration import CalibrationOptions, accumulate_resumable
from kvt.harness.calibration import calibrate as run_calibration
from kvt.harness.files import load_stats
from kvt.stats import FIELDS, Sums

QUIET, WEIGHTED = CalibrationOptions(progress=False), CalibrationOptions(progress=False, weights="attention")
from conftest import calib_of, tiny_config
from test_stats import DiesAfter, Interrupted

pytestmark = pytest.mark.usefixtures("one_thread")

f64 = torch.float64


def pair(seed=0):
    cfg = tiny_config(n_layers=3, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=256)
    return kvt.build_model(cfg, seed=seed, std=0.1), kvt.build_model(cfg, seed=seed + 1, std=0.1)


def calib(vocab, n=12, T=40, seed=0):
    return calib_of(torch.randint(0, vocab, (n, T), generator=torch.Generator().manual_seed(seed)), val=3, diag=1)


def test_alpha_zero_reproduces_the_uniform_fit_exactly(monkeypatch):
    """With every alpha 0 the attention-weighted fit is today's head-scope ridge, bit for bit: W, b,
    R^2 and lambda of every target layer. Guards: the blend reading the wrong groups or feature order
    of the r-weighted sums, or the plain sums rounded on their way through blend."""
    source, target = pair()
    c = calib(source.config.vocab_size)
    uniform, _ = run_calibration(source, target, c, scope="head", k=2, options=QUIET)
    monkeypatch.setattr(attnfit, "ess_alpha", lambda n, rr, p: torch.zeros_like(rr))
    weighted, _ = run_calibration(source, target, c, scope="head", k=2, options=WEIGHTED)
    for kind in ("k", "v"):
        assert torch.equal(weighted.layers[kind], uniform.layers[kind]), "the selection must not change"
        assert torch.equal(weighted.W[kind], uniform.W[kind]), f"{kind}: W differs from the uniform fit"
        assert torch.equal(weighted.b[kind], uniform.b[kind]), f"{kind}: b differs from the uniform fit"
        assert weighted.meta["r2"][kind] == uniform.meta["r2"][kind]
        assert weighted.meta["lambda"][kind] == uniform.meta["lambda"][kind]
    assert weighted.meta["alpha"]["k"][0] == [0.0, 0.0]


def test_uniform_token_weights_reproduce_the_uniform_fit(monkeypatch):
    """r = 1 everywhere (the alpha then is 1): the r-weighted sums, streamed by the second pass, are the
    plain sums again, so the fit is today's to float64 rounding. Guards the second pass pairing the
    wrong source layers, heads or target layers with a target head's outputs."""
    source, target = pair(seed=3)
    c = calib(source.config.vocab_size, seed=1)
    uniform, _ = run_calibration(source, target, c, scope="head", k=2, lam=1e-3, options=QUIET)
    monkeypatch.setattr(attnfit, "token_weights", lambda q, k, v, lengths: (torch.ones(k.shape[:3], dtype=f64),) * 2)
    weighted, _ = run_calibration(source, target, c, scope="head", k=2, lam=1e-3, options=WEIGHTED)
    assert weighted.meta["alpha"]["v"][1] == [1.0, 1.0]
    for kind in ("k", "v"):
        err = (weighted.W[kind] - uniform.W[kind]).abs().max().item()
        scale = uniform.W[kind].abs().max().item()
        assert err <= 1e-4 * scale, f"{kind}: W {err:.2e} from the uniform fit (W up to {scale:.2e})"


def test_weighted_fit_equals_dense_weighted_least_squares():
    """blend + ridge.eigen/weights at alpha is the weighted, centred, standardized ridge solved densely
    from the tokens: w = 1 + alpha (r - 1), weighted means, Xc^T D Xc + lam S^2. Guards: weights applied
    to x but not to y (or to the means), (1 - alpha) and alpha swapped, the bias left unweighted."""
    g = torch.Generator().manual_seed(0)
    G, N, F, O, lam, alpha = 2, 300, 6, 3, 1e-2, torch.tensor([0.3, 0.8], dtype=f64)
    x = torch.randn(G, N, F, generator=g, dtype=f64) * torch.linspace(0.5, 2, F, dtype=f64) + 1.0
    y = x @ torch.randn(G, F, O, generator=g, dtype=f64) + 0.5 * torch.randn(G, N, O, generator=g, dtype=f64)
    r = torch.rand(G, N, generator=g, dtype=f64) ** 3
    r = r / r.mean(1, keepdim=True)                                          # mean 1, as token_weights makes it
    plain, rs = Sums.zeros(G, F, O).add_(x, y), Sums.zeros(G, F, O)
    rs.n = torch.zeros(G, dtype=f64)
    attnfit.add_r_(rs, x, y, r)
    W, b = ridge.weights(ridge.eigen(attnfit.blend(plain, rs, alpha)), lam)
    for i in range(G):
        w = 1 + alpha[i] * (r[i] - 1)                                        # (N,)
        mx, my = (w @ x[i]) / w.sum(), (w @ y[i]) / w.sum()
        xc, yc = x[i] - mx, y[i] - my
        S2 = torch.diag((w @ xc ** 2) / w.sum())                             # weighted variances
        Wd = torch.linalg.solve(xc.T @ (w[:, None] * xc) / w.sum() + lam * S2, xc.T @ (w[:, None] * yc) / w.sum())
        assert (W[i] - Wd).abs().max() < 1e-10, f"group {i}: W differs from the dense weighted solve"
        assert (b[i] - (my - mx @ Wd)).abs().max() < 1e-10, f"group {i}: b differs"


def test_ess_rule_picks_the_alpha_of_its_formula():
    """ess_alpha gives the alpha at which ESS = (sum w)^2 / sum w^2 of the explicit weights equals
    min(n, 2p), capped at 1, and 0 when n <= 2p. Guards: ESS computed from r instead of w, the bound n
    instead of min(n, 2p), alpha not capped."""
    g = torch.Generator().manual_seed(1)
    n, p = 1000, 200
    r = torch.rand(3, n, generator=g, dtype=f64) ** torch.tensor([[8.0], [2.0], [0.2]], dtype=f64)
    r = r / r.mean(1, keepdim=True)
    a = attnfit.ess_alpha(n, (r * r).sum(1), p)
    for i in range(3):
        w = 1 + a[i] * (r[i] - 1)
        ess = (w.sum() ** 2 / (w * w).sum()).item()
        if a[i] < 1:
            assert abs(ess - 2 * p) < 1e-8, f"row {i}: ESS {ess} at alpha {a[i]:.4f}, not {2 * p}"
        else:
            assert ess >= 2 * p, f"row {i}: alpha 1 but ESS {ess} < {2 * p}"
    assert a[0] < 1 and a[2] == 1, f"the spread-out row must be shrunk and the flat one not: {a.tolist()}"
    assert attnfit.ess_alpha(n, (r * r).sum(1), n).tolist() == [0.0, 0.0, 0.0], "n <= 2p leaves no room"


def test_token_weights_are_the_attention_sensitivities():
    """token_weights against a loop over tokens and query heads at one boundary (the last, T), and its
    normalisation: mean 1 over the sequence. Guards: query heads paired with the wrong KV head, the
    1/sqrt(d) scale missing from the scores, ||v_i - o_u|| taken with another head's output."""
    g = torch.Generator().manual_seed(2)
    B, H, Hkv, T, D = 1, 4, 2, 9, 8
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=f64) for h in (H, Hkv, Hkv))
    rk, rv = attnfit.token_weights(q, k, v, [T])
    U = H // Hkv
    for h in range(Hkv):
        ek, ev = torch.zeros(T, dtype=f64), torch.zeros(T, dtype=f64)
        for u in range(h * U, (h + 1) * U):
            a = torch.softmax(torch.stack([q[0, u, T - 1] @ k[0, h, i] / D ** 0.5 for i in range(T)]), 0)
            o = sum(a[i] * v[0, h, i] for i in range(T))
            for i in range(T):
                ev[i] += a[i] ** 2
                ek[i] += a[i] ** 2 * (v[0, h, i] - o).pow(2).sum() * q[0, u, T - 1].pow(2).sum() / D
        assert torch.allclose(rv[0, h], ev / ev.mean(), atol=1e-12), f"head {h}: r_V"
        assert torch.allclose(rk[0, h], ek / ek.mean(), atol=1e-12), f"head {h}: r_K"
    assert attnfit.boundaries(1024)[-1] == 1024 and attnfit.boundaries(1024)[0] == 2


def test_attention_weights_need_head_scope():
    """--token-weights attention with layer scope is refused in one line (the fit is head-local)."""
    source, target = pair()
    with pytest.raises(KvtError, match="--scope head"):
        run_calibration(source, target, calib(source.config.vocab_size), scope="layer", k=2, options=WEIGHTED)


def test_weighted_pass_resumes_bit_identically(tmp_path):
    """The r-weighted sums checkpoint and resume like calibration's own: an interrupted pass resumed from
    its checkpoint gives the unbroken pass's sums bit for bit (sum r^2 in n included). Guards: a
    checkpoint that drops the per-group n, or a resumed pass that weights its batches differently."""
    source, target = pair(seed=5)
    c = calib(source.config.vocab_size, seed=2)
    selected = {kind: torch.tensor([[0, 2], [1, 2], [0, 1]]) for kind in ("k", "v")}

    def fresh():
        return attnfit.new_weighted_stats(source.config, target.config, selected, key="t")
    kw = dict(add=attnfit.add_weighted, capture_target=attnfit.capture_weighted, progress=False)
    whole = accumulate_resumable(source, target, c, fresh(), 2, every=2, **kw)
    path = tmp_path / "attn.safetensors"
    with pytest.raises(Interrupted):
        accumulate_resumable(DiesAfter(source, 3), target, c, fresh(), 2, path, every=2, save_s=0, **kw)
    assert load_stats(path).seen == 4
    resumed = accumulate_resumable(source, target, c, fresh(), 2, path, every=2, save_s=0, **kw)
    assert all(torch.equal(getattr(resumed.sums[n], f), getattr(whole.sums[n], f)) for n in whole.sums for f in FIELDS)
    assert whole.sums["k.fit"].n.shape == (3 * 2,) and (whole.sums["k.fit"].n > 0).all()


def test_run_refuses_attention_weights_outside_head_scope():
    """`kvt run --token-weights attention` without --scope head is one line before any work, and
    --scope head-local is kvt's head scope by another name. Guards: the refusal reached only after the
    models load, or head-local refused as an unknown scope."""
    from kvt.harness.pipeline import Settings, parse_args
    with pytest.raises(KvtError, match="add --scope head"):
        Settings.from_args(parse_args(["--token-weights", "attention"]))
    assert Settings.from_args(parse_args(["--scope", "head-local", "--token-weights", "attention"])).scope == "head"
