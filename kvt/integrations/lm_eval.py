"""kvt inside lm-evaluation-harness: any harness task under one of kvt's conditions, and retention from the
harness's own output folders.

    pip install 'kvt[lmeval]'          # lm-eval >=0.4.10,<0.5 (tested: 0.4.10, 0.4.13)
    python -m kvt.integrations.lm_eval --model_args source=weights/toy-s,target=weights/toy-m,condition=transfer \\
        --tasks TASK --output_path out/transfer --log_samples          # the harness's own arguments
    python -m kvt.integrations.lm_eval retention out/target out/transfer [out/source]

`python -m kvt.integrations.lm_eval ...` imports this file (which registers the model "kvt" with the harness) and runs
the harness's command line with the same arguments (`--model kvt` unless another is named), so it writes
the harness's results and samples files. From Python: `import kvt.integrations.lm_eval`, then
lm_eval.simple_evaluate(model="kvt", model_args=...). A bare `lm_eval --model kvt` does not find kvt: the
harness discovers models only among its own and those imported before it runs (0.4.13 reads no plugin
entry points, and --include_path adds tasks, not models).

model_args (comma-separated key=value, as for any harness model):
    source, target   checkpoint folders; or pair=FAMILY-SRC:TGT (e.g. toy-s:m) read from weights=DIR
    condition        target (the target's own prefill), source (the source alone), or transfer (the source
                     prefills the context, the mapper carries its cache to the target, which runs the last
                     context token and scores or generates the continuation; kvt.harness.evals.transfer)
    recompute_last, recompute_first, recompute_frac, recompute_by, recompute_rank
                     transfer with a recompute budget (kvt.harness.recompute.Recompute; kvt run's options:
                     recompute_by attention, suffix, rank, random or error, the oracle; recompute_rank r)
    mapper           a saved mapper file; without it, the mapper `kvt run` would make with its defaults is
                     calibrated (or reused) in out=DIR (default runs/<source>_<target>, as kvt run's)
    calib, calib_seqs, calib_len, data_dir   that calibration's text (a file or folder), size and data folder
                     (kvt run's --calib, --calib-seqs, --calib-len, --data-dir)
    dtype, device, max_length   as the harness's hf model's; the batch size is the harness's --batch_size
    plain            true: every step's plain path (kvt run's --plain; KVT_PLAIN=1 in the environment too)
How each request is answered, with kvt's own scoring (kvt/evals.py, kvt/harness/evals.py):
    loglikelihood          (context, continuation) pairs with one context are scored from one prefill of
                           it (batch_size continuations at a time), tokenized as the harness does
                           (kvt.evals.encode_pair); the context is cut on the left to fit max_length
    loglikelihood_rolling  the harness's rolling windows (lm_eval.utils.get_rolling_token_windows) of
                           max_length tokens, each window's context read by the condition. The harness's
                           windows share one token of context (rolling_context=1, its default), so a
                           transfer changes nothing there; kvt's option rolling_context=N gives every
                           window after the first N tokens of context, which the source reads under transfer
    generate_until         greedy (the harness's do_sample=False), kvt.harness.evals.generate_until, until the
                           task's stop strings, EOS or max_gen_toks
"""
import inspect
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

import kvt
import kvt.evals
from kvt.harness import dist, evals, pipeline, report, tasks
from kvt.config import KvtError, find_weights, load_config, parse_pair, plain_requested
from kvt.harness.data import calibration_sequences, check_same_tokenizer
from kvt.harness.recompute import RANK, RULES, budget as recompute_budget, rank_sequences
from kvt.harness.files import load_mapper
from kvt.loading import layer_devices
from kvt.harness.summary import average_retention, summarize
from kvt.weights import check_pair_weights

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
except ImportError as e:  # an optional extra, never a requirement of kvt itself
    raise KvtError(f"kvt.integrations.lm_eval needs lm-evaluation-harness ({e}); pip install 'kvt[lmeval]'") from None

CONDITIONS = ("target", "source", "transfer")
RECOMPUTE_BY = RULES


