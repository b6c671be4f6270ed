"""kvt end to end: calibrate (or reuse) a mapper for a pair, check it, evaluate, benchmark, report.

    python run.py                                  # the toy family in weights/, offline, minutes on a CPU
    python run.py --pair qwen3-14b:32b             # weights/qwen3-14b -> weights/qwen3-32b
    python run.py --source DIR --target DIR --tasks arc_easy --limit 200

Steps, each a call into one kvt stage:
  1. checks before heavy work: the pair is matched-KV (or --scope layer), both tokenizers are the same,
     weights and task data are present, the contexts fit the models;
  2. calibration sequences (data.py) -> statistics, layer selection, ridge (mapper.calibrate), saved to
     OUT/mapper-<settings>.safetensors and reused when it exists; `--mapper mlp` adds the backstop;
  3. diagnostics on held-out sequences and the gate (handoff.py);
  4. every task under target / transfer / source / floor (evals.py), one record per item and condition
     appended to OUT/records-<mapper>.jsonl as it is computed, so an interrupted run resumes;
  5. prefill vs transfer timings (bench.py);
  6. OUT/results.json and OUT/report.md, and the tables on stdout.
A problem the user can fix is one line on stderr and exit code 2.
"""
import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

import kvt
from kvt import dist, evals, toy
from kvt.bench import bench, format_rows, random_mapper
from kvt.config import KvtError, check_matched_kv, load_config, parse_pair
from kvt.data import calibration_sequences, check_same_tokenizer
from kvt.handoff import diagnose, format_diagnostics, gate
from kvt.mapper import add_mlp, calibrate, load_mapper, save_mapper
from kvt.model import layer_devices
from kvt.plan import capacity, check_plan, format_plan, plan
from kvt.stats import diagnostic_start
from kvt.weights import fingerprint

ROOT = Path(__file__).resolve().parent
TOY_TASKS = "toy_recall,toy_recall_gen,toy_copy,toy_count"
REAL_TASKS = "hellaswag,arc_easy,arc_challenge,mmlu,gsm8k"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="toy-s:m", help="FAMILY-SRC:TGT, read from WEIGHTS/<name> (default: the toy family)")
    ap.add_argument("--source", type=Path, help="source checkpoint folder (instead of --pair)")
    ap.add_argument("--target", type=Path, help="target checkpoint folder (instead of --pair)")
    ap.add_argument("--weights", type=Path, default=ROOT / "weights")
    ap.add_argument("--data-dir", type=Path, default=Path(evals.default_data_dir()), help="task data ($KVT_DATA)")
    ap.add_argument("--calib", nargs="*", help="calibration text files or folders (default: DATA/calib/wikitext-2; "
                    "the toy corpus for toy pairs)")
    ap.add_argument("--calib-seqs", type=int, help="calibration sequences (paper: 500; toy default 200)")
    ap.add_argument("--calib-len", type=int, help="tokens per sequence (paper: 1024; toy default 256)")
    ap.add_argument("--k", type=int, default=8, help="source layers per target layer (paper: 8)")
    ap.add_argument("--lam", type=float, default=0.01, help="ridge lambda, relative (see ridge.py; paper: 0.01)")
    ap.add_argument("--sweep", action="store_true", help="pick lambda on held-out data from a sweep")
    ap.add_argument("--scope", choices=["head", "layer"], default="head")
    ap.add_argument("--mapper", choices=["ridge", "mlp"], default="ridge", help="mlp: ridge + MLP backstop")
    ap.add_argument("--tasks", help=f"comma-separated (default toy: {TOY_TASKS}; real: {REAL_TASKS})")
    ap.add_argument("--limit", type=int, help="items per task (default: toy 200, real 500)")
    ap.add_argument("--bench", dest="bench", action="store_true", default=True)
    ap.add_argument("--no-bench", dest="bench", action="store_false")
    ap.add_argument("--bench-lengths", help="context lengths to time (default: toy 256,512,1024; CPU 512..4096; "
                    "GPU up to 32768)")
    ap.add_argument("--min-attn-cos", type=float, default=0.9, help="gate: mean attention-output cosine")
    ap.add_argument("--max-kl", type=float, default=0.5, help="gate: next-token KL in nats")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--devices", help="split both models by layers over these, e.g. cuda:0,cuda:1 (under "
                    "torchrun: shared out among the ranks of a node)")
    ap.add_argument("--context", type=int, help="longest context to plan memory for (default: the longest bench length)")
    ap.add_argument("--stats-dtype", choices=["float64", "float32"], default="float64",
                    help="calibration statistics (float32 halves them; solves stay float64)")
    ap.add_argument("--candidates", type=int, help="consider only this many evenly spaced source layers")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="model dtype (default: bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--out", type=Path, help="output folder (default: runs/<src>_<tgt>)")
    return ap.parse_args(argv)


