"""The calibration a command runs: the paper's steps (kvt/calibrate.py) with what a long run needs around them.

    mapper, report = calibrate(source, target, calib, "layer", k=8, options=CalibrationOptions(checkpoint="out/stats"))
    mapper = add_mlp(mapper, source, target, calib, mode="replace")    # the MLP backstop (`--mapper mlp`)

The steps are kvt/calibrate.py's, built from the same helpers (stats.new_stats, ridge.pick_layers,
ridge.fit_layers, mapper.from_fits), so both give the same mapper (tests/test_mapper.py). Around them:
  - checkpoints and resume (accumulate_resumable): each pass's statistics saved every `save_s` seconds
    at a flush point, and a run that finds them resumes bit-identically or reuses them;
  - data parallelism under torchrun (harness/dist.py): each rank streams its share, the sums all-reduced;
  - bounded memory: the memory plan printed (harness/plan.py), fewer candidate layers, float32 sums,
    and layer scope's second pass split into groups of target layers (target_groups, layer_fits), each
    group's fits saved as it is done;
  - a custom layer-selection rule (`select`), and the attention-weighted fit (harness/attnfit.py);
  - the MLP backstop (add_mlp), trained on sampled features, each MLP checkpointed;
  - the fingerprints of the pair's weights in the mapper, checked against the models it meets.
"""
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from kvt import fast, mlp, ridge
from kvt.capture import capture, features
from kvt.config import KvtError, check_matched_kv, matched_kv
from kvt.harness import attnfit, dist, whiten
from kvt.harness.files import load_fits, load_mlp_checkpoint, load_stats, save_fits, save_mlp_checkpoint, save_stats, short_id
from kvt.harness.plan import describe_plan, layer_group_bound, memory_plan, sums_bytes
from kvt.mapper import flat, from_fits, unflat
from kvt.stats import KINDS, SPLITS, candidate_layers, groups, layers_used, new_stats
from kvt.weights import comparable, model_fingerprint

SAVE_S = 600.0     # seconds between statistics checkpoints: a pass of a large pair is tens of GiB to write


@dataclass(frozen=True)
class CalibrationOptions:
    """How a command runs calibration, beyond the paper's steps; the defaults are kvt/calibrate.py's."""
    checkpoint: str = None        # path prefix: each pass's statistics saved and resumed (CHECKPOINT.pass1, ...)
    key: str = ""                 # what the checkpoints depend on (run.py: both weights, the tokens, the dtype)
    tokenizer: str = ""           # the tokenizer's fingerprint, recorded in the mapper
    progress: bool = True         # progress bars and the memory plan
    stats_device: str = None      # where the sums live (default: the source's first device)
    stats_dtype: torch.dtype = torch.float64   # float32 halves the sums' memory
    candidates: int = None        # how many source layers, spread evenly, to select from (default all)
    group: int = None             # target layers per layer-level pass at most (plan.layer_group_bound)
    keep_stats: bool = True       # False: a layer-level pass keeps its fits on disk, not its statistics
    save_s: float = SAVE_S        # seconds between statistics checkpoints
    select: Callable = None       # a layer-selection rule (stats, kind, k, lams) -> (Lt, k); default the paper's
    weights: str = "uniform"      # "uniform" (the paper's), "attention" (attnfit.py, head scope only) or
                                  # "whitened" (attention and the keys' query metric, whiten.py)
    plain: bool = False           # float64 products (stats.add_batches) instead of the fast adder


# ---- statistics: resumable, data parallel ----------------------------------------------------------------