def model_arg(key, value, kind=int, least=None, most=None):
    """A number of model_args as `kind`, within [least, most]; else one line naming key=value."""
    try:
        v = kind(value) if not isinstance(value, bool) else None
        ok = v is not None and math.isfinite(v) and (kind is float or float(value) == v)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise KvtError(f"model_args {key}={value}: give {'an integer' if kind is int else 'a number'}")
    if (least is not None and v < least) or (most is not None and v > most):
        within = f"within [{least}, {most}]" if most is not None else f"at least {least}"
        raise KvtError(f"model_args {key}={value}: must be {within}")
    return v


def run_calibration(s, tok):
    """The calibration sequences `kvt run` draws with Settings s (its --calib, --calib-seqs, --calib-len, seed)."""
    return calibration_sequences(s.calib, tok, s.calib_seqs, s.calib_len, seed=s.seed,
                                 documents=pipeline.toy_calibration_text(s))


def mapper_for(s, pair):
    """The mapper `kvt run` makes with Settings s (--source, --target, --out and the run's defaults) for the
    loaded pair: reused from s.out when it is there, else calibrated and saved there (pipeline.get_mapper;
    s.plain: --plain's)."""
    seqs = run_calibration(s, pair.tok)
    skey = pipeline.stats_key(s, s.source, s.target, seqs)
    s.out.mkdir(parents=True, exist_ok=True)
    mapper, _ = pipeline.get_mapper(s, pair, seqs, s.out, skey)
    return mapper