def resolve(args):
    """(source dir, target dir, source name, target name)."""
    if args.source or args.target:
        if not (args.source and args.target):
            raise KvtError("give both --source and --target (or --pair)")
        return args.source, args.target, args.source.name, args.target.name
    src, tgt = parse_pair(args.pair)
    return args.weights / src, args.weights / tgt, src, tgt


def settings_id(args, src_dir, tgt_dir):
    """A short name for a mapper's settings and the two checkpoints' weights, so a different request,
    or the same one on retrained weights, never reuses a mapper or a record made for another."""
    key = json.dumps([fingerprint(src_dir), fingerprint(tgt_dir), args.scope, args.k, args.lam, args.sweep,
                      args.mapper, sorted(map(str, args.calib)), args.calib_seqs, args.calib_len])
    return f"{args.scope}-k{args.k}-{args.mapper}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def get_mapper(args, source, target, tok, ids, out, name, dtype, reverse=False):
    """Load the mapper for these settings from OUT, or calibrate and save it (statistics checkpointed)."""
    a, b = (target, source) if reverse else (source, target)
    path = out / f"mapper-{name}{'-reverse' if reverse else ''}.safetensors"
    if path.exists():
        print(f"reusing {path}")
        return load_mapper(path, a.config, b.config, tok.fingerprint()).to(dtype=dtype)
    mapper, report = calibrate(a, b, ids, args.scope, args.k, args.lam, lams=[1e-4, 1e-3, 1e-2, 1e-1, 1.0] if args.sweep else None,
                               checkpoint=out / f"stats-{name}{'-reverse' if reverse else ''}",
                               tokenizer=tok.fingerprint(), stats_dtype=getattr(torch, args.stats_dtype),
                               candidates=args.candidates, progress=dist.rank() == 0)
    if args.mapper == "mlp":
        mapper = add_mlp(mapper, a, b, ids)
    mapper.meta["diagnostics"] = diagnose(a, b, mapper, ids[diagnostic_start(len(ids)):])  # unseen by fit and MLP
    mapper.meta["r2_single"] = {kind: v.tolist() for kind, v in report["r2_single"].items()}
    if dist.rank() == 0:  # every rank fitted the same mapper from the same all-reduced statistics
        save_mapper(mapper, path)
    return mapper.to(dtype=dtype)


def read_records(path):
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_tasks(args, tasks, tok, conds, path, options):
    """Evaluate every task under conds, appending each record to a jsonl as it lands, so a stopped run
    resumes. Under torchrun each rank takes a share of the items still to do and writes its own file."""
    files = sorted(path.parent.glob(path.stem + "*.jsonl"))
    done = {(r["task"], r["condition"], r["idx"]) for f in files for r in read_records(f)}
    mine = path if dist.world() == 1 else path.with_name(f"{path.stem}-rank{dist.rank()}.jsonl")
    with open(mine, "a") as f:
        for task in tasks:
            items = evals.load_task(task, args.data_dir, args.limit)
            todo = [i for i in range(len(items)) if any((task, c, i) not in done for c in conds)]
            skip = {(c, i) for i in set(range(len(items))) - set(dist.shard(todo)) for c in conds}
            skip |= {(c, i) for t, c, i in done if t == task}
            for rec in evals.evaluate(task, items, tok, conds, done=skip, progress=dist.rank() == 0,
                                      **options.get(task, {})):
                f.write(json.dumps(rec) + "\n")
                f.flush()
    dist.barrier()
    return [r for f in sorted(path.parent.glob(path.stem + "*.jsonl")) for r in read_records(f)]


