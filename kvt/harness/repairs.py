"""Every published repair side by side on one pair, judged first on what the target generates (kvt's option).

    python -m kvt.harness.repairs --source weights/toy-s --target weights/toy-m --out runs/repairs-toy-s-m

One calibration, then one mapper per fit (--fits):
    ridge      the paper's: layer scope, uniform token weights
    head       head-local (head h from head h), uniform token weights
    attention  head-local, attention-weighted (CacheBridge's, attnfit.py)
    whitened   head-local, attention-weighted, keys measured in the target's query metric (whiten.py)
and every condition on the same items (a paired comparison):
    target, source, floor   the target's own prefill; the source alone; the target without the context
    random map              a mapper of the first fit's shapes whose every weight tensor (per target layer) is
                            random at that fit's norm: what a map that carries no information gives (control)
    raw source              the source's cache given to the target unmapped (where both have the same layers
                            and KV shapes; else absent)
    FIT rule rho            the transfer with that fit, the target recomputing ceil(rho n) of the n mapped
                            slots chosen by the rule (kvt/harness/recompute.py; rho = 0: the plain transfer).
                            error is an oracle (it reads the target's true KV), for reference only.
Metrics, generation first: each generate_until task's primary metric (exact match); CoQA's F1 at the turns of
--coqa-turns, handed over at the story (start 1: the target then answers turns 1..10 from its own cache);
agreement: on --agree-prompts held-out prompts of --agree-context tokens (--agree-text, never calibration's), the
share of the first N = 32 greedy tokens the condition generates identically to the target's own prefill
before the first difference (the floor: the target from the prompt's last token alone); then the
multiple-choice tasks. Each cell: the mean with a 95% bootstrap interval over items, and beside it retention
(x / target), floor-normalized ((x - floor) / (target - floor)) and gap recovered ((x - source) /
(target - source)), each with a paired bootstrap 95% interval (summary.bootstrap). Writes report.md,
repairs.json (not run.py's results.json, which the gate figure reads) and budget-curves.png (matplotlib, when
installed) in --out.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

import kvt
from kvt.config import KvtError
from kvt.harness import evals, recompute, summary, tasks, toy
from kvt.harness.bench import hardware
from kvt.harness.calibration import CalibrationOptions, calibrate
from kvt.harness.data import calibration_sequences, check_same_tokenizer
from kvt.harness.figures import pyplot
from kvt.harness.report import write_atomic

FITS = {"ridge": ("layer", "uniform"), "head": ("head", "uniform"), "attention": ("head", "attention"),
        "whitened": ("head", "whitened")}
BUDGETS = (0.0, 0.1, 0.2, 0.3, 0.5)
AGREE_N = 32            # new tokens compared with the target's own
CONTROLS = ("target", "source", "floor", "random map", "raw source")


def random_map(mapper, seed=0):
    """A mapper of `mapper`'s shapes and layer selection whose W and b, per target layer, are Gaussian at the
    fitted ones' Frobenius norms (a ridge mapper; the control that carries no information)."""
    g = torch.Generator().manual_seed(seed)

    def rand(x):
        if not x.is_floating_point():
            return x
        r = torch.randn(x.shape, generator=g, dtype=torch.float64)
        dims = tuple(range(1, x.dim()))                                   # per target layer
        norm = lambda t: t.double().pow(2).sum(dims, keepdim=True).sqrt()  # noqa: E731
        return (r * norm(x) / norm(r)).to(x.dtype)
    return mapper.to()._with(rand)


def same_kv(src_cfg, tgt_cfg):
    """Whether the source's cache can go to the target unmapped: the same layers, KV heads, head dim and RoPE."""
    return all(getattr(src_cfg, f) == getattr(tgt_cfg, f) for f in ("n_layers", "n_kv_heads", "head_dim", "rope"))


def raw_source(source, target):
    """The prefill of the raw-source control: the source's cache of all but the last token, unmapped, then
    the target runs the last token on it."""
    @torch.no_grad()
    def prefill(ids, mask=None):
        _, cache = source(ids[:, :-1], mask=None if mask is None else mask[:, :-1], last=True)
        logits, cache = target(ids[:, -1:], cache=cache, mask=None if mask is None else mask[:, -1:])
        return logits[:, -1], cache
    return prefill


