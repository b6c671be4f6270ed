"""The report of a run: OUT/report.md (what ran, the diagnostics and gate, the accuracy table with retention,
context gain, CoQA per turn, the bench), OUT/results.json (the same numbers, lm-evaluation-harness's layout per
condition under "lm_eval", the versions and hardware behind them), and the tables on stdout.

    results = report(s, Outcome(...))     # pipeline.run's last step
"""
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import time
from pathlib import Path

import torch

import kvt
from kvt import fast
from kvt.config import KvtError
from kvt.harness import tasks
from kvt.harness.bench import format_rows, hardware
from kvt.harness.diagnose import format_diagnostics
from kvt.harness.figures import retention_png
from kvt.harness.recompute import RULE_WORDS
from kvt.harness.summary import CORPUS, average_retention, lm_eval_results, summarize

@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a run made and measured, for report: the pair's names, the output folder, the mapper and its
    name, the calibration sequences, the check (diagnostics, gate fit, its reasons), the items and their
    records, CoQA per direction, context gains, the bench rows, and how it ran (dtype, device, evaluation
    batch, the start time)."""
    names: tuple
    out: Path
    mapper: object
    name: str
    calib: object
    check: tuple
    items: dict
    records: list
    coqa: dict
    gains: list
    rows: list
    dtype: torch.dtype
    device: str
    batch: int
    t0: float


ACCURACY = "## Accuracy (%, 95% interval) and retention"


def report(s, o):
    """OUT/report.md, OUT/results.json, and the tables on stdout (from the accuracy table on). Returns the
    results dict."""
    summary, average = summarize(o.records), average_retention(o.records)
    lines = [*header_lines(s, o), "", *diagnostics_section(o.check), "", *accuracy_section(summary, average, o),
             *gain_section(o.gains), *coqa_section(o.coqa), *speed_section(o.rows, o.device, o.dtype),
             "", f"wall time {time.time() - o.t0:.0f} s"]
    write_atomic(o.out / "report.md", "\n".join(lines) + "\n")
    results = results_of(s, o, summary, average)
    write_atomic(o.out / "results.json", json.dumps(strict(results), indent=1, allow_nan=False))
    print("\n" + "\n".join(lines[lines.index(ACCURACY):]))
    print(f"\nwrote {o.out / 'report.md'} and {o.out / 'results.json'}")
    return results


def header_lines(s, o):
    """report.md's title and what ran: the mapper, its lambdas, any recompute, the items."""
    (src_name, tgt_name), mapper, calib, recompute = o.names, o.mapper, o.calib, s.recompute
    k = mapper.meta.get("k", s.k)
    return [f"# kvt: {src_name} -> {tgt_name}", "",
            f"mapper: {o.name}, {s.mapper}, {s.scope} scope, {s.token_weights} weights, k={k}"
            + (f" (of {s.k} asked; the source has {mapper.src_cfg.n_layers} layers)" if k != s.k else "")
            + f", {mapper.n_params():,} parameters ({mapper.nbytes() / 2**20:.1f} MiB); calibration {len(calib.fit)} x "
            f"{s.calib_len} tokens (validation {len(calib.val)}, diagnostics {len(calib.diag)} sequences)",
            f"lambda (on standardized features): {lambda_summary(mapper.meta)}", fast.path_line(s.plain),
            *([f"recompute (kvt's option): the target recomputes the last {recompute.last}, the first "
               f"{recompute.first} and {100 * recompute.frac:g}% "
               f"{RULE_WORDS[recompute.by]} prompt tokens after mapping"]
              if recompute else []),
            f"items: a seeded sample (seed {s.seed}) of up to {s.limit} per task"
            + "".join(f", {t} {n}" for t, n in s.task_limits.items()) + ", the same for every condition"]


DIAGNOSTICS_SAY = ("How close the mapped cache comes to the target's own on calibration sequences no fit has seen, per "
                   "target layer: R^2 of keys and values (the fit's own objective) and the attention-output cosine "
                   "(the target's queries over the true and over the mapped cache); then the next-token KL after a "
                   "handoff. The gate passes a mapper whose mean cosine and KL clear --min-attn-cos and --max-kl.")


def diagnostics_section(check):
    diag, fit, reasons = check
    return ["## Calibration diagnostics (held-out)", "", DIAGNOSTICS_SAY, "", "```", format_diagnostics(diag),
            "gate: " + ("fit" if fit else "UNFIT: " + "; ".join(reasons)), "```"]


ACCURACY_SAY = ("Accuracy on the same items under four conditions: target (the target prefills the context itself: "
                "the ceiling), transfer (the source prefills, the mapper hands its cache over, the target answers), "
                "source (the source alone) and floor (the target without the context). Retention = transfer / "
                "target; floor-normalized retention = (transfer - floor) / (target - floor), the share of what the "
                "context added that the transfer keeps; gap recovered = (transfer - source) / (target - source), the "
                "share of the source-to-target gap the transfer closes; the average row, the paper's headline, is the mean over "
                "tasks of each task's retention on its primary metric.")


