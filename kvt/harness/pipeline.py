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

The command line becomes one Settings (frozen: no step changes it); run() then calls the steps in turn,
each a function here calling into one kvt stage:
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
     interrupted run resumes; measure_context_gain for --heldout;
  5. run_bench: prefill vs transfer timings (bench.py);
  6. report: OUT/results.json (kvt's numbers, the same in lm-evaluation-harness's layout per condition
     under "lm_eval", and the versions and hardware behind them) and OUT/report.md, and the tables on stdout.
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
from kvt.harness import dist, evals, tasks, toy
from kvt import fast, ridge
from kvt.harness.bench import bench, format_rows, hardware, random_mapper
from kvt.config import (KvtError, at_least, check_matched_kv, checkpoint_name, find_weights, load_config, parse_pair,
                        plain_requested)
from kvt.harness.data import calibration_sequences, check_same_tokenizer, heldout_windows, read_documents
from kvt.harness.figures import retention_png
from kvt.harness.diagnose import MAX_KL, MIN_ATTN_COS, diagnose, format_diagnostics, gate, next_nll
from kvt.harness.recompute import Recompute
from kvt.harness.calibration import CalibrationOptions, add_mlp, calibrate, check_pair_weights
from kvt.harness.files import MAPPER_FORMAT, STATS_FORMAT, load_mapper, save_mapper, short_id
from kvt.loading import check_weights, layer_devices
from kvt.harness.plan import (Options, capacity, check_plan, disk_plan, eval_batch, format_plan, k_used, nearly_full,
                              plan, plan_line, split_to_fit)
from kvt.harness.summary import (CORPUS, average_retention, context_gain, coqa_agreement, coqa_turns, lm_eval_results,
                          summarize)
from kvt.weights import fingerprint

TOY_TASKS = "toy_recall,toy_recall_gen,toy_copy,toy_count"
REAL_TASKS = "hellaswag,arc_easy,arc_challenge,mmlu,gsm8k"
REAL_CALIB = ("calib/wikitext-2", "calib/gutenberg")    # under the data folder: about 3.7M tokens of prose
RECORDS_FORMAT = "kvt-records-3"                         # 3: keyed by what was scored (item_key)
SMALL_WIDTH = 512  # models narrower than this run on one CPU thread (the toy family: 64-128 wide)
MLP_MODES = {"mlp": "replace", "ridge+mlp": "residual"}
MAX_LAM = 1e4    # --lam beyond 100x the grid's largest: every standardized direction shrunk to near zero


@dataclasses.dataclass(frozen=True)
class Settings:
    """What `kvt run` is asked, one field per option (parse_args reads its defaults from here), checked
    (check_args) and with the defaults that depend on the pair filled in when it is made: a toy pair
    calibrates on 200 x 256 tokens of the toy corpus (the length its models are trained on) and samples 200
    items per task, any other pair on the paper's 500 x 1024 of WikiText-2 and Gutenberg under --data-dir,
    500 items. No step changes it. Build it from keywords, Settings(pair="qwen3-14b:32b"), or from a command
    line, Settings.from_args(parse_args(argv))."""
    pair: str = "toy-s:m"
    source: Path | None = None
    target: Path | None = None
    weights: Path | None = None
    data_dir: Path = dataclasses.field(default_factory=lambda: Path(tasks.default_data_dir()))
    calib: list | None = None
    calib_seqs: int | None = None
    calib_len: int | None = None
    k: int = 8
    lam: float | None = None
    scope: str = "layer"
    token_weights: str = "uniform"
    mapper: str = "ridge"
    tasks: str | None = None
    task_file: list = dataclasses.field(default_factory=list)
    limit: int | None = None
    task_limit: list = dataclasses.field(default_factory=list)
    seed: int = 0
    batch_size: int | None = None
    bench: bool = True
    bench_lengths: str | None = None
    recompute_last: int = 0
    recompute_first: int = 0
    recompute_frac: float = 0.0
    recompute_by: str = "attention"
    heldout: list = dataclasses.field(default_factory=list)
    nll_windows: int = 32
    nll_context: str | None = None
    nll_next: int | None = None
    min_attn_cos: float = MIN_ATTN_COS
    max_kl: float = MAX_KL
    device: str = dataclasses.field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    devices: str | None = None
    context: int | None = None
    show_plan: bool = False
    stats_dtype: str = "float64"
    keep_stats: bool = False
    candidates: int | None = None
    dtype: str | None = None
    plain: bool = False
    out: Path | None = None

    def __post_init__(self):
        check_args(self)
        toy = self.toy
        filled = {"scope": "head" if self.scope == "head-local" else self.scope,  # CacheBridge's name, the same map
                  "calib": self.calib or ([] if toy else [self.data_dir / c for c in REAL_CALIB]),
                  "calib_seqs": (200 if toy else 500) if self.calib_seqs is None else self.calib_seqs,
                  "calib_len": (256 if toy else 1024) if self.calib_len is None else self.calib_len,
                  "limit": (200 if toy else 500) if self.limit is None else self.limit}
        for name, value in filled.items():
            object.__setattr__(self, name, value)  # frozen: set once, here, while it is made

    @classmethod
    def from_args(cls, ns):
        """The Settings of argparse's namespace; --plain or KVT_PLAIN=1 (the entry point's switch) sets plain."""
        return cls(**{**vars(ns), "plain": ns.plain or plain_requested()})

    @property
    def toy(self):
        """A toy pair (its source is named toy-*) or toy tasks: the toy corpus and the toy defaults."""
        src = checkpoint_name(self.source) if self.source else "" if self.target else parse_pair(self.pair)[0]
        return src.startswith("toy-") or self.tasks is not None and self.tasks.startswith("toy_")

    @property
    def task_limits(self):
        """--task-limit as {task: items}."""
        return {name: int(n) for name, _, n in (spec.partition("=") for spec in self.task_limit)}

    @property
    def recompute(self):
        return Recompute(self.recompute_last, self.recompute_first, self.recompute_frac, self.recompute_by)


