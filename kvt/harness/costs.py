"""The run on paper: the time of each phase from FLOPs and bytes at a GPU's rates (estimate), the memory plan
per GPU count (summary), and all of it for every mapper a run fits, CoQA's way back too (rehearsal); the
`kvt plan` command prints them. The memory itself is counted in plan.py.

    kvt plan --pair qwen3-14b:32b --device h200                            # the headline run: memory, host, disk, time
    python -m kvt.harness.costs --pair qwen3-14b:32b --summary             # H100/H200 x 1, 2, 4, 8
"""
import argparse
import dataclasses
from dataclasses import dataclass

import torch

from kvt.config import KvtError, at_least, command, parse_pair, shape
from kvt.harness.plan import (GPUS, HOST, USABLE, GiB, Options, calibration_passes, candidate_layers, capacity,
                              check_plan, disk_plan, fit_shapes, fits, format_plan, forward_flops, mapper_bytes, nbytes,
                              plan, split_to_fit, sums_bytes, weight_bytes)
from kvt.stats import groups

PAPER_TASKS = "hellaswag,arc_easy,arc_challenge,mmlu,gsm8k,coqa"
PAPER_32K = {"prefill_s": 6.98, "transfer_s": 0.28}   # the paper's Qwen3 14B -> 32B at 32K tokens, one H200
RATES = {"h200": {"bf16": 989e12, "fp32": 67e12, "fp64": 67e12, "hbm": 4.8e12},   # dense peaks (NVIDIA's
         "h100": {"bf16": 989e12, "fp32": 67e12, "fp64": 67e12, "hbm": 3.35e12}}  # H100/H200 SXM datasheets)
FRACTION = {"matmul": 0.5, "hbm": 0.5, "eigh": 0.05}  # of peak assumed: matmuls, bandwidth-bound steps, eigh
DISK = 2e9                                            # bytes per second written to the output folder (NVMe)
# Tokens per evaluated item: read (the context, every choice; CoQA the story and every turn) and at most
# generated (the task's max_new_tokens; CoQA per answered turn), Qwen3 tokenizer, 100 items each:
# `python -m tests.task_tokens`.
EVAL_TOKENS = {"hellaswag": (166, 0), "arc_easy": (42, 0), "arc_challenge": (55, 0), "mmlu": (690, 0),
               "gsm8k": (765, 256), "coqa": (487, 576)}


def weight_reads(cfg, dtype=torch.bfloat16):
    """Bytes one decode step reads: every weight once (bandwidth-bound at small batch)."""
    return sum(weight_bytes(cfg, ["cpu"], dtype).values())


@dataclass(frozen=True)
class Workload:
    """What the run does besides holding memory, for its time estimate: calibration on calib_seqs fit sequences (a
    tenth more for validation, as data.py draws them) and diag_seqs for diagnostics, with a statistics checkpoint
    every save_s; `limit` items of each of `tasks`, evaluated in batches of eval_batch; the bench at
    bench_lengths, `repeats` times after a warm-up."""
    calib_seqs: int = 500
    diag_seqs: int = 25
    save_s: float = 600.0
    tasks: tuple = tuple(PAPER_TASKS.split(","))
    limit: int = 500
    eval_batch: int = 32
    bench_lengths: tuple = (2048, 8192, 32768)
    repeats: int = 3


