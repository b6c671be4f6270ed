"""Figures: the source-layer x target-layer R^2 map and the layers selection chose, in a terminal or a PNG.

Calibration's first pass (kvt/calibrate.py) fits every target layer from every single source layer and
keeps the held-out R^2 of each fit: an (Ls, Lt) map, report["r2_single"][kind]. Selection then takes
the k best rows of each column. heatmap() draws that map with unicode shades (one row per source layer,
one column per target layer, `*` on the chosen cells); save_png() draws it with matplotlib when that
is installed (it is never required).

    python -m kvt.harness.figures r2                                   # the toy pair toy-s -> toy-m, in weights/
    python -m kvt.harness.figures r2 --pair qwen3-0.6b:1.7b --calib ../shared/data/calib/wikitext-2 --png r2.png
"""
import argparse
from pathlib import Path

import torch

SHADES = " ░▒▓█"  # R^2 < 0.2, < 0.4, < 0.6, < 0.8, >= 0.8 (below 0: blank)
RESULTS = ("a results.json of a finished kvt run", ("pair", "settings", "diagnostics", "tasks", "average_retention"))
BENCH = ("a kvt bench --json file", ("pair", "scope", "dtype", "hardware", "rows"))


def read_json(path, what):
    """The JSON object in `path`, refused in one line unless it holds what = (its description, its keys)."""
    import json

    from kvt.config import KvtError
    name, keys = what
    try:
        obj = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise KvtError(f"{path}: no such file; give {name}") from None
    except (OSError, ValueError) as e:  # a folder, not UTF-8, not JSON (a records .jsonl)
        raise KvtError(f"{path} is not {name} ({type(e).__name__}); give {name}") from None
    lacks = [k for k in keys if k not in obj] if isinstance(obj, dict) else ["a JSON object"]
    if lacks:
        raise KvtError(f"{path} is not {name} (it lacks {', '.join(lacks)}); give {name}")
    return obj


def pyplot(say=False):
    """matplotlib.pyplot with a file-only backend, or None when matplotlib is not installed (an optional
    extra: pip install kvt[plots]); say: print that the table printed instead has the numbers."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if say:
            print("matplotlib is not installed (pip install kvt[plots]), so no PNG; the table above has the numbers")
        return None
    return plt


def shade(r2):
    """The shade of one R^2 value on a fixed [0, 1] scale, so maps of different pairs compare."""
    return SHADES[min(len(SHADES) - 1, max(0, int(r2 * len(SHADES))))]


def heatmap(r2, src_layers=None, selected=None, values=False, title=None):
    """A text heatmap of r2 (Ls, Lt): rows are source layers (src_layers, default 0..Ls-1), columns
    target layers; selected (Lt, k) source layer numbers per target layer are marked `*`.
    values=True writes each R^2 as a number instead of a shade (readable for small maps)."""
    r2 = torch.as_tensor(r2, dtype=torch.float64)
    Ls, Lt = r2.shape
    src_layers = list(range(Ls)) if src_layers is None else list(src_layers)
    chosen = set()
    if selected is not None:
        chosen = {(src, t) for t, row in enumerate(torch.as_tensor(selected).tolist()) for src in row}
    width = 6 if values else (3 if Lt <= 32 else 2)        # cell: " 0.93*" | 3 or 2 shades, the last one `*` if chosen
    w = max(len(str(max(src_layers))), 3)                  # the source-layer column

    def cell(v, mark):
        if values:
            return f"{v:5.2f}{mark}"
        return shade(v) * (width - 1) + (mark if mark != " " else shade(v))

    step = 1 if width > len(str(Lt - 1)) else 5               # column labels every `step` target layers
    header = "".join(f"{t:<{width * step}d}" for t in range(0, Lt, step))
    lines = [title] if title else []
    lines.append(f"{'src':>{w}}  {header.rstrip()}   <- target layer")
    for i, src in enumerate(src_layers):
        row = "".join(cell(r2[i, t].item(), "*" if (src, t) in chosen else " ") for t in range(Lt))
        lines.append(f"{src:>{w}}  {row.rstrip()}")
    if not values:
        levels = "  ".join(f"'{s}' {i / len(SHADES):.1f}+" for i, s in enumerate(SHADES) if i)
        lines.append(f"shades: ' ' below 0.2  {levels}"
                     + ("   * selected" if selected is not None else ""))
    return "\n".join(lines)


def save_png(r2, path, src_layers=None, selected=None, title=""):
    """The map as a PNG (matplotlib). Returns False, writing nothing, when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return False
    r2 = torch.as_tensor(r2, dtype=torch.float64)
    Ls, Lt = r2.shape
    src_layers = list(range(Ls)) if src_layers is None else list(src_layers)
    fig, ax = plt.subplots(figsize=(max(4.5, 1.5 + 0.22 * Lt), max(3.0, 1.2 + 0.22 * Ls)))
    im = ax.imshow(r2.clamp(0, 1).numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1)  # row 0 on top, as heatmap()
    if selected is not None:
        row = {src: i for i, src in enumerate(src_layers)}
        ts, ss = zip(*[(t, row[s]) for t, sel in enumerate(torch.as_tensor(selected).tolist()) for s in sel])
        ax.scatter(ts, ss, marker="o", facecolors="none", edgecolors="red", s=30)
        title = (title + " (circles: selected)").strip()
    ax.set_xlabel("target layer")
    ax.set_ylabel("source layer")
    ax.set_yticks(range(Ls), [str(s) for s in src_layers], fontsize=7 if Ls <= 40 else 5)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="held-out R^2")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return True


