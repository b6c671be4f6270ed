"""The answers of tutorial section 15's exercises 1 to 5, recomputed on the shipped toy family and checked, for
instructors (docs/course.md). They live outside the kvt package, so no student copy (`kvt course make`) holds them.

    OMP_NUM_THREADS=1 python -m tests.exercises               # all five; exit status 1 if a check fails
    python -m tests.exercises --exercise 1                    # only these (repeatable)

Each answer runs on the toy family in seconds on one thread, and returns (lines to print, checks: [(what must
hold, whether it does)]); tests/test_course.py runs them all and compares them with docs/course.md.
"""
import argparse
import math
import sys
from pathlib import Path

import torch

import kvt
from kvt import ridge, rope, stats
from kvt.calibrate import Run, calibrate
from kvt.capture import layer_features
from kvt.harness import calibration, toy
from kvt.harness.data import calibration_sequences

ROOT = Path(__file__).resolve().parents[1]   # the working copy: weights/toy-*


def greedy_layers(stats, kind, k, lams=ridge.LAMBDAS):
    """Exercise 5's rule, a `select` for harness.calibration.calibrate: per target layer, start from no source
    layer and add, k times, the one that raises the validation R^2 of the joint fit the most. (Lt, k), ascending."""
    chosen = [[] for _ in stats.tgt_layers]                          # per target layer, in stats.tgt_layers order
    for _ in range(min(k, len(stats.src_layers))):
        best = [(-math.inf, None)] * len(chosen)
        for s in stats.src_layers:                                   # s added to every target layer at once
            rows = {t: c + [s if s not in c else next(x for x in stats.src_layers if x not in c)]  # (a row that
                    for t, c in zip(stats.tgt_layers, chosen)}                                     # has s: unused)
            fits = ridge.fit_layers(stats, kind, {t: torch.tensor(sorted(r)) for t, r in rows.items()}, lams)
            for j, t in enumerate(stats.tgt_layers):
                if s not in chosen[j] and fits[t][2] > best[j][0]:
                    best[j] = (fits[t][2], s)
        for c, (_, s) in zip(chosen, best):
            c.append(s)
    return torch.tensor([sorted(c) for c in chosen])


def toy_model(name):
    """A member of the shipped toy family."""
    return kvt.load_model(ROOT / "weights" / name)


def toy_calibration(n_seqs=40):
    """The tutorial's calibration text (section 4): toy-corpus documents the models were not trained on."""
    return calibration_sequences(None, kvt.load_tokenizer(ROOT / "weights" / "toy-l"), n_seqs, 256,
                                 documents=toy.corpus(2000, seed=99))


def heldout_r2(fit, val):
    """Validation R^2 of the ridge fit of y on x, (x (G, N, F), y (G, N, O)) per region, at its best lambda."""
    sf, sv = (stats.Sums.zeros(x.shape[0], x.shape[2], y.shape[2]).add_(x.double(), y.double())
              for x, y in (fit, val))
    eig = ridge.eigen(sf)
    return max(1 - (ridge.sse(sv, *ridge.weights(eig, lam)).sum() / ridge.sst(sv).sum()).item() for lam in ridge.LAMBDAS)


def answer_1():
    """Exercise 1, do not strip RoPE: held-out R^2 of each toy-l key layer from both toy-m layers (head scope),
    on position-free keys and on the cached, rotated ones."""
    source, target, calib = toy_model("toy-m"), toy_model("toy-l"), toy_calibration()

    def keys(model, ids, strip):  # (G=Hkv, N, L*D): every layer's keys side by side, per head
        _, cache = model(ids, last=True)
        ks = [rope.strip(k, cache.positions, model.inv_freq, model.rope_scale) if strip else k for k in cache.keys]
        return [layer_features(k, "head") for k in ks]

    lines, checks, r2 = [], [], {}
    with torch.no_grad():
        for strip in (True, False):
            xs = {r: torch.cat(keys(source, getattr(calib, r), strip), -1) for r in ("fit", "val")}
            ys = {r: keys(target, getattr(calib, r), strip) for r in ("fit", "val")}
            r2[strip] = [heldout_r2((xs["fit"], ys["fit"][t]), (xs["val"], ys["val"][t])) for t in range(4)]
    for name, strip in (("position-free keys", True), ("rotated keys", False)):
        lines.append(f"  {name:<19} R^2 K per target layer " + " ".join(f"{v:.3f}" for v in r2[strip]))
    checks.append(("rotated keys fit worse on every target layer, and layer 0 (a function of the token alone, "
                   "rotated alike on both sides) loses least", all(a > b for a, b in zip(r2[True], r2[False]))
                   and r2[True][0] - r2[False][0] == min(a - b for a, b in zip(r2[True], r2[False]))))
    return lines, checks


