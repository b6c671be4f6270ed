"""kvt end to end: calibrate (or reuse) a mapper for a pair, check it, evaluate, benchmark, report.

    python run.py                                  # the toy family, offline, seconds on a CPU (README; or: kvt run)
    python run.py --pair qwen3-14b:32b             # weights/qwen3-14b -> weights/qwen3-32b
    python run.py --source DIR --target DIR --tasks arc_easy --limit 200

This is the last stage of the data flow: it calls every other one. run.py, at the top of the
repository, and the installed `kvt run` command (kvt/cli.py) both run main().

The default mapper is the paper's configuration for every pair: layer scope (each target head reads all
heads of the k selected source layers), k = 8, calibration on 500 sequences of 1,024 tokens (toy
pairs: 200 of 256 from the toy corpus, the length toy models are trained on). Where kvt's defaults go
beyond the paper they say so: the ridge lambda is picked per target layer and kind on a validation
region (the paper states none), and features are standardized (ridge.py).

Steps, each a call into one kvt stage:
  1. checks before heavy work: the pair is matched-KV (or --scope layer), both tokenizers are the same,
     weights and task data are present, the contexts fit the models, the memory plan fits;
  2. calibration sequences in three disjoint regions (data.py) -> statistics, layer selection, ridge
     (mapper.calibrate), saved to OUT/mapper-<settings>.safetensors and reused when it exists;
     `--mapper mlp` swaps ridge for the paper's MLP, `--mapper ridge+mlp` adds kvt's residual one;
  3. diagnostics on the diagnostics region and the gate (handoff.py);
  4. every task (tasks.py; --task-file adds the user's own) under target / transfer / source / floor
     (evals.py) on one seeded sample of items, one record per item and condition appended to
     OUT/records-<settings>.jsonl as it is computed, so an interrupted run resumes;
  5. prefill vs transfer timings (bench.py);
  6. OUT/results.json (kvt's numbers, the same in lm-evaluation-harness's layout per condition under
     "lm_eval", and the versions and hardware behind them) and OUT/report.md, and the tables on stdout.
A problem the user can fix is one line on stderr and exit code 2.
"""
import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

import kvt
from kvt import dist, evals, fast, ridge, tasks, toy
from kvt.bench import bench, format_rows, hardware, random_mapper
from kvt.config import (KvtError, at_least, check_matched_kv, checkpoint_name, find_weights, load_config, parse_pair,
                        plain_requested)
from kvt.data import calibration_sequences, check_same_tokenizer, heldout_windows
from kvt.figures import retention_png
from kvt.handoff import MAX_KL, MIN_ATTN_COS, Recompute, diagnose, format_diagnostics, gate, next_nll
from kvt.mapper import FORMAT as MAPPER_FORMAT
from kvt.mapper import add_mlp, calibrate, check_pair_weights, load_mapper, save_mapper
from kvt.model import check_weights, layer_devices
from kvt.plan import capacity, check_plan, disk_plan, eval_batch, format_plan, plan, split_to_fit
from kvt.stats import FORMAT as STATS_FORMAT
from kvt.stats import add_batch as stats_add_batch
from kvt.summary import (CORPUS, average_retention, context_gain, coqa_agreement, coqa_turns, lm_eval_results,
                          summarize)
from kvt.weights import fingerprint

