"""Each fast-path trick against the plain path, timed in one process in interleaved rounds (a warm-up round,
then `--repeats`; medians, and the ratio per round): the figures behind tutorial section 11's list.

    python -m tests.bench_fast apply  --scope head --tokens 1024 --dtype float32    # Mapper.apply vs fast.apply (tiles)
    python -m tests.bench_fast decode --shape qwen3-0.6b --tokens 1024 --steps 8     # fast.generate vs decode.generate, and the one-token step's kernels with and without AMX
    python -m tests.bench_fast stats  --tokens 1024                                  # calibration statistics: fast.add_batches vs stats.add_batches
    python -m tests.bench_fast stream --shape qwen3-1.7b --tokens 2048               # copy vs read-only vs the one-token step, GB/s
    python -m tests.bench_fast step   --shape qwen3-1.7b --tokens 2048 --dtype bfloat16  # one token after 2K: Reserved vs plain Cache

--profile runs the first (fast) of them once more under torch.profiler and prints where its time goes,
op by op (self time, calls), after the race: `apply --profile` is the map, `step --profile` the
transfer's last step, which is also one decode step (one token over the cache, every weight read once).

Random weights of named shapes (apply: qwen3-0.6b -> 1.7b, k = 8; stats: tests/test_mapper_bench.py's pair,
forward passes included, a flush's worth of batches).
"""
import argparse
import statistics
import time

import torch

import kvt
from kvt import fast, stats
from kvt.bench import median_times
from kvt.harness.bench import copier, hardware, last_step_bytes, random_mapper
from kvt.cache import Cache
from kvt.capture import capture
from kvt.config import Config, shape


def race(fns, repeats):
    """Interleaved rounds of every fn; prints each one's median (min-max) and its time over the first's, per round."""
    times = {name: [] for name in fns}
    for i in range(repeats + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if i:
                times[name].append(time.perf_counter() - start)
    first = next(iter(times.values()))
    for name, t in times.items():
        ratio = statistics.median(a / b for a, b in zip(t, first))
        print(f"| {name} | {statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f}) | {ratio:.3f} |", flush=True)


def apply_fns(scope, n, dtype):
    s, t = shape("qwen3-0.6b"), shape("qwen3-1.7b")
    m = random_mapper(s, t, scope, 8, dtype)
    g = torch.Generator().manual_seed(0)
    kv = [torch.randn(1, s.n_kv_heads, n, s.head_dim, generator=g).to(dtype) for _ in range(s.n_layers)]
    cache = Cache(kv, kv, torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool), full=True)

    def tiles_of(size):
        def go():
            tiles = fast.TILE, fast.AMX_TILE
            fast.TILE = fast.AMX_TILE = size
            try:
                fast.apply(m, cache, room=1)
            finally:
                fast.TILE, fast.AMX_TILE = tiles
        return go
    return {f"fast.apply (tiles of {fast.tile_tokens(dtype)})": lambda: fast.apply(m, cache, room=1),
            "Mapper.apply (plain)": lambda: m.apply(cache),
            "fast.apply in one tile": tiles_of(n), "fast.apply in tiles of 256 (without AMX)": tiles_of(256)}