def accumulate_resumable(source, target, calib, stats, batch_size=1, path=None, every=20, save_s=SAVE_S,
                         final=True, progress=True, add=fast.add_batches, capture_target=capture):
    """stats.accumulate for a long run: stream every not-yet-seen sequence of calib.fit, then of calib.val,
    through both models into stats (in place), adding `every` rounds of batches at a time (add(stats,
    stream): fast.add_batches, stats.add_batches, or attnfit.add_weighted, which captures the target
    with capture_target), so each run of rounds ends at a flush point. With `path`, the statistics are
    saved there at the first flush point `save_s` seconds after the last save (0: at every flush point)
    and, with `final`, once complete; a run that finds a checkpoint resumes from it (one made for other
    data, another plan or another key is refused). Saves land on flush points only, so a resumed run
    adds in the order an unbroken one does: bit-identical sums. final=False leaves the complete sums
    unsaved (the caller saves what it fits from them; the last checkpoint stays for it to delete), and
    deletes a checkpoint before writing the next, so the disk never holds two of them.

    Data parallel under torchrun (dist.py; every rank calls this with the same calib and stats): the
    batches are dealt out in rounds, one batch per rank, and the ranks' sums are all-reduced at every
    checkpoint and at the end, so every rank returns the statistics over all the sequences, equal to one
    process's up to float32 rounding. The invariant: the ranks' sums add up to the statistics of the
    first stats.seen sequences (what stats held on entry counts once, on rank 0). A checkpoint holds
    those totals and a resume point between rounds, so it resumes with any number of ranks. Returns stats."""
    if path and Path(path).exists():
        load_stats(path, like=stats)                    # into stats' own tensors: no second copy
    stats.data = stats.data or calib.hash()
    if stats.data != calib.hash():
        raise KvtError(f"statistics {path or ''} were accumulated over other calibration sequences; delete the "
                       "file or use the same corpus, --calib-seqs, --calib-len and seed")
    if dist.rank() > 0:
        zero_(stats)
    ids = torch.cat([calib.fit, calib.val])
    n, n_fit = len(ids), len(calib.fit)
    starts = [*range(0, n_fit, batch_size), *range(n_fit, n, batch_size)]  # batches never straddle splits
    todo = [(s, min(s + batch_size, n_fit if s < n_fit else n)) for s in starts if s >= stats.seen]
    rounds = [todo[i:i + dist.world()] for i in range(0, len(todo), dist.world())]
    devices = [next(m.parameters()).device for m in (source, target)]      # where each model's input goes
    desc = f"calibration stats ({stats.scope}, {len(stats.src_layers)} source x {len(stats.tgt_layers)} target layers)"
    bar = tqdm(total=len(rounds), desc=desc, disable=not progress or dist.rank() > 0)

    def stream(run):                                      # this rank's batches of a run of rounds, captured
        for batches in run:
            for s, e in dist.shard(batches):
                src, tgt = capture(source, ids[s:e].to(devices[0])), capture_target(target, ids[s:e].to(devices[1]))
                yield ("fit" if s < n_fit else "val"), src, tgt
            bar.update()

    with bar:                                             # closed before an interrupt's message is printed
        saved = time.monotonic()
        for i in range(0, len(rounds), every):               # each run ends at a flush point, with or without a
            run = rounds[i:i + every]                         # path, so a resumed run adds as an unbroken one does
            add(stats, stream(run))
            stats.seen = run[-1][-1][1]
            done = stats.seen == n
            due = torch.tensor([float(time.monotonic() - saved >= save_s)], device=stats.part("k", "fit").xx.device)
            if path and (final if done else dist.all_reduce_(due).item() > 0):   # any rank's clock: all save
                saved = time.monotonic()
                all_reduce_(stats)
                if dist.rank() == 0:
                    if not final and Path(path).exists():     # the disk holds one checkpoint of a pass whose
                        os.remove(path)                       # result the caller keeps, not two while rewriting
                    save_stats(stats, path)
                else:
                    zero_(stats)                              # the totals count once: on rank 0
    return all_reduce_(stats)                             # every rank: the sums over all the sequences


def source_range(stats):
    """meta["src_range"]: per source layer of the statistics, the root of the largest per-feature sum of
    squares of its position-free K and of its V over every calibration token (fit and validation), which
    no calibration value exceeds: the serving connector refuses source KV beyond it (a corrupt file)."""
    out = {"layers": list(stats.src_layers)}
    for kind in KINDS:
        sq = sum(stats.part(kind, split).xx.diagonal(dim1=1, dim2=2) for split in SPLITS)   # (G, F): sum x^2
        out[kind] = sq.unflatten(1, (len(stats.src_layers), stats.bx)).amax((0, 2)).sqrt().tolist()
    return out