TOY_TASKS = "toy_recall,toy_recall_gen,toy_copy,toy_count"
REAL_TASKS = "hellaswag,arc_easy,arc_challenge,mmlu,gsm8k"
REAL_CALIB = ("calib/wikitext-2", "calib/gutenberg")    # under the data folder: about 3.7M tokens of prose
RECORDS_FORMAT = "kvt-records-3"                         # 3: keyed by what was scored (item_key)
SMALL_WIDTH = 512  # models narrower than this run on one CPU thread (the toy family: 64-128 wide)
MLP_MODES = {"mlp": "replace", "ridge+mlp": "residual"}
MAX_LAM = 1e4    # --lam beyond 100x the grid's largest: every standardized direction shrunk to near zero


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="kvt run", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="toy-s:m", help="FAMILY-SRC:TGT, read from WEIGHTS/<name> (default: the toy family)")
    ap.add_argument("--source", type=Path, help="source checkpoint folder (instead of --pair)")
    ap.add_argument("--target", type=Path, help="target checkpoint folder (instead of --pair)")
    ap.add_argument("--weights", type=Path, help="folder of checkpoint folders (default: ./weights, then the toy "
                    "family kvt ships)")
    ap.add_argument("--data-dir", type=Path, default=Path(tasks.default_data_dir()), help="task data ($KVT_DATA)")
    ap.add_argument("--calib", nargs="*", help="calibration text files or folders (default: DATA/calib/wikitext-2 "
                    "and DATA/calib/gutenberg; the toy corpus for toy pairs)")
    ap.add_argument("--calib-seqs", type=int, help="fit sequences (paper: 500; toy default 200), plus a tenth for "
                    "validation and a twentieth for diagnostics, from other documents")
    ap.add_argument("--calib-len", type=int, help="tokens per sequence (paper: 1024; toy default 256)")
    ap.add_argument("--k", type=int, default=8, help="source layers per target layer (paper: 8)")
    ap.add_argument("--lam", type=float, help="ridge lambda on standardized features (default: the best of "
                    "ridge.LAMBDAS per target layer and kind, on the validation region; the paper gives none)")
    ap.add_argument("--scope", choices=["layer", "head", "head-local"], default="layer",
                    help="layer: each target head from all heads of the selected layers (the paper's, default); "
                    "head (= head-local, CacheBridge's name): head h from head h of the selected layers (kvt's "
                    "option, about 8x smaller)")
    ap.add_argument("--token-weights", choices=["uniform", "attention"], default="uniform",
                    help="ridge token weights: uniform (the paper's, default) or attention (CacheBridge's "
                    "attention-weighted fit, kvt's option; --scope head only, kvt/attnfit.py)")
    ap.add_argument("--mapper", choices=["ridge", "mlp", "ridge+mlp"], default="ridge",
                    help="mlp: the paper's backstop, an MLP of two hidden layers of 1,024 units instead of ridge; "
                    "ridge+mlp: kvt's option, ridge plus a residual MLP of one hidden layer")
    ap.add_argument("--tasks", help=f"comma-separated (default toy: {TOY_TASKS}; real: {REAL_TASKS}); none: no tasks")
    ap.add_argument("--task-file", type=Path, action="append", default=[],
                    help="a Python file of your own tasks (kvt.tasks.Task), imported before --tasks is read; "
                    "repeat for several")
    ap.add_argument("--limit", type=int, help="items per task, a seeded sample (default: toy 200, real 500)")
    ap.add_argument("--task-limit", action="append", default=[], metavar="TASK=N",
                    help="items of one task, overriding --limit (repeatable), e.g. coqa=50")
    ap.add_argument("--seed", type=int, default=0, help="the item sample and the calibration draw")
    ap.add_argument("--batch-size", type=int, help="items evaluated together, left-padded (default: on a GPU the "
                    "largest power of two up to 64 the memory plan fits, plan.eval_batch; on a CPU 8); records "
                    "equal batch 1's within the dtype's rounding, so a resumed run may change it")
    ap.add_argument("--bench", dest="bench", action="store_true", default=True)
    ap.add_argument("--no-bench", dest="bench", action="store_false")
    ap.add_argument("--bench-lengths", help="context lengths to time (default: toy 256,512,1024; CPU 512..4096; "
                    "GPU up to 32768)")
    ap.add_argument("--recompute-last", type=int, default=0, help="kvt's option: after mapping, the target "
                    "recomputes the KV of the last R prompt tokens itself (the last one it always runs)")
    ap.add_argument("--recompute-first", type=int, default=0, help="kvt's option: ... of the first S tokens")
    ap.add_argument("--recompute-frac", type=float, default=0.0, help="kvt's option: ... of this fraction of the "
                    "tokens, those the source attended to most while finishing the prompt")
    ap.add_argument("--recompute-by", choices=["attention", "suffix"], default="attention",
                    help="which tokens --recompute-frac takes: the most attended (default) or the last ones")
    ap.add_argument("--heldout", nargs="*", default=[], help="held-out text files for the context-gain measure "
                    "(NLL of the next --nll-next tokens after --nll-context of context, target / transfer / floor); "
                    "'toy' for unseen toy-corpus documents; none by default; must not be calibration text")
    ap.add_argument("--nll-windows", type=int, default=32, help="windows per held-out text (default 32)")
    ap.add_argument("--nll-context", help="comma-separated context lengths (default: 1024; toy 128); those the "
                    "models cannot hold with --nll-next after them are skipped")
    ap.add_argument("--nll-next", type=int, help="tokens scored after the context (default 256; toy 64)")
    ap.add_argument("--min-attn-cos", type=float, default=MIN_ATTN_COS, help="gate: mean attention-output cosine "
                    f"(default {MIN_ATTN_COS}, from the gate evidence in docs/real-weights.md)")
    ap.add_argument("--max-kl", type=float, default=MAX_KL, help=f"gate: next-token KL in nats (default {MAX_KL})")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--devices", help="split both models by layers over these, e.g. cuda:0,cuda:1 (under "
                    "torchrun: shared out among the ranks of a node)")
    ap.add_argument("--context", type=int, help="longest context to plan memory for (default: the longest bench length)")
    ap.add_argument("--stats-dtype", choices=["float64", "float32"], default="float64",
                    help="calibration statistics (float32 halves them; solves stay float64)")
    ap.add_argument("--keep-stats", action="store_true", help="keep the calibration statistics files once the "
                    "mapper is saved (tens of GiB on a large pair; another --lam or --k reuses them)")
    ap.add_argument("--candidates", type=int, help="consider only this many evenly spaced source layers")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="model dtype (default: bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--plain", action="store_true", help="run every step's plain path (= KVT_PLAIN=1): the method "
                    "as tutorial.md writes it, to step through with a debugger; the same results, slower")
    ap.add_argument("--out", type=Path, help="output folder (default: runs/<src>_<tgt>)")
    return ap.parse_args(argv)