def format_summary(summary, src_name, tgt_name):
    """The paper's table: accuracy per condition, retention and floor-normalized retention."""
    lines = [f"| task | metric | target ({tgt_name}) | transfer | source ({src_name}) | floor | retention | floor-norm. retention | n |",
             "|---|---|---|---|---|---|---|---|---|"]
    def cell(row, m):
        if row is None:
            return "-"
        lo, hi = row[m + "_ci"]
        return f"{100 * row[m]:.1f} [{100 * lo:.0f}, {100 * hi:.0f}]"
    for task, conds in summary.items():
        ret = conds.get("retention", {})
        for m in evals.METRICS[evals.TASKS[task][1]]:
            r = ret.get(m, {})
            ratio = f"{100 * r['ratio']:.1f}%" if r else "-"
            fn = f"{100 * r['floor_normalized']:.1f}%" if r.get("floor_normalized") is not None else "-"
            lines.append(f"| {task} | {m} | {cell(conds.get('target'), m)} | {cell(conds.get('transfer'), m)} | "
                         f"{cell(conds.get('source'), m)} | {cell(conds.get('floor'), m)} | {ratio} | {fn} | "
                         f"{conds.get('target', {}).get('n', 0)} |")
    return "\n".join(lines)


def bench_default(is_toy, device):
    return "256,512,1024" if is_toy else ("2048,8192,32768" if device.startswith("cuda") else "512,1024,2048,4096")