def estimate(p, gpu="h200", work=Workload(), conditions=4):
    """[(phase, seconds, how)]: a time estimate of the plan's run on one `gpu` from FLOPs and bytes at
    RATES x FRACTION, doing `work`. Calibration: every pass runs both models over the fit and validation
    sequences and adds float32 products to the sums (fp32 units: torch keeps TF32 off), then fits
    (eigh about 9 F^3 per group, slow on a GPU: FRACTION["eigh"]) and writes checkpoints every save_s;
    evaluation: every item read under four conditions (target, transfer, source, floor; conditions=2:
    target and transfer, CoQA's way back) and generated in batches of eval_batch, each decode step
    reading the weights once, every item generating its task's most tokens (an upper bound: stops end
    most answers sooner); the bench: prefills and transfers at each length, (repeats + 1) times."""
    calib_seqs = work.calib_seqs + work.calib_seqs // 10      # the fit and validation regions (data.py)
    diag_seqs, save_s, tasks, limit, eval_batch = work.diag_seqs, work.save_s, work.tasks, work.limit, work.eval_batch
    bench_lengths, repeats = work.bench_lengths, work.repeats
    o, r = p.options, RATES[gpu]
    src, tgt, k, L = p.src_cfg, p.tgt_cfg, o.k, o.calib_len
    mm, fp32, bw = r["bf16"] * FRACTION["matmul"], r["fp32"] * FRACTION["matmul"], r["hbm"] * FRACTION["hbm"]
    out = []
    if o.calibrate:
        forward = calib_seqs * (forward_flops(src, L) + forward_flops(tgt, L)) / mm
        shapes = fit_shapes(src, tgt, o.scope, k, o.candidates, o.group)
        n_passes = [1] + ([calibration_passes(p) - 1] if len(shapes) > 1 else [])
        itemsize = nbytes(o.stats_dtype)
        for i, ((G, F, O, f, _), n) in enumerate(zip(shapes, n_passes), 1):
            products = 2 * calib_seqs * L * G * (F * F + 2 * F * O) / fp32          # K and V, xx's upper half
            targets = tgt.n_layers if i == len(shapes) else 0                          # the final fits
            fits = 2 * targets * G * 9 * f ** 3 / (r["fp64"] * FRACTION["eigh"])
            fits += 2 * (len(candidate_layers(src.n_layers, o.candidates)) if i == 1 else 0) * G * 9 * (F // (
                len(candidate_layers(src.n_layers, o.candidates)))) ** 3 / (r["fp64"] * FRACTION["eigh"])
            pass_s = forward + products
            saves = (int(pass_s // save_s) + (i == 1)) * sums_bytes(G, F, O, itemsize) / DISK
            total = n * pass_s + fits / max(n, 1) * n + n * saves
            out.append((f"calibration pass {i}" + (f" (x{n})" if n > 1 else ""), total,
                        f"{n} x (forward {forward:.0f} s + products {products:.0f} s + checkpoints {saves:.0f} s)"
                        f" + fits {fits:.0f} s"))
        out.append(("diagnostics", diag_seqs * (forward_flops(src, L) + 2 * forward_flops(tgt, L)) / mm,
                    f"{diag_seqs} sequences, both models"))
    if tasks:
        read = gen = 0.0
        for t in tasks:
            tokens_in, tokens_out = EVAL_TOKENS.get(t, (1000, 0))
            readers, writers = ((tgt, src, src, tgt), (tgt, tgt, src, tgt)) if conditions == 4 else \
                ((tgt, src), (tgt, tgt))                   # target, transfer (the source reads), source, floor
            read += limit * sum(forward_flops(c, tokens_in) for c in readers) / mm
            steps = -(-limit // eval_batch) * tokens_out
            gen += steps * sum(weight_reads(c, o.dtype) for c in writers) / bw
        out.append(("evaluation", read + gen, f"{len(tasks)} tasks x {limit} items x {conditions} conditions: reading "
                    f"{read:.0f} s, generating {gen:.0f} s (batches of {eval_batch}, every step reads the weights)"))
    if o.bench:
        prefill = sum(forward_flops(src, n) + forward_flops(tgt, n) for n in bench_lengths) / mm
        G, bx, by = groups(src, tgt, o.scope)
        mapping = sum(2 * 2 * n * G * k * bx * by * (tgt.n_layers + src.n_layers) for n in bench_lengths) / mm
        out.append(("bench", (repeats + 1) * 2 * (prefill + mapping),
                    f"lengths {','.join(map(str, bench_lengths))}, {repeats} repeats and a warm-up, both ways"))
    return out


def headline_times(src_cfg, tgt_cfg, gpu="h200", T=32768, scope="layer", k=8):
    """(target prefill s, map s) at T tokens on `gpu` at RATES x FRACTION: the estimate to set beside the
    paper's measured 32K figures."""
    mm, r = RATES[gpu]["bf16"] * FRACTION["matmul"], RATES[gpu]
    G, bx, by = groups(src_cfg, tgt_cfg, scope)
    flops = 2 * 2 * (T - 1) * G * k * bx * by * tgt_cfg.n_layers
    moved = (2 * T * (src_cfg.n_layers * src_cfg.n_kv_heads * src_cfg.head_dim +
                      tgt_cfg.n_layers * tgt_cfg.n_kv_heads * tgt_cfg.head_dim) * 2
             + sum(mapper_bytes(src_cfg, tgt_cfg, scope, k, ["cpu"], torch.bfloat16).values()))
    return forward_flops(tgt_cfg, T) / mm, max(flops / mm, moved / (r["hbm"] * FRACTION["hbm"]))


def summary(src_cfg, tgt_cfg, options=Options(), counts=(1, 2, 4, 8), gpus=("h100", "h200")):
    """A markdown table: the most any one device needs (GiB), per scope and statistics dtype (rows) and
    named GPU x count (columns), marked when it does not fit; layer scope split into as few passes over
    the data as fit (split_to_fit), their number shown when more than one."""
    cols = [(g, n) for g in gpus for n in counts]
    lines = ["| scope | statistics | " + " | ".join(f"{g.upper()} x{n}" for g, n in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for scope in ("head", "layer"):
        for sd in (torch.float64, torch.float32):
            cells = []
            for g, n in cols:
                devices = [f"cuda:{i}" for i in range(n)]
                cap = capacity(devices, g)
                asked = dataclasses.replace(options, scope=scope, stats_dtype=sd, devices=devices)
                p = split_to_fit(plan(src_cfg, tgt_cfg, asked), cap)
                worst, passes = max(p.need().values()), calibration_passes(p)
                cells.append(f"{worst / GiB:.0f}" + (f", {passes} passes" if passes > 2 else "")
                             + ("" if fits(p, cap) else " (no)"))
            lines.append(f"| {scope} | {str(sd).replace('torch.', '')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rehearsal(src_cfg, tgt_cfg, names, options=Options(context=32768), gpu="h200", count=1, work=Workload()):
    """The headline run on paper: (text, {"spare": fraction, "disk": bytes, "seconds": s, "host": bytes}).
    Every mapper the run fits (the reverse one for CoQA too) planned as `options` say (on `count` x `gpu`)
    and split as run.py does, each phase's peak with every resident tensor, the host memory, the disk and
    a time estimate of `work`."""
    tasks = work.tasks
    devices = [f"cuda:{i}" for i in range(count)]
    cap = capacity(devices, gpu)
    ways = [(src_cfg, tgt_cfg, names)] + ([(tgt_cfg, src_cfg, names[::-1])] if "coqa" in tasks else [])
    lines, rows, spare, host, disk, seconds, kept = [], [], 1.0, 0, 0, 0.0, 0
    for i, (a, b, (x, y)) in enumerate(ways):
        p = split_to_fit(plan(a, b, dataclasses.replace(options, devices=devices, bench=i == 0)), cap)
        lines += [format_plan(p, cap, f"{x} -> {y} on {count} x {gpu.upper()} ({GPUS[gpu] / GiB:.1f} GiB each)"), ""]
        need = p.need()
        for ph in ["weights", *sorted(p.phases(), key=[r[0] for r in p.rows].index)]:
            peak = max(p.total("weights", d) + (p.total(ph, d) if ph != "weights" else 0) for d in p.devices)
            rows.append((f"{x} -> {y}", ph, peak, 1 - peak / min(cap.values()), p.total(ph, HOST)))
        spare = min(spare, *(1 - need[d] / cap[d] for d in p.devices))
        host = max(host, p.host())
        disk = max(disk, kept + sum(n for _, n in disk_plan(p)))
        kept += disk_plan(p)[-1][1]                          # its mapper file stays beside the next one's work
        for ph, t, how in estimate(p, gpu, work if i == 0 else dataclasses.replace(work, tasks=("coqa",)),
                                   conditions=4 if i == 0 else 2):
            seconds += t
            rows.append((f"{x} -> {y}", f"time: {ph}", t, how, None))
    lines.append(f"{'mapper':<22} {'phase':<28} {'peak GiB':>9} {'spare':>7} {'host GiB':>9}")
    for way, ph, peak, spare_, host_ in rows:
        if host_ is not None:
            lines.append(f"{way:<22} {ph:<28} {peak / GiB:9.2f} {spare_:7.1%} {host_ / GiB:9.2f}")
    lines += ["", f"{'mapper':<22} {'time':<28} {'minutes':>9}  how"]
    for way, ph, t, how, host_ in rows:
        if host_ is None:
            lines.append(f"{way:<22} {ph.removeprefix('time: '):<28} {t / 60:9.1f}  {how}")
    prefill, mapping = headline_times(src_cfg, tgt_cfg, gpu)
    r = RATES[gpu]
    lines += ["", f"rates: bf16 {r['bf16'] / 1e12:.0f} TFLOP/s, fp32 {r['fp32'] / 1e12:.0f}, fp64 {r['fp64'] / 1e12:.0f}, "
              f"HBM {r['hbm'] / 1e12:.2f} TB/s; assumed {FRACTION['matmul']:.0%} of peak for matmuls, "
              f"{FRACTION['hbm']:.0%} of HBM for decoding, {FRACTION['eigh']:.0%} of fp64 for eigh; disk {DISK / 1e9:.0f} GB/s",
              f"at 32K tokens: target prefill {prefill:.2f} s, map {mapping:.2f} s" +
              (f" (the paper's, on one H200: prefill {PAPER_32K['prefill_s']} s, {prefill / PAPER_32K['prefill_s']:.2f}x; "
               f"transfer {PAPER_32K['transfer_s']} s, {mapping / PAPER_32K['transfer_s']:.2f}x)"
               if tuple(names) == ("qwen3-14b", "qwen3-32b") and gpu == "h200" else ""),
              f"end to end: {seconds / 3600:.2f} h; GPU memory spare in every phase >= {spare:.1%}; host {host / GiB:.1f} GiB; "
              f"disk at most {disk / 1e9:.0f} GB at once"]
    return "\n".join(lines), {"spare": spare, "disk": disk, "seconds": seconds, "host": host}


MAX_COUNT = 128  # torch numbers a machine's GPUs cuda:0 .. cuda:127


def check_request(args, names, src, tgt):
    """Refuse, in one line each, a plan that would describe a run kvt would not make: a pair of two families
    (no shared tokenizer), a context past the models' positions, more source layers than there are, task
    names plan has no token counts for, or more GPUs than torch numbers."""
    if src.family != tgt.family:
        raise KvtError(f"--pair {args.pair}: {names[0]} and {names[1]} are of two families ({src.family}, {tgt.family}) "
                       "with two tokenizers, and transfer needs one; name two models of one family, e.g. qwen3-14b:32b")
    limit = min(src.max_seq_len, tgt.max_seq_len)
    for name in ("context", "calib-len"):
        if getattr(args, name.replace("-", "_")) > limit:
            raise KvtError(f"--{name} {getattr(args, name.replace('-', '_'))}: the models hold at most {limit} "
                           "positions (max_position_embeddings); give at most that")
    if args.candidates is not None and args.candidates > src.n_layers:
        raise KvtError(f"--candidates {args.candidates}: {names[0]} has {src.n_layers} layers; give at most that")
    if args.k > (args.candidates or src.n_layers):
        raise KvtError(f"--k {args.k}: {names[0]} has {args.candidates or src.n_layers} layers to select from; "
                       "give at most that")
    unknown = [t for t in args.tasks.split(",") if t not in EVAL_TOKENS]
    if unknown:
        raise KvtError(f"--tasks: plan has no token counts for {unknown[0]!r}; name tasks among "
                       f"{', '.join(EVAL_TOKENS)} (one of like length for a task of your own)")
    if args.count > MAX_COUNT:
        raise KvtError(f"--count {args.count}: torch numbers at most {MAX_COUNT} GPUs in a machine; give at most "
                       f"{MAX_COUNT} (several machines: plan one and see docs/scale.md)")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kvt plan", description="Print the memory plan of a pair on named GPUs (no "
                                 "hardware needed).")
    ap.add_argument("--pair", default="qwen3-14b:32b", help="FAMILY-SRC:TGT of known shapes (default qwen3-14b:32b)")
    ap.add_argument("--scope", default="layer", choices=["head", "layer"], help="layer: the paper's (default)")
    ap.add_argument("--k", type=int, default=8, help="source layers per target layer (paper: 8)")
    ap.add_argument("--context", type=int, default=32768, help="tokens of the longest context to transfer")
    ap.add_argument("--batch", type=int, default=1, help="contexts transferred at once")
    ap.add_argument("--calib-len", type=int, default=1024, help="tokens per calibration sequence (paper: 1024)")
    ap.add_argument("--calib-seqs", type=int, default=500, help="fit sequences (a tenth more for validation)")
    ap.add_argument("--tasks", default=PAPER_TASKS, help="the tasks whose evaluation is timed (coqa: the way back too)")
    ap.add_argument("--limit", type=int, default=500, help="items per task")
    ap.add_argument("--eval-batch", type=int, default=32, help="items evaluated together (32 items of ~1K tokens: "
                    "the 32K tokens the transfer phase plans)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"], help="model weights")
    ap.add_argument("--stats-dtype", default="float64", choices=["float64", "float32"],
                    help="calibration statistics (float32 halves them)")
    ap.add_argument("--candidates", type=int, default=None, help="consider only this many evenly spaced source layers")
    ap.add_argument("--gpu", "--device", dest="gpu", default="h200", choices=sorted(GPUS), help="the GPU model to plan for")
    ap.add_argument("--count", type=int, default=1, help="how many of those GPUs")
    ap.add_argument("--summary", action="store_true", help="a table over scopes, statistics dtypes, H100/H200 x 1-8")
    args = ap.parse_args(argv)
    for name, least in (("k", 1), ("context", 1), ("batch", 1), ("calib-len", 2), ("calib-seqs", 1), ("limit", 1),
                        ("eval-batch", 1), ("candidates", 2), ("count", 1)):
        at_least(name, getattr(args, name.replace("-", "_")), least)
    names = parse_pair(args.pair)
    src, tgt = (shape(n) for n in names)
    check_request(args, names, src, tgt)
    asked = Options(args.scope, args.k, args.candidates, args.context, args.batch, getattr(torch, args.dtype),
                    calib_len=args.calib_len, stats_dtype=getattr(torch, args.stats_dtype))
    if args.summary:
        print(f"{args.pair}: GiB the fullest device needs, bf16 weights unless --dtype, k={args.k}, "
              f"{args.batch} x {args.context} tokens; (no) = over {USABLE:.0%} of the GPU")
        print(summary(src, tgt, asked))
        return
    work = Workload(args.calib_seqs, tasks=tuple(args.tasks.split(",")), limit=args.limit, eval_batch=args.eval_batch)
    text, _ = rehearsal(src, tgt, names, asked, args.gpu, args.count, work)
    print(text)
    for a, b in [(src, tgt), (tgt, src)][:1 + ("coqa" in args.tasks.split(","))]:
        devices = [f"cuda:{i}" for i in range(args.count)]
        try:
            check_plan(plan(a, b, dataclasses.replace(asked, devices=devices, bench=True)),
                       capacity(devices, args.gpu))
        except KvtError as e:
            print(e)


if __name__ == "__main__":
    command(main)  # as `kvt plan`: an error is one line
