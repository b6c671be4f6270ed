"""mapper.py, calibrate.py and harness/calibration.py: an exact pair is mapped exactly; the harness fits the
core's mapper; files round-trip and refuse other pairs; the MLP backstop."""
from pathlib import Path

import pytest
import torch
from conftest import calib_of, function_preserving_twin, tiny_config

import kvt
from kvt import mlp, ridge
from kvt.config import KvtError
from kvt.calibrate import calibrate
from kvt.harness import calibration
from kvt.harness.calibration import CalibrationOptions, saved_mlps
from kvt.mlp import add_mlp
from kvt.harness.files import load_mapper, save_mapper

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
IDS = torch.randint(0, 128, (14, 24), generator=torch.Generator().manual_seed(0))
CALIB = calib_of(IDS)                                      # 10 fit, 2 validation, 2 diagnostics sequences


def assert_close(actual, expected, what, atol=1e-4):
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= atol, f"{what}: max abs error {err:.2e} > {atol:.0e}"


def assert_same_cache(a, b, what, atol=1e-4):
    for l in range(len(b.keys)):
        assert_close(a.keys[l], b.keys[l], f"{what}: layer {l} keys", atol)
        assert_close(a.values[l], b.values[l], f"{what}: layer {l} values", atol)
    assert torch.equal(a.positions, b.positions) and torch.equal(a.mask, b.mask)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def exact_pair(request):
    source = kvt.build_model(tiny_config(request.param, n_layers=3), seed=0)
    return source, function_preserving_twin(source, seed=1)


@pytest.mark.parametrize("scope", ["head", "layer"])
def test_exact_pair_is_mapped_exactly(exact_pair, scope):
    """The twin's KV is R_h k and M_h v of the same layer: selection finds that layer, ridge the map.
    apply maps a batch of 2 and one row of it (head scope, batch 1: values written straight into the
    cache; writing them elsewhere fails)."""
    source, target = exact_pair
    mapper, report = calibrate(source, target, CALIB, scope=scope, k=1, lam=1e-9)
    for kind in "kv":
        assert mapper.layers[kind][:, 0].tolist() == [0, 1, 2], f"{kind}: selected {mapper.layers[kind].tolist()}"
        assert (report["r2"][kind] > 1 - 1e-6).all(), f"{kind} validation R^2 {report['r2'][kind].tolist()}"  # float32 KV
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(5))  # longer than calibration
    _, src_cache = source(ids)
    _, tgt_cache = target(ids)
    assert_same_cache(mapper.apply(src_cache), tgt_cache, f"{scope} scope")
    assert_same_cache(mapper.apply(src_cache.select(slice(1, 2))), tgt_cache.select(slice(1, 2)), f"{scope}, batch 1")


def test_mapped_keys_relocate(exact_pair):
    """Keys mapped to other positions equal the target's own prefill at those positions (RoPE re-applied)."""
    source, target = exact_pair
    mapper, _ = calibrate(source, target, CALIB, scope="head", k=1, lam=1e-9)
    ids = IDS[:2, :16]
    _, src_cache = source(ids)
    moved = src_cache.positions + 7
    _, tgt_cache = target(ids, positions=moved)
    assert_same_cache(mapper.apply(src_cache, positions=moved), tgt_cache, "relocated by 7")


def test_layer_scope_maps_across_kv_shapes():
    source = kvt.build_model(tiny_config("qwen3", n_layers=3), seed=0)                  # 2 KV heads x 16
    target = kvt.build_model(tiny_config("qwen3", n_kv_heads=1, head_dim=32), seed=1)   # 1 KV head x 32
    mapper, report = calibrate(source, target, CALIB, scope="layer", k=2)
    assert mapper.W["k"].shape == (2, 1, 2 * 32, 32)                                    # (Lt, G, k*Hkv*D, Hkv*D)
    _, cache = target(IDS[:2])
    mapped = mapper.apply(source(IDS[:2])[1])
    assert [k.shape for k in mapped.keys] == [k.shape for k in cache.keys]
    assert all(torch.isfinite(r).all() for r in report["r2"].values())