def conditions(source, target, mappers, budgets, rules, calib, r, seed=0):
    """{name: evals.Condition}: the controls, then every fit x rule x budget (budget 0 once per fit)."""
    out = evals.conditions(target, source)                                  # target, floor, source
    first = next(iter(mappers.values()))
    out["random map"] = evals.Condition(target, evals.transfer(source, target, random_map(first, seed)))
    if same_kv(source.config, target.config):
        out["raw source"] = evals.Condition(target, raw_source(source, target))
    for fit, m in mappers.items():
        out[f"{fit} rho=0"] = evals.Condition(target, evals.transfer(source, target, m))
        basis = recompute.rank_basis(source, m, recompute.rank_sequences(calib), r) if "rank" in rules else None
        for rule in rules:
            for rho in budgets:
                if rho:
                    b = recompute.Recompute(frac=rho, by=rule, seed=seed, basis=basis if rule == "rank" else None,
                                            target=target if rule == "error" else None)
                    out[f"{fit} {rule} rho={rho:g}"] = evals.Condition(target, evals.transfer(source, target, m, b))
    return out


@torch.no_grad()
def agreement(conds, prompts, n=AGREE_N):
    """{condition: [per prompt: the share of the first n greedy tokens equal to the target's own before the
    first difference]}; prompts (P, T). The floor reads only each prompt's last token."""
    gen = {}
    for name, cond in tqdm(conds.items(), desc="agreement", leave=False):
        outs = []
        for p in prompts:
            ids = p[None, -1:] if cond.floor else p[None]
            logits, cache = cond(ids)
            outs.append(cond.generate(logits, cache, n)[0])
        gen[name] = outs
    def prefix(a, b):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return k / n
    return {name: [prefix(o, t) for o, t in zip(outs, gen["target"])] for name, outs in gen.items()}


def task_scores(name, items, tok, conds, coqa_turns):
    """{column: {condition: [per item score]}} of one task: its primary metric, or CoQA's F1 per turn."""
    task = tasks.get(name)
    recs = list(evals.evaluate(name, items, tok, conds, progress=False, batch_size=8,
                               **({"start": 1} if task.kind == "coqa" else {})))
    cols = {}
    for rec in recs:
        if task.kind == "coqa":
            for t, f1 in zip(rec["turns"], rec["f1_turns"]):
                if t in coqa_turns:
                    cols.setdefault(f"coqa F1 turn {t}", {}).setdefault(rec["condition"], []).append(f1)
        else:
            cols.setdefault(f"{name} {task.primary}", {}).setdefault(rec["condition"], []).append(rec[task.primary])
    return cols


def cell(per_cond, name, n_boot=1000):
    """The numbers of one condition in one column: mean, its interval, and retention, floor-normalized and gap
    recovered with paired intervals (None where a reference is missing or a ratio undefined)."""
    x = per_cond[name]
    row = {"n": len(x), "mean": sum(x) / len(x), "mean_ci": summary.bootstrap(torch.mean, [x], n_boot)}
    ref = {"retention": ("target", None), "floor_normalized": ("target", "floor"), "gap_recovered": ("target", "source")}
    for key, (top, base) in ref.items():
        if top not in per_cond or (base and base not in per_cond):
            row[key], row[key + "_ci"] = None, (None, None)
            continue
        cols = [x, per_cond[top]] + ([per_cond[base]] if base else [])

        def ratio(*c):
            lo = c[2].mean() if len(c) > 2 else 0.0
            den = c[1].mean() - lo
            return None if abs(float(den)) < 1e-12 else float((c[0].mean() - lo) / den)
        row[key] = ratio(*(torch.tensor(c, dtype=torch.float64) for c in cols))
        row[key + "_ci"] = summary.bootstrap(ratio, cols, n_boot)
    return row


def pct(v, ci=None):
    if v is None:
        return "n/a"
    s = f"{100 * v:.1f}"
    return s if ci is None or ci[0] is None else f"{s} [{100 * ci[0]:.0f}, {100 * ci[1]:.0f}]"