def check_args(args):
    """Refuse, with one line each, the settings that can only fail later (or silently do something else)."""
    positive = at_least
    if args.scope == "head-local":                 # CacheBridge's name for kvt's head scope: the same map
        args.scope = "head"
    positive("nll-windows", args.nll_windows, why=" (held-out windows per text)")
    positive("nll-next", args.nll_next, why=" (tokens scored after the context)")
    if args.token_weights == "attention" and args.scope != "head":
        raise KvtError("--token-weights attention is the head-local attention-weighted fit; add --scope head")
    positive("k", args.k, why=" (source layers per target layer; the paper uses 8)")
    positive("calib-seqs", args.calib_seqs, why=" (calibration sequences; the paper uses 500)")
    positive("calib-len", args.calib_len, 2, " (tokens per calibration sequence; the paper uses 1024)")
    positive("limit", args.limit, why=" (items per task)")
    for spec in args.task_limit:
        name, _, n = spec.partition("=")
        if not n.isdigit() or int(n) < 1:
            raise KvtError(f"--task-limit {spec!r}: give TASK=N with N at least 1, e.g. coqa=50")
    positive("candidates", args.candidates, 2, " (source layers to select from)")
    positive("recompute-last", args.recompute_last, 0, " (prompt tokens the target recomputes)")
    positive("recompute-first", args.recompute_first, 0, " (prompt tokens the target recomputes)")
    if not 0 <= args.recompute_frac <= 1:
        raise KvtError(f"--recompute-frac {args.recompute_frac}: a fraction of the prompt, within [0, 1]")
    if args.lam is not None and not (math.isfinite(args.lam) and args.lam > 0):
        raise KvtError(f"--lam {args.lam}: the ridge lambda must be a positive number (or leave it out to pick one "
                       "per target layer on validation data)")
    if args.lam is not None and args.lam > MAX_LAM:
        raise KvtError(f"--lam {args.lam:g}: above {MAX_LAM:g} the ridge shrinks the map to nearly zero (lambda is "
                       f"relative to each standardized feature's variance of 1; the grid ends at {ridge.LAMBDAS[-1]:g}); "
                       f"give at most {MAX_LAM:g}, or leave it out to pick one per target layer")
    for name in ("min_attn_cos", "max_kl"):
        if not math.isfinite(getattr(args, name)):
            raise KvtError(f"--{name.replace('_', '-')} must be a number")
    if not -1 <= args.min_attn_cos <= 1:
        raise KvtError(f"--min-attn-cos {args.min_attn_cos}: a cosine, within [-1, 1]")
    if args.max_kl < 0:
        raise KvtError(f"--max-kl {args.max_kl}: a KL divergence is never negative; give a threshold of at least 0")
    if args.tasks is not None and not [t for t in args.tasks.split(",") if t.strip()]:
        raise KvtError(f"--tasks is empty; name at least one task (known: {', '.join(tasks.TASKS)})")
    if args.nll_context is not None:
        try:
            contexts = [int(n) for n in args.nll_context.split(",")]
        except ValueError:
            contexts = []
        if not contexts or min(contexts) < 1:
            raise KvtError(f"--nll-context {args.nll_context!r}: give comma-separated context lengths of at least 1 "
                           "token, e.g. 1024,4096")
    if args.bench_lengths is not None:
        try:
            lengths = [int(n) for n in args.bench_lengths.split(",")]
        except ValueError:
            lengths = []
        if not lengths or min(lengths) < 2:
            raise KvtError(f"--bench-lengths {args.bench_lengths!r}: give comma-separated context lengths of at "
                           "least 2 tokens, e.g. 512,1024,2048")
    positive("context", args.context, 2)
    positive("batch-size", args.batch_size, why=" (items per evaluation batch)")
    for name, holds in (("weights", "the checkpoint folders"), ("data_dir", "the task data")):
        folder = getattr(args, name)
        if folder is not None and folder.exists() and not folder.is_dir():
            raise KvtError(f"--{name.replace('_', '-')} {folder} is a file; give the folder that holds {holds}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise KvtError(f"--out {args.out} is a file; give a folder (it is created if missing)")


def check_lengths(lengths, cfgs, tok):
    """Every context the run will build fits both models, and the tokenizer's ids fit their vocabularies."""
    limit = min(c.max_seq_len for c in cfgs)
    if max(lengths) > limit:
        raise KvtError(f"a context of {max(lengths)} tokens exceeds the models' limit of {limit} "
                       "(max_position_embeddings); use shorter --bench-lengths, --context or --calib-len")
    if tok.vocab_size > min(c.vocab_size for c in cfgs):
        raise KvtError(f"the tokenizer has {tok.vocab_size} tokens, more than a model's vocabulary of "
                       f"{min(c.vocab_size for c in cfgs)}; use the tokenizer that came with these weights")


def eval_shape(items, tok):
    """What an evaluation batch holds per item, for plan.eval_batch: the longest prompt in tokens (a context
    with its longest choice and its continuation; a whole conversation), the most continuations an item
    scores (choices, or a multiple_input item's contexts), and the most tokens a task generates."""
    longest, choices, new = 1, 1, 0
    for task, its in items.items():
        kind = tasks.get(task).kind
        for it in its:
            if kind == "coqa":
                text = "".join(tasks.coqa_segments(it))
            else:
                text = it.context + max(it.choices or [""], key=len) + it.continuation
                choices = max(choices, len(it.choices or []))
            longest = max(longest, len(tok.encode(text)))
        if kind in ("generate_until", "coqa"):
            new = max(new, tasks.get(task).max_new_tokens)
    return longest, choices, new


def resolve(args):
    """(source dir, target dir, source name, target name)."""
    if args.source or args.target:
        if not (args.source and args.target):
            raise KvtError("give both --source and --target (or --pair)")
        return args.source, args.target, checkpoint_name(args.source), checkpoint_name(args.target)
    src, tgt = parse_pair(args.pair)
    return find_weights(src, args.weights), find_weights(tgt, args.weights), src, tgt


def short_hash(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:8]


def stats_key(args, src_dir, tgt_dir, calib):
    """What calibration statistics depend on: both checkpoints' weights, the calibration tokens, the
    statistics' dtype and candidates. Another lambda, k or mapper type reuses them."""
    return {"format": STATS_FORMAT, "source": fingerprint(src_dir), "target": fingerprint(tgt_dir),
            "calib": calib.hash(), "stats_dtype": args.stats_dtype, "candidates": args.candidates}


def mapper_key(args, stats):
    """Everything a mapper is made from: its statistics' key and the settings of the fit. A different
    request, or the same one on retrained weights, never reuses a mapper (nor records made with it)."""
    return {**stats, "format": MAPPER_FORMAT, "stats_format": stats["format"], "scope": args.scope, "k": args.k,
            "lambda": args.lam, "mapper": args.mapper, **({"weights": args.token_weights} if args.token_weights != "uniform" else {})}


def mapper_name(args, skey):
    key = mapper_key(args, skey)
    weighted = "-attn" if key.get("weights") == "attention" else ""
    return f"{key['scope']}-k{key['k']}-{key['mapper']}{weighted}-{short_hash(key)}"


def check_disk(out, plans, args, skeys):
    """Refuse, in one line, a run whose output folder lacks the space its calibrations need at most at
    once (plan.disk_plan; mappers already saved need none, statistics already there count as space)."""
    need, kept = 0, 0
    for p, skey in zip(plans, skeys):
        rows = disk_plan(p)
        if not (out / f"mapper-{mapper_name(args, skey)}.safetensors").exists():
            need = max(need, kept + sum(n for _, n in rows))
            kept += rows[-1][1]                                   # its mapper file stays
    have = shutil.disk_usage(out).free + sum(f.stat().st_size for f in out.glob("stats-*"))
    if need > have:
        raise KvtError(f"the output folder {out} has {have / 1e9:.1f} GB free and calibration needs up to "
                       f"{need / 1e9:.1f} GB at once (memory plan, disk); free space or choose another --out")
    return need


def get_mapper(args, source, target, tok, calib, out, skey, dtype, group=None):
    """Load the mapper made from these settings in OUT, or calibrate and save it (statistics checkpointed
    under a name of their own, so another lambda, k or mapper type reads them again)."""
    key, name = mapper_key(args, skey), mapper_name(args, skey)
    path = out / f"mapper-{name}.safetensors"
    if path.exists():
        print(f"reusing {path}")
        mapper = load_mapper(path, source.config, target.config, tok.fingerprint(), key=short_hash(key))
        check_pair_weights(mapper, source, target, f"mapper {path}")          # the key's file fingerprints, checked again
        return mapper.to(dtype=dtype), name
    stats = out / f"stats-{short_hash(skey)}"
    t0 = time.time()
    mapper, report = calibrate(source, target, calib, args.scope, args.k, args.lam, checkpoint=stats,
                               key=short_hash(skey), tokenizer=tok.fingerprint(), group=group,
                               stats_dtype=getattr(torch, args.stats_dtype), candidates=args.candidates,
                               progress=dist.rank() == 0, keep_stats=args.keep_stats, weights=args.token_weights,
                               add=stats_add_batch if args.plain else fast.add_batch)
    if args.mapper in MLP_MODES:
        mapper = add_mlp(mapper, source, target, calib, mode=MLP_MODES[args.mapper], progress=dist.rank() == 0,
                         checkpoint=out / f"mlp-{name}", key=short_hash(key))
    mapper.meta["fit_s"] = time.time() - t0                       # statistics, selection, ridge (and MLP) on this run
    used = mapper.to(dtype=dtype)                                   # the mapper as evaluation and the bench use it
    mapper.meta["diagnostics"] = diagnose(source, target, used, calib.diag, plain=args.plain)  # a region no choice saw
    mapper.meta["r2_single"] = {kind: v.tolist() for kind, v in report["r2_single"].items()}
    mapper.meta["key"] = short_hash(key)
    if dist.rank() == 0:  # every rank fitted the same mapper from the same all-reduced statistics
        save_mapper(mapper, path)
        for f in out.glob(f"mlp-{name}-*.safetensors"):             # the mapper file holds the MLPs now
            f.unlink()
        for f in [] if args.keep_stats else out.glob(f"{stats.name}.*"):   # its statistics and fits, too
            f.unlink()
    used.meta = mapper.meta
    return used, name


# ---- records ---------------------------------------------------------------------------------------------

def record_files(path):
    """The records of one run: `path` and, under torchrun, one file per rank beside it."""
    return [f for f in [path, *sorted(path.parent.glob(f"{path.stem}.rank*.jsonl"))] if f.exists()]


def read_records(path, header):
    """The records of a jsonl file written by open_records, after checking its header line; a torn last
    line (a crash in mid-write) is cut off, so the run redoes that record."""
    with open(path, "rb") as f:
        *lines, torn = f.read().split(b"\n")                      # torn: bytes after the last newline
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise KvtError(f"{path}: line {i + 1} is corrupt; delete the file to evaluate again, or use another --out")
    if torn:
        with open(path, "r+b") as f:
            f.truncate(sum(len(line) + 1 for line in lines))
    if rows and rows[0] != header:
        raise KvtError(f"{path} holds records of other settings or an older kvt ({json.dumps(rows[0])[:120]}); "
                       "delete it or use another --out")
    return rows[1:]


def open_records(path, header):
    """Append mode, with the header as the first line of a new file."""
    new = not path.exists() or path.stat().st_size == 0
    try:
        f = open(path, "a")
    except OSError as e:
        raise KvtError(f"cannot write to {path} ({e.strerror}); make it writable, or choose another --out")
    if new:
        f.write(json.dumps(header) + "\n")
        f.flush()
    return f


def item_key(task, item):
    """What a record scored, as a short hash: the item's fields that reach a model or a score (context,
    choices or continuation, gold, floor, stop strings; a conversation's story, questions and answers) and
    the task's settings that shape one (kind, metrics, longest answer, score function). A record is reused
    only under the same key, so an item whose data changed under the same id is scored again."""
    t = tasks.get(task)
    fields = {k: v for k, v in dataclasses.asdict(item).items() if k != "stratum"}
    score = t.score and f"{t.score.__module__}.{getattr(t.score, '__qualname__', type(t.score).__name__)}"
    what = {"item": fields, "kind": t.kind, "metrics": t.metrics, "score": score, "max_new_tokens": t.max_new_tokens}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def check_old_records(path):
    """Refuse the records of an older kvt beside this run's, keyed by item id alone: they may hold scores of
    items that have changed since, and this run would not know which."""
    for f in path.parent.glob(f"{path.name.rsplit('-', 1)[0]}-*.jsonl"):
        with open(f, "rb") as fh:
            first = fh.readline()
        try:
            fmt = json.loads(first).get("format")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(fmt, str) and fmt.startswith("kvt-records-") and fmt != RECORDS_FORMAT:
            raise KvtError(f"{f} holds records of an older kvt ({fmt}), keyed by item id alone, which cannot tell "
                           "whether an item changed since; delete it to evaluate again, or use another --out")


def run_tasks(args, items, tok, conds, path, header):
    """Evaluate every task's items under conds, appending each record to a jsonl as it lands, so a
    stopped run resumes. Records are keyed by task, condition, item id and item_key (what was scored).
    Under torchrun each rank takes a share of the items still to do and writes its own file. Returns the
    records of exactly these items."""
    check_old_records(path)
    keys = {(task, it.id): item_key(task, it) for task, its in items.items() for it in its}
    done = {(r["task"], r["condition"], r["id"], r.get("key"))
            for f in record_files(path) for r in read_records(f, header)}
    mine = path if dist.world() == 1 else path.with_name(f"{path.stem}.rank{dist.rank()}.jsonl")
    with open_records(mine, header) as f:
        for task, its in items.items():
            todo = [it.id for it in its if any((task, c, it.id, keys[task, it.id]) not in done for c in conds)]
            mine_ids = set(dist.shard(todo))
            skip = {(c, it.id) for it in its for c in conds
                    if it.id not in mine_ids or (task, c, it.id, keys[task, it.id]) in done}
            for rec in evals.evaluate(task, its, tok, conds, done=skip, progress=dist.rank() == 0,
                                      batch_size=args.batch_size):
                f.write(json.dumps({**rec, "key": keys[task, rec["id"]]}) + "\n")
                f.flush()
    dist.barrier()
    return [r for f in record_files(path) for r in read_records(f, header)
            if keys.get((r["task"], r["id"])) == r.get("key")]


# ---- report ----------------------------------------------------------------------------------------------

def pct(x, digits=1):
    return "-" if x is None else f"{100 * x:.{digits}f}"


def format_summary(summary, average, src_name, tgt_name):
    """The paper's table: accuracy per condition, retention and floor-normalized retention, and the
    average retention over tasks of each task's primary metric (the paper's headline column)."""
    lines = [f"| task | metric | target ({tgt_name}) | transfer | source ({src_name}) | floor | retention | floor-norm. retention | n |",
             "|---|---|---|---|---|---|---|---|---|"]

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
                         f"{ret(r, 'floor_normalized')} | {conds.get('target', {}).get('n', 0)} |")
    if average and average.get("tasks"):
        acc = {c: {"mean": v, "mean_ci": average["accuracy_ci"][c]} for c, v in average["accuracy"].items()}
        lines.append(f"| **average** ({len(average['tasks'])} tasks) | primary | {cell(acc.get('target'), 'mean')} | "
                     f"{cell(acc.get('transfer'), 'mean')} | {cell(acc.get('source'), 'mean')} | "
                     f"{cell(acc.get('floor'), 'mean')} | {ret(average, 'retention')} | {ret(average, 'floor_normalized')} | |")
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
    needs it) and the processor (kvt.bench.hardware)."""
    try:
        transformers = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers = None
    return {"kvt": kvt.__version__, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers, "hardware": hardware(device)}


def bench_default(is_toy, device):
    return "256,512,1024" if is_toy else ("2048,8192,32768" if device.startswith("cuda") else "512,1024,2048,4096")


def write_atomic(path, text):
    tmp = Path(f"{path}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:  # e.g. a folder of that name: the records are kept, a rerun only writes the report
        raise KvtError(f"cannot write {path} ({e.strerror}); move it away and run again (the results are kept)")


def heldout_texts(args, is_toy):
    """[(name, documents or None, path)]: the held-out texts of the context-gain measure; refuses one that is
    (or is inside, or holds) calibration text."""
    out = []
    for h in args.heldout:
        if h == "toy":
            out.append(("toy corpus (seed 98)", toy.corpus(400, seed=98), None))   # calibration: seed 99
            continue
        p = Path(h).resolve()
        if not p.exists():
            raise KvtError(f"--heldout {h} does not exist; pass a .txt file (or 'toy')")
        for c in map(lambda x: Path(x).resolve(), args.calib):
            if p == c or c in p.parents or p in c.parents:
                raise KvtError(f"--heldout {h} is calibration text too (--calib {c}); calibrate on other text "
                               "(e.g. --calib DATA/calib/wikitext-2/valid.txt) or hold out another file")
        out.append((p.name, None, p))
    return out


def measure_context_gain(args, source, target, mapper, tok, is_toy):
    """One row per held-out text and context length: context_gain over --nll-windows windows."""
    next_n = args.nll_next or (64 if is_toy else 256)
    contexts = [int(c) for c in (args.nll_context or ("128" if is_toy else "1024")).split(",")]
    limit = min(source.config.max_seq_len, target.config.max_seq_len)
    rows = []
    for name, docs, path in heldout_texts(args, is_toy):
        for c in contexts:
            if c + next_n > limit:
                print(f"context gain: {c} + {next_n} tokens exceed the models' {limit}; skipped")
                continue
            ids = heldout_windows(path, tok, args.nll_windows, c + next_n, documents=docs)
            row = context_gain(next_nll(source, target, mapper, ids, c, plain=args.plain), seed=args.seed)
            rows.append({"text": name, "context": c, "next": next_n, **row})
    return rows


def format_context_gain(rows):
    lines = ["| held-out text | context | next | windows | NLL target | NLL transfer | NLL floor | context gain kept |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["gain_ci"]
        ci = f" [{pct(lo)}, {pct(hi)}]" if lo is not None else ""
        lines.append(f"| {r['text']} | {r['context']} | {r['next']} | {r['windows']} | {r['nll']['target']:.4f} | "
                     f"{r['nll']['transfer']:.4f} | {r['nll']['floor']:.4f} | {pct(r['gain'])}%{ci} |")
    return "\n".join(lines)


def main(argv=None):
    """Run everything (see the module docstring); returns the results dict. A run that fails leaves no
    empty output folder behind (a folder with a checkpoint in it stays: the rerun resumes from it)."""
    args = parse_args(argv)
    check_args(args)
    fast.keep_freed_memory()                     # process-wide: glibc keeps freed blocks for the next cache
    args.plain = args.plain or plain_requested()  # --plain or KVT_PLAIN=1: every step's plain path, passed on
    src_dir, tgt_dir, src_name, tgt_name = resolve(args)
    out = args.out or Path("runs") / f"{src_name}_{tgt_name}"
    created, threads = not out.exists(), torch.get_num_threads()
    try:
        return run(args, src_dir, tgt_dir, src_name, tgt_name, out)
    except BaseException:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
    finally:
        torch.set_num_threads(threads)


def calibration_defaults(args, is_toy):
    """Fill in what the user left out of the calibration: the text (none for a toy pair: the toy corpus,
    toy_calibration_text; else WikiText-2 and Gutenberg under --data-dir), 200 x 256 tokens for a toy pair
    (the length its models are trained on), the paper's 500 x 1024 for any other."""
    args.calib = args.calib or ([] if is_toy else [args.data_dir / c for c in REAL_CALIB])
    args.calib_seqs = (200 if is_toy else 500) if args.calib_seqs is None else args.calib_seqs
    args.calib_len = (256 if is_toy else 1024) if args.calib_len is None else args.calib_len


