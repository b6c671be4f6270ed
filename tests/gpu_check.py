"""The GPU checks, prepared to run as one command when a GPU is lent (about 5 minutes on one H200):

    python -m tests.gpu_check --out $OUT          # cuda: the bench and a calibration, each into $OUT
    python -m tests.gpu_check --device cpu --small --out /tmp/gpu   # 0.6b -> 1.7b, toy lengths: try it here

1. kvt.harness.bench at 8K and 32K tokens on random weights of the qwen3-1.7b and qwen3-4b shapes, bf16, head
   scope (synchronized before every clock read; median of 5): bench.txt, bench.json.
2. A calibration with its statistics on the GPU (the paper's layer scope, k = 8, float32 products
   into float64 sums), qwen3-1.7b -> 4b shapes, 32 random sequences of 1,024 tokens, timed against
   the two models' forward passes over the same tokens: calibration.txt.
3. The headline rehearsal: the whole run.py path (`python run.py --source S --target T`) on a few layers of
   the real Qwen3-14B and Qwen3-32B shapes (3 and 4 layers, their full width and vocabulary) with random
   weights and the Qwen3 tokenizer, every task of the paper with two items each (CoQA one conversation,
   so its way back is calibrated and evaluated too), calibration on 16 x 256 tokens of wikitext-2, the
   bench at 4K tokens; the device's peak memory checked against the plan run.py printed (at most
   HEADLINE_MARGIN over it): headline.txt, and the run folder's report.md and results.json beside it.
   --small: Qwen3-0.6B's shape (3 and 4 layers), 4 x 64 calibration tokens, k = 2, one item a task, the
   bench at 128 tokens (the CPU's
   peak is reported, not checked: the process's resident memory counts the tokenizer and data too).
   --only headline runs this step alone.
4. kvt's vLLM connector on the GPU (`--only serving`, or after the others when this Python imports vLLM, the
   CUDA build): tests/test_vllm.py's long checks in this Python (KVT_VLLM_PYTHON): kvt's "gpu" KV layout
   against vLLM's own views, the source engine's saved KV against kvt's forward, the target engine's tokens
   and logprobs against kvt's handoff (float32, then bf16 within bf16's own rounding), the fallbacks, and
   the router's stack tests (tests/test_router.py) with both servers on the GPU: serving.txt. Not yet run
   on a GPU (docs/serving.md); without vLLM here it says so in serving.txt and stops.
Random weights: times, not accuracy. The first line of each file names the device.
"""
import argparse
import contextlib
import importlib.util
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import kvt
import kvt.bench
from kvt.harness import bench
from kvt.config import parse_pair
from kvt.harness.data import Calibration
from kvt.harness.calibration import CalibrationOptions, calibrate


def calibration_check(pair, device, dtype, n_seqs, length, k, scope):
    """Text lines: the forward passes over the calibration tokens, then the whole calibration, timed."""
    src_name, tgt_name = parse_pair(pair)
    source = kvt.build_model(src_name, dtype=dtype, device=device, seed=0)
    target = kvt.build_model(tgt_name, dtype=dtype, device=device, seed=1)
    ids = torch.randint(0, source.config.vocab_size, (n_seqs + 4, length), generator=torch.Generator().manual_seed(0))
    calib = Calibration(ids[:n_seqs], ids[n_seqs:n_seqs + 2], ids[n_seqs + 2:])
    with torch.no_grad():
        source(ids[:1].to(device), last=True), target(ids[:1].to(device), last=True)    # warm-up
        kvt.bench.sync(device)
        t0 = time.perf_counter()
        for row in calib.fit.to(device):
            source(row[None], last=True), target(row[None], last=True)
        kvt.bench.sync(device)
        forward = time.perf_counter() - t0
    t0 = time.perf_counter()
    mapper, report = calibrate(source, target, calib, scope=scope, k=k,
                               options=CalibrationOptions(stats_device=device, progress=False))
    kvt.bench.sync(device)
    total = time.perf_counter() - t0
    peak = bench.peak_memory_gb(device)
    return [f"{pair}, {bench.hardware(device)}, {dtype}",
            f"{n_seqs} x {length} tokens: forward passes of both models {forward:.1f} s; calibration ({scope} scope, "
            f"k={k}, statistics on {device}) {total:.1f} s, {total / forward:.1f}x the forward passes; "
            f"peak {peak:.1f} GiB; mapper {mapper.n_params() / 1e9:.2f}B parameters; "
            f"validation R^2 K {report['r2']['k'].mean():.3f} V {report['r2']['v'].mean():.3f} (random weights)"]


HEADLINE_MARGIN = 0.05   # the device's peak may exceed the plan's need by this fraction (allocator rounding)


