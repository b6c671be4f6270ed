"""Summary: records -> accuracy, 95% intervals and retention per task, the average over tasks, CoQA per
turn, and the same numbers in lm-evaluation-harness's results layout.

    summarize(records)           {task: {condition: {metric, metric_ci, metric_stderr, n}, "retention": ...}}
    average_retention(records)   the paper's headline: the mean over tasks of each one's retention
    lm_eval_results(summary)     {condition: {"results": {task: {"acc,none": .., "acc_stderr,none": ..}}}}
    coqa_turns, coqa_agreement   CoQA per turn: gold F1 and EM, the gap, its drift

A record is one plain dict per (task, condition, item id) (kvt/harness/evals.py). Most metrics are means over
items. The perplexities of loglikelihood_rolling tasks are corpus-level, as the harness aggregates them
(weighted_perplexity, bits_per_byte): one number from the sums over all scored texts of the
loglikelihood `ll` and the length in words or bytes, lower is better. Retention is transfer / target
(target / transfer for a lower-is-better metric, so 100% is still "all kept"), floor-normalized
(transfer - floor) / (target - floor) either way, and gap recovered (transfer - source) / (target -
source): the share of the source-to-target gap the transfer closes (one replication read 86% retention
but 20% of the gap). Undefined numbers (a ratio over 0, an interval with
no finite resample) are None, never NaN, so a summary is strict JSON.
"""
import math

import torch

from kvt.harness import tasks
from kvt.harness.answers import token_f1


def _exp(x):
    return math.exp(x) if x < 709 else math.inf  # past 709 a float overflows: an infinite perplexity


CORPUS = {  # metric -> (the length it divides by, the number from the mean loglikelihood per unit m)
    "word_perplexity": ("words", lambda m: _exp(-m)),
    "byte_perplexity": ("bytes", lambda m: _exp(-m)),
    "bits_per_byte": ("bytes", lambda m: -m / math.log(2)),
}
LOWER_IS_BETTER = set(CORPUS)


# ---------------------------------------------------------------------------------- intervals

def wilson(k, n, z=1.96):
    """95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, center - half), min(1.0, center + half))  # clipped: rounding can step past 0 or 1


def percentiles(stats):
    """95% percentile interval of resampled statistics (n_boot,), over the finite ones; (None, None) if none."""
    stats = stats[stats.isfinite()]
    if len(stats) == 0:
        return (None, None)
    return (stats.quantile(0.025).item(), stats.quantile(0.975).item())


def bootstrap(fn, columns, n_boot=1000, seed=0):
    """95% percentile interval of fn(*columns) over items resampled with replacement (paired columns).
    fn returns a number, or None where undefined (that resample is dropped)."""
    cols = [torch.tensor(c, dtype=torch.float64) for c in columns]
    if len(cols[0]) == 0:
        return (None, None)
    idx = torch.randint(len(cols[0]), (n_boot, len(cols[0])), generator=torch.Generator().manual_seed(seed))
    stats = [fn(*(c[i] for c in cols)) for i in idx]
    return percentiles(torch.tensor([math.nan if v is None else v for v in stats], dtype=torch.float64))


def context_gain(nll, vocab_size=None, n_boot=1000, seed=0):
    """"Context gain kept" from next_nll's per-window NLLs {target, transfer, floor: (W,)}: of what the
    context takes off the floor's NLL, the share the transfer keeps, (floor - transfer) / (floor - target)
    over the windows' mean NLLs, with a seeded 95% bootstrap interval over windows (paired).

    The ratio means something only where the target itself gains from context: its gain, floor - target
    ("target_gain", nats per token, with its interval), must be above its noise (the interval above 0),
    and the target must model the text at all (its NLL at most log(vocab_size), uniform over its
    vocabulary; a toy scored on English sits far above). Otherwise gain and gain_ci are None and
    "no_ratio" says why, in words (None where the ratio is given)."""
    cols = [nll[c].tolist() for c in ("floor", "transfer", "target")]
    means = {c: sum(v) / len(v) for c, v in zip(("floor", "transfer", "target"), cols)}

    def gain(f, x, t):
        d = f.mean() - t.mean()
        return None if d.abs() < 1e-12 else ((f.mean() - x.mean()) / d).item()
    target_gain = means["floor"] - means["target"]
    lo, hi = bootstrap(lambda f, t: (f.mean() - t.mean()).item(), [cols[0], cols[2]], n_boot, seed)
    no_ratio = None
    if vocab_size is not None and means["target"] > math.log(vocab_size):
        no_ratio = (f"the target cannot model this text: its NLL {means['target']:.2f} is above uniform over its "
                    f"{vocab_size} tokens ({math.log(vocab_size):.2f})")
    elif lo is None or lo <= 0:
        ci = f" [{lo:.3f}, {hi:.3f}]" if lo is not None else ""
        no_ratio = f"the target gains {target_gain:.3f} nats{ci} from context, not above its noise"
    point, ci = (None, (None, None)) if no_ratio else (
        gain(*(torch.tensor(c, dtype=torch.float64) for c in cols)), bootstrap(gain, cols, n_boot, seed))
    return {"nll": means, "target_gain": target_gain, "target_gain_ci": (lo, hi), "gain": point, "gain_ci": ci,
            "no_ratio": no_ratio, "windows": len(cols[0])}


def stderr(vals):
    """The harness's mean_stderr: the sample standard deviation (n - 1) over sqrt(n); None under 2 items."""
    n = len(vals)
    if n < 2:
        return None
    mean = sum(vals) / n
    return math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1) / n)


