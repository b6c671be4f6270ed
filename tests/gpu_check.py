"""The GPU checks of issue 15, prepared to run as one command when a GPU is lent (about 5 minutes on one H200):

    python -m tests.gpu_check --out $OUT          # cuda: the bench and a calibration, each into $OUT
    python -m tests.gpu_check --device cpu --small --out /tmp/gpu   # 0.6b -> 1.7b, toy lengths: try it here

1. kvt.bench at 8K and 32K tokens on random weights of the qwen3-1.7b and qwen3-4b shapes, bf16, head
   scope (synchronized before every clock read; median of 5): bench.txt, bench.json.
2. A calibration with its statistics on the GPU (the paper's layer scope, k = 8, float32 products
   into float64 sums), qwen3-1.7b -> 4b shapes, 32 random sequences of 1,024 tokens, timed against
   the two models' forward passes over the same tokens: calibration.txt.
Random weights: times, not accuracy. The first line of each file names the device.
"""
import argparse
import contextlib
import io
import time
from pathlib import Path

import torch

import kvt
from kvt import bench
from kvt.config import parse_pair
from kvt.data import Calibration
from kvt.mapper import calibrate


def calibration_check(pair, device, dtype, n_seqs, length, k, scope):
    """Text lines: the forward passes over the calibration tokens, then the whole calibration, timed."""
    src_name, tgt_name = parse_pair(pair)
    source = kvt.build_model(src_name, dtype=dtype, device=device, seed=0)
    target = kvt.build_model(tgt_name, dtype=dtype, device=device, seed=1)
    ids = torch.randint(0, source.config.vocab_size, (n_seqs + 4, length), generator=torch.Generator().manual_seed(0))
    calib = Calibration(ids[:n_seqs], ids[n_seqs:n_seqs + 2], ids[n_seqs + 2:])
    with torch.no_grad():
        source(ids[:1].to(device), last=True), target(ids[:1].to(device), last=True)    # warm-up
        bench.sync(device)
        t0 = time.perf_counter()
        for row in calib.fit.to(device):
            source(row[None], last=True), target(row[None], last=True)
        bench.sync(device)
        forward = time.perf_counter() - t0
    t0 = time.perf_counter()
    mapper, report = calibrate(source, target, calib, scope=scope, k=k, stats_device=device, progress=False)
    bench.sync(device)
    total = time.perf_counter() - t0
    peak = bench.peak_memory_gb(device)
    return [f"{pair}, {bench.hardware(device)}, {dtype}",
            f"{n_seqs} x {length} tokens: forward passes of both models {forward:.1f} s; calibration ({scope} scope, "
            f"k={k}, statistics on {device}) {total:.1f} s, {total / forward:.1f}x the forward passes; "
            f"peak {peak:.1f} GiB; mapper {mapper.n_params() / 1e9:.2f}B parameters; "
            f"validation R^2 K {report['r2']['k'].mean():.3f} V {report['r2']['v'].mean():.3f} (random weights)"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--small", action="store_true", help="toy sizes: try the script without a GPU")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    pair, lengths, n_seqs, length, k, scope = ("qwen3-1.7b:4b", "8192,32768", 32, 1024, 8, "layer") \
        if not args.small else ("qwen3-0.6b:1.7b", "64,128", 4, 64, 2, "head")
    dtype = bench.default_dtype(args.device)                            # bf16 on a GPU
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        bench.main(["--pair", pair, "--scope", "head", "--lengths", lengths, "--device", args.device, "--dtype", dtype,
                    "--repeats", "5", "--json", str(args.out / "bench.json")])
    (args.out / "bench.txt").write_text(printed.getvalue())
    print(printed.getvalue())
    lines = calibration_check(pair, args.device, getattr(torch, dtype), n_seqs, length, k, scope)
    (args.out / "calibration.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
