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
import time

import pytest
import torch

import kvt
from kvt.cache import Cache
from kvt.capture import capture
from kvt.config import Config
from kvt.mapper import Mapper
from kvt import fast
from kvt.fast import FLUSH, add_batch
from kvt.stats import flush, new_stats

pytestmark = pytest.mark.slow
ROPE = {"rope_type": "default", "rope_theta": 1000000.0}
N_TOKENS = 1024  # one calibration sequence of the paper's length
SRC = Config("qwen3", 32000, 512, 14, 8, 4, 128, 1536, 1e-6, ROPE)
TGT = Config("qwen3", 32000, 1024, 14, 8, 4, 128, 3072, 1e-6, ROPE)


def median_time(fn, repeats=3):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def test_statistics_overhead_vs_forward_passes():
    """Guards: statistics that cost more than a fifth of the forward passes they are fitted from (float64
    products ran at +25-37% on these CPUs; float32 products added to the float64 sums batch by batch,
    +28%). Timed as accumulate streams: FLUSH tokens of batches, then their flush, per batch."""
    source, target = kvt.build_model(SRC, seed=0), kvt.build_model(TGT, seed=1)
    ids = torch.randint(0, 32000, (1, N_TOKENS), generator=torch.Generator().manual_seed(0))
    s, t = capture(source, ids), capture(target, ids)
    forward = median_time(lambda: (capture(source, ids), capture(target, ids)))
    rows, batches = {}, FLUSH // N_TOKENS                                  # a flush's worth of batches

    def stream(stats, products):
        pending = {}
        for _ in range(batches):
            add_batch(stats, "fit", s, t, pending, products)
        flush(pending.values())
    for products in (torch.float64, torch.float32):
        stats = new_stats(SRC, TGT, "head")
        rows[products] = median_time(lambda: stream(stats, products)) / batches
    print(f"\n{N_TOKENS} tokens: forward passes {forward:.3f} s; statistics float64 products {rows[torch.float64]:.3f} s "
          f"(+{rows[torch.float64] / forward:.0%}), float32 products (the default) {rows[torch.float32]:.3f} s "
          f"(+{rows[torch.float32] / forward:.0%})")
    assert rows[torch.float32] <= 0.2 * forward, "streaming statistics costs more than 20% of the forward passes"


def test_apply_throughput_vs_matmul():
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
    apply_s = median_time(lambda: fast.apply(mapper, cache))
    a, w = torch.randn(n, 1024), torch.randn(1024, 1024)
    mm_s = median_time(lambda: a @ w, repeats=5)
    x = torch.randn(G, n, k * D)
    bmm_s = median_time(lambda: torch.bmm(x, W["k"][0]), repeats=5)
    apply_rate, mm_rate = flops / apply_s / 1e9, 2 * n * 1024 * 1024 / mm_s / 1e9
    bmm_rate = 2 * G * n * k * D * D / bmm_s / 1e9
    print(f"\napply n={n}: {apply_s * 1e3:.1f} ms, {apply_rate:.1f} GFLOP/s; fp32 matmul {mm_rate:.1f} GFLOP/s "
          f"({apply_rate / mm_rate:.0%}); the mapper's own bmm shape alone {bmm_rate:.1f} GFLOP/s")
    assert apply_rate >= 0.5 * mm_rate, "mapper apply is below half of the measured matmul throughput"
