"""Evaluation time at several batch sizes, side by side in one process, and whether the records agree.

    python -m tests.bench_eval                                   # the toy pair, toy_recall + toy_recall_gen
    python -m tests.bench_eval --source weights/smollm2-135m --target weights/smollm2-135m \\
        --tasks arc_easy,gsm8k --limit 16 --max-new-tokens 32    # a real checkpoint (KVT_DATA for the data)

Every condition a run evaluates (target, floor, source, transfer) on the same items; the transfer uses a
random mapper of the pair's shapes (timing needs no fit). Each round times evaluate() once per batch
size, in turn, after a warm-up round; the table gives each size's median seconds, min and max, and the
speedup over the first size twice: of the medians and per round (kvt.harness.bench.per_round). The last lines
say how far the batched records are from the first size's: the largest loglikelihood difference and how
many generated outputs differ.
"""
import argparse
import time
from pathlib import Path

import torch

import kvt
from kvt.harness import evals, tasks
from kvt.bench import Timing, per_round
from kvt.harness.bench import hardware, random_mapper


def run_once(task_items, tok, conds, batch, max_new_tokens):
    start = time.perf_counter()
    records = {}
    for task, items in task_items.items():
        options = {"max_new_tokens": max_new_tokens} if max_new_tokens and tasks.get(task).kind == "generate_until" else {}
        for r in evals.evaluate(task, items, tok, conds, progress=False, batch_size=batch, **options):
            records[(task, r["condition"], r["id"])] = r
    return time.perf_counter() - start, records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", type=Path, default=Path("weights/toy-s"))
    ap.add_argument("--target", type=Path, default=Path("weights/toy-m"))
    ap.add_argument("--tasks", default="toy_recall,toy_recall_gen")
    ap.add_argument("--limit", type=int, default=32, help="items per task")
    ap.add_argument("--batches", default="1,8", help="batch sizes to time, the first the reference")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, help="generation tasks: at most this many tokens (default: the task's)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    dtype, batches = getattr(torch, args.dtype), [int(b) for b in args.batches.split(",")]
    source, target = (kvt.load_model(p, dtype, args.device) for p in (args.source, args.target))
    tok = kvt.load_tokenizer(args.target)
    mapper = random_mapper(source.config, target.config, "layer", 8, torch.float32, args.device)
    conds = evals.conditions(target, source, evals.transfer(source, target, mapper))
    task_items = {t: tasks.load_task(t, tasks.default_data_dir(), args.limit) for t in args.tasks.split(",")}
    times, records = {b: [] for b in batches}, {}
    for round_ in range(args.repeats + 1):                       # round 0: the warm-up, not timed
        for b in batches:
            seconds, records[b] = run_once(task_items, tok, conds, b, args.max_new_tokens)
            if round_:
                times[b].append(seconds)
    timing = {b: Timing(t) for b, t in times.items()}
    n = sum(len(its) for its in task_items.values())
    print(f"{args.source.name} -> {args.target.name}, {args.tasks}, {n} items x {len(conds)} conditions, {args.dtype} "
          f"on {hardware(args.device)}; median of {args.repeats} after a warm-up")
    print(f"{'batch':>6} {'seconds':>9} {'min':>8} {'max':>8} {'items/s':>8} {'speedup':>8} {'per round (min-max)':>22}")
    first = batches[0]
    for b in batches:
        med, lo, hi = per_round(timing[first], timing[b])
        print(f"{b:6d} {timing[b]:9.2f} {timing[b].min:8.2f} {timing[b].max:8.2f} {n / timing[b]:8.2f} "
              f"{timing[first] / timing[b]:8.2f} {f'{med:.2f} ({lo:.2f}-{hi:.2f})':>22}")
    def scores(r):                                              # a record's loglikelihoods, if it has any
        return r.get("lls") or ([r["ll"]] if "ll" in r else [])
    for b in batches[1:]:
        ll = [abs(x - y) for key, r in records[first].items() for x, y in zip(scores(r), scores(records[b][key]))]
        outs = [key for key, r in records[first].items() if r.get("output") != records[b][key].get("output")]
        print(f"batch {b} vs {first}: largest loglikelihood difference {max(ll, default=0):.2e}, "
              f"{len(outs)} of {sum('output' in r for r in records[first].values())} generated outputs differ")

if __name__ == "__main__":
    main()
