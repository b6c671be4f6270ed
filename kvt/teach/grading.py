"""The course's grading: the assignments (ASSIGNMENTS), the case each graded function must reproduce (CASES:
seeded inputs, tiny tensors and random tiny models), what each case is (ABOUT), and `check`, which grades one
function of a student copy. `kvt course make` (course.py) copies this file into every grader folder, whose
test loads that copy: the student's own kvt/teach/grading.py is never consulted.

At make time every graded function's case runs on the reference code, and its outputs go to
GRADER/expected.safetensors. While function F is checked, the assignment's other graded functions are swapped
for the reference ones (GRADER/reference/), so a mistake in one function costs only its own points even when F
calls it. A failure says what the case ran, where the output differs (which rows, heads, positions, channels),
and a hint written for that case.
"""
import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

import kvt
from kvt import evals, handoff, ridge, rope, stats
from kvt.config import Config, KvtError
from kvt.harness import bench, summary

KVT = Path(__file__).resolve().parents[1]   # the package, copied into every assignment
ROOT = KVT.parent                       # the working copy: tutorial.md, run.py, weights/toy-*
f64 = torch.float64


@dataclass(frozen=True)
class Graded:
    name: str         # "module.function" or "module.Class.method", as kvt/<module>.py defines it
    points: int
    section: int      # the tutorial section that explains it
    teaches: str
    tol: float = 1e-4  # allowed error, relative to max(1, largest |expected|); looser for bootstraps

    @property
    def module(self):
        return self.name.split(".")[0]


@dataclass(frozen=True)
class Assignment:
    title: str
    sections: tuple   # the tutorial sections to read first
    functions: tuple  # of Graded

    @property
    def reading(self):
        return f"tutorial section{'s' if len(self.sections) > 1 else ''} {', '.join(map(str, self.sections))}"

    @property
    def points(self):
        return sum(f.points for f in self.functions)


ASSIGNMENTS = {
    "rope": Assignment("RoPE as pure functions", (3,), (
        Graded("rope.rotate", 3, 3, "the rotation of each plane (i, i + D/2): x cos + rotate_half(x) sin"),
        Graded("rope.apply", 1, 3, "RoPE at given positions, from frequencies and YaRN's scale"),
        Graded("rope.strip", 3, 3, "the exact inverse: rotation by -position, the scale divided out"),
        Graded("rope._llama3", 2, 3, "Llama 3.1's frequencies: keep the high, divide the low, blend between"),
        Graded("rope._yarn", 3, 3, "YaRN's frequencies and attention factor (Ministral 3)"))),
    "ridge": Assignment("The normal equations, streamed", (4, 6), (
        Graded("stats.Sums.add_", 2, 4, "sufficient statistics streamed batch by batch: float64 sums of products"),
        Graded("ridge.eigen", 3, 6, "centered covariances, standardized features, one eigendecomposition"),
        Graded("ridge.weights", 2, 6, "ridge at any lambda from the eigendecomposition, and the bias"),
        Graded("ridge.sse", 3, 4, "held-out squared error from sums alone, without the tokens"),
        Graded("ridge.sst", 1, 4, "the total sum of squares, R^2's denominator"))),
    "mapper": Assignment("Layer selection, the mapper, and the handoff", (4, 5, 7, 9), (
        Graded("ridge.single_layer_r2", 3, 4, "validation R^2 of every (source layer, target layer) fit"),
        Graded("ridge.select_layers", 2, 5, "top-k source layers per target layer, ascending"),
        Graded("mapper.Mapper.apply", 4, 7, "strip the source's RoPE, map, apply the target's RoPE"),
        Graded("handoff.handoff", 3, 9, "the source reads T - 1 tokens, the target runs the last itself"))),
    "evals": Assignment("Scoring and retention, honestly", (10,), (
        Graded("evals.loglikelihoods", 4, 10, "loglikelihood from a cache, and its off-by-one"),
        Graded("evals.mc_metrics", 1, 10, "acc and acc_norm as lm-evaluation-harness computes them"),
        Graded("summary.wilson", 2, 10, "the Wilson interval of a proportion"),
        Graded("summary.bootstrap", 3, 10, "a paired percentile bootstrap", tol=0.01),
        Graded("summary.retention", 3, 10, "retention and floor-normalized retention with paired intervals: "
               "{metric: {n, ratio, ratio_ci, floor_normalized, floor_normalized_ci}} (see summarize)", tol=0.02))),
}