@register_model("kvt")
class KvtLM(LM):
    """An lm-evaluation-harness model answering every request under one kvt condition (the module docstring)."""

    def __init__(self, source=None, target=None, pair=None, weights=None, condition="target", mapper=None, out=None,
                 recompute_last=0, recompute_first=0, recompute_frac=0.0, recompute_by="attention", recompute_rank=RANK,
                 calib=None, calib_seqs=None, calib_len=None, data_dir=None, dtype=None, device=None, batch_size=1,
                 max_length=None, rolling_context=1, plain=False,
                 max_batch_size=None):  # max_batch_size: the harness's, unused
        super().__init__()
        if condition not in CONDITIONS:
            raise KvtError(f"condition={condition}: use one of {', '.join(CONDITIONS)}")
        recompute_last, recompute_first = (model_arg(k, v, int, 0) for k, v in
                                           (("recompute_last", recompute_last), ("recompute_first", recompute_first)))
        recompute_frac = model_arg("recompute_frac", recompute_frac, float, 0, 1)
        recompute_rank = model_arg("recompute_rank", recompute_rank, int, 1)
        if recompute_by not in RECOMPUTE_BY:
            raise KvtError(f"model_args recompute_by={recompute_by}: use one of {', '.join(RECOMPUTE_BY)}")
        if condition != "transfer" and (mapper or recompute_last or recompute_first or recompute_frac):
            raise KvtError(f"model_args: a mapper or recompute budget needs condition=transfer (this is "
                           f"condition={condition}); drop them or ask for condition=transfer")
        calib_seqs = None if calib_seqs is None else model_arg("calib_seqs", calib_seqs, int, 1)
        calib_len = None if calib_len is None else model_arg("calib_len", calib_len, int, 2)
        if max_length is not None:
            max_length = model_arg("max_length", max_length, int, 2)
        if pair:
            src, tgt = parse_pair(pair)
            source, target = find_weights(src, weights), find_weights(tgt, weights)
        if target is None or (source is None and condition != "target"):
            raise KvtError("model_args need source=DIR,target=DIR (or pair=FAMILY-SRC:TGT); condition=target "
                           "needs only target")
        if mapper and not Path(mapper).is_file():
            raise KvtError(f"model_args mapper={mapper}: no such file; give a mapper file (kvt run saves "
                           "runs/SRC_TGT/mapper-*.safetensors), or leave mapper out to calibrate one")
        limit = min(load_config(d).max_seq_len for d in (source, target) if d)   # checks the folders, too
        if max_length and max_length > limit:
            raise KvtError(f"model_args max_length={max_length}: the models hold at most {limit} positions "
                           "(max_position_embeddings); give at most that")
        try:
            batch_size = int(str(batch_size).split(":")[0])
        except ValueError:
            raise KvtError(f"batch_size={batch_size}: give a number (kvt has no automatic batch size)") from None
        if batch_size < 1:
            raise KvtError(f"batch_size {batch_size}: must be at least 1")
        rolling_context = model_arg("rolling_context", rolling_context, int, 1)
        if plain not in (True, False):                           # the harness reads true/false as bools (1/0: ints)
            raise KvtError(f"model_args plain={plain}: give true or false")
        plain = bool(plain) or plain_requested()
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dist.check_devices([device])
        dtype = dtype or ("bfloat16" if str(device).startswith("cuda") else "float32")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise KvtError(f"dtype={dtype}: use float32, bfloat16 or float16")
        dtype = getattr(torch, dtype)
        self.batch_size, self.rolling_context = batch_size, int(rolling_context)
        self._device = torch.device(device)
        self.tok = kvt.load_tokenizer(target if condition != "source" else source)
        load = lambda d: kvt.load_model(d, dtype, device=device)  # noqa: E731
        if condition == "target":
            self.cond = evals.Condition(load(target), plain=plain)
        elif condition == "source":
            self.cond = evals.Condition(load(source), plain=plain)
        else:
            check_same_tokenizer(kvt.load_tokenizer(source), self.tok)
            src_model, tgt_model = load(source), load(target)
            out = out or Path("runs") / f"{Path(source).name}_{Path(target).name}"
            s = pipeline.Settings(source=Path(source), target=Path(target), out=Path(out),   # the run's defaults
                                  calib=[Path(calib)] if calib else None, calib_seqs=calib_seqs or None,
                                  calib_len=calib_len or None, plain=plain,
                                  **({"data_dir": Path(data_dir)} if data_dir else {}))
            if mapper:
                m = load_mapper(mapper, src_model.config, tgt_model.config, self.tok.fingerprint())
                check_pair_weights(m, src_model, tgt_model, f"mapper={mapper}")
            else:
                m = mapper_for(s, pipeline.Pair(src_model, tgt_model, self.tok, dtype))
            m = m.to(dtype=dtype).place(layer_devices(tgt_model))
            seqs = None
            if recompute_frac and recompute_by == "rank":             # the subspaces from the run's calibration text
                seqs = rank_sequences(run_calibration(s, self.tok))
            budget = recompute_budget(int(recompute_last), int(recompute_first), float(recompute_frac), recompute_by,
                                      source=src_model, target=tgt_model, mapper=m, calib_seqs=seqs, r=recompute_rank)
            self.cond = evals.Condition(tgt_model, evals.transfer(src_model, tgt_model, m, budget, plain), plain=plain)
        self.max_length = max_length or limit

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        """The harness's way in (--model_args "k=v,..." and its own --device, --batch_size): an unknown key
        is refused in one line, and a key given in model_args wins over the harness's setting of it
        (LM.create_from_arg_string passes both, a TypeError for device=cpu in model_args)."""
        args = simple_parse_args_string(arg_string or "")
        known = [k for k in inspect.signature(cls.__init__).parameters if k != "self"]
        unknown = [k for k in args if k not in known]
        if unknown:
            raise KvtError(f"model_args: unknown key {unknown[0]!r}; kvt's keys are {', '.join(known[:-1])} "
                           "(python -m kvt.integrations.lm_eval --help, docs/lm-eval.md)")
        return cls(**args, **{k: v for k, v in (additional_config or {}).items() if v is not None and k not in args})

    # ------------------------------------------------------------------------------ loglikelihood

    def _pair(self, context, continuation):
        """Token ids (context, continuation) as the harness encodes them, the context cut on the left so
        that what the model reads (context + continuation[:-1]) fits max_length."""
        ctx, cont = kvt.evals.encode_pair(self.tok.encode, context, continuation, self.tok.prefix_id)
        if len(cont) > self.max_length:
            raise KvtError(f"a continuation of {len(cont)} tokens exceeds max_length={self.max_length}")
        return ctx[-(self.max_length + 1 - len(cont)):], cont

    def _score(self, pairs, desc="loglikelihood"):
        """[(ll, greedy)] for (ctx ids, cont ids) pairs: each distinct context prefilled once per batch of
        at most batch_size of its continuations (kvt.evals.loglikelihoods)."""
        by_ctx = defaultdict(list)                               # context ids -> indices of its requests
        for i, (ctx, _) in enumerate(pairs):
            by_ctx[tuple(ctx)].append(i)
        out = [None] * len(pairs)
        bar = tqdm(total=len(pairs), desc=desc, disable=len(pairs) < 2)
        for ctx, idx in by_ctx.items():
            for s in range(0, len(idx), self.batch_size):
                chunk = idx[s:s + self.batch_size]
                [(lls, greedy)] = kvt.evals.loglikelihoods(self.cond.model, [(list(ctx), [pairs[i][1] for i in chunk])],
                                                         self.cond.prefill)
                for i, ll, g in zip(chunk, lls, greedy):
                    out[i] = (ll, bool(g))
                bar.update(len(chunk))
        bar.close()
        return out

    def loglikelihood(self, requests, disable_tqdm=False):
        out = self._score([self._pair(*r.args) for r in requests])
        for r, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", r.args, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        out = []
        for r in tqdm(requests, desc="loglikelihood_rolling", disable=disable_tqdm):
            ids = self.tok.encode(r.args[0], special=False)          # the text's own tokens, as the harness's
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                ids, self.tok.prefix_id, self.max_length, self.rolling_context)]
            ll = sum(ll for ll, _ in self._score(windows, "windows")) if windows else 0.0
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, ll)
            out.append(ll)
        return out

    # ---------------------------------------------------------------------------------- generation

    def generate_until(self, requests, disable_tqdm=False):
        out = []
        for r in tqdm(requests, desc="generate_until", disable=disable_tqdm):
            context, kw = r.args
            kw = dict(kw)
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.pop("max_gen_toks", 256))
            if kw.pop("do_sample", False) or float(kw.pop("temperature", 0.0) or 0.0) > 0:
                raise KvtError("kvt generates greedily; give the task do_sample: false and temperature: 0")
            if len(self.tok.encode(context)) + max_new > self.max_length:  # the harness would cut the context
                raise KvtError(f"a context of {len(self.tok.encode(context))} tokens and max_gen_toks={max_new} exceed "
                               f"max_length={self.max_length}; raise max_length (up to the models' context)")
            text = evals.generate_until(self.cond, self.tok, context, until, max_new)
            self.cache_hook.add_partial("generate_until", r.args, text)
            out.append(text)
        return out