def check_range(cache, src_range):
    """Refuse (KvtError) source KV that is not finite or larger than the calibration's could hold: per
    source layer the recorded bound (the root of the largest per-feature sum of squares over the
    calibration tokens, so no calibration value exceeds it), keys by sqrt(2) more (the file holds them
    after RoPE, which mixes each pair of position-free dims)."""
    for kind, tensors in (("k", cache.keys), ("v", cache.values)):
        slack = math.sqrt(2) if kind == "k" else 1.0
        for l, bound in zip(src_range["layers"], src_range[kind]):
            x = tensors[l]
            if not bool(torch.isfinite(x).all()):
                raise KvtError(f"source layer {l}'s {'keys' if kind == 'k' else 'values'} are not finite")
            big = x.abs().max().item()
            if big > slack * bound:
                raise KvtError(f"source layer {l}'s {'keys' if kind == 'k' else 'values'} reach {big:.3g}, beyond "
                               f"the {slack * bound:.3g} its calibration KV could hold")


def all_reduce_(stats):
    """Sum every rank's statistics, in place, in their own dtype (float64 by default). Returns stats."""
    for s in stats.sums.values():
        for t in s.tensors():
            dist.all_reduce_(t)
    return stats


def zero_(stats):
    for s in stats.sums.values():
        for t in s.tensors():
            t.zero_()


# ---- the steps --------------------------------------------------------------------------------------------

def calibrate(source, target, calib, scope="layer", k=8, lam=None, batch_size=1, options=CalibrationOptions()):
    """kvt.calibrate.calibrate's steps, run as `options` say (CalibrationOptions):
    1. statistics over the candidate source layers (head-level when the pair has matched KV), saved to
       CHECKPOINT.pass1 and resumed from, or reused by a calibration that needs the same sums;
    2. per target layer and kind, the k candidates with the best validation single-layer R^2 (or
       options.select's rule, read from the first pass's statistics);
    3. layer scope on a matched pair: layer-level passes of only the selected layers, one per group of
       target layers (layer_fits: CHECKPOINT.pass2-<id of its layers>, its fits CHECKPOINT.fit-<id>-<id>);
    4. ridge per target layer and kind, lambda picked on validation (with weights="attention": the
       attention-weighted fit, weighted_fits, from a second pass saved as CHECKPOINT.attn-<id>).
    Data parallel under torchrun: every rank calls this with the same calib and gets the same mapper.
    Returns (mapper, report) as kvt.calibrate.calibrate does; the mapper's meta also records the
    tokenizer, the pair's weight fingerprints (weights_meta) and, if any, the lambdas skipped as singular."""
    o, src_cfg, tgt_cfg = options, source.config, target.config
    check_matched_kv(src_cfg, tgt_cfg, scope)
    if o.weights not in ("uniform", "attention", "whitened"):
        raise KvtError(f"token weights {o.weights!r} are not known; use 'uniform', 'attention' or 'whitened'")
    if o.weights != "uniform" and scope != "head":
        raise KvtError(f"the attention-weighted fit (--token-weights {o.weights}) is head-local; use it with --scope head")
    matched, lams = matched_kv(src_cfg, tgt_cfg), ridge.lambdas(lam)
    k = min(k, len(candidate_layers(src_cfg.n_layers, o.candidates)))
    device = o.stats_device or next(source.parameters()).device
    if o.progress and dist.rank() == 0:
        rows = memory_plan(src_cfg, tgt_cfg, scope, k, calib.fit.shape[1] * batch_size, o.candidates, o.stats_dtype,
                           o.group, device)
        print(f"calibration memory plan ({scope} scope, k={k}): {describe_plan(rows)}")

    def run_pass(name, scope_, src_layers=None, tgt_layers=None, final=True):
        stats = new_stats(src_cfg, tgt_cfg, scope_, src_layers, tgt_layers, device, o.stats_dtype, o.key)
        return accumulate_resumable(source, target, calib, stats, batch_size, o.checkpoint and f"{o.checkpoint}.{name}",
                                    save_s=o.save_s, final=final, progress=o.progress, add=fast.adder(o.plain))

    skipped, alphas = ridge.no_skips(), None
    stats = run_pass("pass1", "head" if matched else "layer", candidate_layers(src_cfg.n_layers, o.candidates))
    r2_single, selected = ridge.pick_layers(stats, k, lams, skipped["select"])
    src_range = source_range(stats)
    if o.select:
        selected = {kind: o.select(stats, kind, k, lams) for kind in KINDS}
    if scope == "layer" and matched:
        del stats                                      # free the first pass before the next allocates
        bound = layer_group_bound(src_cfg, tgt_cfg, k, o.group, o.candidates)
        fits, skipped["fit"] = layer_fits(run_pass, src_cfg, tgt_cfg, selected, lams, bound, o)
    elif o.weights != "uniform":                       # kvt's option: a second, attention-weighted pass
        fits, alphas = weighted_fits(source, target, calib, stats, selected, lams, skipped["fit"], batch_size, o)
    else:
        fits = {kind: ridge.fit_layers(stats, kind, selected[kind], lams, skipped["fit"][kind], host=True)
                for kind in KINDS}
    meta = {"k": k, "tokenizer": o.tokenizer, "calib_sequences": len(calib.fit), "calib_len": calib.fit.shape[1],
            "calib": calib.hash(), "src_range": src_range, **weights_meta(source, target)}
    if alphas is not None:
        per_layer = {kind: [alphas[kind][t] for t in range(tgt_cfg.n_layers)] for kind in KINDS}
        meta.update(weights=o.weights, alpha=per_layer)     # per target layer, per head
    meta.update(ridge.skipped_meta(skipped))
    if "lambda_skipped" in meta and dist.rank() == 0:
        print(f"warning: ridge skipped lambdas whose system is singular: {skipped_text(skipped)}")
    return from_fits(scope, src_cfg, tgt_cfg, selected, fits, r2_single, meta)


