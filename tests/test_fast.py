"""Every fast twin of kvt/fast.py equals its plain function: fast.apply (Mapper.apply), fast.add_fast_
(Sums.add_) and the streamed statistics (fast.add_batches, Pending; stats.add_batches), the in-place cache
update (fast.Reserved through reserve; Cache.update), fast.one_query_attention (Cache.attend), and the
whole handoff and generate on both paths.

Random inputs of several shapes, dtypes, scopes, batch sizes and left padding. "Equal" is within a
tolerance set by the dtype, relative to the largest magnitude compared (TOL): the two paths round in
different orders, float32 by a few units of its last place (2^-24 ~ 6e-8), bfloat16 by at most one
unit of its last place (2^-8) since both round the mapped cache once, float64 to 1e-12."""
import pytest
import torch

import kvt
from kvt import decode, fast, stats
from kvt.harness.bench import random_mapper
from kvt.cache import Cache
from kvt.handoff import take_over
from kvt.stats import Sums
from tests.conftest import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2 ** -7}


def assert_equal_within(fast, plain, dtype, what):
    """max |fast - plain| <= TOL[dtype] * max |plain|."""
    err = (fast.double() - plain.double()).abs().max().item()
    scale = plain.double().abs().max().item()
    assert err <= TOL[dtype] * scale, f"{what}: max difference {err:.2e} > {TOL[dtype]:.0e} x {scale:.2e} ({dtype})"


def assert_same_cache(fast, plain, dtype, what):
    for l in range(len(plain.keys)):
        assert_equal_within(fast.keys[l], plain.keys[l], dtype, f"{what}: layer {l} keys")
        assert_equal_within(fast.values[l], plain.values[l], dtype, f"{what}: layer {l} values")
    assert torch.equal(fast.positions, plain.positions) and torch.equal(fast.mask, plain.mask), what


def source_cache(cfg, B, T, dtype, pad=0, seed=0):
    """A random post-RoPE cache of B rows, the first `pad` slots of row 0 left padding."""
    g = torch.Generator().manual_seed(seed)
    kv = lambda: [torch.randn(B, cfg.n_kv_heads, T, cfg.head_dim, generator=g).to(dtype)  # noqa: E731
                  for _ in range(cfg.n_layers)]
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :pad] = False
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    return Cache(kv(), kv(), positions, mask, full=not pad)


PAIRS = {"head": (tiny_config("qwen3", n_layers=3), tiny_config("llama", n_layers=4)),
         "layer": (tiny_config("qwen3", n_layers=3), tiny_config("qwen3", n_layers=2, n_kv_heads=1, head_dim=32))}