# ------------------------------------------------------------------------------------ retention

NOT_MEANS = {"perplexity", "bleu", "chrf", "ter", "f1", "mcc", "brier_score"}  # harness metrics aggregated otherwise
ROLLING = ("word_perplexity", "byte_perplexity", "bits_per_byte")              # kvt.harness.summary.CORPUS, per document


def read_samples(folder):
    """{task: {doc_id: {metric: value}}} from the newest samples_<task>_*.jsonl under a harness output folder
    (its model subfolders included), and the model_args string of its newest results_*.json. A metric of a
    filter other than "none" is named metric,filter (exact_match,strict-match); a rolling task's
    (loglikelihood, words or bytes) pairs become kvt's ll, words and bytes."""
    folder = Path(folder)
    results = sorted(folder.rglob("results_*.json"), key=lambda f: f.name)
    if not results:
        raise KvtError(f"no results_*.json under {folder}; give folders the harness wrote (--output_path) "
                       "with --log_samples")
    config = json.loads(results[-1].read_text()).get("config", {})
    newest = {}
    for f in sorted(folder.rglob("samples_*.jsonl"), key=lambda f: f.name):
        newest[f.name[len("samples_"):].rsplit("_", 1)[0]] = f       # samples_<task>_<timestamp>.jsonl
    if not newest:
        raise KvtError(f"no samples_*.jsonl under {folder}; run the harness with --log_samples")
    out = {}
    for task, f in newest.items():
        docs = out.setdefault(task, {})
        for line in f.read_text().splitlines():
            s = json.loads(line)
            rec = docs.setdefault(s["doc_id"], {})
            filt = s.get("filter", "none")
            for m in s.get("metrics", []):
                v = s.get(m)
                if m in ROLLING:
                    rec["ll"], rec["bytes" if m != "word_perplexity" else "words"] = v[0], v[1]
                    rec[m] = None                                     # named, computed from ll and the length
                elif m not in NOT_MEANS and isinstance(v, (int, float, bool)):
                    rec[m if filt == "none" else f"{m},{filt}"] = float(v)
    return out, config