def target_groups(selected, bx, by, bound):
    """Target layers split into consecutive groups, each the statistics of one layer-scope pass: a group
    grows while its union of selected source layers (both kinds) and its outputs need no more memory
    than `bound` = (source layers, target layers) can (plan.layer_group_bound), so no pass exceeds
    what the plan counted, and most hold more target layers than the bound's."""
    n_tgt = selected["k"].shape[0]
    if bound[1] >= n_tgt:
        return [list(range(n_tgt))]
    budget = sums_bytes(1, bound[0] * bx, bound[1] * by)
    out, union = [], set()
    for t in range(n_tgt):
        mine = set(layers_used(selected, [t]))
        if out and sums_bytes(1, len(union | mine) * bx, (len(out[-1]) + 1) * by) <= budget:
            out[-1].append(t)
            union |= mine
        else:
            out.append([t])
            union = mine
    return out


def layer_fits(run_pass, src_cfg, tgt_cfg, selected, lams, bound, options):
    """Steps 3 and 4 on a matched pair in layer scope: layer-level statistics of only the selected source
    layers, one pass per group of target layers (target_groups within `bound`), each fitted by ridge as
    soon as it is complete and then freed. run_pass(name, scope, src_layers, tgt_layers, final)
    accumulates one pass (calibrate's). With options.checkpoint, a group's fits are saved
    (CHECKPOINT.fit-<id of its layers>-<id of the fit>) and reused by a run that needs them, and with
    keep_stats=False its statistics checkpoint is deleted once they are.
    Returns (fits {kind: {target layer: (W, b, R^2, lambda)}}, skipped {kind: {target layer: [lambdas]}})."""
    fits, skipped = {kind: {} for kind in KINDS}, {kind: {} for kind in KINDS}
    checkpoint, key, keep = options.checkpoint, options.key, options.keep_stats
    _, bx, by = groups(src_cfg, tgt_cfg, "layer")
    for targets in target_groups(selected, bx, by, bound):
        union = layers_used(selected, targets)
        plan_id = short_id([union, targets])
        fit_id = short_id([lams, {kind: selected[kind][targets].tolist() for kind in KINDS}])
        done = checkpoint and f"{checkpoint}.fit-{plan_id}-{fit_id}"   # this group's fits, once made
        got = load_fits(done, key)
        if got is None:
            stats = run_pass(f"pass2-{plan_id}", "layer", union, targets, final=keep)  # named by what it sums
            skip = {kind: {} for kind in KINDS}
            got = ({kind: ridge.fit_layers(stats, kind, selected[kind], lams, skip[kind], host=True)
                    for kind in KINDS}, skip)
            del stats
            if done and dist.rank() == 0:
                save_fits(done, *got, key)
                if not keep and os.path.exists(f"{checkpoint}.pass2-{plan_id}"):
                    os.remove(f"{checkpoint}.pass2-{plan_id}")                   # its fits hold what it gave
        for kind in KINDS:                             # each W left the device as it was fitted
            fits[kind].update(got[0][kind])
            skipped[kind].update(got[1][kind])
    return fits, skipped