def test_parameter_count_and_bytes(exact_pair):
    source, target = exact_pair
    G, D, Lt = 2, 16, 3
    mapper, _ = calibrate(source, target, CALIB, scope="head", k=2)
    assert mapper.n_params() == 2 * Lt * (G * 2 * D * D + G * D)                        # K and V: W and b
    assert mapper.nbytes() == 4 * mapper.n_params()
    mapper, _ = calibrate(source, target, CALIB, k=2)                   # layer scope: 1 group
    assert mapper.n_params() == 2 * Lt * (2 * G * D * G * D + G * D)


def test_save_load_roundtrip_and_refusals(exact_pair, tmp_path):
    source, target = exact_pair
    options = CalibrationOptions(progress=False, tokenizer="tok123")
    mapper, _ = calibration.calibrate(source, target, CALIB, k=2, options=options)
    path = tmp_path / "m.safetensors"
    save_mapper(mapper, path)
    back = load_mapper(path, source.config, target.config, tokenizer="tok123")
    assert back.scope == mapper.scope and back.meta["k"] == 2 and back.meta["lambda"] == mapper.meta["lambda"]
    assert set(back.meta["lambda"]) == {"k", "v"} and all(l in ridge.LAMBDAS for l in back.meta["lambda"]["k"])
    for name, t in mapper.tensors().items():
        assert torch.equal(back.tensors()[name], t), name
    save_mapper(mapper, tmp_path / "half.safetensors", dtype=torch.bfloat16)
    half = load_mapper(tmp_path / "half.safetensors")
    _, cache = source(IDS[:1])
    assert_same_cache(half.apply(cache), mapper.apply(cache), "bf16-stored mapper", atol=0.05)
    assert (tmp_path / "half.safetensors").stat().st_size < 0.6 * path.stat().st_size

    other = kvt.build_model(tiny_config("qwen3", n_layers=4), seed=0)
    for kw in ({"src_cfg": other.config}, {"tgt_cfg": other.config}, {"tokenizer": "another"}):
        with pytest.raises(KvtError) as e:
            load_mapper(path, **kw)
        assert "recalibrate" in str(e.value) and "\n" not in str(e.value), kw
    (tmp_path / "x.safetensors").write_bytes(path.read_bytes()[:100])
    with pytest.raises(KvtError, match="not a readable mapper file"):
        load_mapper(tmp_path / "x.safetensors")


def test_mlp_learns_what_ridge_cannot():
    """Guards: an MLP that fails to train (a stale best state, the standardization folded in wrongly)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1200, 8, generator=g)
    y = torch.tanh(2 * x @ torch.randn(8, 4, generator=g))                              # nonlinear
    xa = torch.cat([x, torch.ones(1200, 1)], 1)
    A = torch.linalg.lstsq(xa[:1000], y[:1000]).solution
    linear = ((xa[1000:] @ A - y[1000:]) ** 2).mean() / y[1000:].var(0).mean()
    for hidden in (64, (64, 64)):                                                       # kvt's residual form, the paper's
        p, loss = mlp.train(x[:1000], y[:1000], x[1000:], y[1000:], hidden,
                            mlp.Schedule(lr=3e-3, batch=32, max_epochs=60, patience=10))
        assert mlp.n_layers(p) == (2 if hidden == 64 else 3)
        val = ((mlp.forward(p, x[1000:]) - y[1000:]) ** 2).mean() / y[1000:].var(0).mean()
        assert val < 0.5 * linear, f"{hidden}: MLP validation error {val:.3f} vs linear {linear:.3f}"
        assert abs(val - loss) < 0.05 * linear, "train() reports its validation loss in variance units"


def test_mlp_keeps_its_best_epoch_when_gains_are_small():
    """Early stopping waits for a 1% gain, but the weights returned are the best epoch's. Guards: keeping
    the state of the last 1% gain (here epoch 1), which throws away every smaller gain after it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1200, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 4, generator=g))
    args = (x[:1000], y[:1000], x[1000:], y[1000:])
    _, one = mlp.train(*args, 16, mlp.Schedule(lr=3e-5, batch=100, max_epochs=1))   # each epoch gains well under 1%
    _, more = mlp.train(*args, 16, mlp.Schedule(lr=3e-5, batch=100, max_epochs=30, patience=3))
    assert more < one - 1e-3, f"validation loss {more:.4f} after early stopping, {one:.4f} after one epoch"