def retention_png(summary, primary, path, title=""):
    """A run's accuracy per task (its primary metric, primary[task]) under each condition, with 95%
    intervals, as a PNG: summary is summary.summarize()'s output. Returns False, writing nothing, when
    matplotlib is not installed (pip install kvt[plots]); report.md has the same numbers as a table."""
    plt = pyplot()
    if plt is None:
        return False
    conds = ["target", "transfer", "source", "floor"]
    tasks = [t for t in summary if any(c in summary[t] for c in conds)]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(tasks) + 1.5), 3.6))
    width = 0.8 / len(conds)
    for i, c in enumerate(conds):
        rows = [summary[t].get(c) for t in tasks]
        m = primary
        value = [100 * (r[m[t]] or 0) if r else 0 for r, t in zip(rows, tasks)]
        ci = [r[m[t] + "_ci"] if r else (None, None) for r, t in zip(rows, tasks)]   # None: no interval
        lo = [max(0.0, v - 100 * a) if a is not None else 0 for v, (a, _) in zip(value, ci)]   # >= 0: an interval
        hi = [max(0.0, 100 * b - v) if b is not None else 0 for v, (_, b) in zip(value, ci)]   # may round past it
        ax.bar([x + (i - 1.5) * width for x in range(len(tasks))], value, width, yerr=[lo, hi], capsize=2, label=c)
    ax.set_xticks(range(len(tasks)), [f"{t}\n({primary[t]})" for t in tasks], fontsize=8)
    ax.set_ylabel("accuracy (%), 95% interval")
    ax.set_ylim(0, 118)                                                # room for the legend above 100%
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=4, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return True


def scaling_figure(paths, png=None):
    """Times of the target's prefill and of the transfer against context length, from `kvt bench --json`
    files, on log-log axes, beside the FLOP model: each side's FLOPs at one rate (FLOP/s), the median of
    its measured points. Prints the table; draws the PNG when matplotlib is installed."""
    import statistics
    runs = [read_json(p, BENCH) for p in paths]
    series = {}  # (direction, side) -> [(tokens, seconds, flops)]
    for run in runs:
        for r in run["rows"]:
            for side in ("target_prefill", "transfer"):
                flops = r["prefill_flops" if side == "target_prefill" else "transfer_flops"]
                series.setdefault((r["direction"], side), []).append((r["tokens"], r[side + "_s"], flops))
    print(f"{runs[0]['pair']}, {runs[0]['scope']} scope, {runs[0]['dtype']}; {runs[0]['hardware']}")
    print(f"{'direction':<28} {'side':<15} {'rate GFLOP/s':>12}   tokens: seconds")
    rates = {}
    for (direction, side), points in sorted(series.items()):
        points.sort()
        rates[direction, side] = statistics.median(f / t for _, t, f in points)
        times = "  ".join(f"{n}: {t:.3f}" for n, t, _ in points)
        print(f"{direction:<28} {side:<15} {rates[direction, side] / 1e9:12.1f}   {times}")
    if not png:
        return
    plt = pyplot(say=True)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for (direction, side), points in sorted(series.items()):
        n, t, f = zip(*points)
        line = ax.plot(n, t, "o", label=f"{direction}: {side.replace('_', ' ')}")[0]
        ax.plot(n, [x / rates[direction, side] for x in f], "-", color=line.get_color(), alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"{runs[0]['pair']}, {runs[0]['scope']} scope, {runs[0]['dtype']}: points measured, lines = FLOPs / "
                 "one rate", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=150)
    print(f"wrote {png}")