def parse_args(argv=None):
    """argparse's namespace of a `kvt run` command line (Settings.from_args makes the run's Settings of it)."""
    ap = argparse.ArgumentParser(prog="kvt run", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", help="FAMILY-SRC:TGT, read from WEIGHTS/<name> (default: the toy family)")
    ap.add_argument("--source", type=Path, help="source checkpoint folder (instead of --pair)")
    ap.add_argument("--target", type=Path, help="target checkpoint folder (instead of --pair)")
    ap.add_argument("--weights", type=Path, help="folder of checkpoint folders (default: ./weights, then the toy "
                    "family kvt ships)")
    ap.add_argument("--data-dir", type=Path, help="task data ($KVT_DATA)")
    ap.add_argument("--calib", nargs="*", help="calibration text files or folders (default: DATA/calib/wikitext-2 "
                    "and DATA/calib/gutenberg; the toy corpus for toy pairs)")
    ap.add_argument("--calib-seqs", type=int, help="fit sequences (paper: 500; toy default 200), plus a tenth for "
                    "validation and a twentieth for diagnostics, from other documents")
    ap.add_argument("--calib-len", type=int, help="tokens per sequence (paper: 1024; toy default 256)")
    ap.add_argument("--k", type=int, help="source layers per target layer (paper: 8)")
    ap.add_argument("--lam", type=float, help="ridge lambda on standardized features (default: the best of "
                    "ridge.LAMBDAS per target layer and kind, on the validation region; the paper gives none)")
    ap.add_argument("--scope", choices=["layer", "head", "head-local"],
                    help="layer: each target head from all heads of the selected layers (the paper's, default); "
                    "head (= head-local, CacheBridge's name): head h from head h of the selected layers (kvt's "
                    "option, about 8x smaller)")
    ap.add_argument("--token-weights", choices=["uniform", "attention"],
                    help="ridge token weights: uniform (the paper's, default) or attention (CacheBridge's "
                    "attention-weighted fit, kvt's option; --scope head only, kvt/harness/attnfit.py)")
    ap.add_argument("--mapper", choices=["ridge", "mlp", "ridge+mlp"],
                    help="mlp: the paper's backstop, an MLP of two hidden layers of 1,024 units instead of ridge; "
                    "ridge+mlp: kvt's option, ridge plus a residual MLP of one hidden layer")
    ap.add_argument("--tasks", help=f"comma-separated (default toy: {TOY_TASKS}; real: {REAL_TASKS}); none: no tasks")
    ap.add_argument("--task-file", type=Path, action="append",
                    help="a Python file of your own tasks (kvt.harness.tasks.Task), imported before --tasks is read; "
                    "repeat for several")
    ap.add_argument("--limit", type=int, help="items per task, a seeded sample (default: toy 200, real 500)")
    ap.add_argument("--task-limit", action="append", metavar="TASK=N",
                    help="items of one task, overriding --limit (repeatable), e.g. coqa=50")
    ap.add_argument("--seed", type=int, help="the item sample and the calibration draw")
    ap.add_argument("--batch-size", type=int, help="items evaluated together, left-padded (default: on a GPU the "
                    "largest power of two up to 64 the memory plan fits, plan.eval_batch; on a CPU 8); records "
                    "equal batch 1's within the dtype's rounding, so a resumed run may change it")
    ap.add_argument("--bench", dest="bench", action="store_true")
    ap.add_argument("--no-bench", dest="bench", action="store_false")
    ap.add_argument("--bench-lengths", help="context lengths to time (default: toy 256,512,1024; CPU 512..4096; "
                    "GPU up to 32768)")
    ap.add_argument("--recompute-last", type=int, help="kvt's option: after mapping, the target "
                    "recomputes the KV of the last R prompt tokens itself (the last one it always runs)")
    ap.add_argument("--recompute-first", type=int, help="kvt's option: ... of the first S tokens")
    ap.add_argument("--recompute-frac", type=float, help="kvt's option: ... of this fraction of the "
                    "tokens, those the source attended to most while finishing the prompt")
    ap.add_argument("--recompute-by", choices=["attention", "suffix"],
                    help="which tokens --recompute-frac takes: the most attended (default) or the last ones")
    ap.add_argument("--heldout", nargs="*", help="held-out text files for the context-gain measure "
                    "(NLL of the next --nll-next tokens after --nll-context of context, target / transfer / floor); "
                    "'toy' for unseen toy-corpus documents; none by default; must not be calibration text")
    ap.add_argument("--nll-windows", type=int, help="windows per held-out text (default 32)")
    ap.add_argument("--nll-context", help="comma-separated context lengths (default: 1024; toy 128); those the "
                    "models cannot hold with --nll-next after them are skipped")
    ap.add_argument("--nll-next", type=int, help="tokens scored after the context (default 256; toy 64)")
    ap.add_argument("--min-attn-cos", type=float, help="gate: mean attention-output cosine "
                    f"(default {MIN_ATTN_COS}, from the gate evidence in docs/real-weights.md)")
    ap.add_argument("--max-kl", type=float, help=f"gate: next-token KL in nats (default {MAX_KL})")
    ap.add_argument("--device")
    ap.add_argument("--devices", help="split both models by layers over these, e.g. cuda:0,cuda:1 (under "
                    "torchrun: shared out among the ranks of a node)")
    ap.add_argument("--context", type=int, help="longest context to plan memory for (default: the longest bench length)")
    ap.add_argument("--show-plan", action="store_true", help="print every row of the memory plan (by default one "
                    "line, and every row only when the plan fills more than half of a device's usable memory)")
    ap.add_argument("--stats-dtype", choices=["float64", "float32"],
                    help="calibration statistics (float32 halves them; solves stay float64)")
    ap.add_argument("--keep-stats", action="store_true", help="keep the calibration statistics files once the "
                    "mapper is saved (tens of GiB on a large pair; another --lam or --k reuses them)")
    ap.add_argument("--candidates", type=int, help="consider only this many evenly spaced source layers")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="model dtype (default: bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--plain", action="store_true", help="run every step's plain path (= KVT_PLAIN=1): the method "
                    "as tutorial.md writes it, to step through with a debugger; the same results, slower")
    ap.add_argument("--out", type=Path, help="output folder (default: runs/<src>_<tgt>)")
    ap.set_defaults(**{f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                       for f in dataclasses.fields(Settings)})       # every default is Settings' own
    return ap.parse_args(argv)


