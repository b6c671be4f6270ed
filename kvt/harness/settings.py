"""What `kvt run` is asked: the command line (parse_args) made into one frozen Settings, checked in one line per
mistake (check_args) before any work, with the defaults that depend on the pair filled in. pipeline.py runs on it.

    s = Settings(pair="qwen3-14b:32b")                 # from keywords
    s = Settings.from_args(parse_args(argv))           # from a command line
"""
import argparse
import dataclasses
import math
from pathlib import Path

import torch

from kvt import ridge
from kvt.config import KvtError, at_least, checkpoint_name, parse_pair, plain_requested
from kvt.harness.recompute import RANK, RULES, Recompute
from kvt.harness import tasks
from kvt.harness.diagnose import MAX_KL, MIN_ATTN_COS

DESCRIPTION = "kvt end to end: calibrate (or reuse) a mapper for a pair, check it, evaluate, benchmark, report."
TOY_TASKS = "toy_recall,toy_recall_gen,toy_copy,toy_count"
REAL_TASKS = "hellaswag,arc_easy,arc_challenge,mmlu,gsm8k"
REAL_CALIB = ("calib/wikitext-2", "calib/gutenberg")    # under the data folder: about 3.7M tokens of prose
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
    recompute_rank: int = RANK
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


def add_evaluation_args(ap):
    """parse_args' options of the handoff's recompute budget, the held-out NLL measure and the gate."""
    ap.add_argument("--recompute-last", type=int, help="kvt's option: after mapping, the target "
                    "recomputes the KV of the last R prompt tokens itself (the last one it always runs)")
    ap.add_argument("--recompute-first", type=int, help="kvt's option: ... of the first S tokens")
    ap.add_argument("--recompute-frac", type=float, help="kvt's option: ... of this fraction of the "
                    "tokens, those the source attended to most while finishing the prompt")
    ap.add_argument("--recompute-by", choices=list(RULES),
                    help="which tokens --recompute-frac takes (kvt/harness/recompute.py): the most attended "
                    "(default), the last ones (suffix), rank (RaReCache's rank disagreement), random (seeded), or "
                    "error (an oracle: the map's error against the target's true KV, for reference only)")
    ap.add_argument("--recompute-rank", type=int, help=f"rank's r, the calibration subspace's dimension "
                    f"(RaReCache: {RANK})")
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


def parse_args(argv=None):
    """argparse's namespace of a `kvt run` command line (Settings.from_args makes the run's Settings of it)."""
    ap = argparse.ArgumentParser(prog="kvt run", description=DESCRIPTION,
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
    ap.add_argument("--token-weights", choices=["uniform", "attention", "whitened"],
                    help="ridge token weights: uniform (the paper's, default) or attention (CacheBridge's "
                    "attention-weighted fit, kvt's option; --scope head only, kvt/harness/attnfit.py); whitened: "
                    "attention, with each key head's error measured in the target's query metric "
                    "(kvxfer's whitened key fit, kvt/harness/whiten.py)")
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
    add_evaluation_args(ap)
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
    if s.token_weights != "uniform" and s.scope not in ("head", "head-local"):
        raise KvtError(f"--token-weights {s.token_weights} is the head-local attention-weighted fit; add --scope head")
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
    positive("recompute-rank", s.recompute_rank, 1, " (rank's subspace dimension)")
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
