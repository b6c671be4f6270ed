"""kvt/harness/repairs.py, the side-by-side command's controls and columns: the random map keeps the fitted
one's shapes and norms, the raw source is the target's own prefill when source and target are one model,
agreement of the target with itself is 1, and the cell's ratios are the formulas its docstring gives."""
import pytest
import torch
from conftest import calib_of, tiny_config

import kvt
from kvt.calibrate import calibrate
from kvt.harness import evals
from kvt.harness.repairs import agreement, cell, random_map, raw_source, same_kv

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = torch.randint(0, 128, (14, 24), generator=torch.Generator().manual_seed(0))


def test_random_map_has_the_fitted_shapes_and_norms_but_not_its_weights():
    """Guards: a control with other norms (a scale alone would then separate it from the fit), with the
    fitted weights left in, or with one norm for all target layers."""
    source = kvt.build_model(tiny_config(n_layers=3), seed=0)
    target = kvt.build_model(tiny_config(n_layers=3), seed=5)
    mapper, _ = calibrate(source, target, calib_of(IDS))
    rnd = random_map(mapper, seed=1)
    for kind in ("k", "v"):
        for a, b in ((mapper.W[kind], rnd.W[kind]), (mapper.b[kind], rnd.b[kind])):
            assert a.shape == b.shape
            for l in range(a.shape[0]):
                assert abs(a[l].norm().item() - b[l].norm().item()) < 1e-4 * a[l].norm().item()
            assert (a - b).abs().max() > 1e-3
        assert torch.equal(rnd.layers[kind], mapper.layers[kind])


def test_raw_source_of_one_model_is_its_own_prefill_and_agreement_with_itself_is_one():
    """Guards: the raw-source control dropping the last token (or running it twice), and agreement compared
    with another condition than the target's own prefill."""
    model = kvt.build_model(tiny_config(n_layers=2), seed=0)
    ids = IDS[:1, :16]
    got, _ = raw_source(model, model)(ids)
    own, _ = model(ids)
    assert (got - own[:, -1]).abs().max() < 1e-5
    assert same_kv(model.config, model.config) and not same_kv(model.config, tiny_config(n_layers=3))
    conds = {"target": evals.Condition(model), "raw": evals.Condition(model, raw_source(model, model)),
             "floor": evals.Condition(model, floor=True)}
    agree = agreement(conds, IDS[:3, :12], n=6)
    assert agree["target"] == [1.0] * 3 and agree["raw"] == [1.0] * 3 and all(0 <= a <= 1 for a in agree["floor"])


def test_cell_ratios_are_retention_floor_normalized_and_gap_recovered():
    """Guards: the gap taken against the floor, or the floor-normalized ratio against the source."""
    per = {"target": [1, 1, 1, 0], "source": [1, 0, 0, 0], "floor": [0, 0, 0, 0], "x": [1, 1, 0, 0]}
    c = cell(per, "x", n_boot=100)
    assert c["mean"] == 0.5 and c["retention"] == pytest.approx(2 / 3)
    assert c["floor_normalized"] == pytest.approx(2 / 3) and c["gap_recovered"] == pytest.approx(0.5)
    assert cell({"x": [1, 0]}, "x", n_boot=10)["gap_recovered"] is None


@pytest.mark.slow
def test_the_side_by_side_command_at_a_small_size(tmp_path):
    """The documented command (docs/real-weights.md) at a small size on toy-s -> toy-m: every column has the
    controls and every fit x rule x budget, and at budget 1 every rule scores exactly as the target's own
    prefill on every column (generation included). Guards a rule or fit dropped from the table, a control
    missing, and a recompute that leaves a slot mapped (or a condition scored on other items)."""
    from kvt.harness import repairs
    from kvt.harness.recompute import RULES
    out = tmp_path / "rep"
    res = repairs.main(["--source", "weights/toy-s", "--target", "weights/toy-m", "--calib-seqs", "24", "--limit", "6",
                        "--agree-prompts", "3", "--fits", "ridge,whitened", "--budgets", "0,0.2,1", "--rank", "8",
                        "--out", str(out)])
    assert list(res)[:3] == ["toy_recall_gen em", "toy_copy em", "agreement@32"]  # generation first
    for col, rows in res.items():
        assert {"target", "source", "floor", "random map", "raw source"} <= set(rows), col
        for fit in ("ridge", "whitened"):
            assert f"{fit} rho=0" in rows
            for rule in RULES:
                assert rows[f"{fit} {rule} rho=0.2"]["n"] == rows["target"]["n"]
                assert rows[f"{fit} {rule} rho=1"]["mean"] == rows["target"]["mean"], (col, fit, rule)
    text = (out / "report.md").read_text()
    assert "gap recovered" in text and "(oracle)" in text and "Hardware:" in text
    assert "| toy_recall_gen em | whitened | rank | " in text and "| agreement@32 | raw source | |" in text