# ---------------------------------------------------------------------------------- aggregates

def fields(metric):
    """The record fields a metric is computed from: the metric itself, or ll and a length (CORPUS)."""
    return ("ll", CORPUS[metric][0]) if metric in CORPUS else (metric,)


def aggregate(metric, *cols):
    """A metric over items from its fields' columns (tensors (n,)): a mean, or a corpus-level
    perplexity (CORPUS); None without items."""
    if len(cols[0]) == 0:
        return None
    if metric in CORPUS:
        ll, units = cols
        return CORPUS[metric][1](float(ll.sum() / units.sum())) if units.sum() > 0 else None
    return float(cols[0].mean())


def _div(a, b):
    """a / b; None when either is undefined or b = 0."""
    return None if a is None or b is None or b == 0 or math.isnan(b) else a / b


def _by_task(records):
    """task -> condition -> item id -> record."""
    by = {}
    for r in records:
        by.setdefault(r["task"], {}).setdefault(r["condition"], {})[r["id"]] = r
    return by


def _common(conds, names):
    """The item ids every one of the named conditions has, sorted (a fixed order for paired resampling);
    none if a condition has no records."""
    return sorted(set.intersection(*(set(conds.get(c, ())) for c in names)))


def item_ids(records):
    """task -> the ids of its items, in the order their first records appear (the sampled order)."""
    ids = {}
    for r in records:
        ids.setdefault(r["task"], {})[r["id"]] = None  # a dict keeps first-seen order
    return {task: list(seen) for task, seen in ids.items()}


# ---------------------------------------------------------------------------------- summaries

def summarize(records, n_boot=1000):
    """{task: {condition: {metric: value, metric_ci: (lo, hi), metric_stderr, n}, "retention": {metric: {...}}}}.
    Retention = transfer / target and (transfer - floor) / (target - floor), on the item ids every one
    of the three conditions has, with a paired bootstrap interval; n = 0 and None when they share none.
    A binary metric's interval is Wilson's, any other a bootstrap; stderr is the harness's (means only)."""
    out = {}
    for task, conds in _by_task(records).items():
        metrics = tasks.get(task).metrics
        out[task] = {}
        for name, recs in conds.items():
            row = {"n": len(recs)}
            for m in metrics:
                if m in CORPUS:
                    cols = [[r[f] for r in recs.values()] for f in fields(m)]
                    row[m] = aggregate(m, *(torch.tensor(c, dtype=torch.float64) for c in cols))
                    row[m + "_ci"] = bootstrap(lambda *c: aggregate(m, *c), cols, n_boot)
                    row[m + "_stderr"] = None  # the harness gives none for perplexities ("N/A")
                    continue
                vals = [r[m] for r in recs.values()]
                row[m] = sum(vals) / len(vals)
                binary = all(v in (0.0, 1.0) for v in vals)
                row[m + "_ci"] = wilson(sum(vals), len(vals)) if binary else bootstrap(torch.mean, [vals], n_boot)
                row[m + "_stderr"] = stderr(vals)
            out[task][name] = row
        if "transfer" in conds and "target" in conds:
            out[task]["retention"] = retention(conds, metrics, n_boot)
    return out