def table(results, column):
    """One column's markdown table: a row per condition."""
    lines = [f"**{column}** (items: {results[column]['target']['n']})", "",
             "| condition | score | retention | floor-normalized | gap recovered |", "|---|---|---|---|---|"]
    for name, row in results[column].items():
        label = name + (" (oracle)" if " error " in f" {name} " else "")
        lines.append(f"| {label} | {pct(row['mean'], row['mean_ci'])} | {pct(row['retention'], row['retention_ci'])} | "
                     f"{pct(row['floor_normalized'], row['floor_normalized_ci'])} | "
                     f"{pct(row['gap_recovered'], row['gap_recovered_ci'])} |")
    return "\n".join(lines)


def side_by_side(results, fits, rules, budgets):
    """The side-by-side table, generation first: a row per metric x fit x rule, a column per budget rho, each
    cell the score (%) with its 95% interval; the controls in the rows after each metric's (at rho = 0)."""
    nonzero = [b for b in budgets if b]
    lines = ["| metric | fit | rule | " + " | ".join(f"rho={b:g}" for b in [0.0] + nonzero) + " |",
             "|" + "---|" * (4 + len(nonzero))]
    for col, res in results.items():
        show = lambda n: pct(res[n]["mean"], res[n]["mean_ci"]) if n in res else "-"  # noqa: E731
        for fit in fits:
            for rule in rules or [None]:
                cells = [show(f"{fit} rho=0")] + [show(f"{fit} {rule} rho={b:g}") if rule else "" for b in nonzero]
                label = (rule or "-") + (" (oracle)" if rule == "error" else "")
                lines.append(f"| {col} | {fit} | {label} | " + " | ".join(cells) + " |")
        for ctl in CONTROLS:
            if ctl in res:
                lines.append(f"| {col} | {ctl} | | {show(ctl)} |" + " |" * len(nonzero))
    return "\n".join(lines)


