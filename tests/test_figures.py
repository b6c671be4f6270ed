"""figures.py and diagnose.fit_gate: the evidence tables drawn from finished runs' results.json."""
import pytest

from kvt.harness.figures import correlations, gate_evidence, recompute_rows
from kvt.harness.diagnose import fit_gate


def result(cos, kl, retention, frac=0.0, by=None, tasks=None):
    """The parts of a run.py results.json these functions read."""
    tasks = tasks or {"copy": retention}
    settings = {"scope": "layer", "mapper": "ridge", "recompute_frac": frac}
    if by:
        settings["recompute_by"] = by
    return {"pair": ["a", "b"], "settings": settings,
            "diagnostics": {"r2_k_mean": cos, "r2_v_mean": cos, "attn_cos_mean": cos, "kl": kl},
            "average_retention": {"retention": retention, "metric": {t: "em" for t in tasks}},
            "tasks": {t: {"retention": {"em": {"ratio": r}}} for t, r in tasks.items()}}


def test_fit_gate_separates_good_from_bad_by_the_loosest_thresholds():
    """Guards: ties broken toward a stricter gate than the evidence needs, and a KL threshold that
    lets a known bad mapper through."""
    diags = [result(c, k, 0)["diagnostics"] for c, k in [(0.99, 0.01), (0.95, 0.05), (0.97, 0.5), (0.80, 0.02)]]
    good = [True, True, False, False]
    cos, kl, agree = fit_gate(diags, good)
    assert agree == 4
    assert cos == 0.95 and kl == 0.05, (cos, kl)  # the only thresholds on the runs' own values that call all four
    loose = fit_gate(diags[:1] + diags[3:], [True, False], cos_grid=[0.85, 0.9, 0.95], kl_grid=[0.1, 0.2, 0.3])
    assert loose == (0.85, 0.3, 2), loose         # every pair agrees; the loosest is kept


def test_gate_evidence_correlations_and_leave_one_out():
    """Retention falling as KL rises must give rho = -1 for KL. Guards: a correlation taken against the
    wrong column, or leave-one-out scoring a run with a gate fitted on it."""
    runs = [result(0.99, 0.001, 1.0), result(0.97, 0.01, 0.95), result(0.98, 0.1, 0.85), result(0.90, 0.3, 0.6)]
    rows, corr, (cos, kl, agree), loo = gate_evidence(runs)
    assert len(rows) == 4 and corr["kl"][1] == pytest.approx(-1.0) and corr["attn_cos"][1] < 1
    assert agree == 4 and 0 <= loo <= 4
    assert correlations([1, 2, 3], [3, 2, 1]) == pytest.approx((-1.0, -1.0))


def test_gate_evidence_counts_each_map_once_and_no_repair():
    """A map evaluated twice (the same mapper on fewer items) counts once, with its larger run, and runs
    with a recompute budget do not count at all. Guards: recompute runs or repeats of one map inflating
    the evidence (they carry the same diagnostics with other retentions)."""
    runs = [dict(result(0.99, 0.001, 1.0), mapper="a", items={"copy": [1, 2]}),
            dict(result(0.99, 0.001, 0.5), mapper="a", items={"copy": [1]}),
            dict(result(0.98, 0.1, 0.95, 0.25), mapper="b", items={"copy": [1, 2, 3]}), dict(result(0.98, 0.1, 0.85), mapper="b"),
            dict(result(0.90, 0.3, 0.6), mapper="c")]
    rows, *_ = gate_evidence(runs)
    assert sorted(r["retention"] for r in rows) == [0.6, 0.85, 1.0]


def test_recompute_rows_start_both_curves_at_budget_zero():
    """A run without recompute is the 0% point of both strategies; the others sort by budget within
    their strategy. Guards: runs of another strategy mixed into a curve (recompute_by ignored) and the
    budget-0 run missing from one curve."""
    runs = [result(0.9, 0.1, 0.7, 0.25, "suffix", {"copy": 0.5}), result(0.9, 0.1, 0.9, 0.25, None, {"copy": 0.9}),
            result(0.9, 0.1, 0.6, 0.0, None, {"copy": 0.1}), result(0.9, 0.1, 0.8, 0.05, "attention", {"copy": 0.6})]
    rows = recompute_rows(runs)
    assert [(by, f) for by, f, _, _ in rows] == [("attention", 0.0), ("attention", 0.05), ("attention", 0.25),
                                                 ("suffix", 0.0), ("suffix", 0.25)]
    assert [per["copy"] for by, _, _, per in rows if by == "suffix"] == [0.1, 0.5]


def test_retention_png_draws_intervals_that_round_past_their_value(tmp_path):
    """An interval bound a hair inside its value (1.0 with an upper bound of 0.9999999999) or missing
    (None) draws as a zero-length error bar. Guards: matplotlib's "'yerr' must not contain negative values"
    ending a finished run at its last step."""
    pytest.importorskip("matplotlib")
    from kvt.harness.figures import retention_png
    s = {"t": {"target": {"acc": 0.5, "acc_ci": [0.4, 0.6]}, "transfer": {"acc": 1.0, "acc_ci": [0.9, 0.9999999999]},
               "source": {"acc": 0.0, "acc_ci": [None, None]}}}
    assert retention_png(s, {"t": "acc"}, tmp_path / "r.png") and (tmp_path / "r.png").stat().st_size > 0