def retention(conds, metrics, n_boot):
    """{metric: {"n", "ratio", "ratio_ci"[, "floor_normalized", "floor_normalized_ci"][, "gap_recovered",
    "gap_recovered_ci"]}} from conds {condition: {item id: record}}: transfer over target (target over
    transfer where lower is better), (transfer - floor) / (target - floor), and the share of the
    source-to-target gap recovered, (transfer - source) / (target - source), on the items every
    condition scored, with a paired bootstrap interval (the same resampled items for every condition)."""
    names = ["transfer", "target"] + [c for c in ("floor", "source") if c in conds]
    common = _common(conds, names)
    ret = {}
    for m in metrics:
        k = len(fields(m))
        cols = [[conds[c][i][f] for i in common] for c in names for f in fields(m)]  # condition-major

        def values(*cs):  # the metric of each named condition, from their columns
            return [aggregate(m, *cs[j * k:(j + 1) * k]) for j in range(len(names))]

        def ratio(*cs):
            v = values(*cs)
            return _div(v[1], v[0]) if m in LOWER_IS_BETTER else _div(v[0], v[1])

        def floor_ratio(*cs, base="floor"):
            v = values(*cs)
            j = names.index(base)
            return None if None in v else _div(v[0] - v[j], v[1] - v[j])

        def gap(*cs):  # the share of the source-to-target gap the transfer recovers
            return floor_ratio(*cs, base="source")

        t = [torch.tensor(c, dtype=torch.float64) for c in cols]
        row = {"n": len(common), "ratio": ratio(*t), "ratio_ci": bootstrap(ratio, cols, n_boot)}
        if "floor" in conds:
            row["floor_normalized"] = floor_ratio(*t)
            row["floor_normalized_ci"] = bootstrap(floor_ratio, cols, n_boot)
        if "source" in conds:
            row["gap_recovered"] = gap(*t)
            row["gap_recovered_ci"] = bootstrap(gap, cols, n_boot)
        ret[m] = row
    return ret


def average_retention(records, n_boot=1000, seed=0):
    """The paper's headline: the mean over tasks of each task's retention transfer / target on its
    primary metric (Task.primary), the same for (transfer - floor) / (target - floor) over the tasks
    with a floor, and each condition's mean primary score over the same tasks ("accuracy").

    A task counts on the item ids all its conditions share. A task whose target scores 0 there has no
    ratio and stays out of every mean, as does one whose primary metric is a perplexity (not a score to
    average with accuracies; its own retention is in summarize): "tasks" lists those that entered,
    "skipped" the others and why. 95% intervals: a bootstrap that resamples items within each task (the
    same items for every condition) and recomputes the mean of the per-task ratios; a resample with an
    undefined ratio is dropped, as in bootstrap()."""
    cols, skipped = {}, {}  # task -> condition -> primary scores (n,), paired by item
    for task, conds in _by_task(records).items():
        metric, ids = tasks.get(task).primary, _common(conds, conds)
        if metric in CORPUS:
            skipped[task] = f"its primary metric {metric} is a perplexity, not averaged with accuracies"
        elif "target" not in conds or "transfer" not in conds:
            skipped[task] = "no target or no transfer records"
        elif not ids:
            skipped[task] = "no item that every condition has"
        elif sum(conds["target"][i][metric] for i in ids) == 0:
            skipped[task] = "the target scores 0: retention undefined"
        else:
            cols[task] = {c: torch.tensor([conds[c][i][metric] for i in ids], dtype=torch.float64) for c in conds}
    entered = list(cols)
    floor_tasks = [t for t in entered if "floor" in cols[t] and cols[t]["floor"].mean() != cols[t]["target"].mean()]
    gap_tasks = [t for t in entered if "source" in cols[t] and cols[t]["source"].mean() != cols[t]["target"].mean()]
    names = [c for c in ("target", "transfer", "source", "floor") if all(c in cols[t] for t in entered)]

    def means(score):  # task -> condition -> mean score, 0-d or (n_boot,) -> {quantity: mean over tasks}
        per_task = {"retention": [score[t]["transfer"] / score[t]["target"] for t in entered],
                    "floor_normalized": [(score[t]["transfer"] - score[t]["floor"])
                                         / (score[t]["target"] - score[t]["floor"]) for t in floor_tasks],
                    "gap_recovered": [(score[t]["transfer"] - score[t]["source"])
                                      / (score[t]["target"] - score[t]["source"]) for t in gap_tasks],
                    **{c: [score[t][c] for t in entered] for c in names}}
        return {k: torch.stack(v).mean(0) if v else None for k, v in per_task.items()}

    point = means({t: {c: v.mean() for c, v in col.items()} for t, col in cols.items()})
    g, resampled = torch.Generator().manual_seed(seed), {}
    for t, col in cols.items():
        n = len(col["target"])
        idx = torch.randint(n, (n_boot, n), generator=g)                 # (n_boot, n), shared by the conditions
        resampled[t] = {c: v[idx].mean(1) for c, v in col.items()}       # (n_boot,)
    boot = means(resampled)
    out = {"tasks": entered, "skipped": skipped, "metric": {t: tasks.get(t).primary for t in entered},
           "n": {t: len(cols[t]["target"]) for t in entered}, "floor_tasks": floor_tasks, "gap_tasks": gap_tasks,
           "accuracy": {}, "accuracy_ci": {}}
    for k in point:
        value = None if point[k] is None else point[k].item()
        ci = (None, None) if boot[k] is None else percentiles(boot[k])
        if k in names:
            out["accuracy"][k], out["accuracy_ci"][k] = value, ci
        else:
            out[k], out[k + "_ci"] = value, ci
    return out