def figure(results, fits, rules, budgets, path):
    """Budget curves: per fit, each rule's score against rho on every column (one panel per column)."""
    plt = pyplot()
    if plt is None:
        return None
    cols = list(results)
    fig, axes = plt.subplots(len(fits), len(cols), figsize=(3.2 * len(cols), 2.6 * len(fits)), squeeze=False)
    for i, fit in enumerate(fits):
        for j, col in enumerate(cols):
            ax, res = axes[i][j], results[col]
            for rule in rules:
                names = [f"{fit} rho=0"] + [f"{fit} {rule} rho={b:g}" for b in budgets if b]
                xs = [0.0] + [b for b in budgets if b]
                ax.plot(xs, [100 * res[n]["mean"] for n in names], marker="o", label=rule + (" (oracle)" * (rule == "error")))
            for ctl, style in (("target", "k-"), ("source", "k:"), ("random map", "r--")):
                if ctl in res:
                    ax.axhline(100 * res[ctl]["mean"], color=style[0], ls=style[1:], lw=0.8)
            ax.set_title(f"{fit}: {col}", fontsize=8)
            ax.set_xlabel("rho (recomputed share)", fontsize=7)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kvt.harness.repairs", description=__doc__.split("\n")[0])
    ap.add_argument("--source", type=Path, required=True)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--calib", nargs="*", help="calibration text (default: the toy corpus, seed 99)")
    ap.add_argument("--calib-seqs", type=int, default=200)
    ap.add_argument("--calib-len", type=int, default=256)
    ap.add_argument("--fits", default="ridge,attention,whitened")
    ap.add_argument("--k", type=int, default=8, help="source layers per target layer (paper: 8)")
    ap.add_argument("--candidates", type=int, default=None, help="source layers to select from (default all)")
    ap.add_argument("--rules", default=",".join(recompute.RULES))
    ap.add_argument("--budgets", default=",".join(f"{b:g}" for b in BUDGETS))
    ap.add_argument("--rank", type=int, default=recompute.RANK, help="rank's r (RaReCache: 128)")
    ap.add_argument("--gen-tasks", default="toy_recall_gen,toy_copy", help="generate_until and coqa tasks")
    ap.add_argument("--ll-tasks", default="toy_recall,toy_count", help="loglikelihood tasks, after them")
    ap.add_argument("--limit", type=int, default=60, help="items per task")
    ap.add_argument("--coqa-turns", default="1,3,6,10")
    ap.add_argument("--agree-prompts", type=int, default=24)
    ap.add_argument("--agree-context", type=int, default=128)
    ap.add_argument("--agree-text", nargs="*", help="held-out text for the agreement prompts (default: the toy "
                    "corpus, seed 7, unseen by calibration's seed 99 and training's 0)")
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tables", type=Path, help="print the tables of a finished run's repairs.json and stop")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--tables" in argv:                                                 # no model needed
        done = json.loads(Path(argv[argv.index("--tables") + 1]).read_text())
        res = done["results"]
        print(side_by_side(res, done["fits"], done["rules"], done["budgets"]) + "\n\n"
              + "\n\n".join(table(res, col) for col in res))
        return res
    a = ap.parse_args(argv)
    fits, rules = a.fits.split(","), [r for r in a.rules.split(",") if r and r != "none"]
    budgets = [float(b) for b in a.budgets.split(",")]
    if set(fits) - set(FITS) or set(rules) - set(recompute.RULES) or not all(0 <= b <= 1 for b in budgets):
        raise KvtError(f"--fits of {', '.join(FITS)}; --rules of {', '.join(recompute.RULES)}; --budgets within [0, 1]")
    torch.manual_seed(a.seed)
    source, target, tok = kvt.load_model(a.source), kvt.load_model(a.target), kvt.load_tokenizer(a.target)
    check_same_tokenizer(kvt.load_tokenizer(a.source), tok)
    docs = None if a.calib else toy.corpus(2000, seed=99)
    calib = calibration_sequences(a.calib, tok, a.calib_seqs, a.calib_len, seed=a.seed, documents=docs)
    mappers = {}
    for fit in tqdm(fits, desc="fits"):
        scope, weights = FITS[fit]
        opts = CalibrationOptions(progress=False, weights=weights, candidates=a.candidates)
        mappers[fit], _ = calibrate(source, target, calib, scope, a.k, options=opts)
    conds = conditions(source, target, mappers, budgets, rules, calib, a.rank, a.seed)
    scores = {}
    data_dir = a.data_dir or tasks.default_data_dir()
    turns = {int(t) for t in a.coqa_turns.split(",")}
    for name in [t for t in a.gen_tasks.split(",") if t and t != "none"]:
        scores.update(task_scores(name, tasks.load_task(name, data_dir, a.limit, seed=a.seed), tok, conds, turns))
    held = calibration_sequences(a.agree_text, tok, a.agree_prompts, a.agree_context, seed=a.seed + 1,
                                 documents=None if a.agree_text else toy.corpus(500, seed=7))
    prompts = held.fit                                                     # text no fit saw (other file or seed)
    scores[f"agreement@{AGREE_N}"] = agreement(conds, prompts)
    for name in [t for t in a.ll_tasks.split(",") if t and t != "none"]:
        scores.update(task_scores(name, tasks.load_task(name, data_dir, a.limit, seed=a.seed), tok, conds, turns))
    results = {col: {name: cell(per, name) for name in conds if name in per} for col, per in scores.items()}
    a.out.mkdir(parents=True, exist_ok=True)
    hw = hardware()
    head = (f"# Repairs side by side: {a.source.name} -> {a.target.name}\n\n"
            f"Command: `python -m kvt.harness.repairs {' '.join(argv or [])}`\n\n"
            f"Calibration {a.calib_seqs} x {a.calib_len} tokens ({', '.join(map(str, a.calib or ['toy corpus, seed 99']))}); "
            f"fits {', '.join(fits)} (k = {a.k}); rules {', '.join(rules) or 'none'} (error: an oracle); budgets {', '.join(map(str, budgets))}; "
            f"rank r = {a.rank}; agreement on {len(prompts)} held-out prompts of {prompts.shape[1]} tokens; "
            f"{a.limit} items per task; 95% bootstrap intervals over items (1,000 resamples). Hardware: {hw}.\n")
    text = (head + "\n" + side_by_side(results, fits, rules, budgets) + "\n\n"
            + "\n\n".join(table(results, col) for col in results) + "\n")
    write_atomic(a.out / "report.md", text)
    write_atomic(a.out / "repairs.json", json.dumps({"argv": argv, "hardware": hw, "fits": fits, "rules": rules,
                                                     "budgets": budgets, "results": results}, indent=1))
    png = figure(results, fits, rules, budgets, a.out / "budget-curves.png")
    print(text)
    print(f"wrote {a.out / 'report.md'}, repairs.json" + (f", {png.name}" if png else ""))
    return results


if __name__ == "__main__":
    from kvt.config import command
    command(main)  # an error is one line