def weighted_fits(source, target, calib, stats, selected, lams, skipped, batch_size, options):
    """Step 4 with attention weights (attnfit.py): a second pass over calib (accumulate_resumable with
    attnfit.capture_weighted and attnfit.add_weighted) streams the r-weighted sums of every target
    layer's selected source layers (selected: kind -> (Lt, k)), checkpointed as
    CHECKPOINT.attn-<id of the selection>; then attnfit.fit_layers blends them into the first pass's
    plain sums `stats` per kind (options.weights "whitened": the keys' error measured in the target's
    query metrics, whiten.query_metrics over calib.fit). Returns (fits {kind: {target layer: (W, b,
    R^2, lambda)}}, alphas {kind: {target layer: [alpha per head]}}); skipped {kind: {}} gets the
    singular lambdas."""
    sel_id = short_id({kind: selected[kind].tolist() for kind in KINDS})
    device = stats.part("k", "fit").xx.device
    wstats = attnfit.new_weighted_stats(source.config, target.config, selected, device, f"{options.key}-attn-{sel_id}")
    accumulate_resumable(source, target, calib, wstats, batch_size,
                         options.checkpoint and f"{options.checkpoint}.attn-{sel_id}", save_s=options.save_s,
                         progress=options.progress, add=attnfit.add_weighted, capture_target=attnfit.capture_weighted)
    alphas = {kind: {} for kind in KINDS}
    metric = {"k": whiten.query_metrics(target, calib.fit, batch_size) if options.weights == "whitened" else None,
              "v": None}                               # whitened: the keys' error in the queries' metric
    fits = {kind: attnfit.fit_layers(stats, wstats, kind, selected[kind], lams, skipped[kind], host=True,
                                     alphas=alphas[kind], metric=metric[kind]) for kind in KINDS}
    return fits, alphas


def skipped_text(skipped):
    """One line: which lambdas were skipped where (calibrate's meta["lambda_skipped"])."""
    where = {"select": "source layer", "fit": "target layer"}
    return "; ".join(f"{kind.upper()} {where[step]} {l} at {', '.join(f'{lam:g}' for lam in lams)}"
                     for step, kinds in skipped.items() for kind, by in kinds.items() for l, lams in by.items())


# ---- the MLP backstop -------------------------------------------------------------------------------------