def model_args(config):
    """A harness run's model_args as a dict (results files hold a dict or the command line's string)."""
    args = config.get("model_args") or {}
    return dict(kv.split("=", 1) for kv in args.split(",") if "=" in kv) if isinstance(args, str) else args


def condition_of(config, folder):
    """The kvt condition named in a harness run's model_args (a non-kvt model, e.g. hf, is a target)."""
    args = model_args(config)
    if config.get("model") not in (None, "kvt"):
        return "target"
    if args.get("condition", "target") not in CONDITIONS:
        raise KvtError(f"{folder}: condition {args.get('condition')!r} is not one of {', '.join(CONDITIONS)}")
    return args.get("condition", "target")


def retention(folders):
    """kvt's summary (kvt.harness.summary.summarize) of harness output folders, one per condition, item-paired by
    the harness's doc ids; folders: paths, or NAME=PATH to name a folder's condition. Each harness task is
    registered as a kvt task lm_eval:<task> with the per-item metrics its samples carry. Returns summarize's
    and average_retention's results and the pair's names [source, target] (from the transfer run)."""
    records, seen, configs = [], {}, {}
    for spec in folders:
        name, path = spec.split("=", 1) if "=" in spec else ("", spec)
        samples, config = read_samples(path)
        name = name or condition_of(config, path)
        if name in seen:
            raise KvtError(f"{path} and {seen[name]} are both {name}; name them, e.g. target={path}")
        seen[name], configs[name] = path, config
        for task, docs in samples.items():
            metrics = sorted({m for r in docs.values() for m in r if m not in ("ll", "words", "bytes")})
            rolling = [m for m in ROLLING if m in metrics]
            if not metrics:                                           # only metrics that are not means
                continue
            kind = "loglikelihood_rolling" if rolling else "generate_until"   # generate_until: any metric names
            tasks.register(tasks.Task(f"lm_eval:{task}", lambda: [], kind, tuple(rolling or metrics)))
            for doc_id, r in docs.items():
                records.append({"task": f"lm_eval:{task}", "condition": name, "id": str(doc_id), **r})
    if "target" not in seen or "transfer" not in seen:
        raise KvtError(f"retention needs a target and a transfer folder (have {', '.join(seen) or 'none'}); "
                       "name them, e.g. target=DIR transfer=DIR")
    pair = [Path(str(model_args(configs["transfer"]).get(k, k))).name for k in ("source", "target")]
    return summarize(records), average_retention(records), pair


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["retention"]:
        if len(argv) < 3:
            raise KvtError("usage: python -m kvt.integrations.lm_eval retention TARGET_DIR TRANSFER_DIR [SOURCE_DIR] "
                           "(or NAME=DIR each)")
        summary, average, (src, tgt) = retention(argv[1:])
        print(report.format_summary(summary, average, src, tgt))
        return summary
    from lm_eval.__main__ import cli_evaluate                          # the harness's own command line
    if not any(a == "--model" or a.startswith("--model=") for a in argv):
        argv = ["--model", "kvt", *argv]
    saved, sys.argv = sys.argv, ["lm_eval", *argv]                    # the harness parses sys.argv
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


def cli(argv=None):
    """main(), with a problem the user can fix as one line `kvt: ...` and exit status 2 (kvt/cli.py)."""
    try:
        main(argv)
    except KvtError as e:
        print(f"kvt: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