def toy_calibration_text(args, is_toy):
    """The toy corpus's documents to calibrate a toy pair on when no --calib is given (seed 99: unseen
    in training, which used seed 0), else None."""
    return toy.corpus(2000, seed=99) if is_toy and not args.calib else None


def run(args, src_dir, tgt_dir, src_name, tgt_name, out):
    t0 = time.time()
    is_toy = src_name.startswith("toy-") or args.tasks is not None and args.tasks.startswith("toy_")
    calibration_defaults(args, is_toy)
    args.limit = (200 if is_toy else 500) if args.limit is None else args.limit
    origin = {}  # task name -> the task file that defined it
    for f in args.task_file:  # the user's tasks, registered before --tasks is read
        names = tasks.load_task_file(f)
        twice = [n for n in names if n in origin]
        if twice:
            raise KvtError(f"task {twice[0]!r} is defined in both {origin[twice[0]]} and {f}; give each its own name")
        origin.update(dict.fromkeys(names, f))
        print(f"{f}: tasks {', '.join(names)}")
    task_names = [t.strip() for t in (args.tasks or (TOY_TASKS if is_toy else REAL_TASKS)).split(",") if t.strip()]
    task_names = [] if task_names == ["none"] else task_names      # --tasks none: diagnostics (and --heldout) only
    limits = {name: int(n) for name, _, n in (spec.partition("=") for spec in args.task_limit)}
    for name in limits:
        if name not in task_names:
            raise KvtError(f"--task-limit {name}={limits[name]}: {name!r} is not a task of this run "
                           f"({', '.join(task_names)}); check its name")
    dist.check_devices(args.devices.split(",") if args.devices else [args.device])
    devices = dist.init(args.devices.split(",") if args.devices else [args.device])
    args.device = devices[0]
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))

    # 1. checks before heavy work
    src_cfg, tgt_cfg = load_config(src_dir, args.calib_len), load_config(tgt_dir, args.calib_len)
    if args.device == "cpu" and max(src_cfg.dim, tgt_cfg.dim) < SMALL_WIDTH:
        torch.set_num_threads(1)  # as toy.py trains them: a second thread only waits on the first (main restores it)
    check_matched_kv(src_cfg, tgt_cfg, args.scope)
    src_tok, tok = kvt.load_tokenizer(src_dir), kvt.load_tokenizer(tgt_dir)
    check_same_tokenizer(src_tok, tok)
    lengths = [int(n) for n in (args.bench_lengths or bench_default(is_toy, args.device)).split(",")]
    check_lengths((lengths if args.bench else []) + [args.calib_len, args.context or 2], (src_cfg, tgt_cfg), tok)
    for cfg, folder in ((src_cfg, src_dir), (tgt_cfg, tgt_dir)):  # the configs' sizes feed the memory plan: check
        check_weights(cfg, folder)                                   # them against the weights' headers first
    heldout_texts(args, is_toy)                    # refused now if it is calibration text, not after calibrating
    items = {task: tasks.load_task(task, args.data_dir, limits.get(task, args.limit), seed=args.seed) for task in task_names}
    toy_text = toy_calibration_text(args, is_toy)
    missing = [str(p) for p in args.calib if not Path(p).exists()]
    if missing and not is_toy and args.calib == [args.data_dir / c for c in REAL_CALIB]:
        raise KvtError(f"no calibration text at {', '.join(missing)}; point --data-dir (or KVT_DATA) at a data folder "
                       "with calib/wikitext-2 (WikiText-2 raw, .txt) and calib/gutenberg (Project Gutenberg books, "
                       ".txt), "
                       "e.g. ../shared/data, or pass --calib with your own .txt/.jsonl/.json files or folders")
    calib = calibration_sequences(args.calib, tok, args.calib_seqs, args.calib_len, seed=args.seed, documents=toy_text,
                                  cache=None if toy_text else out, progress=dist.rank() == 0)
    skey = stats_key(args, src_dir, tgt_dir, calib)
    cap = capacity(devices)
    plans = {}                                     # the plan of every mapper this run fits, checked before any of it
    for way, a, b, names in [("forward", src_cfg, tgt_cfg, (src_name, tgt_name))] + (
            [("back", tgt_cfg, src_cfg, (tgt_name, src_name))] if "coqa" in task_names else []):
        plans[way] = split_to_fit(plan(a, b, args.scope, args.k, args.context or max(lengths + [args.calib_len]),
                                         dtype, devices, calib_len=args.calib_len,
                                         stats_dtype=getattr(torch, args.stats_dtype), candidates=args.candidates,
                                         bench=args.bench and not plans), cap)
        if dist.rank() == 0:
            print(format_plan(plans[way], cap, " -> ".join(names)))
    for p in plans.values():
        check_plan(p, cap)
    memory = plans["forward"]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KvtError(f"cannot create the output folder {out} ({e.strerror}); choose another --out")
    try:  # a folder that exists but takes no files (read-only) fails here, not at the first save after calibration
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise KvtError(f"cannot write in the output folder {out} ({e.strerror}); choose another --out")
    skeys = [skey] + ([stats_key(args, tgt_dir, src_dir, calib)] if len(plans) > 1 else [])
    disk = check_disk(out, plans.values(), args, skeys)
    if dist.rank() == 0:
        print(f"disk: calibration writes up to {disk / 1e9:.1f} GB at once under {out} "
              f"({'kept' if args.keep_stats else 'statistics deleted once each mapper is saved'})")
    source = kvt.load_model(src_dir, dtype, devices=devices)
    target = kvt.load_model(tgt_dir, dtype, devices=devices)
    print(f"{src_name} ({src_cfg.n_layers} layers) -> {tgt_name} ({tgt_cfg.n_layers} layers), {dtype} on {args.device}")

    # 2-3. mapper and its diagnostics, with its weights where the target keeps each layer
    mapper, name = get_mapper(args, source, target, tok, calib, out, skey, dtype, memory.options["group"])
    mapper = mapper.place(layer_devices(target))
    diag = mapper.meta["diagnostics"]
    fit, reasons = gate(diag, args.min_attn_cos, args.max_kl)
    print(format_diagnostics(diag))
    print("gate: fit for use" if fit else "gate: UNFIT: " + "; ".join(reasons))

    # 4. evaluation, all conditions on the same items
    recompute = Recompute(args.recompute_last, args.recompute_first, args.recompute_frac, args.recompute_by)
    header = {"format": RECORDS_FORMAT, "mapper": name, "dtype": str(dtype),
              **({"recompute": [recompute.last, recompute.first, recompute.frac]} if recompute else {}),
              **({"recompute_by": recompute.by} if recompute.frac and recompute.by != "attention" else {})}
    conds = evals.conditions(target, source, evals.transfer(source, target, mapper, recompute, args.plain), args.plain)
    if args.batch_size is None:
        context, choices, new = eval_shape(items, tok)
        args.batch_size = eval_batch(src_cfg, tgt_cfg, cap, context, choices, new, args.scope, args.k, dtype, devices)
    print(f"evaluation: {args.batch_size} items a batch (--batch-size)")
    records = run_tasks(args, items, tok, conds, out / f"records-{name}-{short_hash(header)}.jsonl", header)
    summary, average = summarize(records), average_retention(records)
    coqa = {}
    if "coqa" in task_names:  # the other direction: the large model hands the conversation to the small one
        back_key = stats_key(args, tgt_dir, src_dir, calib)
        back, back_name = get_mapper(args, target, source, tok, calib, out, back_key, dtype,
                                     plans["back"].options["group"])
        back = back.place(layer_devices(source))
        rev_header = dict(header, mapper=back_name)
        rev = run_tasks(args, {"coqa": items["coqa"]}, tok,
                        {"target": evals.Condition(source, plain=args.plain),
                         "transfer": evals.Condition(source, evals.transfer(target, source, back, plain=args.plain),
                                                     plain=args.plain)},
                        out / f"records-{back_name}-{short_hash(rev_header)}.jsonl", rev_header)
        coqa = {f"{src_name} -> {tgt_name}": {"gold": coqa_turns(records), "agreement": coqa_agreement(records)},
                f"{tgt_name} -> {src_name}": {"gold": coqa_turns(rev), "agreement": coqa_agreement(rev)}}

    if dist.rank() != 0:
        return dist.close()

    gains = measure_context_gain(args, source, target, mapper, tok, is_toy) if args.heldout else []

    # 5. speed
    rows = []
    if args.bench:
        back = random_mapper(tgt_cfg, src_cfg, args.scope, args.k, dtype, args.device)  # timing needs no fit
        rows = bench(source, target, mapper, back, lengths, names=(src_name, tgt_name),
                     fracs=[recompute.frac] if recompute.frac else [], plain=args.plain)

    # 6. report
    table = format_summary(summary, average, src_name, tgt_name)
    k_used = mapper.meta.get("k", args.k)
    report = [f"# kvt: {src_name} -> {tgt_name}", "",
              f"mapper: {name}, {args.mapper}, {args.scope} scope, {args.token_weights} weights, k={k_used}"
              + (f" (of {args.k} asked; the source has {src_cfg.n_layers} layers)" if k_used != args.k else "")
              + f", {mapper.n_params():,} parameters ({mapper.nbytes() / 2**20:.1f} MiB); calibration {len(calib.fit)} x "
              f"{args.calib_len} tokens (validation {len(calib.val)}, diagnostics {len(calib.diag)} sequences)",
              f"lambda (on standardized features): {lambda_summary(mapper.meta)}",
              *([f"recompute (kvt's option): the target recomputes the last {recompute.last}, the first "
                 f"{recompute.first} and {100 * recompute.frac:g}% "
                 f"{'most attended' if recompute.by == 'attention' else 'last'} prompt tokens after mapping"]
                if recompute else []),
              f"items: a seeded sample (seed {args.seed}) of up to {args.limit} per task"
              + "".join(f", {t} {n}" for t, n in limits.items()) + ", the same for every condition", "",
              "## Calibration diagnostics (held-out)", "", "```", format_diagnostics(diag),
              "gate: " + ("fit" if fit else "UNFIT: " + "; ".join(reasons)), "```", "",
              "## Accuracy (%, 95% interval) and retention", "", table]
    if gains:
        report += ["", "## Context gain kept (held-out next-token NLL, nats; 95% interval over windows)", "",
                   format_context_gain(gains)]
    for direction, c in coqa.items():
        g, a = c["gold"], c["agreement"]
        report += ["", f"## CoQA, handed over {direction}: gold F1 per turn", "",
                   "| turn | " + " | ".join(str(t) for t in g["turns"]) + " |",
                   "|---|" + "---|" * len(g["turns"])]
        for cond in ("target", "transfer"):
            report.append(f"| {cond} | " + " | ".join(f"{f:.1f}" for f in g["f1"][cond]) + " |")
        num = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
        report += ["", f"gold F1 target {num(g['mean']['target']['f1'], '.1f')}, transfer "
                   f"{num(g['mean']['transfer']['f1'], '.1f')} (EM {num(g['mean']['target']['em'], '.1f')} / "
                   f"{num(g['mean']['transfer']['em'], '.1f')}); gap target - transfer {num(g['mean_gap'], '+.1f')} F1 "
                   f"points, its drift {num(g['drift']['gap'], '+.2f')} points per turn; transfer scored against the "
                   f"target's own answers: F1 {num(a['mean'], '.1f')}, drift {num(a['drift_per_turn'], '+.2f')} per turn"]
    if rows:
        report += ["", "## Prefill vs transfer (seconds, median)", "", f"{hardware(args.device)}; {dtype}", "",
                   format_rows(rows)]
    shown = {t: tasks.get(t).primary for t in summary if tasks.get(t).primary not in CORPUS}
    if shown:
        drawn = retention_png({t: summary[t] for t in shown}, shown, out / "retention.png", f"{src_name} -> {tgt_name}")
        at = report.index("## Accuracy (%, 95% interval) and retention") + 2
        report[at:at] = (["![retention](retention.png)", ""] if drawn else  # above the table it draws
                         ["(no retention figure: matplotlib is not installed; pip install kvt[plots] draws it)", ""])
    report += ["", f"wall time {time.time() - t0:.0f} s"]
    write_atomic(out / "report.md", "\n".join(report) + "\n")
    settings = {k: (str(v) if isinstance(v, Path) else [str(x) for x in v] if isinstance(v, list) else v)
                for k, v in vars(args).items()}
    results = {"pair": [src_name, tgt_name], "mapper": name, "settings": settings, "k_used": k_used,
               "lambda": mapper.meta.get("lambda"), "mapper_bytes": mapper.nbytes(), "fit_s": mapper.meta.get("fit_s"),
               "alpha": mapper.meta.get("alpha"), "diagnostics": diag, "gate": {"fit": fit, "reasons": reasons},
               "tasks": summary, "average_retention": average, "context_gain": gains, "coqa": coqa, "lm_eval": lm_eval_results(summary),
               "bench": rows, "items": {task: [it.id for it in its] for task, its in items.items()},
               "versions": versions(args.device), "wall_s": time.time() - t0}
    write_atomic(out / "results.json", json.dumps(strict(results), indent=1, allow_nan=False))
    print("\n" + "\n".join(report[report.index("## Accuracy (%, 95% interval) and retention"):]))
    print(f"\nwrote {out / 'report.md'} and {out / 'results.json'}")
    dist.close()
    return results

