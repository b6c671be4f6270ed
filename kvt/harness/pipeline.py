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

The command line becomes one Settings (settings.py; frozen: no step changes it); run() then calls the steps
in turn, each a function below, in the order run() calls them, calling into one kvt stage:
  1. checks before heavy work (task_list, open_devices, check_pair, calibration, plan_memory, check_out,
     load_pair): the pair is matched-KV (or --scope layer), both tokenizers are the same, weights and task
     data are present, the contexts fit the models, the memory plan fits; the calibration sequences in
     three disjoint regions (data.py);
  2. get_mapper: statistics, layer selection, ridge (harness/calibration.py), saved to
     OUT/mapper-<settings>.safetensors and reused when it exists; `--mapper mlp` swaps ridge for the
     paper's MLP, `--mapper ridge+mlp` adds kvt's residual one;
  3. check_mapper: diagnostics on the diagnostics region and the gate (harness/diagnose.py);
  4. batch_size, evaluate (evaluate_back: CoQA the other way): every task (tasks.py; --task-file adds the
     user's own) under target / transfer / source / floor (evals.py) on one seeded sample of items, one
     record per item and condition appended to OUT/records-<settings>.jsonl as it is computed, so an
     interrupted run resumes (records.py); measure_context_gain for --heldout;
  5. run_bench: prefill vs transfer timings (bench.py);
  6. report (report.py): OUT/results.json (kvt's numbers, the same in lm-evaluation-harness's layout per condition
     under "lm_eval", and the versions and hardware behind them) and OUT/report.md, and the tables on stdout.
A problem the user can fix is one line on stderr and exit code 2.
"""
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path

import torch

import kvt
from kvt import fast
from kvt.config import KvtError, check_matched_kv, checkpoint_name, find_weights, load_config, parse_pair
from kvt.loading import check_weights, layer_devices
from kvt.weights import fingerprint
from kvt.harness import dist, evals, tasks, toy
from kvt.harness.bench import bench, random_mapper
from kvt.harness.calibration import CalibrationOptions, calibrate, check_pair_weights
from kvt.harness.data import calibration_sequences, check_same_tokenizer, heldout_windows, read_documents
from kvt.harness.diagnose import diagnose, format_diagnostics, gate, next_nll
from kvt.harness.files import MAPPER_FORMAT, STATS_FORMAT, load_mapper, save_mapper, short_id
from kvt.harness.plan import (Options, capacity, check_plan, disk_plan, eval_batch, format_plan, k_used, nearly_full,
                              plan, plan_line, split_to_fit)
from kvt.harness.recompute import budget as recompute_budget, rank_sequences
from kvt.harness.records import RECORDS_FORMAT, run_tasks
from kvt.harness.report import Outcome, report
from kvt.harness.settings import REAL_CALIB, REAL_TASKS, TOY_TASKS, Settings, parse_args
from kvt.harness.summary import context_gain, coqa_agreement, coqa_turns

SMALL_WIDTH = 512  # models narrower than this run on one CPU thread (the toy family: 64-128 wide)


@dataclasses.dataclass(frozen=True)
class Pair:
    """The loaded pair a step works on: the source and target models, their one tokenizer, the dtype they run in."""
    source: object
    target: object
    tok: object
    dtype: torch.dtype

    def back(self):
        """The pair the other way: the target hands its cache to the source (CoQA's way back)."""
        return Pair(self.target, self.source, self.tok, self.dtype)


def main(argv=None):
    """Run everything (see the module docstring); returns the results dict. A run that fails leaves no
    empty output folder behind (a folder with a checkpoint in it stays: the rerun resumes from it)."""
    s = Settings.from_args(parse_args(argv))
    print(fast.path_line(s.plain))               # which functions run: the fast twins or the reading order's own
    fast.keep_freed_memory()                     # process-wide: glibc keeps freed blocks for the next cache
    src_dir, tgt_dir, src_name, tgt_name = resolve(s)
    out = s.out or Path("runs") / f"{src_name}_{tgt_name}"
    created, threads = not out.exists(), torch.get_num_threads()
    try:
        return run(s, src_dir, tgt_dir, src_name, tgt_name, out)
    except BaseException:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
    finally:
        torch.set_num_threads(threads)


def resolve(s):
    """(source dir, target dir, source name, target name)."""
    if s.source or s.target:
        if not (s.source and s.target):
            raise KvtError("give both --source and --target (or --pair)")
        return s.source, s.target, checkpoint_name(s.source), checkpoint_name(s.target)
    src, tgt = parse_pair(s.pair)
    return find_weights(src, s.weights), find_weights(tgt, s.weights), src, tgt


def run(s, src_dir, tgt_dir, src_name, tgt_name, out):
    """The steps of the module docstring, in order, each a function below; `s` is the run's Settings."""
    t0, names = time.time(), (src_name, tgt_name)
    # 1. checks before heavy work
    task_names = task_list(s)
    devices, dtype = open_devices(s)
    src_cfg, tgt_cfg, tok, lengths = check_pair(s, src_dir, tgt_dir, devices[0])
    heldout_texts(s)                               # refused now if it is calibration text, not after calibrating
    items = {task: tasks.load_task(task, s.data_dir, s.task_limits.get(task, s.limit), seed=s.seed)
             for task in task_names}
    calib = calibration(s, tok, out)
    plans, cap = plan_memory(s, src_cfg, tgt_cfg, names, "coqa" in items, lengths, dtype, devices)
    skeys = {"forward": stats_key(s, src_dir, tgt_dir, calib)}     # what each mapper's statistics depend on
    if "back" in plans:
        skeys["back"] = stats_key(s, tgt_dir, src_dir, calib)
    check_out(s, out, plans, skeys)
    pair = Pair(*load_pair(src_dir, tgt_dir, names, dtype, devices), tok, dtype)

    # 2. the mapper, with its weights where the target keeps each layer
    mapper, name = get_mapper(s, pair, calib, out, skeys["forward"], plans["forward"].options.group)
    mapper = mapper.place(layer_devices(pair.target))

    # 3. its diagnostics and the gate
    diag, fit, reasons = check_mapper(s, mapper)

    # 4. evaluation, all conditions on the same items
    batch = batch_size(s, items, tok, src_cfg, tgt_cfg, cap, dtype, devices)
    records, header = evaluate(s, items, pair, mapper, name, out, batch, calib)
    coqa = {}
    if "coqa" in items:  # the other direction: the large model hands the conversation to the small one
        back, back_name = get_mapper(s, pair.back(), calib, out, skeys["back"], plans["back"].options.group)
        back_records = evaluate_back(s, items, pair.back(), back.place(layer_devices(pair.source)), back_name, out,
                                     header, batch)
        coqa = {" -> ".join(names): coqa_result(records), " -> ".join(names[::-1]): coqa_result(back_records)}
    if dist.rank() != 0:
        return dist.close()
    gains = measure_context_gain(s, pair, mapper) if s.heldout else []

    # 5. speed
    rows = run_bench(s, pair, mapper, lengths, names, devices[0]) if s.bench else []

    # 6. report
    results = report(s, Outcome(names, out, mapper, name, calib, (diag, fit, reasons), items, records, coqa, gains,
                                rows, dtype, devices[0], batch, t0))
    dist.close()
    return results


def task_list(s):
    """The run's tasks: the user's --task-file tasks registered (each name defined once), then --tasks (default:
    the toy or the real list; none: no tasks), with every --task-limit naming one of them."""
    origin = {}  # task name -> the task file that defined it
    for f in s.task_file:  # the user's tasks, registered before --tasks is read
        names = tasks.load_task_file(f)
        twice = [n for n in names if n in origin]
        if twice:
            raise KvtError(f"task {twice[0]!r} is defined in both {origin[twice[0]]} and {f}; give each its own name")
        origin.update(dict.fromkeys(names, f))
        print(f"{f}: tasks {', '.join(names)}")
    task_names = [t.strip() for t in (s.tasks or (TOY_TASKS if s.toy else REAL_TASKS)).split(",") if t.strip()]
    task_names = [] if task_names == ["none"] else task_names      # --tasks none: diagnostics (and --heldout) only
    for name, n in s.task_limits.items():
        if name not in task_names:
            raise KvtError(f"--task-limit {name}={n}: {name!r} is not a task of this run "
                           f"({', '.join(task_names)}); check its name")
    return task_names


def open_devices(s):
    """This rank's devices (--devices or --device; under torchrun its share of them, dist.init) and the
    models' dtype (--dtype, else bfloat16 on a GPU, float32 on a CPU)."""
    asked = s.devices.split(",") if s.devices else [s.device]
    dist.check_devices(asked)
    devices = dist.init(asked)
    return devices, getattr(torch, s.dtype or ("bfloat16" if devices[0].startswith("cuda") else "float32"))


def check_pair(s, src_dir, tgt_dir, device):
    """The pair before any weight is read: matched KV (or --scope layer), one tokenizer, every context the run
    builds within both models, the configs against the weights' headers. Returns (source config, target
    config, tokenizer, bench lengths)."""
    src_cfg, tgt_cfg = load_config(src_dir, s.calib_len), load_config(tgt_dir, s.calib_len)
    if device == "cpu" and max(src_cfg.dim, tgt_cfg.dim) < SMALL_WIDTH:
        torch.set_num_threads(1)  # as toy.py trains them: a second thread only waits on the first (main restores it)
    check_matched_kv(src_cfg, tgt_cfg, s.scope)
    src_tok, tok = kvt.load_tokenizer(src_dir), kvt.load_tokenizer(tgt_dir)
    check_same_tokenizer(src_tok, tok)
    lengths = [int(n) for n in (s.bench_lengths or bench_default(s.toy, device)).split(",")]
    check_lengths((lengths if s.bench else []) + [s.calib_len, s.context or 2], (src_cfg, tgt_cfg), tok)
    for cfg, folder in ((src_cfg, src_dir), (tgt_cfg, tgt_dir)):  # the configs' sizes feed the memory plan: check
        check_weights(cfg, folder)                                   # them against the weights' headers first
    return src_cfg, tgt_cfg, tok, lengths


def bench_default(is_toy, device):
    return "256,512,1024" if is_toy else ("2048,8192,32768" if device.startswith("cuda") else "512,1024,2048,4096")


def check_lengths(lengths, cfgs, tok):
    """Every context the run will build fits both models, and the tokenizer's ids fit their vocabularies."""
    limit = min(c.max_seq_len for c in cfgs)
    if max(lengths) > limit:
        raise KvtError(f"a context of {max(lengths)} tokens exceeds the models' limit of {limit} "
                       "(max_position_embeddings); use shorter --bench-lengths, --context or --calib-len")
    if tok.vocab_size > min(c.vocab_size for c in cfgs):
        raise KvtError(f"the tokenizer has {tok.vocab_size} tokens, more than a model's vocabulary of "
                       f"{min(c.vocab_size for c in cfgs)}; use the tokenizer that came with these weights")


def heldout_texts(s):
    """[(name, documents)]: the held-out texts of the context-gain measure, read now (run() calls this
    before calibrating, so a path that is not text is refused before the hours of work); refuses one that
    is (or is inside, or holds) calibration text."""
    out = []
    for h in s.heldout:
        if h == "toy":
            out.append(("toy corpus (seed 98)", toy.corpus(400, seed=98)))   # calibration: seed 99
            continue
        p = Path(h).resolve()
        if not p.exists():
            raise KvtError(f"--heldout {h} does not exist; pass a text file (or 'toy')")
        for c in map(lambda x: Path(x).resolve(), s.calib):
            if p == c or c in p.parents or p in c.parents:
                raise KvtError(f"--heldout {h} is calibration text too (--calib {c}); calibrate on other text "
                               "(e.g. --calib DATA/calib/wikitext-2/valid.txt) or hold out another file")
        out.append((p.name, read_documents(p, option="--heldout")))
    return out


def calibration(s, tok, out):
    """The calibration sequences in three disjoint regions (data.calibration_sequences): the toy corpus for a
    toy pair without --calib, else the --calib text, refused in one line when the default text is missing."""
    toy_text = toy_calibration_text(s)
    missing = [str(p) for p in s.calib if not Path(p).exists()]
    if missing and not s.toy and s.calib == [s.data_dir / c for c in REAL_CALIB]:
        raise KvtError(f"no calibration text at {', '.join(missing)}; point --data-dir (or KVT_DATA) at a data folder "
                       "with calib/wikitext-2 (WikiText-2 raw, .txt) and calib/gutenberg (Project Gutenberg books, "
                       ".txt), "
                       "e.g. ../shared/data, or pass --calib with your own .txt/.jsonl/.json files or folders")
    return calibration_sequences(s.calib, tok, s.calib_seqs, s.calib_len, seed=s.seed, documents=toy_text,
                                 cache=None if toy_text else out, progress=dist.rank() == 0)


def toy_calibration_text(s):
    """The toy corpus's documents to calibrate a toy pair on when no --calib is given (seed 99: unseen
    in training, which used seed 0), else None."""
    return toy.corpus(2000, seed=99) if s.toy and not s.calib else None


def plan_memory(s, src_cfg, tgt_cfg, names, coqa, lengths, dtype, devices):
    """The memory plan of every mapper this run fits (the way back too for CoQA), checked before any of it
    and printed: in one line, or every row with --show-plan or where it nearly fills a device (plan.nearly_full,
    as it does when it does not fit). Returns ({"forward": plan, "back": plan}, the devices' capacity)."""
    cap = capacity(devices)
    asked = Options(s.scope, s.k, s.candidates, s.context or max(lengths + [s.calib_len]), dtype=dtype,
                    devices=devices, calib_len=s.calib_len, stats_dtype=getattr(torch, s.stats_dtype))
    plans = {}
    for way, a, b, shown in [("forward", src_cfg, tgt_cfg, names)] + ([("back", tgt_cfg, src_cfg, names[::-1])]
                                                                      if coqa else []):
        p = plans[way] = split_to_fit(plan(a, b, dataclasses.replace(asked, bench=s.bench and not plans)), cap)
        if dist.rank() == 0:
            full = s.show_plan or nearly_full(p, cap)
            print((format_plan if full else plan_line)(p, cap, " -> ".join(shown)))
    for p in plans.values():
        check_plan(p, cap)
    return plans, cap


def stats_key(s, src_dir, tgt_dir, calib):
    """What calibration statistics depend on: both checkpoints' weights, the calibration tokens, the
    statistics' dtype and candidates. Another lambda, k or mapper type reuses them."""
    return {"format": STATS_FORMAT, "source": fingerprint(src_dir), "target": fingerprint(tgt_dir),
            "calib": calib.hash(), "stats_dtype": s.stats_dtype, "candidates": s.candidates}


def check_out(s, out, plans, skeys):
    """The output folder: made, writable, and with the disk space the calibrations need (check_disk)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KvtError(f"cannot create the output folder {out} ({e.strerror}); choose another --out")
    try:  # a folder that exists but takes no files (read-only) fails here, not at the first save after calibration
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise KvtError(f"cannot write in the output folder {out} ({e.strerror}); choose another --out")
    disk = check_disk(out, plans.values(), s, [skeys[way] for way in plans])
    if dist.rank() == 0:
        print(f"disk: calibration writes up to {disk / 1e9:.1f} GB at once under {out} "
              f"({'kept' if s.keep_stats else 'statistics deleted once each mapper is saved'})")


def check_disk(out, plans, s, skeys):
    """Refuse, in one line, a run whose output folder lacks the space its calibrations need at most at
    once (plan.disk_plan; mappers already saved need none, statistics already there count as space)."""
    need, kept = 0, 0
    for p, skey in zip(plans, skeys):
        rows = disk_plan(p)
        if not (out / f"mapper-{mapper_name(s, skey, p.src_cfg)}.safetensors").exists():
            need = max(need, kept + sum(n for _, n in rows))
            kept += rows[-1][1]                                   # its mapper file stays
    have = shutil.disk_usage(out).free + sum(f.stat().st_size for f in out.glob("stats-*"))
    if need > have:
        raise KvtError(f"the output folder {out} has {have / 1e9:.1f} GB free and calibration needs up to "
                       f"{need / 1e9:.1f} GB at once (memory plan, disk); free space or choose another --out")
    return need


def mapper_key(s, stats):
    """Everything a mapper is made from: its statistics' key and the settings of the fit. A different
    request, or the same one on retrained weights, never reuses a mapper (nor records made with it)."""
    return {**stats, "format": MAPPER_FORMAT, "stats_format": stats["format"], "scope": s.scope, "k": s.k,
            "lambda": s.lam, "mapper": s.mapper, **({"weights": s.token_weights} if s.token_weights != "uniform" else {})}


def mapper_name(s, skey, src_cfg):
    """The name of a mapper's file, mapper-<name>.safetensors, and of its records: the settings that made it
    (scope, the k it is fitted with, which plan.k_used caps at the source's candidate layers, and the mapper
    type), then the hash of everything else it is made from (mapper_key, which holds the k asked)."""
    key = mapper_key(s, skey)
    weighted = "-attn" if key.get("weights") == "attention" else ""
    return f"{key['scope']}-k{k_used(src_cfg, s.k, s.candidates)}-{key['mapper']}{weighted}-{short_id(key)}"


def load_pair(src_dir, tgt_dir, names, dtype, devices):
    """Both models, split by layers over `devices` where there are several."""
    source = kvt.load_model(src_dir, dtype, devices=devices)
    target = kvt.load_model(tgt_dir, dtype, devices=devices)
    print(f"{names[0]} ({source.config.n_layers} layers) -> {names[1]} ({target.config.n_layers} layers), {dtype} "
          f"on {devices[0]}")
    return source, target


def get_mapper(s, pair, calib, out, skey, group=None):
    """Load the mapper made from these settings in OUT for pair.source -> pair.target, or calibrate and save it
    (statistics checkpointed under a name of their own, so another lambda, k or mapper type reads them again).
    Returns (the mapper in pair.dtype, its name)."""
    source, target, tok, dtype = pair.source, pair.target, pair.tok, pair.dtype
    key, name = mapper_key(s, skey), mapper_name(s, skey, source.config)
    path = out / f"mapper-{name}.safetensors"
    if path.exists():
        print(f"reusing {path}")
        mapper = load_mapper(path, source.config, target.config, tok.fingerprint(), key=short_id(key))
        check_pair_weights(mapper, source, target, f"mapper {path}")          # the key's file fingerprints, checked again
        return mapper.to(dtype=dtype), name
    stats = out / f"stats-{short_id(skey)}"
    t0 = time.time()
    options = CalibrationOptions(checkpoint=stats, key=short_id(skey), tokenizer=tok.fingerprint(), group=group,
                                 stats_dtype=getattr(torch, s.stats_dtype), candidates=s.candidates,
                                 progress=dist.rank() == 0, keep_stats=s.keep_stats, weights=s.token_weights,
                                 plain=s.plain, mlp_checkpoint=out / f"mlp-{name}", mlp_key=short_id(key))
    mapper, report = calibrate(source, target, calib, s.scope, s.k, s.lam, mapper=s.mapper, options=options)
    mapper.meta["fit_s"] = time.time() - t0                       # statistics, selection, ridge (and MLP) on this run
    used = mapper.to(dtype=dtype)                                   # the mapper as evaluation and the bench use it
    mapper.meta["diagnostics"] = diagnose(source, target, used, calib.diag, plain=s.plain)  # a region no choice saw
    mapper.meta["r2_single"] = {kind: v.tolist() for kind, v in report["r2_single"].items()}
    mapper.meta["key"] = short_id(key)
    if dist.rank() == 0:  # every rank fitted the same mapper from the same all-reduced statistics
        save_mapper(mapper, path)
        for f in out.glob(f"mlp-{name}-*.safetensors"):             # the mapper file holds the MLPs now
            f.unlink()
        for f in [] if s.keep_stats else out.glob(f"{stats.name}.*"):   # its statistics and fits, too
            f.unlink()
    used.meta = mapper.meta
    return used, name


def check_mapper(s, mapper):
    """The mapper's diagnostics on the diagnostics region (made when it was fitted) and the gate on them,
    printed. Returns (diagnostics, fit, reasons)."""
    diag = mapper.meta["diagnostics"]
    fit, reasons = gate(diag, s.min_attn_cos, s.max_kl)
    print("calibration diagnostics on sequences no fit has seen: R^2 of keys and values and the attention-output "
          "cosine per target layer, the next-token KL after a handoff")
    print(format_diagnostics(diag))
    print("gate: fit for use" if fit else "gate: UNFIT: " + "; ".join(reasons))
    return diag, fit, reasons


def batch_size(s, items, tok, src_cfg, tgt_cfg, cap, dtype, devices):
    """--batch-size, else the most items a batch the memory plan fits (plan.eval_batch)."""
    batch = s.batch_size
    if batch is None:
        context, choices, new = eval_shape(items, tok)
        batch = eval_batch(src_cfg, tgt_cfg, cap, context, choices, new, Options(s.scope, s.k, dtype=dtype, devices=devices))
    print(f"evaluation: {batch} items a batch (--batch-size)")
    return batch


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


def evaluate(s, items, pair, mapper, name, out, batch, calib):
    """Every task under target / transfer / source / floor (evals.conditions) on the same items, recorded in
    OUT/records-<mapper>-<header hash>.jsonl as they land; a recompute budget with what its rule reads (rank:
    its subspaces from calib's first fit sequences; error: the target). Returns (records, the records' header)."""
    recompute = recompute_budget(s.recompute_last, s.recompute_first, s.recompute_frac, s.recompute_by,
                                 source=pair.source, target=pair.target, mapper=mapper,
                                 calib_seqs=rank_sequences(calib), r=s.recompute_rank)
    header = {"format": RECORDS_FORMAT, "mapper": name, "dtype": str(pair.dtype),
              **({"recompute": [recompute.last, recompute.first, recompute.frac]} if recompute else {}),
              **({"recompute_by": recompute.by} if recompute.frac and recompute.by != "attention" else {}),
              **({"recompute_rank": s.recompute_rank} if recompute.frac and recompute.by == "rank" else {})}
    transfer = evals.transfer(pair.source, pair.target, mapper, recompute, s.plain)
    conds = evals.conditions(pair.target, pair.source, transfer, s.plain)
    return run_tasks(items, pair.tok, conds, out / f"records-{name}-{short_id(header)}.jsonl", header, batch), header


def evaluate_back(s, items, back, mapper, name, out, header, batch):
    """CoQA the other way, on the pair turned around (`back`: the target hands over to the source) with its own
    mapper. Returns its records."""
    rev_header = dict(header, mapper=name)
    conds = {"target": evals.Condition(back.target, plain=s.plain),
             "transfer": evals.Condition(back.target, evals.transfer(back.source, back.target, mapper, plain=s.plain),
                                         plain=s.plain)}
    return run_tasks({"coqa": items["coqa"]}, back.tok, conds, out / f"records-{name}-{short_id(rev_header)}.jsonl",
                     rev_header, batch)


def coqa_result(records):
    return {"gold": coqa_turns(records), "agreement": coqa_agreement(records)}


def measure_context_gain(s, pair, mapper):
    """One row per held-out text and context length: context_gain over --nll-windows windows."""
    source, target, tok = pair.source, pair.target, pair.tok
    next_n = s.nll_next or (64 if s.toy else 256)
    contexts = [int(c) for c in (s.nll_context or ("128" if s.toy else "1024")).split(",")]
    limit = min(source.config.max_seq_len, target.config.max_seq_len)
    rows = []
    for name, docs in heldout_texts(s):
        for c in contexts:
            if c + next_n > limit:
                print(f"context gain: {c} + {next_n} tokens exceed the models' {limit}; skipped")
                continue
            ids = heldout_windows(name, tok, s.nll_windows, c + next_n, documents=docs)
            nll = next_nll(source, target, mapper, ids, c, plain=s.plain)
            row = context_gain(nll, vocab_size=target.config.vocab_size, seed=s.seed)
            rows.append({"text": name, "context": c, "next": next_n, **row})
    return rows


def run_bench(s, pair, mapper, lengths, names, device):
    """Prefill vs transfer timings (bench.bench) at every bench length; the way back is a random mapper of
    the right shapes (timing needs no fit)."""
    source, target = pair.source, pair.target
    back = random_mapper(target.config, source.config, s.scope, s.k, pair.dtype, device)
    return bench(source, target, mapper, back, lengths, names=names,
                 fracs=[s.recompute.frac] if s.recompute.frac else [], plain=s.plain)