def headline_check(device, out, small):
    """Text lines: the whole run.py path on scaled-down Qwen3 14B -> 32B checkpoints, its peak against its plan."""
    import dataclasses
    import shutil

    from kvt.harness import pipeline
    from kvt.harness.bench import peak_memory_gb, reset_peak_memory
    from kvt.config import shape
    from kvt.harness.plan import Options, capacity, plan, split_to_fit
    from kvt.weights import save_model
    shared = Path(__file__).resolve().parents[1].parent / "shared"
    names = ("qwen3-0.6b", "qwen3-0.6b") if small else ("qwen3-14b", "qwen3-32b")
    dtype = torch.float32 if small else torch.bfloat16
    folders = []
    for i, (name, layers) in enumerate(zip(names, (3, 4))):
        cfg = dataclasses.replace(shape(name), n_layers=layers)
        folder = out / "checkpoints" / f"{name}-{layers}l"
        if not (folder / "model.safetensors").exists():
            save_model(kvt.build_model(cfg, dtype=dtype, seed=i, std=0.02), folder)
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(shared / "tokenizers" / "qwen3" / f, folder / f)
        folders.append(folder)
    calib = shared / "data" / "calib" / "wikitext-2"
    seqs, length, context, items, k = (4, 64, 128, 1, 2) if small else (16, 256, 4096, 2, 8)
    run_dir = out / "headline-run"
    argv = ["--source", str(folders[0]), "--target", str(folders[1]), "--out", str(run_dir), "--device", device,
            "--data-dir", str(shared / "data"), "--calib", str(calib), "--calib-seqs", str(seqs), "--calib-len",
            str(length), "--tasks", "hellaswag,arc_easy,arc_challenge,mmlu,gsm8k,coqa", "--limit", str(items),
            "--task-limit", "coqa=1", "--bench-lengths", str(context), "--k", str(k)]
    reset_peak_memory(device)
    t0 = time.perf_counter()
    results = pipeline.main(argv)
    wall, peak = time.perf_counter() - t0, peak_memory_gb(device) * 2**30
    src_cfg, tgt_cfg = (kvt.load_config(f) for f in folders)
    cap = capacity([device])
    need = 0
    for a, b in ((src_cfg, tgt_cfg), (tgt_cfg, src_cfg)):                 # both mappers, as run.py plans them
        p = split_to_fit(plan(a, b, Options("layer", k, context=context, dtype=dtype, devices=[device], calib_len=length,
                                            bench=a is src_cfg)), cap)
        need = max(need, max(p.need().values()))
    lines = [f"headline rehearsal: {names[0]} (3 layers) -> {names[1]} (4 layers), random weights, {dtype}, "
             f"{bench.hardware(device)}",
             f"python run.py {' '.join(argv)}",
             f"wall {wall:.0f} s; gate {'fit' if results['gate']['fit'] else 'UNFIT'} (random weights); "
             f"tasks {', '.join(results['tasks'])}; CoQA both ways: {', '.join(results['coqa'])}",
             f"peak {'allocated' if device.startswith('cuda') else 'resident'} {peak / 2**30:.2f} GiB, "
             f"plan's need {need / 2**30:.2f} GiB ({peak / need:.2f}x)"]
    if device.startswith("cuda"):
        ok = peak <= need * (1 + HEADLINE_MARGIN)
        lines.append(f"{'within' if ok else 'OVER'} the plan (margin {HEADLINE_MARGIN:.0%})")
    return lines


def serving_check():
    """Text lines: kvt's vLLM connector and router tests run in this Python, on its vLLM's device."""
    if importlib.util.find_spec("vllm") is None:
        return ["serving: not run: this Python has no vLLM (pip install vllm, its CUDA build, then rerun "
                "`python -m tests.gpu_check --only serving --out DIR`)"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "slow", "tests/test_vllm.py", "tests/test_router.py"]
    r = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                       env={**os.environ, "KVT_VLLM_PYTHON": sys.executable})
    return [f"serving, {bench.hardware('cuda' if torch.cuda.is_available() else 'cpu')}: {' '.join(cmd[1:])}",
            *r.stdout.strip().splitlines()[-40:], f"exit status {r.returncode}"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--small", action="store_true", help="toy sizes: try the script without a GPU")
    ap.add_argument("--only", choices=["headline", "serving"], help="run one step alone")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only == "serving":
        lines = serving_check()
        (args.out / "serving.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    if args.only == "headline":
        lines = headline_check(args.device, args.out, args.small)
        (args.out / "headline.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
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
    lines = headline_check(args.device, args.out, args.small)
    (args.out / "headline.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    lines = serving_check()
    (args.out / "serving.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
