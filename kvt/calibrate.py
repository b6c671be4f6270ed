"""Calibration, the paper's method end to end: from two models and calibration text to a fitted Mapper.

    mapper, report = calibrate(source, target, calib)    # calib: a data.Calibration (fit and validation regions)

1. Capture both models' KV on the calibration sequences and stream the sums of every ridge fit over
   all source layers (stats.py): head-level (each KV head its own fit) when the pair has matched KV
   heads, else layer-level.
2. Per target layer and kind (K, V), select the k source layers whose single-layer fit has the best
   validation R^2 (ridge.pick_layers).
3. In layer scope on a matched pair, a second pass: layer-level sums of only the selected layers.
4. Ridge per target layer and kind (ridge.fit_layers), lambda picked from ridge.LAMBDAS on validation
   unless one is given; the fits stacked into a Mapper (mapper.from_fits).

Statistics go through the fast adder unless plain=True (fast.adder: centered float32 products, or
float64 ones). The commands run these same steps with what a long run needs around them (checkpoints
and resume, data parallelism, memory-bounded passes, attention weights, the MLP backstop):
kvt/harness/calibration.py.
"""
from kvt import fast, ridge
from kvt.config import check_matched_kv, matched_kv
from kvt.mapper import from_fits
from kvt.stats import KINDS, accumulate, layers_used, new_stats
from kvt.weights import weights_meta


def calibrate(source, target, calib, scope="layer", k=8, lam=None, batch_size=1, plain=False):
    """Fit a ridge Mapper from source to target (kvt models) on calib, `k` source layers per target layer,
    at `lam` (None: each target layer picks its own on validation). Returns (mapper, report):
    report["r2_single"][kind] (Ls, Lt) validation R^2 of every single-layer fit, report["r2"][kind] (Lt,)
    and report["lambda"][kind] (Lt,) of the final fits."""
    src_cfg, tgt_cfg = source.config, target.config
    check_matched_kv(src_cfg, tgt_cfg, scope)
    matched, lams, k = matched_kv(src_cfg, tgt_cfg), ridge.lambdas(lam), min(k, src_cfg.n_layers)
    device, add, skipped = next(source.parameters()).device, fast.adder(plain), ridge.no_skips()

    def sums(scope_, src_layers=None):                 # zero statistics, streamed full over calib
        return accumulate(source, target, calib, new_stats(src_cfg, tgt_cfg, scope_, src_layers, device=device),
                          batch_size, add)

    # 1. statistics over every source layer, head-level where the pair has matched KV
    stats = sums("head" if matched else "layer")
    # 2. per target layer and kind, the k source layers with the best validation single-layer R^2
    r2_single, selected = ridge.pick_layers(stats, k, lams, skipped["select"])
    # 3. layer scope on a matched pair: a layer-level pass over only the selected layers
    if scope == "layer" and matched:
        del stats                                      # free the first pass before the next allocates
        stats = sums("layer", layers_used(selected))
    # 4. ridge per target layer and kind, at the lambda with the best validation R^2
    fits = {kind: ridge.fit_layers(stats, kind, selected[kind], lams, skipped["fit"][kind], host=True)
            for kind in KINDS}
    meta = {"k": k, "calib_sequences": len(calib.fit), "calib_len": calib.fit.shape[1], "calib": calib.hash(),
            **weights_meta(source, target), **ridge.skipped_meta(skipped)}    # the pair's weights' ids
    return from_fits(scope, src_cfg, tgt_cfg, selected, fits, r2_single, meta)
