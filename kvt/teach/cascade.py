"""The cascade a transfer is for (kvt's, beyond the paper): a small model answers; when it is unsure,
the query escalates to a large model, which needs the prompt's KV one of three ways:

    prefill    the large model reads the prompt itself (what serving does today)
    transfer   kvt maps the small model's cache (the handoff: the large model runs the last token)
    recompute  transfer, then the large model recomputes a budget of the mapped slots (handoff.Recompute)

    python -m kvt.teach.cascade runs/toy-s_toy-l/records-*.jsonl --recompute runs/rc/records-*.jsonl \
        --shapes qwen3-0.6b:1.7b --tokens 4096

Accuracy comes from the records of a finished run.py, which scored every item as the small model alone
("source"), the large model after its own prefill ("target") and after a transfer ("transfer"); a
second run with a recompute budget gives the third way. Same items, so the ways are compared item by
item, each right or wrong by its task's primary metric. The small model's confidence: for multiple
choice, the probability it gives its own answer among the choices (the softmax of their
loglikelihoods); for generation, exp of the mean log-probability of its answer's tokens. Escalating
the n least confident items, for every n, sweeps the escalation rate from 0 to 100%.

Cost per query comes from the FLOP model of kvt/harness/bench.py on real model shapes (--shapes: a toy's
prefill costs too little to be worth timing): the small model's prefill for every query, plus, for an
escalated one, the large model's prefill, the transfer (mapper and the large model's last token), or the
transfer plus the recomputed fraction of a prefill. Costs are in units of the large model's prefill of
the same prompt. --bench adds seconds to the first token of an escalated answer, from a `kvt bench
--json` file measured at --tokens (for recompute, one taken with `kvt bench --recompute FRAC`).
"""
import argparse
import json
import math
from pathlib import Path

from kvt.harness import tasks
from kvt.harness.plan import transfer_flops
from kvt.config import KvtError, at_least, command, parse_pair, shape
from kvt.harness.figures import pyplot
from kvt.harness.plan import forward_flops, mapper_bytes

WAYS = ("prefill", "transfer", "recompute")


def index(records):
    """{(task, condition, id): record} of records as evals.evaluate yields them."""
    return {(r["task"], r["condition"], r["id"]): r for r in records if "task" in r}