def correlations(xs, ys):
    """(Pearson r, Spearman rho) of two equal-length lists."""
    x, y = torch.tensor(xs, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)
    def pearson(a, b):
        a, b = a - a.mean(), b - b.mean()
        return (a @ b / (a.norm() * b.norm())).item()
    rank = lambda t: t.argsort().argsort().double()  # noqa: E731 (ties broken by order; fine for real-valued data)
    return pearson(x, y), pearson(rank(x), rank(y))


def one_per_map(results):
    """The runs a gate is judged on: none with a recompute budget (the gate judges the map, not its
    repair), and one per mapper (results' "mapper", which names its weights and calibration), the one
    that scored the most items, so a map evaluated twice is not counted twice."""
    from kvt.harness.recompute import Recompute
    best = {}
    for r in results:
        s = r["settings"]
        if Recompute(s.get("recompute_last", 0), s.get("recompute_first", 0), s.get("recompute_frac", 0.0)):
            continue
        key, n = r.get("mapper", id(r)), sum(len(v) for v in r.get("items", {}).values())
        if key not in best or n > best[key][0]:
            best[key] = (n, r)
    return [r for _, r in best.values()]


def gate_evidence(results, good_at=0.9):
    """From run.py results (dicts of results.json), how well each diagnostic predicts average retention,
    and how often a gate fitted on the other pairs calls a left-out pair right (retention >= good_at).
    Only one_per_map(results) count. Returns (rows, correlations {diagnostic: (r, rho)}, thresholds fitted
    on all, leave-one-out agreements)."""
    from kvt.harness.diagnose import fit_gate, gate
    results = one_per_map(results)
    rows = [{"pair": r.get("run", "") + " -> ".join(r["pair"]) + f" ({r['settings']['scope']}, {r['settings']['mapper']})",
             "r2": (r["diagnostics"]["r2_k_mean"] + r["diagnostics"]["r2_v_mean"]) / 2,
             "attn_cos": r["diagnostics"]["attn_cos_mean"], "kl": r["diagnostics"]["kl"],
             "retention": r["average_retention"]["retention"], "diag": r["diagnostics"]}
            for r in results if r["average_retention"].get("retention") is not None]
    ret = [row["retention"] for row in rows]
    corr = {name: correlations([row[name] for row in rows], ret) for name in ("r2", "attn_cos", "kl")}
    good = [x >= good_at for x in ret]
    diags = [row["diag"] for row in rows]
    thresholds = fit_gate(diags, good)
    loo = 0
    for i in range(len(rows)):
        c, k, _ = fit_gate(diags[:i] + diags[i + 1:], good[:i] + good[i + 1:])
        loo += gate(diags[i], c, k)[0] == good[i]
    return rows, corr, thresholds, loo


def gate_figure(paths, png=None):
    """Print gate_evidence over run.py results (and draw retention against each diagnostic as a PNG)."""
    results = [{**read_json(p, RESULTS), "run": f"{Path(p).parent.name}: "} for p in paths]
    rows, corr, (c, k, agree), loo = gate_evidence(results)
    print(f"{'run: pair':<58} {'mean R^2':>8} {'attn cos':>8} {'KL nats':>8} {'retention':>9}")
    for r in sorted(rows, key=lambda r: -r["retention"]):
        print(f"{r['pair']:<58} {r['r2']:8.3f} {r['attn_cos']:8.3f} {r['kl']:8.4f} {100 * r['retention']:8.1f}%")
    print(f"\n{len(rows)} runs; correlation with average retention (Pearson r, Spearman rho):")
    for name, (r, rho) in corr.items():
        print(f"  {name:<9} r = {r:+.2f}  rho = {rho:+.2f}")
    print(f"gate fitted on all runs (retention >= 90% is 'fit'): --min-attn-cos {c} --max-kl {k}, right on "
          f"{agree} of {len(rows)}; fitted on all but one, right on the left-out run {loo} of {len(rows)} times")
    if png:
        plt = pyplot(say=True)
        if plt is None:
            return
        fig, axes = plt.subplots(1, 3, figsize=(11, 3.4), sharey=True)
        for ax, (name, label) in zip(axes, [("r2", "mean R^2"), ("attn_cos", "attention-output cosine"),
                                            ("kl", "next-token KL (nats)")]):
            ax.scatter([r[name] for r in rows], [100 * r["retention"] for r in rows], s=18)
            ax.set_xlabel(label)
            ax.set_title(f"r = {corr[name][0]:+.2f}, rho = {corr[name][1]:+.2f}", fontsize=9)
        axes[0].set_ylabel("average retention (%)")
        fig.tight_layout()
        fig.savefig(png, dpi=150)
        print(f"wrote {png}")