def lengths_at_least(text, least):
    """Is text comma-separated whole numbers, each at least `least`?"""
    try:
        lengths = [int(n) for n in text.split(",")]
    except ValueError:
        return False
    return bool(lengths) and min(lengths) >= least


def check_args(s):
    """Refuse, with one line each, the settings that can only fail later (or silently do something else)."""
    positive = at_least
    positive("nll-windows", s.nll_windows, why=" (held-out windows per text)")
    positive("nll-next", s.nll_next, why=" (tokens scored after the context)")
    if s.token_weights == "attention" and s.scope not in ("head", "head-local"):
        raise KvtError("--token-weights attention is the head-local attention-weighted fit; add --scope head")
    positive("k", s.k, why=" (source layers per target layer; the paper uses 8)")
    positive("calib-seqs", s.calib_seqs, why=" (calibration sequences; the paper uses 500)")
    positive("calib-len", s.calib_len, 2, " (tokens per calibration sequence; the paper uses 1024)")
    positive("limit", s.limit, why=" (items per task)")
    for spec in s.task_limit:
        name, _, n = spec.partition("=")
        if not n.isdigit() or int(n) < 1:
            raise KvtError(f"--task-limit {spec!r}: give TASK=N with N at least 1, e.g. coqa=50")
    positive("candidates", s.candidates, 2, " (source layers to select from)")
    positive("recompute-last", s.recompute_last, 0, " (prompt tokens the target recomputes)")
    positive("recompute-first", s.recompute_first, 0, " (prompt tokens the target recomputes)")
    if not 0 <= s.recompute_frac <= 1:
        raise KvtError(f"--recompute-frac {s.recompute_frac}: a fraction of the prompt, within [0, 1]")
    if s.lam is not None and not (math.isfinite(s.lam) and s.lam > 0):
        raise KvtError(f"--lam {s.lam}: the ridge lambda must be a positive number (or leave it out to pick one "
                       "per target layer on validation data)")
    if s.lam is not None and s.lam > MAX_LAM:
        raise KvtError(f"--lam {s.lam:g}: above {MAX_LAM:g} the ridge shrinks the map to nearly zero (lambda is "
                       f"relative to each standardized feature's variance of 1; the grid ends at {ridge.LAMBDAS[-1]:g}); "
                       f"give at most {MAX_LAM:g}, or leave it out to pick one per target layer")
    for name in ("min_attn_cos", "max_kl"):
        if not math.isfinite(getattr(s, name)):
            raise KvtError(f"--{name.replace('_', '-')} must be a number")
    if not -1 <= s.min_attn_cos <= 1:
        raise KvtError(f"--min-attn-cos {s.min_attn_cos}: a cosine, within [-1, 1]")
    if s.max_kl < 0:
        raise KvtError(f"--max-kl {s.max_kl}: a KL divergence is never negative; give a threshold of at least 0")
    if s.tasks is not None and not [t for t in s.tasks.split(",") if t.strip()]:
        raise KvtError(f"--tasks is empty; name at least one task (known: {', '.join(tasks.TASKS)})")
    for option, text, least, example in (("--nll-context", s.nll_context, 1, "1024,4096"),
                                         ("--bench-lengths", s.bench_lengths, 2, "512,1024,2048")):
        if text is not None and not lengths_at_least(text, least):
            raise KvtError(f"{option} {text!r}: give comma-separated context lengths of at least {least} "
                           f"token{'s' if least > 1 else ''}, e.g. {example}")
    positive("context", s.context, 2)
    positive("batch-size", s.batch_size, why=" (items per evaluation batch)")
    for name, holds in (("weights", "the checkpoint folders"), ("data_dir", "the task data")):
        folder = getattr(s, name)
        if folder is not None and folder.exists() and not folder.is_dir():
            raise KvtError(f"--{name.replace('_', '-')} {folder} is a file; give the folder that holds {holds}")
    if s.out is not None and s.out.exists() and not s.out.is_dir():
        raise KvtError(f"--out {s.out} is a file; give a folder (it is created if missing)")


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