def test_mlp_backstop_on_a_mapper(tmp_path):
    """The paper's MLP replaces ridge: its map ignores the ridge weights entirely, and has two hidden
    layers. kvt's residual MLP adds to ridge. Guards: replace mode still adding the ridge map, a
    residual trained on y instead of y - ridge, and the MLP lost in save/load."""
    source = kvt.build_model(tiny_config("llama", n_layers=3), seed=0)
    target = kvt.build_model(tiny_config("llama", n_layers=2), seed=1)
    mapper, _ = calibrate(source, target, CALIB, k=2)
    _, cache = source(IDS[:1])
    _, own = target(IDS[:1])
    replaced = add_mlp(mapper, source, target, CALIB, hidden=(32, 32), schedule=mlp.Schedule(max_epochs=2))
    assert replaced.mapper == "mlp" and replaced.mlp["k"]["w1"].shape == (2, 32, 32)
    assert replaced.mlp["k"]["w0"].shape == (2, 2 * 2 * 16, 32) and replaced.mlp["k"]["w2"].shape == (2, 32, 32)
    no_ridge = replaced.to()
    no_ridge.W = {kind: torch.randn_like(w) for kind, w in replaced.W.items()}
    assert_same_cache(no_ridge.apply(cache), replaced.apply(cache), "replace mode without ridge weights", atol=0)
    residual = add_mlp(mapper, source, target, CALIB, "ridge+mlp", hidden=64,
                       schedule=mlp.Schedule(max_epochs=40, patience=40))
    assert residual.mapper == "ridge+mlp" and residual.mlp["k"]["w0"].shape == (2, 2 * 2 * 16, 64)
    _, fit_cache = source(CALIB.fit)
    _, fit_own = target(CALIB.fit)

    def err(m):                                          # on the tokens the MLP was trained on
        mapped = m.apply(fit_cache)
        return sum(((a - b) ** 2).mean().item() for a, b in zip(mapped.keys + mapped.values, fit_own.keys + fit_own.values))
    assert err(residual) < 0.9 * err(mapper), "the residual MLP does not improve on ridge's map where it was trained"
    for m in (replaced, residual):
        save_mapper(m, tmp_path / "m.safetensors")
        back = load_mapper(tmp_path / "m.safetensors")
        assert back.mapper == m.mapper
        assert_same_cache(back.apply(cache), m.apply(cache), "MLP mapper after save/load", atol=1e-6)


def test_mlp_training_stopped_midway_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """saved_mlps saves each MLP as it finishes; a run stopped after three of four trains only the last
    one on resume and ends with the same mapper as an uninterrupted run; a checkpoint made for other
    settings is refused in one line. Guards: retraining finished MLPs (hours on a real pair), a resumed
    run drawing another sample, and silently reusing another mapper's MLPs."""
    source = kvt.build_model(tiny_config("llama", n_layers=3), seed=0)
    target = kvt.build_model(tiny_config("llama", n_layers=2), seed=1)
    mapper, _ = calibrate(source, target, CALIB, k=2)
    kw = dict(hidden=(16,), schedule=mlp.Schedule(max_epochs=2))
    whole = add_mlp(mapper, source, target, CALIB, **kw)
    train, calls, stop = mlp.train, [], [True]

    class Stopped(Exception):
        pass

    def stops_after_three(*a, **k):
        if stop[0] and len(calls) == 3:
            raise Stopped
        calls.append(1)
        return train(*a, **k)
    monkeypatch.setattr(mlp, "train", stops_after_three)
    with pytest.raises(Stopped):
        add_mlp(mapper, source, target, CALIB, train_mlp=saved_mlps(tmp_path / "mlp", "a", False), **kw)
    assert len(list(tmp_path.glob("mlp-*.safetensors"))) == 3
    calls.clear()
    stop[0] = False
    resumed = add_mlp(mapper, source, target, CALIB, train_mlp=saved_mlps(tmp_path / "mlp", "a", False), **kw)
    assert len(calls) == 1, "a resumed run retrained MLPs it had saved"
    for kind in "kv":
        for name, w in whole.mlp[kind].items():
            assert torch.equal(w, resumed.mlp[kind][name]), f"{kind}.{name} differs after resuming"
    with pytest.raises(KvtError, match="another pair, mapper or settings"):
        add_mlp(mapper, source, target, CALIB, train_mlp=saved_mlps(tmp_path / "mlp", "b", False), **kw)


