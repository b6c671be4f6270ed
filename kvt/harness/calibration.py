"""The calibration a command runs: kvt/calibrate.py's calibrate, with the hooks a long run needs passed in.

    mapper, report = calibrate(source, target, calib, "layer", k=8, mapper="mlp",
                               options=CalibrationOptions(checkpoint="out/stats", mlp_checkpoint="out/mlp"))

The four steps exist once, in kvt/calibrate.py; this file builds the kvt.calibrate.Run (long_run) they
run through, so both give the same mapper (tests/test_mapper.py). What the hooks bring:
  - checkpoints and resume (accumulate_resumable): each pass's statistics saved every `save_s` seconds
    at a flush point, and a run that finds them resumes bit-identically or reuses them;
  - data parallelism under torchrun (harness/dist.py): each rank streams its share, the sums all-reduced;
  - bounded memory: the memory plan printed (harness/plan.py), fewer candidate layers, float32 sums,
    and layer scope's second pass split into groups of target layers (target_groups), each group's
    fits saved as it is done (saved_fits);
  - a custom layer-selection rule (`select`), and the attention-weighted fit (harness/attnfit.py);
  - each MLP of the backstop saved as it finishes (saved_mlps);
  - the fingerprints of the pair's weights in the mapper (weights.weights_meta, as kvt/calibrate.py's), checked
    against the models it meets (weights.check_pair_weights).
"""
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

import kvt.calibrate
from kvt import fast
from kvt.capture import capture
from kvt.config import KvtError, check_matched_kv
from kvt.harness import attnfit, dist, whiten
from kvt.harness.files import resumable, load_fits, load_mlp_checkpoint, load_stats, save_fits, save_mlp_checkpoint, save_stats, short_id
from kvt.harness.plan import candidate_layers, describe_plan, layer_group_bound, memory_plan, sums_bytes
from kvt.stats import KINDS, SPLITS, groups, layers_used, new_stats
from kvt.weights import check_pair_weights  # noqa: F401 (still imported from here)

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
    mlp_checkpoint: str = None    # path prefix: each MLP saved as it finishes (saved_mlps)
    mlp_key: str = ""             # what the MLP checkpoints depend on


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
    stats = resumable(stats)                            # with a resume point, and what the sums are for
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


# ---- the steps: kvt/calibrate.py's, with a long run's hooks ----------------------------------------------

def calibrate(source, target, calib, scope="layer", k=8, lam=None, batch_size=1, mapper="ridge",
              options=CalibrationOptions()):
    """kvt.calibrate.calibrate, run as `options` say (CalibrationOptions), through the hooks long_run gives it:
    1. statistics over the candidate source layers (head-level when the pair has matched KV), saved to
       CHECKPOINT.pass1 and resumed from, or reused by a calibration that needs the same sums;
    2. per target layer and kind, the k candidates with the best validation single-layer R^2 (or
       options.select's rule, read from the first pass's statistics);
    3. layer scope on a matched pair: layer-level passes of only the selected layers, one per group of
       target layers (target_groups: CHECKPOINT.pass2-<id of its layers>, its fits CHECKPOINT.fit-<id>-<id>);
    4. ridge per target layer and kind, lambda picked on validation (with weights="attention": the
       attention-weighted fit, weighted_fits, from a second pass saved as CHECKPOINT.attn-<id>); with
       mapper="mlp" or "ridge+mlp", the MLPs, each saved as it finishes (saved_mlps).
    Data parallel under torchrun: every rank calls this with the same calib and gets the same mapper.
    Returns (mapper, report) as kvt.calibrate.calibrate does; the mapper's meta also records the
    tokenizer and the source KV's range (source_range)."""
    o, src_cfg, tgt_cfg = options, source.config, target.config
    check_matched_kv(src_cfg, tgt_cfg, scope)
    if o.weights not in ("uniform", "attention", "whitened"):
        raise KvtError(f"token weights {o.weights!r} are not known; use 'uniform', 'attention' or 'whitened'")
    if o.weights != "uniform" and scope != "head":
        raise KvtError(f"the attention-weighted fit (--token-weights {o.weights}) is head-local; use it with --scope head")
    if o.progress and dist.rank() == 0:
        k_used = min(k, len(candidate_layers(src_cfg.n_layers, o.candidates)))
        rows = memory_plan(src_cfg, tgt_cfg, scope, k_used, calib.fit.shape[1] * batch_size, o.candidates,
                           o.stats_dtype, o.group, o.stats_device or next(source.parameters()).device)
        print(f"calibration memory plan ({scope} scope, k={k_used}): {describe_plan(rows)}")
    seen = {}                                          # what the hooks meet on the way: the source's range, alphas
    out, report = kvt.calibrate.calibrate(source, target, calib, scope, k, lam, mapper,
                                          long_run(source, target, calib, k, batch_size, o, seen))
    out.meta.update(tokenizer=o.tokenizer, src_range=seen["src_range"])
    if "alpha" in seen:
        out.meta.update(weights=o.weights, alpha=seen["alpha"])     # per target layer, per head
    if "lambda_skipped" in out.meta and dist.rank() == 0:
        print(f"warning: ridge skipped lambdas whose system is singular: {skipped_text(out.meta['lambda_skipped'])}")
    return out, report


