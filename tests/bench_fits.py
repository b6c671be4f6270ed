"""The three closed-form fits side by side on the same pairs (issue 39), one `kvt run` process per pair and fit:

    paper     --scope layer                             the paper's ridge (kvt's default)
    head      --scope head                              head-local ridge (CacheBridge's head-local map)
    head-attn --scope head --token-weights attention    head-local attention-weighted ridge

    python -m tests.bench_fits run --pairs toy-s:m,toy-m:s --out runs/fits -- --heldout toy --no-bench
    python -m tests.bench_fits table runs/fits            # the markdown table of docs/real-weights.md

Each run writes OUT/<src>_<tgt>-<fit>/results.json (skipped when it exists); `table` reads them all.
Pairs are checkpoint folder names under --weights (run.py --source/--target), e.g. SmolLM2 siblings.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

from kvt.config import parse_pair

FITS = {"paper": ["--scope", "layer"], "head": ["--scope", "head"],
        "head-attn": ["--scope", "head", "--token-weights", "attention"]}


def run(pairs, out, fits, weights, extra):
    for pair in pairs:
        src, tgt = parse_pair(pair)
        for fit in fits:
            folder = out / f"{src}_{tgt}-{fit}"
            if (folder / "results.json").exists():
                print(f"{folder}: done")
                continue
            cmd = [sys.executable, "run.py", "--source", str(weights / src), "--target", str(weights / tgt),
                   "--out", str(folder), *FITS[fit], *extra]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=False)


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}"


def table(out):
    lines = ["| pair | fit | context gain kept (text, context: % [95%]) | attn cos | KL | gate | floor-norm. retention "
             "(avg, %) | mapper MiB | fit s |", "|---|---|---|---|---|---|---|---|---|"]
    for f in sorted(out.glob("*/results.json")):
        r = json.loads(f.read_text())
        pair, fit = f.parent.name.rsplit("-", 1) if not f.parent.name.endswith("head-attn") else \
            (f.parent.name[:-len("-head-attn")], "head-attn")
        gains = "; ".join(f"{g['text']} {g['context']}: " + ("no ratio" if g.get("no_ratio") else
                                                             f"{pct(g['gain'])} [{pct(g['gain_ci'][0])}, {pct(g['gain_ci'][1])}]")
                          for g in r.get("context_gain", []))
        avg = r.get("average_retention") or {}
        fn = avg.get("floor_normalized")
        ci = avg.get("floor_normalized_ci") or (None, None)
        ret = f"{pct(fn)} [{pct(ci[0])}, {pct(ci[1])}]" if fn is not None else "-"
        d = r["diagnostics"]
        lines.append(f"| {pair.replace('_', ' -> ')} | {fit} | {gains or '-'} | {d['attn_cos_mean']:.3f} | {d['kl']:.3f} | "
                     f"{'fit' if r['gate']['fit'] else 'UNFIT'} | {ret} | {r['mapper_bytes'] / 2**20:.2f} | "
                     f"{r['fit_s']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["run", "table"])
    ap.add_argument("out", nargs="?", type=Path, default=Path("runs/fits"))
    ap.add_argument("--out", dest="out_opt", type=Path)
    ap.add_argument("--pairs", default="toy-s:m")
    ap.add_argument("--fits", default=",".join(FITS))
    ap.add_argument("--weights", type=Path, default=Path("weights"))
    args = ap.parse_args(argv)
    out = args.out_opt or args.out
    if args.what == "run":
        run(args.pairs.split(","), out, args.fits.split(","), args.weights, extra)
    print(table(out))


if __name__ == "__main__":
    main()