def read(path):
    """index() of a records jsonl written by run.py (its header line, and a torn last line, skipped), after
    checking that it is one: a corrupt line, or an item that lacks a condition, is refused, and so is a file
    holding fewer items than the results.json beside it lists for the same run."""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob("records-*.jsonl"))
        raise KvtError(f"{path} is a folder" + (f"; give one of its records files, e.g. {found[0]}" if found else
                       " with no records-*.jsonl; give the records-*.jsonl of a finished kvt run"))
    if not path.is_file():
        raise KvtError(f"{path}: no such records file; give the records-*.jsonl of a finished kvt run")
    lines = path.read_text(errors="replace").split("\n")
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif not rows:
            raise KvtError(f"{path} is not a records file (line {i} is not a record); give the records-*.jsonl of a "
                           "finished kvt run, not its results.json")
        elif i < len(lines):  # only the last line, torn by a crash (no newline after it), is skipped
            raise KvtError(f"{path}, line {i}: not a record (corrupt); rerun the run into a new --out to write "
                           "its records again")
    out = index(rows)
    if not out:
        raise KvtError(f"{path} holds no records; give the records-*.jsonl of a finished kvt run")
    conds = {c for _, c, _ in out}
    partial = sorted({(t, i) for t, _, i in out if any((t, c, i) not in out for c in conds if c != "floor")})
    if partial:
        raise KvtError(f"{path}: {len(partial)} items lack a condition (first: {partial[0][0]} {partial[0][1]}); the "
                       "run did not finish: run it again with the same settings and --out to complete them")
    results = path.parent / "results.json"
    if results.is_file():
        try:
            res = json.loads(results.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            res = {}
        same = (isinstance(res, dict) and res.get("mapper") == rows[0].get("mapper") and isinstance(res.get("items"), dict)
                and "recompute" not in rows[0] and not any((res.get("settings") or {}).get(f"recompute_{w}")
                                                           for w in ("last", "first", "frac")))
        if same:  # the run that wrote results.json wrote these records too
            want = sum(len(ids) for ids in res["items"].values())
            have = len({(t, i) for t, c, i in out if t in res["items"] and i in res["items"][t]})
            if have < want:
                raise KvtError(f"{path} holds {have} of the {want} items {results} lists; the file was cut short: "
                               "run the run again with the same settings and --out to complete it")
    return out


def header(path):
    """The first line of a records file: {"format", "mapper": the mapper's name, "recompute": [last, first,
    frac]} ({} if it has none)."""
    with open(path, errors="replace") as f:
        try:
            first = json.loads(f.readline())
        except json.JSONDecodeError:
            return {}
    return first if isinstance(first, dict) and "task" not in first else {}


def check_recompute(records, recompute):
    """The --recompute records are the same run's with a budget: the same mapper (so the same pair and
    settings) and a recompute budget; else one line."""
    mine, theirs = header(records), header(recompute)
    if theirs.get("mapper") != mine.get("mapper"):
        raise KvtError(f"--recompute {recompute} holds records of mapper {theirs.get('mapper')}, {records} of "
                       f"{mine.get('mapper')}: another pair or settings; give the records of the same run with a "
                       "--recompute-* budget")
    if not any(theirs.get("recompute") or []):
        raise KvtError(f"--recompute {recompute} holds records without a recompute budget; give those of a run with "
                       "--recompute-frac (or --recompute-last / --recompute-first)")


def confidence(record):
    """Multiple choice: the probability the model gives its chosen answer among the choices,
    softmax(lls)[pred]. Generation: exp(mean log-probability of its tokens). None when neither is recorded."""
    if "lls" in record:
        top = max(record["lls"])
        return 1 / sum(math.exp(ll - top) for ll in record["lls"])
    return math.exp(record["logprob"]) if "logprob" in record else None


def items(records, recompute=None):
    """[(confidence, small right, large right after prefill, after transfer, after recompute or None)]
    over every item scored under source, target and transfer with a confidence (generation records
    written before kvt recorded `logprob` have none), right = the task's primary metric."""
    rows = []
    for (task, cond, id_), src in records.items():
        if cond != "source" or confidence(src) is None:
            continue
        tgt, tr = records.get((task, "target", id_)), records.get((task, "transfer", id_))
        if tgt is None or tr is None:
            continue
        m = tasks.TASKS[task].primary if task in tasks.TASKS else "acc"  # a task file not imported here
        if m not in src:
            continue
        rc = None if recompute is None else recompute.get((task, "transfer", id_))
        rows.append((confidence(src), src[m], tgt[m], tr[m], None if rc is None else rc[m]))
    if not rows:
        raise KvtError("no item was scored under source, target and transfer with a confidence in these records")
    if recompute is not None and any(r[4] is None for r in rows):
        raise KvtError("the --recompute records do not cover every item of the run; use a run of the same items")
    return sorted(rows, key=lambda r: r[0])  # least confident first: the first to escalate


def costs(small, large, tokens, scope="layer", k=8, frac=0.0):
    """Per-query FLOPs in units of the large model's prefill: (small prefill, and the escalation by each way)."""
    big = forward_flops(large, tokens, last=True)
    mapped = transfer_flops(large, sum(mapper_bytes(small, large, scope, k, ("cpu",)).values()) // 4, tokens)
    return forward_flops(small, tokens, last=True) / big, {"prefill": 1.0, "transfer": mapped / big,
                                                "recompute": (mapped + frac * big) / big}


def sweep(rows, base, escalate, rates=tuple(i / 10 for i in range(11))):
    """At each escalation rate: accuracy of each way and compute per query (units of a large prefill)."""
    out = []
    for rate in rates:
        n = round(rate * len(rows))
        acc = {}
        for i, way in enumerate(WAYS):
            if way == "recompute" and rows[0][4] is None:
                continue
            acc[way] = sum(r[2 + i] if j < n else r[1] for j, r in enumerate(rows)) / len(rows)
        out.append({"rate": n / len(rows), "threshold": rows[n - 1][0] if n else 0.0, "accuracy": acc,
                    "cost": {way: base + n / len(rows) * escalate[way] for way in acc}})
    return out


def format_sweep(table, seconds=None):
    ways = list(table[0]["accuracy"])
    head = "| escalated | below confidence | " + " | ".join(f"acc, {w}" for w in ways) + " | " + \
        " | ".join(f"cost, {w}" for w in ways) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(ways))]
    for row in table:
        lines.append(f"| {100 * row['rate']:.0f}% | {row['threshold']:.3f} | "
                     + " | ".join(f"{100 * row['accuracy'][w]:.1f}" for w in ways) + " | "
                     + " | ".join(f"{row['cost'][w]:.3f}" for w in ways) + " |")
    if seconds:
        lines += ["", "seconds to the first token of an escalated answer: "
                  + ", ".join(f"{w} {s:.3f}" for w, s in seconds.items() if w in ways)]
    return "\n".join(lines)