# ---- cases: the numbers each graded function must reproduce ---------------------------------------------
# A case calls kvt through its modules (rope.strip, not a local name) so the grader's swaps take effect.

CASES = {}  # graded function -> its case: () -> {output name: tensor}


def case(name):
    def register(fn):
        CASES[name] = fn
        return fn
    return register


LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.5}


def tiny(n_layers=2, rope=None):
    """A tiny Qwen3-style config (tests/conftest.py's tiny_config): width 64, 4 heads, 2 KV heads of dim 16."""
    return Config("qwen3", vocab_size=128, dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=16,
                  ffn_dim=128, norm_eps=1e-6, rope=rope or {"rope_type": "default", "rope_theta": 10000.0})


def num(x):
    """A number, a pair or a list that may hold None -> a float64 tensor with NaN for None."""
    return torch.tensor([math.nan if v is None else float(v) for v in (x if isinstance(x, (list, tuple)) else [x])],
                        dtype=f64)


def rope_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 16, generator=g, dtype=dtype)           # (B, H, T, D)
    pos = torch.randint(0, 3000, (2, 5), generator=g)                # (B, T), another offset per row
    inv = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)     # (D/2,)
    return x, pos, inv


@case("rope.rotate")
def case_rotate():
    x, pos, inv = rope_inputs()
    cos, sin = rope.cos_sin(pos, inv, 1.0, x.dtype)
    return {"y": rope.rotate(x, cos, sin), "scaled": rope.rotate(x, *rope.cos_sin(pos, inv, 1.25, x.dtype))}


@case("rope.apply")
def case_apply():
    x, pos, inv = rope_inputs()
    return {"per_row": rope.apply(x, pos, inv, 1.25), "shared": rope.apply(x, pos[0], inv)}


@case("rope.strip")
def case_strip():
    x, pos, inv = rope_inputs(f64)
    y = rope.strip(x, pos, inv, 1.25)
    return {"y": y, "float32": rope.strip(x.float(), pos, inv, 1.25), "dtype": num(y.dtype == f64)}


@case("rope._llama3")
def case_llama3():
    inv = 1.0 / 500000.0 ** (torch.arange(0, 64, 2).float() / 64)   # (D/2,), D = 64
    return {"inv_freq": rope._llama3(inv, LLAMA3)}


@case("rope._yarn")
def case_yarn():
    out = {}
    recipes = [(YARN, 1e6, 32), ({"factor": 8.0, "original_max_position_embeddings": 32}, 1e4, 16),
               ({"factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 1.5, "beta_fast": 16,
                 "beta_slow": 2, "truncate": False}, 1e4, 32)]                # (parameters, base, D)
    for i, (p, base, D) in enumerate(recipes):
        inv, scale = rope._yarn(p, base, D)
        out[f"inv_freq{i}"], out[f"scale{i}"] = inv, num(scale)
    return out


