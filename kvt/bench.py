"""Prefill vs transfer: how long the target takes to rebuild a context's KV itself, and how long the
mapper takes to hand it over from the source's cache. Both are timed in one process, side by side.

    rows = bench(small, large, mapper_fwd, mapper_back, lengths=[512, 1024, 2048, 4096])

For each context length n and each direction (source -> target):
  source prefill   the source's own prefill of n tokens (listed apart: in serving it already happened)
  target prefill   what a model swap costs today: the target re-reads all n tokens
  transfer         mapper.apply on the source's cache of n - 1 tokens, then the target runs the last
                   prompt token itself (the handoff of handoff.py)
  speedup          target prefill / transfer
Each is warmed up, synchronized before every clock read, and the median of `repeats` runs. Timing
needs no trained weights, so models and mappers may be random, built from named shapes alone:

    python -m kvt.bench --pair qwen3-0.6b:1.7b --lengths 512,1024,2048,4096 [--device cuda --dtype bfloat16]
"""
import argparse
import resource
import statistics
import time

import torch
from tqdm import tqdm

from kvt.config import parse_pair, shape
from kvt.mapper import Mapper
from kvt.model import build_model
from kvt.stats import KINDS


def random_mapper(src_cfg, tgt_cfg, scope="head", k=8, dtype=torch.float32, device="cpu", seed=0):
    """A Mapper of the right shapes with random weights: for timing only."""
    k = min(k, src_cfg.n_layers)
    G = src_cfg.n_kv_heads if scope == "head" else 1
    Bx, By = src_cfg.n_kv_heads * src_cfg.head_dim // G, tgt_cfg.n_kv_heads * tgt_cfg.head_dim // G
    g = torch.Generator().manual_seed(seed)
    layers = torch.stack([torch.randperm(src_cfg.n_layers, generator=g)[:k].sort().values
                          for _ in range(tgt_cfg.n_layers)])                          # (Lt, k)
    W = torch.randn(tgt_cfg.n_layers, G, k * Bx, By, generator=g) / (k * Bx) ** 0.5  # (Lt, G, k*Bx, By)
    b = torch.zeros(tgt_cfg.n_layers, G, By)
    m = Mapper(scope, src_cfg, tgt_cfg, {kind: layers for kind in KINDS}, {kind: W for kind in KINDS},
               {kind: b for kind in KINDS})
    return m.to(device=device, dtype=dtype)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_time(fn, device, repeats):
    """Median wall time of fn() over `repeats` runs, after one warm-up run."""
    times = []
    for i in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        if i:  # run 0 warms up caches, allocator and kernels
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_memory_gb(device):
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


@torch.no_grad()
def bench(small, large, fwd, back=None, lengths=(512, 1024, 2048, 4096), repeats=3, names=("small", "large")):
    """Rows of timings (seconds) for small -> large with mapper `fwd`, and large -> small with `back`."""
    device = next(small.parameters()).device
    directions = [(names[0], names[1], small, large, fwd)] + ([(names[1], names[0], large, small, back)] if back else [])
    rows = []
    for n in tqdm(lengths, desc="bench", unit="length"):
        ids = torch.randint(0, min(small.config.vocab_size, large.config.vocab_size), (1, n), device=device)
        prefill = {m: median_time(lambda: m(ids, last=True), device, repeats) for m in (small, large)}
        for src_name, tgt_name, src, tgt, mapper in directions:
            _, src_cache = src(ids[:, :-1], last=True)

            def transfer():
                cache = mapper.apply(src_cache)
                return tgt(ids[:, -1:], cache=cache)

            t_transfer = median_time(transfer, device, repeats)
            rows.append({"direction": f"{src_name} -> {tgt_name}", "tokens": n, "source_prefill_s": prefill[src],
                         "target_prefill_s": prefill[tgt], "transfer_s": t_transfer,
                         "speedup": prefill[tgt] / t_transfer, "mapper_mb": mapper.nbytes() / 2**20,
                         "peak_gb": peak_memory_gb(device)})
    return rows


def format_rows(rows):
    """A markdown table of bench rows."""
    out = ["| direction | tokens | source prefill s | target prefill s | transfer s | speedup | mapper MB |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['direction']} | {r['tokens']} | {r['source_prefill_s']:.3f} | {r['target_prefill_s']:.3f} "
                   f"| {r['transfer_s']:.3f} | {r['speedup']:.1f}x | {r['mapper_mb']:.1f} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description="Time target prefill vs KV transfer on random weights of named shapes.")
    ap.add_argument("--pair", default="qwen3-0.6b:1.7b")
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--scope", default="head", choices=["head", "layer"])
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    names = parse_pair(args.pair)
    dtype = getattr(torch, args.dtype)
    small, large = (build_model(n, dtype=dtype, device=args.device, seed=i) for i, n in enumerate(names))
    fwd = random_mapper(shape(names[0]), shape(names[1]), args.scope, args.k, dtype, args.device)
    back = random_mapper(shape(names[1]), shape(names[0]), args.scope, args.k, dtype, args.device, seed=1)
    rows = bench(small, large, fwd, back, [int(n) for n in args.lengths.split(",")], args.repeats, names)
    print(f"{args.pair}, {args.dtype} on {args.device}, {torch.get_num_threads()} CPU threads, "
          f"median of {args.repeats} after a warm-up")
    print(format_rows(rows))


if __name__ == "__main__":
    main()
