"""plan.py: the memory plan equals the closed-form counts (docs/scale.md), the models' real
parameter counts and loading.place's split, and a plan that does not fit says what would."""
import pytest
import torch
from conftest import calib_of, function_preserving_twin, tiny_config

import kvt
from kvt.config import KvtError, shape
from kvt.harness.calibration import CalibrationOptions, calibrate
from kvt.model import Transformer
from kvt.loading import place
from kvt.harness.plan import (GPUS, USABLE, Options, calibration_passes, capacity, check_plan, fits, memory_plan, plan,
                              split_to_fit, weight_bytes)
from kvt.stats import new_stats

GiB = 2**30
PAIRS = [("qwen3-14b", "qwen3-32b"), ("llama3.1-8b", "llama3.1-70b")]


def closed_form(src, tgt, scope, k=8, T=32768, N=1024, group=None):
    """The formula of the memory plan in docs/scale.md on one device, bf16 weights, float64 statistics, batch 1;
    layer scope's second pass in groups of `group` target layers. Returns {name: bytes} and the total a
    device needs: weights + the largest phase."""
    def weights(c):  # embedding + lm_head (untied here), final norm, layers (Qwen3: + q/k norms)
        layer = c.dim * (2 * c.n_heads * c.head_dim + 2 * c.n_kv_heads * c.head_dim) + 3 * c.dim * c.ffn_dim + 2 * c.dim
        return 2 * (2 * c.vocab_size * c.dim + c.dim + c.n_layers * (layer + 2 * c.head_dim * c.qk_norm))

    def kv(c, tokens, copies=2):
        return copies * tokens * c.n_kv_heads * c.head_dim * c.n_layers * 2

    def stats(G, F, O):  # 4 sums of fp64 (no float32 products held on a GPU), one batch of K and V features
        return 4 * 8 * (G * F * F + G * F * O + G * F + 2 * G * O + 1) + 2 * 8 * N * G * (F + O)

    def ridge(G, Fa, Oa, F, O):  # one sub-fit: two selections, then eigh's matrices, then R^2's Gram and products
        sel = F * F + F * O
        return 8 * G * max(2 * sel + F * Fa + F * Oa, 2 * sel + 5 * F * F + F * O, 2 * sel + 4 * F * F + 5 * F * O)

    Ls, Lt, Hkv, D = src.n_layers, tgt.n_layers, src.n_kv_heads, src.head_dim
    act = max((3 * c.ffn_dim + 4 * c.dim) * 2 for c in (src, tgt))   # bytes per token of one layer's forward
    calib = kv(src, N, 3) + kv(tgt, N, 3) + N * act
    rows = {"weights": weights(src) + weights(tgt), "pass 1": stats(Hkv, Ls * D, Lt * D)}
    fits = {"pass 1": ridge(Hkv, Ls * D, Lt * D, D, Lt * D)}      # one source layer onto every target layer
    if scope == "head":                                            # and the final fits, k layers onto one
        fits["pass 1"] = max(fits["pass 1"], ridge(Hkv, Ls * D, Lt * D, k * D, D))
    if scope == "layer":
        g = group or Lt
        U = min(Ls, k * g)
        rows["pass 2"] = stats(1, U * Hkv * D, g * Hkv * D)
        fits["pass 2"] = ridge(1, U * Hkv * D, g * Hkv * D, k * Hkv * D, Hkv * D)
    G, B = (Hkv, D) if scope == "head" else (1, Hkv * D)
    rows["mapper"] = 2 * 2 * Lt * G * (k * B * B + B)              # bf16: the mapper as evaluation uses it
    rows["transfer"] = kv(src, T) + kv(tgt, T) + rows["mapper"] + 4 * 2 * T * Hkv * D * Ls + T * act
    diagnostics = kv(src, N) + kv(tgt, N, 4) + N * tgt.n_heads * tgt.head_dim * Lt * 2
    passes = [rows[p] + max(calib, fits[p]) for p in fits]        # a pass, then its fits (the batch is gone)
    need = rows["weights"] + max(*passes, rows["transfer"], diagnostics)
    return rows, need


