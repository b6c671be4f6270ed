"""A course kit: assignments cut out of kvt's own code, and an autograder for them (docs/course.md).

    python -m kvt.course list                                  # the assignments, their functions and points
    python -m kvt.course make --assignment rope --out DIR      # a student copy of kvt with stubs to fill in
    python -m kvt.course grade DIR                             # a score per function; exit 1 below full marks

`make` copies kvt (the package, tutorial.md, run.py, requirements.txt, and the toy checkpoints the
tutorial's blocks read) into DIR and replaces the body of each graded function by one line,
`raise NotImplementedError("rope.strip: implement this (tutorial section 3)")`. The signature, the
docstring and comments standing before the first statement stay. The body (its first statement after
the docstring through end_lineno, found with ast) is cut out of the source text, since ast.unparse
would drop every comment. Comments inside the body go with it, because they give answers away
(scoring's off-by-one note), except standalone shape comments such as `# (B, Hkv, T, D)`.

Grading compares numbers, not code. At make time every graded function's CASE (below: seeded inputs,
tiny tensors and random tiny models) runs on the reference code, and its outputs go to
DIR/grading/expected.safetensors. `grade` runs DIR/grading/ with pytest in a subprocess, one test per
function (test_function[rope.strip]). While function F is tested, the assignment's other graded
functions are swapped for the reference ones (DIR/grading/reference/, copies of the original modules,
which a student can read: docs/course.md), so a mistake in one function costs only its own points even
when F calls it.
"""
import argparse
import ast
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

import torch
from safetensors.torch import load_file, save_file

import kvt
from kvt import bench, handoff, ridge, rope, scoring, stats, summary
from kvt.config import Config, KvtError