def decode_fns(name, n, steps, dtype):
    model = kvt.build_model(name, dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    logits, cache = model(ids, last=True)

    def run(plain, amx=None):
        def go():
            choice = fast.AMX
            fast.AMX = choice if amx is None else amx   # the one-token step's kernels as on a CPU with(out) AMX
            try:
                fast.generate(model, logits[:, -1], cache, steps, plain=plain)
            finally:
                fast.AMX = choice
        return go
    return {f"fast.generate (this CPU: AMX {fast.AMX})": run(False),
            "decode.generate (plain: torch.cat, F.linear, scaled_dot_product_attention)": run(True),
            "fast.generate as without AMX (F.linear, one_query_attention)": run(False, amx=False),
            "fast.generate as with AMX (torch.mv for one row, scaled_dot_product_attention)": run(False, amx=True)}


def step_fns(name, n, dtype):
    """The one-token step after n - 1 cached slots (the transfer's last step; a decode step reads the
    same bytes): on a Reserved cache with room for it (fast: appended in place, and this CPU's kernels for
    one token, fast.AMX) and on a plain Cache (torch.cat, F.linear, scaled_dot_product_attention)."""
    model = kvt.build_model(name, dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    _, cache = model(ids[:, :-1], last=True)
    reserved = fast.reserve(cache, 1)

    def quick():
        with fast.one_row_linears(model):                        # as take_over's last step runs it
            return model(ids[:, -1:], cache=reserved)
    return {"one-token step, fast.Reserved": quick,
            "one-token step, plain Cache": lambda: model(ids[:, -1:], cache=cache)}


def profile(fn, rows=14):
    """fn once under torch.profiler (after the race warmed it up): the ops that took the most self time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=40))


def stats_fns(n):
    r = {"rope_type": "default", "rope_theta": 1000000.0}
    src = Config("qwen3", 32000, 512, 14, 8, 4, 128, 1536, 1e-6, r)
    tgt = Config("qwen3", 32000, 1024, 14, 8, 4, 128, 3072, 1e-6, r)
    source, target = kvt.build_model(src, seed=0), kvt.build_model(tgt, seed=1)
    ids = torch.randint(0, 32000, (1, n), generator=torch.Generator().manual_seed(0))

    def stream(add):
        def go():                                       # a flush's worth of batches, captured as they are added
            batches = (("fit", capture(source, ids), capture(target, ids)) for _ in range(max(1, fast.FLUSH // n)))
            add(stats.new_stats(src, tgt, "head"), batches)
        return go
    return {"statistics (fast.add_batches: Pending)": stream(fast.add_batches),
            "statistics (stats.add_batches: Sums.add_)": stream(stats.add_batches)}


def stream(name, n, dtype, repeats):
    """What bounds the transfer's last step: GB/s of a 512 MiB float32 copy (bench.copier, read plus
    written bytes: the roofline's rate), of one read of every weight of the model (each summed, nothing
    written), and of the model's one-token step after n - 1 cached slots (bench.last_step_bytes),
    timed in turn (bench.median_times)."""
    model = kvt.build_model(name, dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    _, cache = model(ids[:, :-1], last=True)
    cache = fast.reserve(cache, 1)
    copy, copy_bytes = copier("cpu")
    weights = list(model.parameters())
    fns = {"copy (read + write)": (copy, copy_bytes),
           "read every weight (sum)": (lambda: [w.sum() for w in weights], sum(w.nbytes for w in weights)),
           "one-token step": (lambda: model(ids[:, -1:], cache=cache),
                              last_step_bytes(model.config, n, weights[0].element_size()))}  # (plain attention)
    timings = median_times([fn for fn, _ in fns.values()], "cpu", repeats)
    print("| what | GB/s (min-max) |\n|---|---|")
    for (what, (_, nbytes)), timing in zip(fns.items(), timings):
        rates = [nbytes / t / 1e9 for t in timing.times]
        print(f"| {what} | {statistics.median(rates):.1f} ({min(rates):.1f}-{max(rates):.1f}) |", flush=True)


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["apply", "decode", "step", "stats", "stream"])
    ap.add_argument("--scope", default="head", choices=["head", "layer"])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="then the first (fast) one once under torch.profiler")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    fast.keep_freed_memory()                                  # as kvt bench and run.py do
    if args.what == "stream":
        print(f"stream, {args.shape}, {args.tokens} tokens, {args.dtype}, {hardware()}; median of {args.repeats} "
              "after a warm-up")
        return stream(args.shape, args.tokens, dtype, args.repeats)
    fns = {"apply": lambda: apply_fns(args.scope, args.tokens, dtype),
           "decode": lambda: decode_fns(args.shape, args.tokens, args.steps, dtype),
           "step": lambda: step_fns(args.shape, args.tokens, dtype),
           "stats": lambda: stats_fns(args.tokens)}[args.what]()
    print(f"{args.what}, {args.tokens} tokens, {args.dtype}, {hardware()}; median (min-max) "
          f"of {args.repeats} after a warm-up\n| what | s | / first, per round |\n|---|---|---|")
    race(fns, args.repeats)
    if args.profile:
        profile(next(iter(fns.values())))


if __name__ == "__main__":
    main()