@pytest.mark.parametrize("scope", ["head", "layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,pad", [(1, 9, 0), (2, 40, 5)])
@pytest.mark.parametrize("tile", [256, 17])
def test_apply_fast_equals_apply(scope, dtype, B, T, pad, tile, monkeypatch):
    """fast.apply and Mapper.apply give the same cache (mapper and cache in `dtype`, biases non-zero, keys
    moved to other positions), whole or, in head scope (By = 16 < TILE), in tiles of 17 tokens (fast.TILE,
    and fast.AMX_TILE for bf16 on a CPU with AMX).
    Guards: the fast map without its
    bias, a selected layer's features put in another's place in the gathered buffer, the target's RoPE
    left out, a tile of the second sequence read from the first's tokens, or a short last tile dropped."""
    monkeypatch.setattr(fast, "TILE", tile)
    monkeypatch.setattr(fast, "AMX_TILE", tile)                   # bf16's tiles on a CPU with AMX
    src, tgt = PAIRS[scope]
    mapper = random_mapper(src, tgt, scope, k=2, dtype=dtype, bias=0.5)
    cache = source_cache(src, B, T, dtype, pad)
    moved = cache.positions + 11
    plain = mapper.apply(cache)
    for room in (0, 1):
        quick = fast.apply(mapper, cache, room=room)
        assert_same_cache(quick, plain, dtype, f"{scope}, B={B}, room {room}")
        assert quick.room == room and quick.keys[0].dtype == dtype
    assert_same_cache(fast.apply(mapper, cache, positions=moved), mapper.apply(cache, positions=moved), dtype, "moved")


@pytest.mark.parametrize("mode", ["mlp", "ridge+mlp"])
def test_apply_fast_with_an_mlp_equals_apply(mode, monkeypatch):
    """The MLP backstop goes through the same map_layer on both paths, the fast one in tiles of 17 tokens.
    Guards: the fast path dropping it."""
    monkeypatch.setattr(fast, "TILE", 17)
    src, tgt = PAIRS["head"]
    mapper = random_mapper(src, tgt, "head", k=2, bias=0.5)
    G, D, k = src.n_kv_heads, src.head_dim, 2
    g = torch.Generator().manual_seed(3)
    mapper.mapper = mode
    mapper.mlp = {kind: {"w0": torch.randn(tgt.n_layers, k * G * D, 8, generator=g) * 0.1,
                         "b0": torch.zeros(tgt.n_layers, 8),
                         "w1": torch.randn(tgt.n_layers, 8, G * D, generator=g) * 0.1,
                         "b1": torch.zeros(tgt.n_layers, G * D)} for kind in "kv"}
    cache = source_cache(src, 2, 40, torch.float32)
    assert_same_cache(fast.apply(mapper, cache), mapper.apply(cache), torch.float32, f"mlp {mode}")


def test_bf16_map_accumulates_in_float32():
    """A bf16 mapper on a bf16 cache, its k = 2 layers' contributions cancelling (the first +40 times the
    result, the second -39 times it): both paths are within one bf16 rounding of the float64 map. Guards:
    the running sum rounded to bf16 after each selected layer (an error of about 40 x 2^-9 of the
    result, computed below, beyond bf16's tolerance)."""
    src, tgt = PAIRS["head"]
    mapper = random_mapper(src, tgt, "head", k=2, dtype=torch.bfloat16)
    D = src.head_dim
    for kind in "kv":                                    # W = [40 A; -39 A]: x1 (40 A) + x2 (-39 A), x1 = x2
        A = torch.randn(tgt.n_layers, src.n_kv_heads, D, D, generator=torch.Generator().manual_seed(1)) / D ** 0.5
        mapper.W[kind] = torch.cat([40 * A, -39 * A], 2).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(1, src.n_kv_heads, 64, D, generator=g).to(torch.bfloat16)
    cache = Cache([kv] * src.n_layers, [kv] * src.n_layers, torch.arange(64)[None], torch.ones(1, 64, dtype=torch.bool))
    exact = mapper.to(dtype=torch.float64).apply(cache.to(dtype=torch.float64))
    for name, mapped in (("Mapper.apply", mapper.apply(cache)), ("fast.apply", fast.apply(mapper, cache))):
        assert_same_cache(mapped, exact, torch.bfloat16, f"{name} against the float64 map")
    # the rounding this guards against: y = round(round(x1 W1) + x2 W2), for the values of target layer 0
    x = kv[0]                                                                # (Hkv, T, D) = features (G, N, D)
    W = mapper.W["v"][0]
    rounded = (x @ W[:, :D]).to(torch.bfloat16) + (x @ W[:, D:])            # bf16 + bf16, rounded again
    err = (rounded.double() - exact.values[0][0]).abs().max().item() / exact.values[0].abs().max().item()
    assert err > TOL[torch.bfloat16], f"the planted cancellation is too weak to tell: {err:.1e}"


def largest_allocation(f):
    """Bytes of the largest single CPU allocation made while f() runs (torch.profiler's memory events)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        f()
    return max(e.cpu_memory_usage for e in p.events())


def test_the_fast_map_never_gathers_a_whole_layers_features():
    """Head scope, k = 3 source layers, T = 1,024 tokens (4 of fast.TILE's tiles): no allocation that
    fast.apply makes is larger than one source layer's features, while Mapper.apply's gather of the k
    layers is k times that. Guards, without a clock (CPUs differ in how much the copy costs: 1.0x to
    2.8x of the plain map's time, docs/speed.md): the fast map that lost its tiles, gathering the k
    layers' features for every token into memory and reading them back."""
    src = tiny_config("qwen3", n_layers=4, n_kv_heads=4, head_dim=64)
    tgt = tiny_config("llama", n_layers=3, n_kv_heads=4, head_dim=64)
    mapper = random_mapper(src, tgt, "head", k=3)
    cache = source_cache(src, 1, 4 * fast.TILE, torch.float32)
    layer = cache.keys[0].numel() * 4                                      # one source layer's features, bytes
    plain = largest_allocation(lambda: mapper.apply(cache))
    fast_ = largest_allocation(lambda: fast.apply(mapper, cache))
    assert plain >= 3 * layer, f"the plain map's gather reads {plain} bytes, not 3 x {layer}: the probe sees nothing"
    assert fast_ <= layer, f"fast.apply allocated {fast_} bytes at once, over one source layer's {layer}"


@pytest.mark.parametrize("G,N,F,O", [(2, 50, 7, 3), (1, 600, 300, 5)])
def test_add_fast_equals_add(G, N, F, O):
    """fast.add_fast_ (centered float32 products, upper part of xx) and Sums.add_ (float64 products) give the
    same sums as gram() and the fit read them, on features with a large mean. Guards: a chunk of xx's
    upper part skipped (the last of CHUNK rows when F = 300)."""
    g = torch.Generator().manual_seed(F)
    x = torch.randn(G, N, F, generator=g, dtype=torch.float64) * 3 + 50
    y = x[..., :O] * 2 + torch.randn(G, N, O, generator=g, dtype=torch.float64)
    plain = Sums.zeros(G, F, O).add_(x[:, :N // 2], y[:, :N // 2]).add_(x[:, N // 2:], y[:, N // 2:])
    quick = fast.add_fast_(fast.add_fast_(Sums.zeros(G, F, O), x[:, :N // 2], y[:, :N // 2]), x[:, N // 2:], y[:, N // 2:])
    assert_equal_within(quick.gram(), plain.gram(), torch.float32, "gram")
    for f in ("xy", "sx", "sy", "syy", "n"):
        assert_equal_within(getattr(quick, f), getattr(plain, f), torch.float32, f)


@pytest.fixture(scope="module")
def pair():
    src = kvt.build_model(tiny_config("qwen3", n_layers=3), seed=0)
    return src, kvt.build_model(tiny_config("llama", n_layers=4), seed=1)


def test_streamed_statistics_fast_equal_plain(pair):
    """accumulate through fast.add_batches (Pending) and through stats.add_batches (Sums.add_) give the same
    sums. Guards: pending products flushed twice (Pending.flush_ not clearing what it added)."""
    from tests.conftest import calib_of
    source, target = pair
    calib = calib_of(torch.randint(0, 128, (8, 20), generator=torch.Generator().manual_seed(2)))
    run = lambda add: stats.accumulate(source, target, calib, stats.new_stats(source.config, target.config, "head"),  # noqa: E731
                                       batch_size=2, add=add)
    quick, plain = run(fast.adder()), run(fast.adder(plain=True))
    for name in plain.sums:
        assert_equal_within(quick.sums[name].gram(), plain.sums[name].gram(), torch.float32, f"{name}.xx")
        for f in ("xy", "sx", "sy", "syy", "n"):
            assert_equal_within(getattr(quick.sums[name], f), getattr(plain.sums[name], f), torch.float32, f"{name}.{f}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scope", ["head", "layer"])
def test_handoff_and_generate_plain_equal_fast(pair, dtype, scope):
    """The target's side of a handoff (fast.apply, room for the last token appended in place) and greedy
    decoding (fast.generate: a reserved cache appended in place) equal the plain path's (Mapper.apply,
    Cache.update's concatenation, decode.generate), batch 2 with left padding. Guards: append_in_place
    writing the new slot over the last cached one."""
    source, target = (m.to(dtype) for m in pair)
    mapper = random_mapper(source.config, target.config, scope, k=2, dtype=dtype, bias=0.1)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :3] = False
    _, src_cache = source(ids[:, :-1], mask=mask[:, :-1], last=True)
    results = {}
    for path, generate in (("fast", fast.generate), ("plain", decode.generate)):
        logits, cache = take_over(target, mapper, src_cache, ids[:, -1:], mask[:, -1:], plain=path == "plain")
        tokens = generate(target, logits[:, -1], cache, 6)
        results[path] = logits, cache, tokens
    (lf, cf, tf), (lp, cp, tp) = results["fast"], results["plain"]
    assert_equal_within(lf, lp, dtype, "last-token logits")
    assert_same_cache(cf, cp, dtype, "handed-over cache")
    assert cf.room == 0 and type(cp) is Cache
    if dtype == torch.float32:                        # bf16's rounding may tip a near-tie argmax
        assert tf == tp, f"greedy tokens differ: {tf} vs {tp}"


def test_the_fast_path_attends_one_query_in_float32(pair, monkeypatch):
    """The cache chooses the attention: on a CPU without AMX, take_over's last token and each of
    fast.generate's steps attend through fast.one_query_attention (a bf16 query, over a Reserved cache), every layer; the
    plain path, and a Reserved cache with no room left (a plain Cache after its step), never do.
    Guards: Reserved.attend lost, the fast path then running torch's fused kernel for one query (1.7x
    slower decoding, docs/speed.md) with every fast test still green."""
    calls = []
    one_query = fast.one_query_attention
    monkeypatch.setattr(fast, "one_query_attention", lambda *a: calls.append(a[0].shape) or one_query(*a))
    monkeypatch.setattr(fast, "AMX", False)                         # the choice of a CPU without AMX
    source, target = (m.to(torch.bfloat16) for m in pair)
    mapper = random_mapper(source.config, target.config, "head", k=2, dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(5))
    _, src_cache = source(ids[:, :-1], last=True)
    L = target.config.n_layers
    logits, cache = take_over(target, mapper, src_cache, ids[:, -1:], plain=True)
    fast.generate(target, logits[:, -1], cache, 4, plain=True)
    assert calls == [], f"the plain path attended {len(calls)} times through one_query_attention"
    logits, cache = take_over(target, mapper, src_cache, ids[:, -1:])
    assert len(calls) == L, f"take_over's last token: {len(calls)} of {L} layers through one_query_attention"
    fast.generate(target, logits[:, -1], cache, 4)                  # 3 forward steps: the 4th token needs none
    assert len(calls) == 4 * L, f"take_over + 3 decode steps: {len(calls)} of {4 * L} layers in one_query_attention"
    _, grown = target(ids[:, -1:], cache=cache)                      # take_over's cache has no room left
    assert type(grown) is Cache and len(calls) == 4 * L, "a Reserved cache out of room attended as a Reserved one"


def test_on_amx_the_one_token_step_reads_its_weights_by_mv(pair, monkeypatch):
    """On a CPU with AMX (forced here, whatever this CPU is), take_over's last token and each decode step
    run every linear of the target (7 per layer and the output layer) as torch.mv inside
    fast.one_row_linears and attend with torch's fused kernel, not one_query_attention; the plain path
    never does; the model's linears are plain nn.Linear again afterwards. Guards: the AMX choice lost
    on its way to a step (then no mv call), and one_row_linears leaving its forward on the model (the
    next prefill then pays a Python call per linear)."""
    mv, rows = torch.mv, []
    monkeypatch.setattr(fast, "AMX", True)
    monkeypatch.setattr(torch, "mv", lambda w, x: rows.append(w.shape) or mv(w, x))
    monkeypatch.setattr(fast, "one_query_attention", lambda *a: pytest.fail("one_query_attention ran on AMX"))
    source, target = (m.to(torch.bfloat16) for m in pair)
    mapper = random_mapper(source.config, target.config, "head", k=2, dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(5))
    _, src_cache = source(ids[:, :-1], last=True)
    L = target.config.n_layers
    for path in ("plain", "fast"):
        logits, cache = take_over(target, mapper, src_cache, ids[:, -1:], plain=path == "plain")
        n = len(rows)
        fast.generate(target, logits[:, -1], cache, 4, plain=path == "plain")
        assert (n, len(rows)) == ((0, 0) if path == "plain" else (7 * L + 1, 4 * (7 * L + 1))), \
            f"{path}: {n} mv calls at the last token, {len(rows)} with 3 decode steps"
    assert not [m for m in target.modules() if "forward" in vars(m)], "one_row_linears left its forward on the model"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_row_linear_equals_linear(dtype, monkeypatch):
    """fast.one_row_linear (torch.mv on a CPU with AMX, forced here) equals a float32 product rounded once
    to dtype, within one unit of dtype's last place, for one row and (through F.linear) for three.
    Guards: the row read reversed or from the weight's columns (a square weight)."""
    monkeypatch.setattr(fast, "AMX", True)
    g = torch.Generator().manual_seed(8)
    linear = torch.nn.Linear(64, 64, bias=False).to(dtype)
    linear.weight.data = torch.randn(64, 64, generator=g).to(dtype)
    for x in (torch.randn(1, 1, 64, generator=g).to(dtype), torch.randn(1, 3, 64, generator=g).to(dtype)):
        exact = (x.float() @ linear.weight.float().T).to(dtype).float()
        err = (fast.one_row_linear(linear, x).float() - exact).abs()
        ulp = 2.0 ** (exact.abs().clamp(min=1e-3).log2().floor() - (7 if dtype == torch.bfloat16 else 10))
        assert (err <= ulp).all(), f"{tuple(x.shape)}: {(err / ulp).max():.1f} units of {dtype}'s last place off"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_query_attention_equals_sdpa(dtype):
    """fast.one_query_attention (one bf16/fp16 query on a CPU, in float32) equals float32
    scaled_dot_product_attention within a rounding of dtype: 8 query heads over 2 KV heads, a batch of 2
    whose second row masks its first 5 slots. Guards: query head h paired with KV head h % Hkv instead of
    h // (H / Hkv), the mask ignored, or the 1/sqrt(D) scale left out."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, h, t, 16, generator=g) for h, t in ((8, 1), (2, 40), (2, 40)))
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    mask[1, ..., :5] = False
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    quick = fast.one_query_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask)
    assert quick.dtype == dtype
    assert_equal_within(quick, exact, torch.bfloat16, f"one_query_attention ({dtype})")
