"""Calibration, the paper's method end to end: from two models and calibration text to a fitted Mapper.

    mapper, report = calibrate(source, target, calib)    # calib: a data.Calibration (fit and validation regions)

1. Capture both models' KV on the calibration sequences and stream the sums of every ridge fit over
   all source layers (stats.py): head-level (each KV head its own fit) when the pair has matched KV
   heads, else layer-level.
2. Per target layer and kind (K, V), select the k source layers whose single-layer fit has the best
   validation R^2 (ridge.pick_layers).
3. In layer scope on a matched pair, a second pass: layer-level sums of only the selected layers.
4. Ridge per target layer and kind (ridge.fit_layers), lambda picked on validation unless one is given,
   stacked into a Mapper (mapper.from_fits); mapper="mlp": the paper's MLP backstop instead, on the
   same layers (mlp.add_mlp).

Statistics go through the fast adder unless run.plain (fast.adder). `run` (config.Run) holds what a long
run passes in (checkpoints, resume, data parallelism, bounded memory): kvt/harness/calibration.py's.
"""
from kvt import fast, ridge
from kvt.config import Run, check_matched_kv, matched_kv  # Run: what a long run passes in
from kvt.mapper import from_fits
from kvt.mlp import Schedule, add_mlp
from kvt.stats import KINDS, accumulate, layers_used, new_stats
from kvt.weights import weights_meta


def calibrate(source, target, calib, scope="layer", k=8, lam=None, mapper="ridge", run=Run()):
    """Fit a Mapper from source to target (kvt models) on calib, `k` source layers per target layer,
    at `lam` (None: each target layer picks its own on validation); mapper: "ridge", "mlp" or
    "ridge+mlp". Returns (mapper, report): report["r2_single"][kind] (Ls, Lt) validation R^2 of every
    single-layer fit, report["r2"][kind] (Lt,) and report["lambda"][kind] (Lt,) of the ridge fits."""
    src_cfg, tgt_cfg = source.config, target.config
    check_matched_kv(src_cfg, tgt_cfg, scope)
    matched, device = matched_kv(src_cfg, tgt_cfg), next(source.parameters()).device
    lams = ridge.LAMBDAS if lam is None else (lam,)     # the grid each target layer picks from, or the one given
    candidates = run.candidates or list(range(src_cfg.n_layers))
    k, skipped = min(k, len(candidates)), {step: {kind: {} for kind in KINDS} for step in ("select", "fit")}

    def sums(name, scope_, src_layers, tgt_layers=None):     # zero statistics, streamed full over calib
        if run.sums:
            return run.sums(name, scope_, src_layers, tgt_layers)
        stats = new_stats(src_cfg, tgt_cfg, scope_, src_layers, tgt_layers, device=device)
        return accumulate(source, target, calib, stats, run.batch_size, fast.adder(run.plain))

    def fit(stats, selected, lams, skip):                    # step 4: ridge per target layer and kind
        return {kind: ridge.fit_layers(stats, kind, selected[kind], lams, skip[kind], host=True) for kind in KINDS}

    # 1. statistics over every candidate source layer, head-level where the pair has matched KV
    stats = sums("pass1", "head" if matched else "layer", candidates)
    # 2. per target layer and kind, the k source layers with the best validation single-layer R^2
    r2_single, selected = ridge.pick_layers(stats, k, lams, skipped["select"])
    if run.select:
        selected = {kind: run.select(stats, kind, k, lams) for kind in KINDS}
    if scope == "layer" and matched:
        # 3. a layer-level pass over only the selected layers (per group of target layers), then 4. per group
        del stats                                      # free the first pass before the next allocates
        fits = {kind: {} for kind in KINDS}
        for targets in run.groups(selected) if run.groups else [None]:
            def fit_group(targets=targets):
                skip = {kind: {} for kind in KINDS}
                return fit(sums("pass2", "layer", layers_used(selected, targets), targets), selected, lams, skip), skip
            got, skip = run.fitted(selected, targets, lams, fit_group) if run.fitted else fit_group()
            for kind in KINDS:
                fits[kind].update(got[kind])
                skipped["fit"][kind].update(skip[kind])
    else:
        # 4. ridge per target layer and kind, at the lambda with the best validation R^2
        fits = (run.fit or fit)(stats, selected, lams, skipped["fit"])
    meta = {"k": k, "calib_sequences": len(calib.fit), "calib_len": calib.fit.shape[1], "calib": calib.hash(),
            **weights_meta(source, target)}              # the pair's weights' ids
    if any(by for step in skipped.values() for by in step.values()):
        meta["lambda_skipped"] = skipped               # lambdas singular somewhere, skipped there
    out, report = from_fits(scope, src_cfg, tgt_cfg, selected, fits, r2_single, meta)
    if mapper != "ridge":                              # the MLP backstop on the selected layers
        out = add_mlp(out, source, target, calib, mapper, schedule=Schedule(progress=run.progress), train_mlp=run.train_mlp)
    return out, report