@pytest.mark.parametrize("scope", ["head", "layer"])
@pytest.mark.parametrize("names", PAIRS, ids=lambda n: ":".join(n))
def test_plan_equals_the_closed_form(names, scope):
    src, tgt = map(shape, names)
    p = plan(src, tgt, Options(scope, k=8, context=32768, dtype=torch.bfloat16, devices=["cuda:0"], calib_len=1024))
    rows, need = closed_form(src, tgt, scope)
    by = {what: where["cuda:0"] for _, what, where in p.rows if "cuda:0" in where}
    assert sum(v for what, v in by.items() if "weights" in what) == rows["weights"]
    assert by[f"head statistics, {src.n_layers} source layers, float64"] == rows["pass 1"]
    if scope == "layer":
        assert by[f"layer statistics, {tgt.n_layers} target x <={src.n_layers} source layers, float64"] == rows["pass 2"]
    assert by[f"mapper, {scope} scope, k=8 (bfloat16, as used)"] == rows["mapper"]
    assert p.need()["cuda:0"] == need, f"plan {p.need()['cuda:0'] / GiB:.2f} GiB vs formula {need / GiB:.2f} GiB"


@pytest.mark.parametrize("names", PAIRS, ids=lambda n: ":".join(n))
def test_layer_scope_split_to_fit_one_h200_and_two_to_eight_h100s(names):
    """The paper's configuration (layer scope, float64 statistics) did not fit any GPU count: one pass
    held 132 GiB of statistics. Split by groups of target layers it fits one H200 (Qwen3 14B -> 32B;
    Llama 3.1 70B alone is 131 GiB in bf16) and two to eight H100s; the plan equals the formula for its
    group, and the largest group that fits is taken (fewest passes over the data)."""
    src, tgt = map(shape, names)
    for gpu, n in [("h200", 1), ("h100", 2), ("h100", 4), ("h100", 8)]:
        if names[1] == "llama3.1-70b" and n < 4:
            continue                                                    # the weights alone do not fit
        devices = [f"cuda:{i}" for i in range(n)]
        cap = capacity(devices, gpu)
        whole = plan(src, tgt, Options("layer", context=32768, devices=devices))
        assert not fits(whole, cap)
        p = split_to_fit(whole, cap)
        g = p.options.group
        assert fits(p, cap) and g is not None and calibration_passes(p) == 1 + -(-tgt.n_layers // g), (gpu, n)
        assert not fits(plan(src, tgt, Options("layer", context=32768, devices=devices, group=g + 1)), cap)
        if n == 1:
            assert p.need()["cuda:0"] == closed_form(src, tgt, "layer", group=g)[1]


def test_two_devices_split_layers_and_keep_statistics_on_the_first():
    src, tgt = shape("llama3.1-8b"), shape("llama3.1-70b")                   # 32 and 80 layers: halves
    p = plan(src, tgt, Options("head", context=32768, devices=["cuda:0", "cuda:1"]))
    by = {what: where for _, what, where in p.rows}
    T, Hkv, D = 32768, 8, 128
    assert by["source KV, 1 x 32768 tokens"] == {d: 2 * T * Hkv * D * 16 * 2 for d in ("cuda:0", "cuda:1")}
    assert by["mapped KV, 1 x 32768 tokens"] == {d: 2 * T * Hkv * D * 40 * 2 for d in ("cuda:0", "cuda:1")}
    # each device maps target layers: its own 16 source layers in float32 plus copies of the other 16
    assert by["position-free source KV (float32)"] == {d: 2 * T * Hkv * D * 32 * 4 for d in ("cuda:0", "cuda:1")}
    assert list(by["head statistics, 32 source layers, float64"]) == ["cuda:0"]


@pytest.mark.parametrize("name", ["qwen3-14b", "qwen3-32b", "llama3.1-8b", "llama3.1-70b", "qwen3-0.6b"])
def test_weights_count_the_real_parameters(name):
    cfg = shape(name)
    with torch.device("meta"):
        model = Transformer(cfg)                                   # no memory: shapes only
    n = sum(p.numel() for p in model.parameters())                 # a tied lm_head is counted once
    assert sum(weight_bytes(cfg, ["cuda:0"], torch.bfloat16).values()) == 2 * n


@pytest.mark.parametrize("tied", [False, True])
def test_weights_follow_model_place(tied):
    """Per device, the plan's weights equal what loading.place puts there (a tied head gets a copy)."""
    cfg = tiny_config("qwen3", n_layers=5, tie_embeddings=tied)
    model = place(kvt.build_model(cfg), ["cpu", "meta"])
    have = {}
    for p in {id(p): p for p in model.parameters()}.values():
        have[str(p.device)] = have.get(str(p.device), 0) + 4 * p.numel()
    assert weight_bytes(cfg, ["cpu", "meta"], torch.float32) == have


def test_a_plan_that_does_not_fit_says_what_would():
    """Guards: a one-line refusal that names options which would not fit either, or none that would."""
    src, tgt = shape("qwen3-14b"), shape("qwen3-32b")
    one = ["cuda:0"]
    check_plan(plan(src, tgt, Options("layer", context=32768, devices=one)), capacity(one, "h200"))  # fits once split
    with pytest.raises(KvtError) as e:
        check_plan(plan(src, tgt, Options("layer", context=32768, devices=one)), capacity(one, "h100"))
    msg = str(e.value)
    assert "\n" not in msg and "would fit: 2 devices of 80 GiB" in msg and "--scope head on 2 devices" not in msg, msg
    src, tgt = shape("llama3.1-8b"), shape("llama3.1-70b")
    with pytest.raises(KvtError, match="would fit: 3 devices"):                             # 141 GiB of weights
        check_plan(plan(src, tgt, Options("head", context=32768, devices=one)), capacity(one, "h100"))
    three = ["cuda:0", "cuda:1", "cuda:2"]
    check_plan(plan(src, tgt, Options("head", context=32768, devices=three)), capacity(three, "h100"))


def test_capacity_of_named_gpus_and_meta():
    assert capacity(["cuda", "meta"], "h100") == {"cuda:0": GPUS["h100"], "meta": float("inf")}
    assert USABLE * GPUS["h200"] / GiB > 129                     # 8% of an H200 kept spare


# ---- the options a plan suggests do what they say -------------------------------------------------------

IDS = torch.randint(0, 128, (14, 24), generator=torch.Generator().manual_seed(0))
CALIB = calib_of(IDS)


@pytest.fixture(scope="module")
def exact_pair(one_thread):
    source = kvt.build_model(tiny_config("llama", n_layers=3), seed=0)
    return source, function_preserving_twin(source, seed=1)


@pytest.mark.parametrize("scope", ["head", "layer"])
def test_float32_statistics_take_half_and_fit_the_same_mapper(exact_pair, scope):
    source, target = exact_pair
    s64, s32 = (new_stats(source.config, target.config, scope, dtype=d) for d in (torch.float64, torch.float32))
    b64, b32 = (sum(t.numel() * t.element_size() for x in s.sums.values() for t in x.tensors()) for s in (s64, s32))
    assert b32 * 2 == b64
    assert b32 == memory_plan(source.config, target.config, scope, batch_tokens=0, dtype=torch.float32)[-1][1]
    pending = b32 // 2                          # float32 products wait for float64 sums only (stats.Pending)
    assert b64 + pending == memory_plan(source.config, target.config, scope, batch_tokens=0)[-1][1]
    want, _ = calibrate(source, target, CALIB, scope=scope, k=1, lam=1e-9, options=CalibrationOptions(progress=False))
    got, report = calibrate(source, target, CALIB, scope=scope, k=1, lam=1e-9,
                            options=CalibrationOptions(progress=False, stats_dtype=torch.float32))
    for kind in "kv":
        assert torch.equal(got.layers[kind], want.layers[kind])
        err = ((got.W[kind] - want.W[kind]).abs().max() / want.W[kind].abs().max()).item()
        assert err < 1e-4, f"{scope} {kind}: float32 statistics move W by {err:.1e} (relative)"
        assert (report["r2"][kind] > 1 - 1e-6).all()


def test_fewer_candidates_select_among_them(exact_pair):
    source, target = exact_pair
    mapper, report = calibrate(source, target, CALIB, scope="head", k=1, lam=1e-9,
                               options=CalibrationOptions(progress=False, candidates=2))
    assert report["r2_single"]["k"].shape == (2, 3)                           # candidates 0 and 2 of 3 layers
    assert mapper.layers["k"][:, 0].tolist() == [0, 0, 2]                     # layer 1 is not a candidate