def sample_features(source, target, ids, max_bytes=2 * 2**30, scope="head", seed=0, progress=False):
    """Position-free K and V of a seeded random sample of the tokens of ids, within max_bytes (float32).

    Returns {kind: (x (G, N, Ls, Bx), y (G, N, Lt, By))} of source and target: the stored features the
    MLP trains on. Memory is bounded by sampling tokens evenly from every sequence."""
    s, t = source.config, target.config
    per_token = 4 * 2 * (s.n_layers * s.n_kv_heads * s.head_dim + t.n_layers * t.n_kv_heads * t.head_dim)
    per_seq = max(1, min(ids.shape[1], max_bytes // per_token // len(ids)))
    g = torch.Generator().manual_seed(seed)
    device, tgt_device = next(source.parameters()).device, next(target.parameters()).device
    parts = {kind: ([], []) for kind in KINDS}
    for seq in tqdm(ids, desc="MLP training features", unit="seq", disable=not progress):
        pick = torch.randperm(ids.shape[1], generator=g)[:per_seq].to(device)  # tokens kept from this sequence
        src, tgt = capture(source, seq[None].to(device)), capture(target, seq[None].to(tgt_device))
        for i, kind in enumerate(KINDS):  # layers of a model split across devices come to `device`
            parts[kind][0].append(features([x.to(device) for x in src[i]], scope)[:, pick].float())
            parts[kind][1].append(features([y.to(device) for y in tgt[i]], scope)[:, pick].float())
    return {kind: (torch.cat(xs, 1), torch.cat(ys, 1)) for kind, (xs, ys) in parts.items()}


MLP_MODES = {"replace": mlp.PAPER_HIDDEN, "residual": (1024,)}  # mode -> default hidden sizes


def add_mlp(mapper, source, target, calib, mode="replace", hidden=None, schedule=mlp.Schedule(),
            max_bytes=2 * 2**30, progress=True, checkpoint=None, key=""):
    """The MLP backstop on a fitted Mapper (its layer selection); returns a new Mapper.

    mode="replace" (the paper's, `--mapper mlp`): the MLP, two hidden layers of 1,024 units, replaces
    ridge. mode="residual" (kvt's option, `--mapper ridge+mlp`): one hidden layer of 1,024 units on top
    of ridge. hidden overrides the sizes. Trains one MLP per target layer and kind (mlp.train, as
    `schedule` says) on a bounded sample of calib.fit's tokens, stopping early on calib.val; calib.diag
    stays unseen for diagnostics (kvt.handoff.diagnose).

    checkpoint: a path prefix; each MLP is saved as it finishes (CHECKPOINT-k3.safetensors, ...), marked
    with `key` (what the caller made it for), and a run that finds them trains only the rest: on a real
    pair the MLPs take hours. The sample is seeded, so a resumed run draws the same tokens."""
    if mode not in MLP_MODES:
        raise KvtError(f"MLP mode {mode!r} is not known; use one of {', '.join(MLP_MODES)}")
    hidden = MLP_MODES[mode] if hidden is None else hidden
    data = {}  # the sampled features, drawn when the first MLP that is not checkpointed needs them
    out = mapper.to()
    out.mlp_mode, out.mlp = mode, {}
    for kind in KINDS:
        params = []
        for l in range(mapper.tgt_cfg.n_layers):
            path = checkpoint and f"{checkpoint}-{kind}{l}.safetensors"
            p = load_mlp_checkpoint(path, key)
            if p is None:
                if not data:
                    data["fit"] = sample_features(source, target, calib.fit, max_bytes, mapper.scope, progress=progress)
                    data["val"] = sample_features(source, target, calib.val, max_bytes // 10 + 1, mapper.scope,
                                                  progress=progress)
                p, loss = mlp.train(*_mlp_data(mapper, kind, l, *data["fit"][kind], mode),
                                    *_mlp_data(mapper, kind, l, *data["val"][kind], mode), hidden, schedule)
                if path and dist.rank() == 0:                             # every rank trains the same MLP
                    save_mlp_checkpoint(path, p, key)
                if progress:
                    print(f"mlp ({mode}) {kind} layer {l}: validation loss {loss:.4f} (fraction of variance left)")
            params.append(p)
        out.mlp[kind] = {name: torch.stack([p[name] for p in params]).cpu() for name in params[0]}
    out.meta["mlp_hidden"] = list(hidden) if not isinstance(hidden, int) else [hidden]
    return out


def _mlp_data(mapper, kind, l, xs, ys, mode):
    """MLP inputs (N, k*Hkv*D) and targets (N, Hkv*D) for target layer l from sampled features
    xs (G, N, Ls, Bx) and ys (G, N, Lt, By); residual: targets minus the ridge map's prediction."""
    y = ys[:, :, l]                                                     # (G, N, By)
    if mode == "residual":
        y = y - mapper.map_layer(kind, l, list(xs.unbind(2)))
    return flat(xs[:, :, mapper.layers[kind][l]]), y.transpose(0, 1).reshape(y.shape[1], -1)


# ---- the weights a mapper was fitted on ----------------------------------------------------------------

def weights_meta(source, target):
    """What calibrate records of its pair's weights (meta["src_weights"], meta["tgt_weights"]): their
    fingerprints (weights.weights_fingerprint), which check_pair_weights compares with the models it meets."""
    return {"src_weights": model_fingerprint(source), "tgt_weights": model_fingerprint(target)}


def check_pair_weights(mapper, source, target, name="the mapper"):
    """Refuse, in one line naming the side, models whose weights are not those the mapper was fitted on:
    one config fits a base and its instruct model, a model and its fine-tune, a function-preserving twin,
    and the configs' fingerprints tell none of them apart. source, target: kvt or transformers models
    (None: not checked). A mapper that records no fingerprints (an older file) is not checked here;
    files.load_mapper said so when it read it."""
    for side, model, entry in (("source", source, "src_weights"), ("target", target, "tgt_weights")):
        made = mapper.meta.get(entry)
        if model is None or not comparable(made):
            continue
        have = model_fingerprint(model)
        if have != made:
            raise KvtError(f"{name} was fitted on other {side} weights (fingerprint {made}, this {side}'s {have}; one "
                           "config, other weights: a base and an instruct model, a fine-tune, or source and target "
                           f"swapped?); pass the {side} it was fitted on, or calibrate a mapper for these models")