def long_run(source, target, calib, k, batch_size, options, seen):
    """The kvt.calibrate.Run of a command: every pass through accumulate_resumable (checkpointed, resumed,
    data parallel), layer scope's second pass in groups whose fits are saved (target_groups, saved_fits),
    the attention-weighted fit when asked (weighted_fits) and the MLPs saved as they finish (saved_mlps).
    seen gets the first pass's source_range and, with attention weights, the alphas."""
    o, src_cfg, tgt_cfg = options, source.config, target.config
    device = o.stats_device or next(source.parameters()).device

    def sums(name, scope, src_layers, tgt_layers):
        if name == "pass2":
            name = f"pass2-{short_id([list(src_layers), list(tgt_layers)])}"   # named by what it sums
        stats = resumable(new_stats(src_cfg, tgt_cfg, scope, src_layers, tgt_layers, device, o.stats_dtype), o.key)
        stats = accumulate_resumable(source, target, calib, stats, batch_size, o.checkpoint and f"{o.checkpoint}.{name}",
                                     save_s=o.save_s, final=o.keep_stats or name == "pass1", progress=o.progress,
                                     add=fast.adder(o.plain))
        if name == "pass1":
            seen["src_range"] = source_range(stats)
        return stats

    def weighted(stats, selected, lams, skipped):
        fits, alphas = weighted_fits(source, target, calib, stats, selected, lams, skipped, batch_size, o)
        seen["alpha"] = {kind: [alphas[kind][t] for t in range(tgt_cfg.n_layers)] for kind in KINDS}
        return fits

    _, bx, by = groups(src_cfg, tgt_cfg, "layer")
    bound = layer_group_bound(src_cfg, tgt_cfg, k, o.group, o.candidates)
    return kvt.calibrate.Run(
        sums=sums, candidates=candidate_layers(src_cfg.n_layers, o.candidates), select=o.select, groups=lambda selected: target_groups(selected, bx, by, bound),
        fitted=saved_fits(o.checkpoint, o.key, o.keep_stats), fit=weighted if o.weights != "uniform" else None,
        train_mlp=saved_mlps(o.mlp_checkpoint, o.mlp_key, o.progress and dist.rank() == 0), batch_size=batch_size,
        plain=o.plain, progress=o.progress)


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


def saved_fits(checkpoint, key, keep_stats):
    """The `fitted` hook of layer scope's groups: fitted(selected, targets, lams, fit) returns the fits
    (fits {kind: {target layer: (W, b, R^2, lambda)}}, skipped {kind: {target layer: [lambdas]}}) of one
    group of target layers, fit()'s or, with a checkpoint, those a run saved
    (CHECKPOINT.fit-<id of its layers>-<id of the fit>); with keep_stats=False the group's statistics
    checkpoint is deleted once its fits are saved."""
    def fitted(selected, targets, lams, fit):
        plan_id = short_id([layers_used(selected, targets), list(targets)])
        fit_id = short_id([lams, {kind: selected[kind][targets].tolist() for kind in KINDS}])
        done = checkpoint and f"{checkpoint}.fit-{plan_id}-{fit_id}"   # this group's fits, once made
        got = load_fits(done, key)
        if got is None:
            got = fit()
            if done and dist.rank() == 0:
                save_fits(done, *got, key)
                if not keep_stats and os.path.exists(f"{checkpoint}.pass2-{plan_id}"):
                    os.remove(f"{checkpoint}.pass2-{plan_id}")                   # its fits hold what it gave
        return got
    return fitted


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


# ---- the MLP backstop's checkpoints ----------------------------------------------------------------------

def saved_mlps(checkpoint, key="", progress=True):
    """The `train_mlp` hook of mlp.add_mlp: each MLP saved as it finishes (CHECKPOINT-k3.safetensors, ...),
    marked with `key` (what the caller made it for), and a run that finds them trains only the rest: on a
    real pair the MLPs take hours. The sample is seeded, so a resumed run draws the same tokens."""
    def train_mlp(kind, l, train):
        path = checkpoint and f"{checkpoint}-{kind}{l}.safetensors"
        p = load_mlp_checkpoint(path, key)
        if p is not None:
            return p, None
        p, loss = train()
        if path and dist.rank() == 0:                                 # every rank trains the same MLP
            save_mlp_checkpoint(path, p, key)
        if progress:
            print(f"mlp {kind} layer {l}: validation loss {loss:.4f} (fraction of variance left)")
        return p, loss
    return train_mlp