def answer_2():
    """Exercise 2, a control: toy-m -> toy-l against a random model of toy-m's shape, layer scope, k = 2."""
    target, calib = toy_model("toy-l"), toy_calibration()
    reports = {name: calibrate(m, target, calib, k=2, run=Run(plain=True))[1]
               for name, m in (("toy-m", toy_model("toy-m")), ("random", kvt.build_model(toy_model("toy-m").config, seed=0)))}
    lines = [f"  {name:<7} R^2 {kind.upper()} per target layer " + " ".join(f"{v:.3f}" for v in r["r2"][kind].tolist())
             for kind in ("k", "v") for name, r in reports.items()]
    trained, random = reports["toy-m"]["r2"], reports["random"]["r2"]
    checks = [("the trained source explains every target layer better than the random one",
               all(bool((trained[kind] > random[kind]).all()) for kind in ("k", "v"))),
              ("the random source still explains most of target layer 0 (R^2 K above 0.5): its keys are a function "
               "of the token", random["k"][0].item() > 0.5)]
    return lines, checks


def answer_3():
    """Exercise 3, vary k: toy-l (4 layers) -> toy-m, layer scope, k = 1 to 4; mean validation R^2."""
    source, target, calib = toy_model("toy-l"), toy_model("toy-m"), toy_calibration()
    r2 = {k: calibrate(source, target, calib, k=k, run=Run(plain=True))[1]["r2"] for k in (1, 2, 3, 4)}
    lines = [f"  k = {k}: mean R^2 K {r['k'].mean():.4f}, V {r['v'].mean():.4f}" for k, r in r2.items()]
    means = [r2[k][kind].mean().item() for kind in ("k", "v") for k in (1, 4)]
    return lines, [("R^2 at k = 4 (every layer) is at least R^2 at k = 1, for K and for V",
                    means[1] >= means[0] and means[3] >= means[2])]


def answer_4():
    """Exercise 4, vary lambda: toy-m -> toy-l, layer scope, k = 2, on 8, 40 and 200 calibration sequences."""
    source, target = toy_model("toy-m"), toy_model("toy-l")
    lams = {n: calibrate(source, target, toy_calibration(n), k=2, run=Run(plain=True))[1]["lambda"] for n in (8, 40, 200)}
    lines = [f"  {n:>3} sequences: lambda K {lam['k']}, V {lam['v']}" for n, lam in lams.items()]
    geo = {n: sum(math.log10(v) for kind in ("k", "v") for v in lam[kind]) for n, lam in lams.items()}
    return lines, [("the chosen lambdas (their geometric mean) move down from 8 to 200 sequences", geo[200] < geo[8])]


def answer_5():
    """Exercise 5, better selection: toy-l (4 layers) -> toy-m, head scope, k = 2: top-k by single-layer R^2
    against greedy forward selection (greedy_layers)."""
    source, target, calib = toy_model("toy-l"), toy_model("toy-m"), toy_calibration()
    runs = {name: calibration.calibrate(source, target, calib, scope="head", k=2,
                                        options=calibration.CalibrationOptions(progress=False, select=rule, plain=True))
            for name, rule in (("top-k", None), ("greedy", greedy_layers))}
    lines = [f"  {name:<6} layers K {m.layers['k'].tolist()}, V {m.layers['v'].tolist()}; R^2 K "
             + " ".join(f"{v:.4f}" for v in r["r2"]["k"].tolist()) + ", V " + " ".join(f"{v:.4f}" for v in r["r2"]["v"].tolist())
             for name, (m, r) in runs.items()]
    top, greedy = runs["top-k"][1]["r2"], runs["greedy"][1]["r2"]
    return lines, [("at k = 2 greedy's validation R^2 is at least top-k's on every target layer (both start from the "
                    "best single layer; greedy then picks the best partner)",
                    all(bool((greedy[kind] >= top[kind] - 1e-12).all()) for kind in ("k", "v")))]


ANSWERS = {1: answer_1, 2: answer_2, 3: answer_3, 4: answer_4, 5: answer_5}


def answers(numbers=None):
    """Print each exercise's answer (numbers and the checks that must hold); returns whether every check held."""
    ok = True
    for n in numbers or ANSWERS:
        fn = ANSWERS[n]
        lines, checks = fn()
        print(f"exercise {n}: {fn.__doc__.split(':')[0].split(', ', 1)[1]}")
        print("\n".join(lines))
        for what, holds in checks:
            print(f"  {'holds' if holds else 'FAILS'}: {what}")
            ok &= holds
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description="The tutorial's exercises' answers, recomputed (instructors); exit 1 if "
                                 "a check fails.")
    ap.add_argument("--exercise", type=int, action="append", choices=sorted(ANSWERS), help="only these (repeatable)")
    if not answers(ap.parse_args(argv).exercise):
        sys.exit(1)


if __name__ == "__main__":
    main()