def planted(G=2, N=300, F=6, O=3, mean=2.0, seed=0):
    """x (G, N, F) with a mean and unequal spreads, y = x A + b + noise (G, N, O), float64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(G, N, F, generator=g, dtype=f64) * torch.logspace(-1, 1, F, dtype=f64) + mean
    y = x @ torch.randn(G, F, O, generator=g, dtype=f64) + 3.0 + 0.1 * torch.randn(G, N, O, generator=g, dtype=f64)
    return x, y


def sums(x, y):
    s = stats.Sums.zeros(x.shape[0], x.shape[2], y.shape[2])
    s.add_(x, y)
    return s


@case("stats.Sums.add_")
def case_add():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 100, 5, generator=g) + 1000.0                 # (G, N, F): a mean 1000 x the spread
    y = x[..., :3] * 2 - 1500.0 + torch.randn(2, 100, 3, generator=g)
    s = stats.Sums.zeros(2, 5, 3)
    s.add_(x[:, :60], y[:, :60])                                     # two batches
    s.add_(x[:, 60:], y[:, 60:])
    mx, my = s.sx / s.n, s.sy / s.n
    return {"gram": s.gram(), "xy": s.xy, "sx": s.sx, "sy": s.sy, "syy": s.syy, "n": s.n,   # then what the fit
            "cov_xx": s.gram() / s.n - mx[:, :, None] * mx[:, None],                        # reads: covariances,
            "cov_xy": s.xy / s.n - mx[:, :, None] * my[:, None], "var_y": s.syy / s.n - my * my}  # lost uncentered


def case_ridge():
    x, y = planted(mean=50.0)
    x[:, :, 2] = 7.0                                                 # a constant feature: weight 0
    s, out = sums(x, y), {}
    for lam in (1e-6, 0.1, 10.0):
        out[f"W{lam:g}"], out[f"b{lam:g}"] = ridge.weights(ridge.eigen(s), lam)
    return out


case("ridge.eigen")(case_ridge)     # eigen is graded through weights (the reference's), weights through eigen
case("ridge.weights")(case_ridge)


@case("ridge.sse")
def case_sse():
    g = torch.Generator().manual_seed(2)
    W, b = torch.randn(2, 6, 3, generator=g, dtype=f64), torch.randn(2, 3, generator=g, dtype=f64)
    return {"sse": ridge.sse(sums(*planted(seed=1)), W, b)}


@case("ridge.sst")
def case_sst():
    return {"sst": ridge.sst(sums(*planted(seed=1)))}


def layered_stats():
    """Head-scope statistics of 3 source layers (numbered 1, 4, 7) and 2 target layers, fit and validation:
    for K, target layer 0 is planted on source layer 7 and target layer 1 on source layers 1 and 4."""
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(2, 400, 3, 4, generator=g, dtype=f64) + 1.0               # (G, N, Ls, Bx)
    A = torch.randn(4, 4, 3, generator=g, dtype=f64)
    noise = torch.randn(2, 400, 2, 3, generator=g, dtype=f64)
    ys = {"k": torch.stack([xs[:, :, 2] @ A[0], xs[:, :, 0] @ A[1] + xs[:, :, 1] @ A[2]], 2) + 0.3 * noise,
          "v": torch.stack([xs[:, :, 1] @ A[3], xs[:, :, 1] ** 2 @ A[0]], 2) + 0.3 * noise}   # (G, N, Lt, By)
    parts = {}
    for kind, y in ys.items():
        parts[f"{kind}.fit"] = sums(xs[:, :300].flatten(2), y[:, :300].flatten(2))
        parts[f"{kind}.val"] = sums(xs[:, 300:].flatten(2), y[:, 300:].flatten(2))
    return stats.Stats("head", [1, 4, 7], [0, 1], 4, 3, parts)


@case("ridge.single_layer_r2")
def case_single_layer_r2():
    st = layered_stats()
    return {"k": ridge.single_layer_r2(st, "k"), "v": ridge.single_layer_r2(st, "v", (1e-3, 1.0, 100.0))}


@case("ridge.select_layers")
def case_select_layers():
    r2 = torch.rand(5, 3, generator=torch.Generator().manual_seed(4), dtype=f64)   # (Ls, Lt)
    return {"k2": ridge.select_layers(r2, [0, 2, 4, 6, 8], 2), "k9": ridge.select_layers(r2, [0, 2, 4, 6, 8], 9)}


def cache_numbers(cache, prefix=""):
    return {prefix + "keys": torch.stack(cache.keys), prefix + "values": torch.stack(cache.values),
            prefix + "positions": cache.positions, prefix + "mask": cache.mask}


@case("mapper.Mapper.apply")
def case_mapper_apply():
    source = kvt.build_model(tiny(2), seed=0, std=0.2)
    target_cfg = tiny(3, rope=YARN)                                  # other frequencies, and a scale != 1
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, :2] = False                                              # row 1 is left-padded
    _, cache = source(ids, mask=mask)
    layer = bench.random_mapper(source.config, target_cfg, "layer", 2, seed=6, bias=0.1)
    head = bench.random_mapper(source.config, target_cfg, "head", 1, seed=7, bias=0.1)
    moved = layer.apply(cache, positions=cache.positions + 100)
    return {**cache_numbers(layer.apply(cache)), **cache_numbers(head.apply(cache), "head_"),
            **cache_numbers(moved, "moved_")}


@case("handoff.handoff")
def case_handoff():
    source, target = kvt.build_model(tiny(2), seed=0, std=0.2), kvt.build_model(tiny(3), seed=1, std=0.2)
    m = bench.random_mapper(source.config, target.config, "head", 1, seed=8, bias=0.1)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :3] = False
    out = {}
    for name, args in (("padded_", (ids, mask)), ("one_", (ids[1:],)), ("single_token_", (ids[:, :1],))):
        logits, cache = handoff.handoff(source, target, m, *args)
        out.update({name + "logits": logits, **cache_numbers(cache, name)})
    logits, cache = handoff.handoff(source, target, m, ids[1:], recompute=handoff.Recompute(last=2))
    return {**out, "recompute_logits": logits, **cache_numbers(cache, "recompute_")}


@case("evals.loglikelihoods")
def case_loglikelihoods():
    model = kvt.build_model(tiny(2), seed=0, std=0.2)
    ctx, greedy = [5, 17, 99, 23, 8, 64, 1], []
    with torch.no_grad():
        for _ in range(3):                                           # the model's own greedy continuation
            greedy.append(model(torch.tensor([ctx + greedy]))[0][0, -1].argmax().item())
    conts = [[40], [7, 7, 120, 3], greedy, [88, 2]]
    [(lls, best)] = evals.loglikelihoods(model, [(ctx, conts)])
    other = evals.loglikelihoods(model, [(ctx, conts[:2])], lambda ids: evals.prefill(model, ids.flip(1)))[0][0]
    two = evals.loglikelihoods(model, [(ctx, conts[1:3]), ([9, 4], [[11, 12, 13], [1]])])   # left-padded together
    return {"ll": num(lls), "greedy": num(best), "one_token": num(evals.loglikelihoods(model, [(ctx, [[40]])])[0][0]),
            "other_prefill": num(other), "two_contexts": num([ll for lls_, _ in two for ll in lls_])}


@case("evals.mc_metrics")
def case_mc_metrics():
    out = {}
    for i, (lls, gold) in enumerate((([-3.0, -1.0, -1.0, -2.0], 1), ([-3.0, -1.0, -1.2, -2.0], 2))):
        r = evals.mc_metrics(lls, ["a", "bb", "ccc", "d"], gold)
        out[f"item{i}"] = num([r["pred"], r["pred_norm"], r["acc"], r["acc_norm"]])
    return out


@case("summary.wilson")
def case_wilson():
    kn = [(0, 0), (0, 10), (10, 10), (3, 7), (45, 60)]
    return {"z1.96": num([v for k, n in kn for v in summary.wilson(k, n)]), "z2.58": num(summary.wilson(3, 7, 2.58))}


@case("summary.bootstrap")
def case_bootstrap():
    g = torch.Generator().manual_seed(10)
    a = torch.rand(200, generator=g, dtype=f64)
    b = a + 0.05 * torch.randn(200, generator=g, dtype=f64)          # b tracks a, item by item
    a, b = a.tolist(), b.tolist()
    return {"mean": num(summary.bootstrap(torch.mean, [a], 2000)),
            "paired_difference": num(summary.bootstrap(lambda x, y: x.mean() - y.mean(), [a, b], 2000)),
            "no_items": num(summary.bootstrap(torch.mean, [[]])),
            "undefined": num(summary.bootstrap(lambda x: None, [a], 50))}


@case("summary.retention")
def case_retention():
    g = torch.Generator().manual_seed(11)
    target = torch.rand(120, generator=g) < 0.9
    conds = {"target": target, "transfer": target & (torch.rand(120, generator=g) < 0.9),
             "floor": torch.rand(120, generator=g) < 0.3}
    conds = {c: {f"item{i}": {"acc": float(v)} for i, v in enumerate(col.tolist())
                 if not (c == "transfer" and i % 17 == 0)} for c, col in conds.items()}   # transfer lacks a few items
    out = {}
    for name, names in (("with_floor", ("target", "transfer", "floor")), ("without_floor", ("target", "transfer"))):
        r = summary.retention({c: conds[c] for c in names}, ["acc"], 2000)["acc"]
        out[name] = num([r["n"], r["ratio"], *r["ratio_ci"],
                         r.get("floor_normalized"), *r.get("floor_normalized_ci", (None, None))])
    return out


# ---- what each case is, for the grader's messages ----------------------------------------------------------

AXES = {"B": "rows", "H": "heads", "Hkv": "KV heads", "T": "positions", "D": "channels", "i": "frequencies",
        "L": "layers", "G": "groups", "F": "features", "O": "outputs", "Ls": "source layers", "Lt": "target layers",
        "k": "selected", "V": "vocabulary", "n": "items"}


@dataclass(frozen=True)
class About:
    case: str            # what the case runs: shapes, positions, recipe, scale
    hint: str            # what to look at when it fails, written for this case
    axes: dict = None    # output name -> its axes ("B H T D"), so a failure says which rows, heads, positions differ


ROPE_X = ("x (B=2, H=3, T=5, D=16), positions (2, 5) drawn from 0-2999, another offset per row, default "
          "frequencies theta_i = 10000^(-2i/16)")
BHTD = "B H T D"
CACHE = {"keys": "L B Hkv T D", "values": "L B Hkv T D", "positions": "B T", "mask": "B T"}
ABOUT = {
    "rope.rotate": About(
        f"{ROPE_X}; y = rotate(x, cos, sin) with cos, sin = cos_sin(pos, inv_freq, 1); scaled: the same with scale "
        "1.25 (cos and sin both carry it)",
        "plane i is channels (i, i + D/2), not (2i, 2i + 1): y = x cos + rotate_half(x) sin, rotate_half(x) = "
        "(-x2, x1) with x1, x2 the halves of x, and cos, sin as cos_sin makes them (each angle twice)",
        {"y": BHTD, "scaled": BHTD}),
    "rope.apply": About(
        f"per_row: {ROPE_X}, scale 1.25; shared: the same x at row 0's positions given as a (T,) tensor, scale 1",
        "apply is rotate with cos_sin(pos, inv_freq, scale, x.dtype): cos_sin takes (B, T) or (T,) positions and "
        "already multiplies cos and sin by the scale",
        {"per_row": BHTD, "shared": BHTD}),
    "rope.strip": About(
        f"{ROPE_X}, scale 1.25, x in float64 (y, and dtype: 1 when y is float64), then in float32 (float32)",
        "strip(y, p) rotates back by -p: y cos - rotate_half(y) sin, divided by cos^2 + sin^2 (cos_sin's cos and sin "
        "carry the scale, so that division also removes it); keep a float64 input in float64",
        {"y": BHTD, "float32": BHTD}),
    "rope._llama3": About(
        "inv_freq of D = 64 (32 frequencies) at base 500000; factor 8, low_freq_factor 1, high_freq_factor 4, "
        "original_max_position_embeddings 64: wavelengths 2 pi / theta below 16 (i = 0-2) are kept, above 64 "
        "(i = 6-31) divided by 8, between (i = 3-5) blended",
        "with wavelength w = 2 pi / theta and old = original_max_position_embeddings: w < old / high_freq_factor "
        "keeps theta; w > old / low_freq_factor gives theta / factor; between, (1 - s) theta / factor + s theta "
        "with s = (old / w - low_freq_factor) / (high_freq_factor - low_freq_factor)",
        {"inv_freq": "i"}),
    "rope._yarn": About(
        "recipe 0: Ministral 3's keys (factor 16, original 16, mscale 1, mscale_all_dim 0.5), base 1e6, D = 32; "
        "recipe 1: factor 8, original 32, nothing else, base 1e4, D = 16; recipe 2: factor 4, original 64, "
        "attention_factor 1.5, beta_fast 16, beta_slow 2, truncate false, base 1e4, D = 32",
        "inv_freq = theta / factor * ramp + theta * (1 - ramp), ramp rising from 0 to 1 between the channels "
        "whose wavelength fits beta_fast (default 32) and beta_slow (default 1) times into the original context "
        "(floored and ceiled unless truncate is false, clamped to 0..D-1); scale = attention_factor if given, "
        "else mscale(factor, mscale) / mscale(factor, mscale_all_dim) if both are given, else mscale(factor), "
        "with mscale(s, m) = 0.1 m ln s + 1 (1 for s <= 1): recipe 0's scale is 1.1218, 1's 1.2079, 2's 1.5",
        {f"inv_freq{i}": "i" for i in range(3)}),
    "stats.Sums.add_": About(
        "x (G=2, N=100, F=5) with a mean 1000 times its spread, y (2, 100, 3) = 2 x[..., :3] - 1500 + noise, "
        "added in two batches of 60 and 40 tokens (float32 tensors, float64 sums)",
        "cast x and y to the sums' dtype (float64) first, then add x^T x, x^T y, the column sums of x and y, "
        "the sum of y^2 and the token count: in float32 the covariances, which subtract two large numbers, "
        "lose their digits",
        {"gram": "G F F", "xy": "G F O", "sx": "G F", "sy": "G O", "syy": "G O", "cov_xx": "G F F",
         "cov_xy": "G F O", "var_y": "G O"}),
    "ridge.eigen": About(
        "2 groups of 300 tokens, 6 features with means near 50 and spreads from 0.1 to 10, feature 2 constant "
        "(7.0), 3 outputs; fits at lambda 1e-6, 0.1 and 10 through the reference weights",
        "C_xx = sum x x^T / n - mean mean^T (centered); standardize by the features' standard deviations (a "
        "constant feature has none: give it weight 0), then one eigendecomposition",
        {**{f"W{lam}": "G F O" for lam in ("1e-06", "0.1", "10")}, **{f"b{lam}": "G O" for lam in ("1e-06", "0.1", "10")}}),
    "ridge.weights": About(
        "ridge.eigen's case, on the reference eigen: lambda 1e-6, 0.1 and 10",
        "W = S^-1 Q diag(1 / (e + lambda)) Q^T S^-1 C_xy from the eigendecomposition R = Q diag(e) Q^T of the "
        "standardized covariance, then b = mean(y) - mean(x) W",
        {**{f"W{lam}": "G F O" for lam in ("1e-06", "0.1", "10")}, **{f"b{lam}": "G O" for lam in ("1e-06", "0.1", "10")}}),
    "ridge.sse": About("sums of 2 groups of 300 tokens (6 features, 3 outputs), random W (2, 6, 3) and b (2, 3)",
                       "expand sum (y - x W - b)^2 into the sums s holds: syy - 2 (W xy + b sy) + W^T gram W "
                       "+ 2 b sx W + n b^2, per output", {"sse": "G O"}),
    "ridge.sst": About("sums of 2 groups of 300 tokens, 3 outputs", "sum (y - mean y)^2 = syy - sy^2 / n, per output",
                       {"sst": "G O"}),
    "ridge.single_layer_r2": About(
        "head-scope statistics of 3 source layers (numbered 1, 4, 7) and 2 target layers, 2 groups of 4 channels, "
        "300 fit and 100 validation tokens; k: the default lambdas, v: lambdas (1e-3, 1, 100)",
        "for every (source layer, target layer): fit on the fit sums at each lambda, score R^2 = 1 - sse / sst "
        "on the validation sums (summed over groups and channels), keep the best lambda's; rows follow the "
        "statistics' source layers, not 0..Ls-1", {"k": "Ls Lt", "v": "Ls Lt"}),
    "ridge.select_layers": About(
        "an R^2 map (Ls=5, Lt=3) of source layers numbered 0, 2, 4, 6, 8; k = 2, and k = 9 (more than there are)",
        "per target layer, the k source layers with the highest R^2, as layer numbers (not row indices), in "
        "ascending order; k above Ls keeps them all", {"k2": "Lt k", "k9": "Lt k"}),
    "mapper.Mapper.apply": About(
        "a random 2-layer source (default RoPE, base 1e4) to a 3-layer target with YaRN RoPE (factor 16, "
        "scale 1.1218), 2 KV heads of 16 channels, a batch of 2 x 7 tokens, row 1 left-padded by 2; layer "
        "scope k = 2 and head scope k = 1 mappers with a bias; moved_: positions + 100",
        "strip the source's RoPE (the source's frequencies and scale) from its keys, x @ W + b over the "
        "selected source layers, lay the result out as (B, Hkv, T, D), and rotate keys only by the target's "
        "RoPE at the target positions (the target's frequencies and scale); values get no RoPE",
        {**CACHE, **{p + n: a for p in ("head_", "moved_") for n, a in CACHE.items()}}),
    "handoff.handoff": About(
        "a random 2-layer source and 3-layer target, a head-scope mapper; 2 x 9 tokens with row 0 left-padded "
        "by 3 (padded_), one row (one_), one token (single_token_), and Recompute(last=2) (recompute_)",
        "the source prefills tokens 0..T-2, the mapper maps that cache, the target runs token T-1 on it; a "
        "one-token prompt has nothing to map",
        {**{p + n: a for p in ("padded_", "one_", "single_token_", "recompute_") for n, a in CACHE.items()},
         **{p + "logits": "B T V" for p in ("padded_", "one_", "single_token_", "recompute_")}}),
    "evals.loglikelihoods": About(
        "a random 2-layer model, a 7-token context and 4 continuations (1, 4, 3 and 2 tokens; the third is the "
        "model's own greedy continuation); other_prefill: a context cache from another prefill function; "
        "two_contexts: two of them beside a 2-token context with 2 continuations, in one call (left padding)",
        "logits at position j predict token j + 1: a continuation's first token is scored by the context's last "
        "logits, each later token by the logits of the token before it; greedy: every token the argmax",
        {"ll": "n", "greedy": "n", "other_prefill": "n", "two_contexts": "n"}),
    "evals.mc_metrics": About(
        "loglikelihoods (-3, -1, -1, -2) with gold 1, then (-3, -1, -1.2, -2) with gold 2; choices 'a', 'bb', "
        "'ccc', 'd' (lengths 1, 2, 3, 1); each item is (pred, pred_norm, acc, acc_norm)",
        "pred: the argmax of the loglikelihoods, the first on a tie; pred_norm: of each divided by its "
        "choice's length in characters"),
    "summary.wilson": About(
        "(k, n) = (0, 0), (0, 10), (10, 10), (3, 7), (45, 60) at z = 1.96 (two bounds each), and (3, 7) at z = 2.58",
        "center (p + z^2 / 2n) / (1 + z^2 / n), half-width z sqrt(p (1 - p) / n + z^2 / 4n^2) / (1 + z^2 / n), "
        "clipped to [0, 1]; (0, 1) when n = 0"),
    "summary.bootstrap": About(
        "200 paired items a and b = a + noise; 2000 resamples of the mean of a, and of mean(a) - mean(b); "
        "no items; and a statistic that is always None",
        "resample item indices with replacement, the same indices for every column (paired); the 2.5% and "
        "97.5% quantiles of the finite statistics; (None, None) with no items or no finite resample"),
    "summary.retention": About(
        "120 items of acc under target, transfer (missing every 17th item) and floor; with and without the floor; "
        "each row is (n, ratio, its interval, floor-normalized, its interval)",
        "only the items every condition scored; ratio = transfer / target and (transfer - floor) / (target - "
        "floor), each with a paired bootstrap interval (summary.bootstrap over the conditions' columns)"),
}


def spans(indices):
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, run = [], []
    for i in indices:
        if run and i != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}")
            run = []
        run.append(i)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}")
    return ", ".join(out)


def where(bad, axes):
    """Which indices along each named axis hold a difference: 'channels 8-15 of 16; positions all 5'."""
    parts = []
    for dim, name in enumerate(axes.split()):
        if bad.shape[dim] == 1:
            continue
        hit = bad.movedim(dim, 0).reshape(bad.shape[dim], -1).any(1).nonzero().flatten().tolist()
        n = bad.shape[dim]
        parts.append(f"{AXES.get(name, name)} ({name}) {'all ' + str(n) if len(hit) == n else spans(hit) + ' of ' + str(n)}")
    return "; ".join(parts)


def difference(out, a, e, allowed, axes):
    """One paragraph: how far output `out` is from the reference's, where, and the largest difference."""
    bad = ((a - e).abs() > allowed) | (a.isnan() != e.isnan())
    err = (a - e).abs().nan_to_num(0)                                   # None (NaN) where both are None
    at = [int(i) for i in torch.unravel_index(err.flatten().argmax(), err.shape)] if err.numel() else []
    worst = (f"largest at {at}: yours {a[tuple(at)].item():.6g}, the reference {e[tuple(at)].item():.6g} "
             f"(allowed difference {allowed:.0e})")
    place = f"; differs at {where(bad, axes)}" if axes and a.dim() == len(axes.split()) else ""
    share = f"{int(bad.sum())} of {bad.numel()} numbers differ"
    planes = f"; {rotation_check(a, e)}" if axes and axes.endswith("D") and a.dim() == len(axes.split()) else ""
    return f"{out} {tuple(a.shape)}{' = (' + ', '.join(axes.split()) + ')' if axes else ''}: {share}{place}; {worst}{planes}"