# ---------------------------------------------------------------------------------- lm-eval layout

LM_EVAL_NAMES = {  # kvt metric -> the harness's "metric,filter" key where it is not "metric,none"
    "em_strict": "exact_match,strict-match",
    "em_flexible": "exact_match,flexible-extract",
}


def lm_eval_results(summary):
    """summarize()'s numbers in lm-evaluation-harness's results.json layout, one block per condition:
    {condition: {"results": {task: {"alias": task, "acc,none": 0.61, "acc_stderr,none": 0.02, ...}},
    "higher_is_better": {task: {"acc": true}}, "n-samples": {task: {"effective": n}}}}. A perplexity's
    stderr is "N/A", as the harness writes it; other undefined values are None."""
    out = {}
    for task, conds in summary.items():
        for cond, row in conds.items():
            if cond == "retention":
                continue
            block = out.setdefault(cond, {"results": {}, "higher_is_better": {}, "n-samples": {}})
            res, better = {"alias": task}, {}
            for m in tasks.get(task).metrics:
                metric, _, filt = LM_EVAL_NAMES.get(m, f"{m},none").partition(",")
                res[f"{metric},{filt}"] = row[m]
                res[f"{metric}_stderr,{filt}"] = "N/A" if m in CORPUS else row[m + "_stderr"]
                better[metric] = m not in LOWER_IS_BETTER
            block["results"][task], block["higher_is_better"][task] = res, better
            block["n-samples"][task] = {"effective": row["n"]}
    return out


# ---------------------------------------------------------------------------------------- coqa turns

def _slope(xs, ys):
    """Least-squares slope of ys over xs; None with fewer than two points."""
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def coqa_turns(records, conds=("target", "transfer")):
    """Per turn, each condition's mean gold F1 and EM in points, on the conversations both conditions
    answered; the gap conds[0] - conds[1] in F1 per turn and over all turns (every turn of every
    conversation weighs the same, as the harness averages turns); and the drift: least-squares slopes
    over turns of each condition's F1 and of the gap, in points per turn."""
    a, b = conds
    by = _by_task(records).get("coqa", {})
    per_turn = {}  # turn -> condition -> metric -> scores
    for i in _common(by, conds):
        for c in conds:
            r = by[c][i]
            for t, f1, em in zip(r["turns"], r["f1_turns"], r["em_turns"]):
                d = per_turn.setdefault(t, {}).setdefault(c, {"f1": [], "em": []})
                d["f1"].append(100 * f1)
                d["em"].append(100 * em)
    turns = sorted(per_turn)
    mean = lambda v: sum(v) / len(v) if v else None  # noqa: E731
    f1 = {c: [mean(per_turn[t][c]["f1"]) for t in turns] for c in conds}
    em = {c: [mean(per_turn[t][c]["em"]) for t in turns] for c in conds}
    gap = [x - y for x, y in zip(f1[a], f1[b])]
    overall = {c: {m: mean([v for t in turns for v in per_turn[t][c][m]]) for m in ("f1", "em")} for c in conds}
    return {"turns": turns, "n": [len(per_turn[t][a]["f1"]) for t in turns], "f1": f1, "em": em, "gap": gap,
            "mean": overall, "mean_gap": None if not turns else overall[a]["f1"] - overall[b]["f1"],
            "drift": {**{c: _slope(turns, f1[c]) for c in conds}, "gap": _slope(turns, gap)}}


def coqa_agreement(records, cond="transfer", reference="target"):
    """Per turn, the mean F1 of `cond`'s answers scored against `reference`'s answers on the same
    conversations, and the drift: the least-squares slope of that F1 over turns, in F1 points per turn."""
    by = _by_task(records).get("coqa", {})
    per_turn = {}
    for i in _common(by, (cond, reference)):
        r, ref = by[cond][i], by[reference][i]
        for t, x, y in zip(r["turns"], r["answers"], ref["answers"]):
            per_turn.setdefault(t, []).append(token_f1(y, x))
    turns = sorted(per_turn)
    f1 = [100 * sum(per_turn[t]) / len(per_turn[t]) for t in turns]
    return {"turns": turns, "f1": f1, "n": [len(per_turn[t]) for t in turns],
            "mean": sum(f1) / len(f1) if f1 else None, "drift_per_turn": _slope(turns, f1)}