def recompute_rows(results):
    """From run.py results of one pair at several recompute budgets: rows of (strategy, budget fraction,
    average retention, {task: retention of its primary metric}), sorted by strategy, then budget."""
    rows = []
    for r in results:
        st, avg = r["settings"], r["average_retention"]
        frac = st.get("recompute_frac") or 0.0
        by = st.get("recompute_by") or "attention"
        tasks = {t: r["tasks"][t]["retention"][m]["ratio"] for t, m in avg["metric"].items()}
        for strategy in ([by] if frac else ["attention", "suffix"]):  # budget 0 starts both curves
            rows.append((strategy, frac, avg["retention"], tasks))
    return sorted(rows, key=lambda row: (row[0], row[1]))


def recompute_figure(paths, png=None):
    """Print retention against the recompute budget over run.py results (and draw it as a PNG)."""
    rows = recompute_rows([read_json(p, RESULTS) for p in paths])
    tasks = list(rows[0][3])
    print(f"{'tokens chosen by':<17} {'budget':>6} {'average':>8} " + " ".join(f"{t:>14}" for t in tasks))
    for by, frac, avg, per in rows:
        print(f"{by:<17} {100 * frac:5.0f}% {100 * avg:7.1f}% " + " ".join(f"{100 * per[t]:13.1f}%" for t in tasks))
    if png:
        plt = pyplot(say=True)
        if plt is None:
            return
        fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(3 * (len(tasks) + 1), 3.2), sharey=True)
        for ax, name in zip(axes, ["average"] + tasks):
            for by in sorted({row[0] for row in rows}):
                xs = [100 * row[1] for row in rows if row[0] == by]
                ys = [100 * (row[2] if name == "average" else row[3][name]) for row in rows if row[0] == by]
                ax.plot(xs, ys, marker="o", label=by)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("recomputed prompt tokens (%)")
        axes[0].set_ylabel("retention (%)")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(png, dpi=150)
        print(f"wrote {png}")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kvt figures", description="Draw the source x target layer R^2 map of a pair "
                                 "and the layers calibration selects (terminal shades; --png with matplotlib).")
    ap.add_argument("figure", choices=["r2", "gate", "scaling", "recompute"], help="r2: a pair's layer map; gate: "
                    "diagnostics vs retention over finished runs (their results.json files); scaling: prefill and "
                    "transfer time against context length (files of kvt bench --json); recompute: retention "
                    "against the recompute budget (results.json of one pair's runs at several budgets)")
    ap.add_argument("results", nargs="*", type=Path, help="gate, recompute: results.json files; scaling: bench JSON files")
    ap.add_argument("--pair", default="toy-s:m", help="FAMILY-SRC:TGT, read from WEIGHTS/<name>")
    ap.add_argument("--weights", type=Path, help="folder of checkpoint folders (default: ./weights, then the toy "
                    "family kvt ships)")
    ap.add_argument("--calib", nargs="*", help="calibration text files or folders (default: the toy corpus for toy "
                    "pairs; required otherwise, e.g. ../shared/data/calib/wikitext-2)")
    ap.add_argument("--calib-seqs", type=int, default=40, help="calibration sequences")
    ap.add_argument("--calib-len", type=int, default=256, help="tokens per calibration sequence")
    ap.add_argument("--k", type=int, default=8, help="source layers per target layer the selection marks")
    ap.add_argument("--lam", type=float, help="ridge lambda (default: the best per target layer on validation data)")
    ap.add_argument("--kind", choices=["k", "v"], nargs="+", default=["k", "v"])
    ap.add_argument("--values", action="store_true", help="print R^2 numbers instead of shades")
    ap.add_argument("--png", help="also write the map(s) to this PNG (one file per kind: NAME-k.png, NAME-v.png)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    from kvt.config import KvtError, at_least
    if args.figure != "r2" and not args.results:
        raise KvtError(f"figures {args.figure} reads files: give "
                       f"{'kvt bench --json files' if args.figure == 'scaling' else 'results.json files of finished runs'}")
    if args.figure == "gate":
        return gate_figure(args.results, args.png)
    if args.figure == "scaling":
        return scaling_figure(args.results, args.png)
    if args.figure == "recompute":
        return recompute_figure(args.results, args.png)

    import kvt
    from kvt.config import find_weights, matched_kv, parse_pair
    from kvt.harness.data import check_same_tokenizer
    from kvt.calibrate import calibrate

    at_least("k", args.k)
    at_least("calib-seqs", args.calib_seqs)
    at_least("calib-len", args.calib_len, 2)
    src_name, tgt_name = parse_pair(args.pair)
    src_dir, tgt_dir = find_weights(src_name, args.weights), find_weights(tgt_name, args.weights)
    src_cfg = kvt.load_config(src_dir)  # a missing folder fails here with the download command
    kvt.load_config(tgt_dir)
    tok = kvt.load_tokenizer(tgt_dir)
    check_same_tokenizer(kvt.load_tokenizer(src_dir), tok)
    calib = r2_calibration(args, src_name, tok)
    source = kvt.load_model(src_dir, device=args.device)
    target = kvt.load_model(tgt_dir, device=args.device)
    matched = matched_kv(src_cfg, target.config)
    mapper, report = calibrate(source, target, calib, "head" if matched else "layer", k=args.k, lam=args.lam)
    show_r2(args, (src_name, tgt_name), mapper, report)


def r2_calibration(args, src_name, tok):
    """kvt figures r2's calibration sequences: --calib, else for a toy pair toy documents the family was not
    trained on (seed 0; run.py takes the same)."""
    from kvt.config import KvtError
    from kvt.harness import toy
    from kvt.harness.data import calibration_sequences
    if args.calib:
        return calibration_sequences(args.calib, tok, args.calib_seqs, args.calib_len)
    if src_name.startswith("toy-"):
        return calibration_sequences(None, tok, args.calib_seqs, args.calib_len, documents=toy.corpus(2000, seed=99))
    raise KvtError(f"{src_name} is not a toy model: pass calibration text with --calib, "
                   "e.g. ../shared/data/calib/wikitext-2")


def show_r2(args, names, mapper, report):
    """The layer maps of each --kind, with the selected layers starred, printed (and drawn with --png)."""
    src_name, tgt_name = names
    src_layers = list(range(mapper.src_cfg.n_layers))
    print(f"{src_name} -> {tgt_name}: validation R^2 of each target layer fitted from one source layer "
          f"({args.calib_seqs} x {args.calib_len} calibration tokens, lambda "
          f"{args.lam if args.lam else 'the best of ridge.LAMBDAS per pair of layers'}); "
          f"* = the k={mapper.meta['k']} layers selection keeps")
    for kind in args.kind:
        r2, sel = report["r2_single"][kind], mapper.layers[kind]
        print()
        title = f"{'keys' if kind == 'k' else 'values'} ({kind.upper()})"
        print(heatmap(r2, src_layers, sel, values=args.values, title=title))
        final = " ".join(f"{v:.2f}" for v in report["r2"][kind].tolist())
        print(f"R^2 per target layer from its k selected layers together: {final}")
        if args.png:
            path = Path(args.png)
            path = path.with_name(f"{path.stem}-{kind}{path.suffix or '.png'}")
            if not save_png(r2, path, src_layers, sel, f"{src_name} -> {tgt_name}, {kind.upper()}"):
                print("\nmatplotlib is not installed, so no PNG (pip install matplotlib); the map above shows the same")
                args.png = None
            else:
                print(f"wrote {path}")


if __name__ == "__main__":
    from kvt.config import command
    command(main)  # as `kvt figures`: an error is one line