def rotation_check(a, e):
    """What a rotation keeps: the length of each plane (channels i, i + D/2). Says whether yours match the
    reference's (then the angles differ), differ by one factor (a scale), or differ (not these planes)."""
    half = a.shape[-1] // 2
    length = lambda x: (x[..., :half] ** 2 + x[..., half:] ** 2).sqrt()   # (..., D/2) per plane
    la, le = length(a), length(e)
    ratio = la / le.clamp_min(1e-12)
    if (la - le).abs().max() <= 1e-4 * max(1.0, le.max().item()):
        return ("the length of every plane (i, i + D/2) is the reference's, so your planes are right and their "
                "angles are not: look at the sign of sin, the frequencies and the positions")
    if (ratio - ratio.median()).abs().max() <= 1e-4 * ratio.median().abs():
        return f"every plane (i, i + D/2) is {ratio.median().item():.4g} times the reference's length: a scale"
    return ("the planes (i, i + D/2) do not keep the reference's lengths: yours is not a rotation of those "
            "planes (is your plane (2i, 2i + 1)?), or it mixes them")


# ---- check: one graded function of a student copy, in the generated test ----------------------------------

_REFERENCE = {}  # module name -> the reference module loaded from GRADER/reference/


def home(module):
    """Where a module the course names lives in the package: "rope" -> "rope", "summary" -> "harness.summary"."""
    for layer in ("", "harness.", "integrations.", "teach."):    # of the kvt this process imports (the student's, when grading)
        if importlib.util.find_spec(f"kvt.{layer}{module}") is not None:
            return layer + module
    raise KvtError(f"kvt has no module {module!r}; name one of kvt's files")