KVT = Path(__file__).resolve().parent   # the package, copied into every assignment
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
    "mapper": Assignment("Layer selection, the mapper, and the handoff", (5, 7, 9), (
        Graded("ridge.single_layer_r2", 3, 5, "validation R^2 of every (source layer, target layer) fit"),
        Graded("ridge.select_layers", 2, 5, "top-k source layers per target layer, ascending"),
        Graded("mapper.Mapper.apply", 4, 7, "strip the source's RoPE, map, apply the target's RoPE"),
        Graded("handoff.handoff", 3, 9, "the source reads T - 1 tokens, the target runs the last itself"))),
    "evals": Assignment("Scoring and retention, honestly", (10,), (
        Graded("scoring.loglikelihoods", 4, 10, "loglikelihood from a cache, and its off-by-one"),
        Graded("scoring.mc_metrics", 1, 10, "acc and acc_norm as lm-evaluation-harness computes them"),
        Graded("summary.wilson", 2, 10, "the Wilson interval of a proportion"),
        Graded("summary.bootstrap", 3, 10, "a paired percentile bootstrap", tol=0.01),
        Graded("summary._retention", 3, 10, "retention and floor-normalized retention with paired intervals: "
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
    moved = layer.apply(cache, positions=cache.positions + 100, room=1)
    return {**cache_numbers(layer.apply(cache)), **cache_numbers(head.apply(cache), "head_"),
            **cache_numbers(moved, "moved_"), "room": num(moved.room)}


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


@case("scoring.loglikelihoods")
def case_loglikelihoods():
    model = kvt.build_model(tiny(2), seed=0, std=0.2)
    ctx, greedy = [5, 17, 99, 23, 8, 64, 1], []
    with torch.no_grad():
        for _ in range(3):                                           # the model's own greedy continuation
            greedy.append(model(torch.tensor([ctx + greedy]))[0][0, -1].argmax().item())
    conts = [[40], [7, 7, 120, 3], greedy, [88, 2]]
    lls, best = scoring.loglikelihoods(model, ctx, conts)
    other = scoring.loglikelihoods(model, ctx, conts[:2], lambda ids: scoring.prefill(model, ids.flip(1)))[0]
    return {"ll": num(lls), "greedy": num(best), "one_token": num(scoring.loglikelihoods(model, ctx, [[40]])[0]),
            "other_prefill": num(other)}


@case("scoring.mc_metrics")
def case_mc_metrics():
    out = {}
    for i, (lls, gold) in enumerate((([-3.0, -1.0, -1.0, -2.0], 1), ([-3.0, -1.0, -1.2, -2.0], 2))):
        r = scoring.mc_metrics(lls, ["a", "bb", "ccc", "d"], gold)
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


@case("summary._retention")
def case_retention():
    g = torch.Generator().manual_seed(11)
    target = torch.rand(120, generator=g) < 0.9
    conds = {"target": target, "transfer": target & (torch.rand(120, generator=g) < 0.9),
             "floor": torch.rand(120, generator=g) < 0.3}
    conds = {c: {f"item{i}": {"acc": float(v)} for i, v in enumerate(col.tolist())
                 if not (c == "transfer" and i % 17 == 0)} for c, col in conds.items()}   # transfer lacks a few items
    out = {}
    for name, names in (("with_floor", ("target", "transfer", "floor")), ("without_floor", ("target", "transfer"))):
        r = summary._retention({c: conds[c] for c in names}, ["acc"], 2000)["acc"]
        out[name] = num([r["n"], r["ratio"], *r["ratio_ci"],
                         r.get("floor_normalized"), *r.get("floor_normalized_ci", (None, None))])
    return out


# ---- check: one graded function of a student copy, in the generated test ----------------------------------

_REFERENCE = {}  # module name -> the reference module loaded from grading/reference/


def use_reference(grading, name, monkeypatch):
    """Swap the student's `name` for the reference one, wherever a kvt module holds it."""
    module, *path = name.split(".")
    if module not in _REFERENCE:
        file = Path(grading) / "reference" / f"{module}.py"
        spec = importlib.util.spec_from_file_location(f"kvt_reference_{module}", file)
        _REFERENCE[module] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_REFERENCE[module])
    owner, ref = sys.modules[f"kvt.{module}"], _REFERENCE[module]
    for part in path[:-1]:                                           # a method: its class
        owner, ref = getattr(owner, part), getattr(ref, part)
    mine, theirs = getattr(owner, path[-1]), getattr(ref, path[-1])
    monkeypatch.setattr(owner, path[-1], theirs)
    for n, m in list(sys.modules.items()):                           # `from kvt.x import f` made another name for it
        if n.startswith("kvt.") and getattr(m, path[-1], None) is mine:
            monkeypatch.setattr(m, path[-1], theirs)


def check(grading, assignment, name, monkeypatch):
    """Assert that graded function `name` reproduces the reference's numbers, the assignment's other graded
    functions being the reference ones meanwhile. The assertion message is one line."""
    grading = Path(grading).resolve()
    assert KVT == grading.parent / "kvt", f"kvt was imported from {KVT}, not from the copy beside {grading}"
    graded = next(f for f in ASSIGNMENTS[assignment].functions if f.name == name)
    for other in ASSIGNMENTS[assignment].functions:
        if other.name != name:
            use_reference(grading, other.name, monkeypatch)
    got = CASES[name]()
    want = load_file(grading / "expected.safetensors")
    for out, value in got.items():
        a, e = torch.as_tensor(value).detach().to(f64), want[f"{name}/{out}"]
        assert a.shape == e.shape, f"{name}: {out} has shape {tuple(a.shape)}, the reference's {tuple(e.shape)}"
        assert torch.equal(a.isnan(), e.isnan()), f"{name}: {out} is None where the reference's is not, or the reverse"
        err = (a - e).nan_to_num(0).abs().max().item() if a.numel() else 0.0
        allowed = graded.tol * max(1.0, e.nan_to_num(0).abs().max().item() if e.numel() else 0.0)
        assert err <= allowed, f"{name}: {out} differs from the reference by {err:.2e} (allowed {allowed:.0e})"


# ---- make -------------------------------------------------------------------------------------------------

SHAPE = re.compile(r"\((B|G|N|T|n|H|Hkv|L|Ls|Lt), ")  # a shape comment: "# (B, Hkv, T, D)"


def stub(source, functions):
    """source with the body of each Graded function replaced by a NotImplementedError (module docstring)."""
    lines, tree, cuts = source.splitlines(keepends=True), ast.parse(source), []
    for f in functions:
        node = tree
        for part in f.name.split(".")[1:]:
            node = next(n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
        first = node.body[1 if ast.get_docstring(node) is not None else 0]  # the first statement after the docstring
        body = lines[first.lineno - 1:node.end_lineno]
        shapes = [line for line in body if line.strip().startswith("#") and SHAPE.search(line)]
        error = f'raise NotImplementedError("{f.name}: implement this (tutorial section {f.section})")\n'
        cuts.append((first.lineno - 1, node.end_lineno, shapes + [" " * first.col_offset + error]))
    for start, end, new in sorted(cuts, reverse=True):              # from the bottom up: line numbers stay valid
        lines[start:end] = new
    return "".join(lines)


TEST = '''"""The grader of assignment {name!r}: one test per graded function, against the reference's numbers
(expected.safetensors). Run it with `python -m kvt.course grade .` from the assignment's folder."""
from pathlib import Path

import pytest

from kvt.course import ASSIGNMENTS, check


@pytest.mark.parametrize("function", [f.name for f in ASSIGNMENTS[{name!r}].functions])
def test_function(function, monkeypatch):
    check(Path(__file__).parent, {name!r}, function, monkeypatch)
'''


def readme(name, solution):
    a = ASSIGNMENTS[name]
    rows = "\n".join(f"| `{f.name}` | `kvt/{f.module}.py` | {f.points} | {f.section} | {f.teaches} |"
                     for f in a.functions)
    todo = ("This copy holds the reference solution (made with --solution)." if solution else
            "Each function below raises NotImplementedError until you write its body; its signature and docstring "
            "say what it takes and returns.")
    return f"""# kvt course, assignment `{name}`: {a.title}

Read {a.reading} (tutorial.md) beside the code. {todo}

| function | file | points | tutorial section | what it teaches |
|---|---|---|---|---|
{rows}

Grade your work from this folder (pytest, one line per function; exit status 0 at full marks only):

    python -m kvt.course grade .

Each function is graded on its own: while one is tested, the other functions of this table are the
reference ones, so a mistake costs only its own points. The tests compare your outputs with numbers the
reference implementation computed (grading/expected.safetensors) on the inputs of kvt/course.py's cases.
grading/reference/ holds the reference modules the grader swaps in: reading them is reading the answers.
"""


def make(name, out, solution=False):
    """Write assignment `name` to the new folder `out` (atomically: built beside it, then renamed)."""
    if name not in ASSIGNMENTS:
        raise KvtError(f"no assignment {name!r}; the assignments are {', '.join(ASSIGNMENTS)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise KvtError(f"{out} already exists and is not an empty folder; give a new one")
    if not out.parent.is_dir():
        raise KvtError(f"{out.parent} does not exist; create it first")
    if not (ROOT / "tutorial.md").exists():
        raise KvtError(f"make needs a working copy of kvt (a clone): there is no tutorial.md beside {KVT}")
    a = ASSIGNMENTS[name]
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)                                             # mkdtemp's 0o700 would hide it from a class
    try:
        shutil.copytree(KVT, tmp / "kvt", ignore=shutil.ignore_patterns("__pycache__"))
        for f in ("tutorial.md", "run.py", "requirements.txt"):
            shutil.copy(ROOT / f, tmp / f)
        for w in sorted((ROOT / "weights").glob("toy-*")):       # the tutorial's blocks load the toy family
            shutil.copytree(w, tmp / "weights" / w.name)
        (tmp / "grading" / "reference").mkdir(parents=True)
        for module in dict.fromkeys(f.module for f in a.functions):
            source = (KVT / f"{module}.py").read_text()
            (tmp / "grading" / "reference" / f"{module}.py").write_text(source)
            if not solution:
                (tmp / "kvt" / f"{module}.py").write_text(stub(source, [f for f in a.functions if f.module == module]))
        expected = {}
        for f in a.functions:                                    # the reference's numbers: this kvt's own code
            try:
                outputs = CASES[f.name]()
            except NotImplementedError:
                raise KvtError(f"{f.name} is a stub in {KVT}; run make from kvt's own working copy") from None
            expected.update({f"{f.name}/{k}": torch.as_tensor(v).detach().to(f64).contiguous()
                             for k, v in outputs.items()})
        save_file(expected, tmp / "grading" / "expected.safetensors")
        (tmp / "grading" / "expected.safetensors").chmod(0o644)  # safetensors writes it 0o600
        (tmp / "grading" / f"test_{name}.py").write_text(TEST.format(name=name))
        (tmp / "grading" / "assignment.json").write_text(json.dumps({"assignment": name, "solution": solution,
                                                                     "kvt_version": kvt.__version__}) + "\n")
        (tmp / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")  # stops pytest's search here
        (tmp / "README.md").write_text(readme(name, solution))
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---- grade ------------------------------------------------------------------------------------------------

def grade(folder):
    """Run an assignment's grader; print the score table; return (points earned, points possible)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise KvtError(f"{folder}: no such folder (make one: python -m kvt.course make --assignment NAME --out DIR)")
    info = folder / "grading" / "assignment.json"
    if not info.exists():
        raise KvtError(f"{folder} is not a kvt assignment (no grading/assignment.json); give the folder `make` wrote")
    name = json.loads(info.read_text())["assignment"]
    if name not in ASSIGNMENTS:
        raise KvtError(f"{folder} is assignment {name!r}, which this kvt does not know ({', '.join(ASSIGNMENTS)})")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder.resolve()), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "results.xml"
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", f"--junitxml={xml}", "grading"], cwd=folder,
                             env=env, capture_output=True, text=True)
        results = {}  # graded function -> None (passed) or the first line of what failed
        for tc in ElementTree.parse(xml).iter("testcase") if xml.exists() else []:  # test_function[<graded name>]
            bad = next((tc.find(tag) for tag in ("failure", "error", "skipped") if tc.find(tag) is not None), None)
            why = None if bad is None else (bad.get("message") or "failed").splitlines()[0]
            results[tc.get("name").partition("[")[2][:-1]] = why
    output = (run.stdout + run.stderr).strip().splitlines()
    errors = [line[1:].strip() for line in output if line.startswith("E ")]   # pytest's lines of the error,
    errors = [e for e in errors if "Error:" in e] + errors                      # the exception's own first
    why_not_run = "not run: " + next(iter(errors), output[-1] if output else "pytest printed nothing")
    a, earned = ASSIGNMENTS[name], 0
    print(f"assignment {name}: {a.title} ({a.reading})")
    for f in a.functions:
        failure = results.get(f.name, why_not_run)
        earned += 0 if failure else f.points
        result = "FAIL  " + failure if failure else "pass"
        print(f"  {0 if failure else f.points:>2} / {f.points:<2} {f.name:<24} {result}")
    print(f"  {earned:>2} / {a.points:<2} total")
    return earned, a.points


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kvt course", description="Assignments cut out of kvt, and their autograder.")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the assignments, their functions and points")
    m = sub.add_parser("make", help="write a student copy of kvt with the assignment's functions stubbed")
    m.add_argument("--assignment", required=True, help=", ".join(ASSIGNMENTS))
    m.add_argument("--out", required=True, help="a new folder")
    m.add_argument("--solution", action="store_true", help="keep the reference bodies (to check the grader)")
    sub.add_parser("grade", help="run an assignment's grader; exit status 1 below full marks").add_argument("folder")
    args = ap.parse_args(argv)
    if args.command == "list":
        for name, a in ASSIGNMENTS.items():
            print(f"{name}: {a.title} ({a.reading}), {a.points} points")
            for f in a.functions:
                print(f"  {f.points} {f.name:<24} section {f.section}: {f.teaches}")
    elif args.command == "make":
        out = make(args.assignment, args.out, args.solution)
        print(f"wrote {out}: {out / 'README.md'} says what to do; grade it with: python -m kvt.course grade {out}")
    elif args.command == "grade":
        earned, total = grade(args.folder)
        if earned < total:
            sys.exit(1)


if __name__ == "__main__":
    from kvt.cli import entry
    entry(["course", *sys.argv[1:]])