def resolve(s):
    """(source dir, target dir, source name, target name)."""
    if s.source or s.target:
        if not (s.source and s.target):
            raise KvtError("give both --source and --target (or --pair)")
        return s.source, s.target, checkpoint_name(s.source), checkpoint_name(s.target)
    src, tgt = parse_pair(s.pair)
    return find_weights(src, s.weights), find_weights(tgt, s.weights), src, tgt


def stats_key(s, src_dir, tgt_dir, calib):
    """What calibration statistics depend on: both checkpoints' weights, the calibration tokens, the
    statistics' dtype and candidates. Another lambda, k or mapper type reuses them."""
    return {"format": STATS_FORMAT, "source": fingerprint(src_dir), "target": fingerprint(tgt_dir),
            "calib": calib.hash(), "stats_dtype": s.stats_dtype, "candidates": s.candidates}


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


def get_mapper(s, source, target, tok, calib, out, skey, dtype, group=None):
    """Load the mapper made from these settings in OUT, or calibrate and save it (statistics checkpointed
    under a name of their own, so another lambda, k or mapper type reads them again)."""
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
                                 plain=s.plain)
    mapper, report = calibrate(source, target, calib, s.scope, s.k, s.lam, options=options)
    if s.mapper in MLP_MODES:
        mapper = add_mlp(mapper, source, target, calib, mode=MLP_MODES[s.mapper], progress=dist.rank() == 0,
                         checkpoint=out / f"mlp-{name}", key=short_id(key))
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