def bench_seconds(path, direction, tokens, frac=None):
    """Seconds to an escalated answer's first token, from a kvt bench --json file's row of `direction`
    ("small -> large") at `tokens`: the small model's prefill, then the large model's prefill, the
    transfer, and (frac given) the transfer with that fraction recomputed, as kvt bench --recompute timed it."""
    redo = f"run kvt bench --lengths {tokens} --json {path} again"
    try:
        rows = [r for r in json.loads(Path(path).read_text())["rows"]
                if (r["direction"], r["tokens"]) == (direction, tokens)]
    except FileNotFoundError:
        raise KvtError(f"--bench {path}: no such file; {redo}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:  # not JSON, or not a kvt bench --json file
        raise KvtError(f"--bench {path} is not a kvt bench --json file ({type(e).__name__}); {redo}") from None
    if not rows:
        raise KvtError(f"{path} has no {direction} row at {tokens} tokens; run kvt bench --lengths {tokens} --json {path}")
    r = rows[0]
    small = r["source_prefill_s"]
    out = {"prefill": small + r["target_prefill_s"], "transfer": small + r["transfer_s"]}
    if frac is not None:
        if str(frac) not in r.get("recompute_s", {}):
            raise KvtError(f"{path} has no transfer + {frac:g} recompute timing; run kvt bench --recompute {frac:g} "
                           f"--lengths {tokens} --json {path}")
        out["recompute"] = small + r["recompute_s"][str(frac)]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kvt cascade", description="A small -> large cascade from a finished run's "
                                 "records: accuracy and compute per query as the escalation rate sweeps from 0 to 100%.")
    ap.add_argument("records", type=Path, help="records-*.jsonl of a run.py (source, target, transfer)")
    ap.add_argument("--recompute", type=Path, help="records of the same run with a --recompute-* budget")
    ap.add_argument("--frac", type=float, default=0.1, help="that run's recompute fraction, for its cost")
    ap.add_argument("--shapes", default="qwen3-0.6b:1.7b", help="FAMILY-SMALL:LARGE whose FLOPs price a query")
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length that prices a query")
    ap.add_argument("--scope", default="layer", choices=["layer", "head"], help="the mapper's, for its cost")
    ap.add_argument("--k", type=int, default=8, help="the mapper's source layers per target layer, for its cost")
    ap.add_argument("--bench", type=Path, help="a kvt bench --json file of the same shapes, for seconds")
    ap.add_argument("--png", type=Path, help="also draw accuracy against cost (needs matplotlib)")
    args = ap.parse_args(argv)
    at_least("tokens", args.tokens)
    at_least("k", args.k)
    if not 0 <= args.frac <= 1:
        raise KvtError(f"--frac {args.frac}: a fraction of the prompt, within [0, 1]")
    names = parse_pair(args.shapes)
    small, large = (shape(n) for n in names)
    if forward_flops(small, args.tokens, last=True) >= forward_flops(large, args.tokens, last=True):
        raise KvtError(f"--shapes {args.shapes}: {names[0]} is not smaller than {names[1]}; name the small model "
                       f"first, e.g. {names[1]}:{names[0].split('-')[-1]}")
    recompute = args.recompute and (read(args.recompute), check_recompute(args.records, args.recompute))[0]
    rows = items(read(args.records), recompute or None)
    base, escalate = costs(small, large, args.tokens, args.scope, args.k, args.frac)
    seconds = (bench_seconds(args.bench, " -> ".join(names), args.tokens, args.frac if args.recompute else None)
               if args.bench else None)
    table = sweep(rows, base, escalate)
    print(f"cascade over {len(rows)} items ({args.records}); cost per query in large-model "
          f"prefills of {args.tokens} tokens, {args.shapes} shapes, {args.scope} scope k={args.k}"
          + (f", recompute {100 * args.frac:g}%" if args.recompute else ""))
    print(format_sweep(table, seconds))
    if args.png:
        plt = pyplot(say=True)
        if plt is None:
            return table
        fig, ax = plt.subplots(figsize=(4.5, 3.4))
        for way in table[0]["accuracy"]:
            ax.plot([r["cost"][way] for r in table], [100 * r["accuracy"][way] for r in table], marker="o", label=way)
        ax.set_xlabel(f"compute per query (large-model prefills, {args.tokens} tokens)")
        ax.set_ylabel("accuracy (%)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.png, dpi=150)
        print(f"wrote {args.png}")
    return table


if __name__ == "__main__":
    command(main)  # as `kvt cascade`: an error is one line