def write_atomic(path, text):
    tmp = Path(f"{path}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    src_dir, tgt_dir, src_name, tgt_name = resolve(args)
    is_toy = src_name.startswith("toy-") or args.tasks is not None and args.tasks.startswith("toy_")
    args.calib = args.calib or ([] if is_toy else [args.data_dir / "calib" / "wikitext-2"])
    args.calib_seqs = args.calib_seqs or (200 if is_toy else 500)
    args.calib_len = args.calib_len or (256 if is_toy else 1024)
    args.limit = args.limit or (200 if is_toy else 500)
    tasks = (args.tasks or (TOY_TASKS if is_toy else REAL_TASKS)).split(",")
    devices = dist.init(args.devices.split(",") if args.devices else [args.device])
    args.device = devices[0]
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    out = args.out or ROOT / "runs" / f"{src_name}_{tgt_name}"

    # 1. checks before heavy work
    src_cfg, tgt_cfg = load_config(src_dir, args.calib_len), load_config(tgt_dir, args.calib_len)
    check_matched_kv(src_cfg, tgt_cfg, args.scope)
    src_tok, tok = kvt.load_tokenizer(src_dir), kvt.load_tokenizer(tgt_dir)
    check_same_tokenizer(src_tok, tok)
    for task in tasks:
        evals.load_task(task, args.data_dir, 1)  # a missing data file fails now, not after calibration
    toy_text = toy.corpus(2000, seed=99) if is_toy and not args.calib else None  # unseen in training (seed 0)
    ids = calibration_sequences(args.calib, tok, args.calib_seqs, args.calib_len, documents=toy_text)
    out.mkdir(parents=True, exist_ok=True)
    name = settings_id(args, src_dir, tgt_dir)
    lengths = [int(n) for n in (args.bench_lengths or bench_default(is_toy, args.device)).split(",")]
    memory = plan(src_cfg, tgt_cfg, args.scope, args.k, args.context or max(lengths + [args.calib_len]), dtype,
                  devices, calib_len=args.calib_len, stats_dtype=getattr(torch, args.stats_dtype),
                  candidates=args.candidates, calibrate=not (out / f"mapper-{name}.safetensors").exists())
    if dist.rank() == 0:
        print(format_plan(memory, capacity(devices), f"{src_name} -> {tgt_name}"))
    check_plan(memory, capacity(devices))
    source = kvt.load_model(src_dir, dtype, devices=devices)
    target = kvt.load_model(tgt_dir, dtype, devices=devices)
    print(f"{src_name} ({src_cfg.n_layers} layers) -> {tgt_name} ({tgt_cfg.n_layers} layers), {dtype} on {args.device}")

    # 2-3. mapper and its diagnostics
    mapper = get_mapper(args, source, target, tok, ids, out, name, dtype)
    if len(set(devices)) > 1:
        mapper = mapper.place(layer_devices(target))
    diag = mapper.meta["diagnostics"]
    fit, reasons = gate(diag, args.min_attn_cos, args.max_kl)
    print(format_diagnostics(diag))
    print("gate: fit for use" if fit else "gate: UNFIT: " + "; ".join(reasons))

    # 4. evaluation, all conditions on the same items
    conds = evals.conditions(target, source, evals.transfer(source, target, mapper))
    records = run_tasks(args, tasks, tok, conds, out / f"records-{name}.jsonl", {})
    summary = evals.summarize(records)
    coqa = {}
    if "coqa" in tasks:  # the other direction: the large model hands the conversation to the small one
        back = get_mapper(args, source, target, tok, ids, out, name, dtype, reverse=True)
        transfer_back = evals.transfer(target, source, back)
        rev = run_tasks(args, ["coqa"], tok, {"target": evals.Condition(source), "transfer": evals.Condition(source, transfer_back)},
                        out / f"records-{name}-reverse.jsonl", {})
        coqa = {f"{src_name} -> {tgt_name}": evals.coqa_agreement(records),
                f"{tgt_name} -> {src_name}": evals.coqa_agreement(rev)}

    if dist.rank() != 0:
        return dist.close()

    # 5. speed
    rows = []
    if args.bench:
        back = random_mapper(tgt_cfg, src_cfg, args.scope, args.k, dtype, args.device)  # timing needs no fit
        rows = bench(source, target, mapper, back, lengths, names=(src_name, tgt_name))

    # 6. report
    table = format_summary(summary, src_name, tgt_name)
    report = [f"# kvt: {src_name} -> {tgt_name}", "", f"mapper: {name}, scope {args.scope}, k={args.k}, "
              f"lambda {mapper.meta.get('lambda')}, {mapper.n_params():,} parameters ({mapper.nbytes() / 2**20:.1f} MiB); "
              f"calibration {args.calib_seqs} x {args.calib_len} tokens", "",
              "## Calibration diagnostics (held-out)", "", "```", format_diagnostics(diag),
              "gate: " + ("fit" if fit else "UNFIT: " + "; ".join(reasons)), "```", "",
              "## Accuracy (%, 95% interval) and retention", "", table]
    for direction, c in coqa.items():
        report += ["", f"## CoQA handoff {direction}: F1 of transfer vs the model's own answers, per turn", "",
                   " ".join(f"turn {t}: {f:.1f}" for t, f in zip(c["turns"], c["f1"])),
                   f"mean {c['mean']:.1f}, drift {c['drift_per_turn']:+.2f} points per turn"]
    if rows:
        report += ["", "## Prefill vs transfer (seconds, median)", "", format_rows(rows)]
    report += ["", f"wall time {time.time() - t0:.0f} s"]
    write_atomic(out / "report.md", "\n".join(report) + "\n")
    results = {"pair": [src_name, tgt_name], "mapper": name, "settings": {k: str(v) for k, v in vars(args).items()},
               "diagnostics": diag, "gate": {"fit": fit, "reasons": reasons}, "tasks": summary, "coqa": coqa,
               "bench": rows, "wall_s": time.time() - t0}
    write_atomic(out / "results.json", json.dumps(results, indent=1, default=str))
    print("\n" + "\n".join(report[report.index("## Accuracy (%, 95% interval) and retention"):]))
    print(f"\nwrote {out / 'report.md'} and {out / 'results.json'}")
    dist.close()
    return results


if __name__ == "__main__":
    try:
        main()
    except KvtError as e:
        sys.exit(f"kvt: {e}")