def path_of(module):
    """The file of a module the course names, inside the package: "summary" -> "harness/summary.py"."""
    return home(module).replace(".", "/") + ".py"


def use_reference(grader, name, monkeypatch):
    """Swap the student's `name` for the reference one, wherever a kvt module holds it."""
    module, *path = name.split(".")
    if module not in _REFERENCE:
        file = Path(grader) / "reference" / f"{module}.py"
        spec = importlib.util.spec_from_file_location(f"kvt_reference_{module}", file)
        _REFERENCE[module] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_REFERENCE[module])
    owner, ref = sys.modules[f"kvt.{home(module)}"], _REFERENCE[module]
    for part in path[:-1]:                                           # a method: its class
        owner, ref = getattr(owner, part), getattr(ref, part)
    mine, theirs = getattr(owner, path[-1]), getattr(ref, path[-1])
    monkeypatch.setattr(owner, path[-1], theirs)
    for n, m in list(sys.modules.items()):                           # `from kvt.x import f` made another name for it
        if n.startswith("kvt.") and getattr(m, path[-1], None) is mine:
            monkeypatch.setattr(m, path[-1], theirs)


def check(student, grader, assignment, name, monkeypatch):
    """Fail (a message of a few lines) unless graded function `name` of the student copy reproduces the
    reference's numbers, the assignment's other graded functions being the reference ones meanwhile."""
    import pytest
    student, grader = Path(student).resolve(), Path(grader).resolve()
    here = Path(kvt.__file__).resolve().parent
    assert here == student / "kvt", f"kvt was imported from {here}, not from the student copy {student}"
    graded = next(f for f in ASSIGNMENTS[assignment].functions if f.name == name)
    for other in ASSIGNMENTS[assignment].functions:
        if other.name != name:
            use_reference(grader, other.name, monkeypatch)
    got = CASES[name]()
    want = load_file(grader / "expected.safetensors")
    about = ABOUT.get(name, About("(not described)", "(none)"))
    problems = []
    for out, value in got.items():
        a, e = torch.as_tensor(value).detach().to(f64), want[f"{name}/{out}"]
        axes = (about.axes or {}).get(out)
        if a.shape != e.shape:
            problems.append(f"{out} has shape {tuple(a.shape)}, the reference's {tuple(e.shape)}"
                            f"{' = (' + ', '.join(axes.split()) + ')' if axes else ''}")
            continue
        if not torch.equal(a.isnan(), e.isnan()):
            problems.append(f"{out} is None where the reference's is not, or the reverse: yours {a.tolist()}, "
                            f"the reference {e.tolist()} (nan: None)")
            continue
        err = (a - e).nan_to_num(0).abs().max().item() if a.numel() else 0.0
        allowed = graded.tol * max(1.0, e.nan_to_num(0).abs().max().item() if e.numel() else 0.0)
        if err > allowed:
            problems.append(difference(out, a, e, allowed, axes))
    if problems:
        pytest.fail("\n".join([f"{name}: {len(problems)} of {len(got)} outputs differ from the reference",
                               *problems, f"the case: {about.case}", f"hint: {about.hint}"]), pytrace=False)