def accuracy_section(summary, average, o):
    """The accuracy table, with the retention figure above it where there are tasks to draw."""
    src_name, tgt_name = o.names
    lines = [ACCURACY, "", ACCURACY_SAY, ""]
    shown = {t: tasks.get(t).primary for t in summary if tasks.get(t).primary not in CORPUS}
    if shown:
        drawn = retention_png({t: summary[t] for t in shown}, shown, o.out / "retention.png", f"{src_name} -> {tgt_name}")
        lines += (["![retention](retention.png)", ""] if drawn else
                  ["(no retention figure: matplotlib is not installed; pip install kvt[plots] draws it)", ""])
    return lines + [format_summary(summary, average, src_name, tgt_name)]


def gain_section(gains):
    if not gains:
        return []
    return ["", "## Context gain kept (held-out next-token NLL, nats; 95% interval over windows)", "",
            "The next tokens' NLL on held-out text after a context, under target, transfer and floor; context gain "
            "kept = (floor - transfer) / (floor - target), the share of what the context takes off the floor's NLL "
            "that the transfer keeps (no ratio, and why, where the target gains nothing from the context).", "",
            format_context_gain(gains)]


def coqa_section(coqa):
    """CoQA per direction: gold F1 per turn under target and transfer, and the gap's drift over turns."""
    lines = []
    num = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
    for direction, c in coqa.items():
        g, a = c["gold"], c["agreement"]
        lines += ["", f"## CoQA, handed over {direction}: gold F1 per turn", "",
                  "Gold F1 of each turn of a conversation, the target answering on its own cache (target) and on "
                  "the one handed over (transfer); the drift says whether the gap grows turn by turn.", "",
                  "| turn | " + " | ".join(str(t) for t in g["turns"]) + " |", "|---|" + "---|" * len(g["turns"])]
        for cond in ("target", "transfer"):
            lines.append(f"| {cond} | " + " | ".join(f"{f:.1f}" for f in g["f1"][cond]) + " |")
        lines += ["", f"gold F1 target {num(g['mean']['target']['f1'], '.1f')}, transfer "
                  f"{num(g['mean']['transfer']['f1'], '.1f')} (EM {num(g['mean']['target']['em'], '.1f')} / "
                  f"{num(g['mean']['transfer']['em'], '.1f')}); gap target - transfer {num(g['mean_gap'], '+.1f')} F1 "
                  f"points, its drift {num(g['drift']['gap'], '+.2f')} points per turn; transfer scored against the "
                  f"target's own answers: F1 {num(a['mean'], '.1f')}, drift {num(a['drift_per_turn'], '+.2f')} per turn"]
    return lines


SPEED_LEGEND = ("target prefill s: the target computes the context's cache itself; transfer s: the source's cache "
                "mapped for the target, then the target's last token; speedup: prefill / transfer (medians); of the "
                "roofline: the share the transfer reaches of the speedup it would have if the map ran at the "
                "prefill's FLOP rate and the last token read memory at copy speed (per round: median, min-max).")


def speed_table(rows):
    """The bench in six columns (bench.format_rows has them all)."""
    pct = lambda m: "-" if not m else f"{100 * m[0]:.0f}% ({100 * m[1]:.0f}-{100 * m[2]:.0f})"  # noqa: E731
    lines = ["| direction | tokens | target prefill s | transfer s | speedup | of the roofline |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['direction']} | {r['tokens']} | {r['target_prefill_s']:.3f} | {r['transfer_s']:.3f} | "
                     f"{r['speedup']:.1f}x | {pct(r.get('of_roofline'))} |")
    return "\n".join(lines)


def speed_section(rows, device, dtype):
    if not rows:
        return []
    return ["", "## Prefill vs transfer (seconds, median)", "",
            "The target's prefill of a context against the transfer that replaces it, timed side by side in one "
            f"process, each warmed up (tutorial.md section 11). {hardware(device)}; {dtype}", "",
            speed_table(rows), "", SPEED_LEGEND, "", "### Every measurement", "",
            "The same rounds with every column tutorial.md section 11 explains: the source's prefill, min-max "
            "ranges, the speedup per round, the map alone, the FLOP limit, the rate the last step reads at, the "
            "copy rate and the roofline they make, the mapper's size.", "", format_rows(rows)]


def results_of(s, o, summary, average):
    """results.json's content: the settings as this rank ran them and every number of the report."""
    diag, fit, reasons = o.check
    asked = {**dataclasses.asdict(s), "device": o.device, "batch_size": o.batch}   # as this rank ran them
    settings = {k: (str(v) if isinstance(v, Path) else [str(x) for x in v] if isinstance(v, list) else v)
                for k, v in asked.items()}
    meta = o.mapper.meta
    return {"pair": list(o.names), "mapper": o.name, "settings": settings, "k_used": meta.get("k", s.k),
            "lambda": meta.get("lambda"), "mapper_bytes": o.mapper.nbytes(), "fit_s": meta.get("fit_s"),
            "alpha": meta.get("alpha"), "diagnostics": diag, "gate": {"fit": fit, "reasons": reasons},
            "tasks": summary, "average_retention": average, "context_gain": o.gains, "coqa": o.coqa,
            "lm_eval": lm_eval_results(summary), "bench": o.rows,
            "items": {task: [it.id for it in its] for task, its in o.items.items()},
            "versions": versions(o.device), "wall_s": time.time() - o.t0}


