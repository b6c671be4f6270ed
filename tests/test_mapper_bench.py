"""Cost of the mapper's two hot paths, timed side by side in one process (run: pytest -m slow -s this file).

1. Calibration: statistics accumulation (head scope, the default float32 products of centered
   features, flushed into float64 sums every FLUSH tokens) vs the two models' forward passes on the
   same batch, at most +20%.
   The pair keeps the real qwen3-0.6b -> 1.7b ratio of statistics FLOPs to forward FLOPs (about 18%)
   at a size a laptop runs: Hkv*D = dim for the source, D = 128, 14 layers each, 32K vocabulary.
2. Apply (the fast path, fast.apply): a head-scope mapper (k = 8) on n = 4,096 tokens vs this
   machine's fp32 matmul throughput.

On a machine shared with other jobs, run with OMP_NUM_THREADS=1: threads waiting on a busy core make
every small op slow and the comparison meaningless.
"""
import statistics

import pytest
import torch

import kvt
from kvt.bench import median_times
from kvt.cache import Cache
from kvt.capture import capture
from kvt.config import Config
from kvt.mapper import Mapper
from kvt import fast
from kvt.fast import FLUSH, add_batch, flush
from kvt.stats import new_stats

pytestmark = pytest.mark.slow
ROPE = {"rope_type": "default", "rope_theta": 1000000.0}
N_TOKENS = 1024  # one calibration sequence of the paper's length
ROUNDS = 5       # timed rounds after a warm-up
SRC = Config("qwen3", 32000, 512, 14, 8, 4, 128, 1536, 1e-6, ROPE)
TGT = Config("qwen3", 32000, 1024, 14, 8, 4, 128, 3072, 1e-6, ROPE)


def test_statistics_overhead_vs_forward_passes():
    """Guards: the default adder running at the plain path's cost (its products in float64, which ran at
    +25-37% of the forward passes on these CPUs, against +14-20% for the float32 ones), or statistics
    costing over a quarter of the forward passes they are fitted from. Timed as accumulate streams:
    FLUSH tokens of batches, then their flush, per batch. The forward passes and both streams are timed
    in turn, round by round (bench.median_times), and each figure is the median over rounds of that
    round's ratio: a spell of load on a shared host slows a round's three runs alike. The goal, at most
    +20% on quiet cores, is measured in docs/measurements.md; a bound at the goal itself failed a run on a
    busy host where quiet runs of the same code read +14-19%, so this check holds a margin above it."""
    source, target = kvt.build_model(SRC, seed=0), kvt.build_model(TGT, seed=1)
    ids = torch.randint(0, 32000, (1, N_TOKENS), generator=torch.Generator().manual_seed(0))
    s, t = capture(source, ids), capture(target, ids)
    batches = FLUSH // N_TOKENS                                            # a flush's worth of batches
    sums = {products: new_stats(SRC, TGT, "head") for products in (torch.float64, torch.float32)}

    def stream(products):
        pending = {}
        for _ in range(batches):
            add_batch(sums[products], "fit", s, t, pending, products)
        flush(pending.values())
    forward, *streams = median_times([lambda: (capture(source, ids), capture(target, ids)),
                                      lambda: stream(torch.float64), lambda: stream(torch.float32)], "cpu", ROUNDS)
    f64, f32 = (statistics.median(x / batches / f for x, f in zip(st.times, forward.times)) for st in streams)
    fast_share = statistics.median(a / b for a, b in zip(streams[1].times, streams[0].times))
    print(f"\n{N_TOKENS} tokens: forward passes {forward:.3f} s; statistics per batch, over the forward passes of "
          f"its round (median of {ROUNDS} rounds): float64 products +{f64:.0%}, float32 products (the default) "
          f"+{f32:.0%}, {fast_share:.2f}x the float64 ones' time")
    assert fast_share <= 0.75, f"the default float32 products take {fast_share:.2f}x the float64 ones' time"
    assert f32 <= 0.25, f"streaming statistics costs {f32:.0%} of the forward passes, more than 25%"


def test_apply_throughput_vs_matmul():
    """Guards: a fast map slower than the plain Mapper.apply it is the twin of (below 0.9x its speed), or
    below a quarter of this machine's fp32 matmul rate. All three are timed in turn, round by round
    (bench.median_times), and compared by the median over rounds of each round's ratio. How much the
    fast path's tiles buy depends on the CPU: 1.3-2.8x as fast as the plain map on an Intel Xeon with
    AMX, 1.02x on a CI host (its CPU unnamed), whose map read 46% of the matmul rate (34-58% on the Xeon).
    That its tiles are there is checked without a clock: test_fast's
    test_the_fast_map_never_gathers_a_whole_layers_features."""
    G, D, k, n = 4, 128, 8, 4096
    g = torch.Generator().manual_seed(0)
    layers = torch.stack([torch.randperm(SRC.n_layers, generator=g)[:k].sort().values for _ in range(TGT.n_layers)])
    W = {kind: torch.randn(TGT.n_layers, G, k * D, D) * 0.01 for kind in "kv"}
    b = {kind: torch.zeros(TGT.n_layers, G, D) for kind in "kv"}
    mapper = Mapper("head", SRC, TGT, {"k": layers, "v": layers}, W, b)
    kv = [torch.randn(1, G, n, D) for _ in range(SRC.n_layers)]
    pos = torch.arange(n)[None]
    cache = Cache(kv, kv, pos, torch.ones(1, n, dtype=torch.bool))
    flops = 2 * n * 2 * TGT.n_layers * G * k * D * D                         # K and V, every target layer
    a, w = torch.randn(n, 1024), torch.randn(1024, 1024)
    apply_s, plain_s, mm_s = median_times([lambda: fast.apply(mapper, cache), lambda: mapper.apply(cache),
                                           lambda: a @ w], "cpu", ROUNDS)
    mm_flops = 2 * n * 1024 * 1024
    share = statistics.median((flops / ta) / (mm_flops / tm) for ta, tm in zip(apply_s.times, mm_s.times))
    faster = statistics.median(tp / ta for ta, tp in zip(apply_s.times, plain_s.times))
    print(f"\napply n={n}: {apply_s * 1e3:.1f} ms, {flops / apply_s / 1e9:.1f} GFLOP/s, {share:.0%} of the fp32 "
          f"matmul's rate and {faster:.2f}x as fast as the plain map (medians per round)")
    assert faster >= 0.9, f"fast.apply runs {faster:.2f}x as fast as Mapper.apply, slower than its plain twin"
    assert share >= 1 / 4, f"fast.apply runs at {share:.0%} of the measured matmul throughput, below a quarter"