@pytest.mark.parametrize("scope", ["head", "layer"])
def test_the_harness_calibration_fits_the_core_mapper(scope, tmp_path):
    """harness/calibration.py runs kvt/calibrate.py's steps (with checkpoints, here every few batches, and the
    fits of layer scope's groups saved) and gives its mapper on the toy pair toy-s -> toy-m: the same layers,
    lambdas, and W and b within float32 rounding. Guards: the two drifting apart (another selection, a second
    pass over other layers, a meta the core lacks), or a harness step the core does not take."""
    from kvt.harness import toy
    from kvt.harness.data import calibration_sequences
    source, target = (kvt.load_model(ROOT / "weights" / n) for n in ("toy-s", "toy-m"))
    calib = calibration_sequences(None, kvt.load_tokenizer(ROOT / "weights" / "toy-m"), 12, 40,
                                  documents=toy.corpus(100, seed=99))
    core, core_report = calibrate(source, target, calib, scope=scope, k=1)
    options = CalibrationOptions(checkpoint=tmp_path / "stats", progress=False, save_s=0)
    harness, report = calibration.calibrate(source, target, calib, scope=scope, k=1, options=options)
    assert_same_mapper(harness, core, report, core_report)


def assert_same_mapper(a, b, report_a, report_b):
    assert a.scope == b.scope and a.meta["lambda"] == b.meta["lambda"], (a.meta["lambda"], b.meta["lambda"])
    assert {k: v for k, v in a.meta.items() if k in b.meta} == b.meta, "the meta the core records differs"
    for kind in "kv":
        assert torch.equal(a.layers[kind], b.layers[kind]), f"{kind}: {a.layers[kind].tolist()} vs {b.layers[kind].tolist()}"
        assert_close(a.W[kind], b.W[kind], f"{kind} W harness vs core", atol=1e-4 * b.W[kind].abs().max().item())
        assert_close(a.b[kind], b.b[kind], f"{kind} b harness vs core", atol=1e-4 * b.b[kind].abs().max().item())
        assert_close(report_a["r2_single"][kind], report_b["r2_single"][kind], f"{kind} single-layer R^2", atol=1e-6)


def test_lambda_is_picked_per_layer_and_is_tiny_for_an_exact_pair(exact_pair):
    """An exact pair needs no shrinkage: every target layer picks a small lambda. Guards: picking
    lambda on the wrong split or by the worst score."""
    source, target = exact_pair
    mapper, report = calibrate(source, target, CALIB, scope="head", k=1)
    for kind in "kv":
        assert len(report["lambda"][kind]) == 3 and max(report["lambda"][kind]) <= 1e-4, report["lambda"]
        assert mapper.meta["lambda"][kind] == report["lambda"][kind]


def test_calibration_checkpoints_every_pass_and_reuses_them(exact_pair, tmp_path):
    source, target = exact_pair
    options = CalibrationOptions(checkpoint=tmp_path / "stats")
    first, _ = calibration.calibrate(source, target, CALIB, scope="layer", k=2, options=options)
    assert (tmp_path / "stats.pass1").exists() and len(list(tmp_path.glob("stats.pass2-*"))) == 1
    again, _ = calibration.calibrate(source, target, CALIB, scope="layer", k=2, options=options)
    for name, t in first.tensors().items():
        assert torch.equal(again.tensors()[name], t), name


def test_layer_scope_split_into_groups_fits_the_same_mapper(exact_pair, tmp_path):
    """Layer-scope statistics split by groups of target layers (one pass over the data each, so a large
    pair fits one GPU) give the same W and b as one pass. Guards: a group's outputs read from the wrong
    target layers, or its source features from the wrong union."""
    source, target = exact_pair
    whole, _ = calibrate(source, target, CALIB, scope="layer", k=2, lam=1e-3)
    split, _ = calibration.calibrate(source, target, CALIB, scope="layer", k=2, lam=1e-3,
                                     options=CalibrationOptions(group=1, checkpoint=tmp_path / "stats"))
    assert len(list(tmp_path.glob("stats.pass2-*"))) >= 2
    for kind in "kv":
        assert torch.equal(split.layers[kind], whole.layers[kind])
        assert_close(split.W[kind], whole.W[kind], f"{kind} W split vs whole", atol=1e-6)
        assert_close(split.b[kind], whole.b[kind], f"{kind} b split vs whole", atol=1e-6)