def pct(x, digits=1):
    return "-" if x is None else f"{100 * x:.{digits}f}"


def format_summary(summary, average, src_name, tgt_name):
    """The paper's table: accuracy per condition, retention, floor-normalized retention and gap recovered, and the
    average retention over tasks of each task's primary metric (the paper's headline column)."""
    lines = [f"| task | metric | target ({tgt_name}) | transfer | source ({src_name}) | floor | retention | floor-norm. retention "
             "| gap recovered | n |", "|---|---|---|---|---|---|---|---|---|---|"]

    def cell(row, m):
        if row is None or row.get(m) is None:
            return "-"
        lo, hi = row[m + "_ci"]
        if m in CORPUS:  # a perplexity or bits per byte, not a percentage
            num = lambda x: "-" if x is None else f"{x:.4g}"  # noqa: E731
            return f"{num(row[m])} [{num(lo)}, {num(hi)}]"
        return f"{pct(row[m])} [{pct(lo, 0)}, {pct(hi, 0)}]"

    def ret(r, name):
        if not r or r.get(name) is None:
            return "-"
        lo, hi = r.get(name + "_ci") or (None, None)
        return f"{pct(r[name])}% [{pct(lo, 0)}, {pct(hi, 0)}]" if lo is not None else f"{pct(r[name])}%"

    for task, conds in summary.items():
        for m in tasks.get(task).metrics:
            r = conds.get("retention", {}).get(m, {})
            lines.append(f"| {task} | {m} | {cell(conds.get('target'), m)} | {cell(conds.get('transfer'), m)} | "
                         f"{cell(conds.get('source'), m)} | {cell(conds.get('floor'), m)} | {ret(r, 'ratio')} | "
                         f"{ret(r, 'floor_normalized')} | {ret(r, 'gap_recovered')} | {conds.get('target', {}).get('n', 0)} |")
    if average and average.get("tasks"):
        acc = {c: {"mean": v, "mean_ci": average["accuracy_ci"][c]} for c, v in average["accuracy"].items()}
        lines.append(f"| **average** ({len(average['tasks'])} tasks) | primary | {cell(acc.get('target'), 'mean')} | "
                     f"{cell(acc.get('transfer'), 'mean')} | {cell(acc.get('source'), 'mean')} | "
                     f"{cell(acc.get('floor'), 'mean')} | {ret(average, 'retention')} | {ret(average, 'floor_normalized')} | "
                     f"{ret(average, 'gap_recovered')} | |")
    return "\n".join(lines)


def format_context_gain(rows):
    """The context-gain table of report.md; where the target gains nothing from context (summary.context_gain's
    no_ratio), that sentence stands in the last column instead of a ratio."""
    lines = ["| held-out text | context | next | windows | NLL target | NLL transfer | NLL floor | context gain kept |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["gain_ci"]
        ci = f" [{pct(lo)}, {pct(hi)}]" if lo is not None else ""
        kept = f"no ratio: {r['no_ratio']}" if r.get("no_ratio") else f"{pct(r['gain'])}%{ci}"
        lines.append(f"| {r['text']} | {r['context']} | {r['next']} | {r['windows']} | {r['nll']['target']:.4f} | "
                     f"{r['nll']['transfer']:.4f} | {r['nll']['floor']:.4f} | {kept} |")
    return "\n".join(lines)


def lambda_summary(meta):
    """One line: the lambdas the fit chose per target layer, for K and V."""
    def one(lams):
        lams = sorted(lams)
        return f"median {lams[len(lams) // 2]:g} (from {lams[0]:g} to {lams[-1]:g})" if len(set(lams)) > 1 else f"{lams[0]:g}"
    lam = meta.get("lambda")
    return "; ".join(f"{kind.upper()} {one(v)}" for kind, v in lam.items()) if isinstance(lam, dict) else str(lam)


def strict(obj):
    """obj with every non-finite float (a diagnostic of a model that produced NaN, say) as None: strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    return obj


def versions(device):
    """What produced the numbers: kvt, Python, torch, transformers (None where not installed; kvt never
    needs it) and the processor (kvt.harness.bench.hardware)."""
    try:
        transformers = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers = None
    return {"kvt": kvt.__version__, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers, "hardware": hardware(device)}


def write_atomic(path, text):
    tmp = Path(f"{path}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:  # e.g. a folder of that name: the records are kept, a rerun only writes the report
        raise KvtError(f"cannot write {path} ({e.strerror}); move it away and run again (the results are kept)")