def run_tasks(items, tok, conds, path, header, batch_size):
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
                                      batch_size=batch_size):
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
    needs it) and the processor (kvt.harness.bench.hardware)."""
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


def measure_context_gain(s, source, target, mapper, tok):
    """One row per held-out text and context length: context_gain over --nll-windows windows."""
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


def main(argv=None):
    """Run everything (see the module docstring); returns the results dict. A run that fails leaves no
    empty output folder behind (a folder with a checkpoint in it stays: the rerun resumes from it)."""
    s = Settings.from_args(parse_args(argv))
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
    source, target = load_pair(src_dir, tgt_dir, names, dtype, devices)

    # 2. the mapper, with its weights where the target keeps each layer
    mapper, name = get_mapper(s, source, target, tok, calib, out, skeys["forward"], dtype,
                              plans["forward"].options.group)
    mapper = mapper.place(layer_devices(target))

    # 3. its diagnostics and the gate
    diag, fit, reasons = check_mapper(s, mapper)

    # 4. evaluation, all conditions on the same items
    batch = batch_size(s, items, tok, src_cfg, tgt_cfg, cap, dtype, devices)
    records, header = evaluate(s, items, tok, source, target, mapper, name, out, dtype, batch)
    coqa = {}
    if "coqa" in items:  # the other direction: the large model hands the conversation to the small one
        back = evaluate_back(s, items, tok, source, target, calib, out, skeys["back"], dtype,
                             plans["back"].options.group, header, batch)
        coqa = {" -> ".join(names): coqa_result(records), " -> ".join(names[::-1]): coqa_result(back)}
    if dist.rank() != 0:
        return dist.close()
    gains = measure_context_gain(s, source, target, mapper, tok) if s.heldout else []

    # 5. speed
    rows = run_bench(s, source, target, mapper, lengths, names, dtype, devices[0]) if s.bench else []

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


def load_pair(src_dir, tgt_dir, names, dtype, devices):
    """Both models, split by layers over `devices` where there are several."""
    source = kvt.load_model(src_dir, dtype, devices=devices)
    target = kvt.load_model(tgt_dir, dtype, devices=devices)
    print(f"{names[0]} ({source.config.n_layers} layers) -> {names[1]} ({target.config.n_layers} layers), {dtype} "
          f"on {devices[0]}")
    return source, target


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
        batch = eval_batch(src_cfg, tgt_cfg, cap, context, choices, new, s.scope, s.k, dtype, devices)
    print(f"evaluation: {batch} items a batch (--batch-size)")
    return batch


def evaluate(s, items, tok, source, target, mapper, name, out, dtype, batch):
    """Every task under target / transfer / source / floor (evals.conditions) on the same items, recorded in
    OUT/records-<mapper>-<header hash>.jsonl as they land. Returns (records, the records' header)."""
    recompute = s.recompute
    header = {"format": RECORDS_FORMAT, "mapper": name, "dtype": str(dtype),
              **({"recompute": [recompute.last, recompute.first, recompute.frac]} if recompute else {}),
              **({"recompute_by": recompute.by} if recompute.frac and recompute.by != "attention" else {})}
    conds = evals.conditions(target, source, evals.transfer(source, target, mapper, recompute, s.plain), s.plain)
    return run_tasks(items, tok, conds, out / f"records-{name}-{short_id(header)}.jsonl", header, batch), header


def evaluate_back(s, items, tok, source, target, calib, out, skey, dtype, group, header, batch):
    """CoQA the other way, target -> source, with a mapper of its own (get_mapper). Returns its records."""
    back, back_name = get_mapper(s, target, source, tok, calib, out, skey, dtype, group)
    back = back.place(layer_devices(source))
    rev_header = dict(header, mapper=back_name)
    conds = {"target": evals.Condition(source, plain=s.plain),
             "transfer": evals.Condition(source, evals.transfer(target, source, back, plain=s.plain), plain=s.plain)}
    return run_tasks({"coqa": items["coqa"]}, tok, conds, out / f"records-{back_name}-{short_id(rev_header)}.jsonl",
                     rev_header, batch)


def coqa_result(records):
    return {"gold": coqa_turns(records), "agreement": coqa_agreement(records)}


def run_bench(s, source, target, mapper, lengths, names, dtype, device):
    """Prefill vs transfer timings (bench.bench) at every bench length; the way back is a random mapper of
    the right shapes (timing needs no fit)."""
    back = random_mapper(target.config, source.config, s.scope, s.k, dtype, device)
    return bench(source, target, mapper, back, lengths, names=names,
                 fracs=[s.recompute.frac] if s.recompute.frac else [], plain=s.plain)


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
            f"lambda (on standardized features): {lambda_summary(mapper.meta)}",
            *([f"recompute (kvt's option): the target recomputes the last {recompute.last}, the first "
               f"{recompute.first} and {100 * recompute.frac:g}% "
               f"{'most attended' if recompute.by == 'attention' else 'last'} prompt tokens after mapping"]
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
                "context added that the transfer keeps; the average row, the paper's headline, is the mean over "
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
