"""Prefill vs transfer, the full table: how long the target takes to rebuild a context's KV itself, and how
long the mapper takes to hand it over from the source's cache. Both are timed in one process, side by side,
by kvt/bench.py's timing (warm-up, medians, rounds in turn: time_side_by_side); this adds what explains the
speedup (the map alone, the copy rate, the roofline), recompute budgets, both directions and the command.

    rows = bench(small, large, mapper_fwd, mapper_back, lengths=[512, 1024, 2048, 4096])

For each context length n and each direction (source -> target):
  source prefill   the source's own prefill of n tokens (listed apart: in serving it already happened)
  target prefill   what a model swap costs today: the target re-reads all n tokens
  transfer         the map of the source's cache of n - 1 tokens (fast.map_cache: fast.apply; Mapper.apply with
                   --plain), then the target runs the last prompt token itself (handoff.take_over)
  speedup          target prefill / transfer (the ratio of their medians)
  per round        the same ratio taken in each round of runs (median, min-max; per_round)
  of which map s   the map alone; the rest of the transfer is the target's last-token step
  last step GB/s   the bytes that step reads (last_step_bytes) over its time
  copy GB/s        a plain copy's rate, timed in turn with the rest (copier): about the most the
                   last step can reach on this device at that time
  roofline         the speedup if the map ran at the prefill's FLOP rate and the last step read its
                   bytes at the copy's rate, both measured in the same rounds; reached: the fraction of
                   it the transfer reaches, per round (median, min-max)
  plain transfer s (with --both) the transfer on the plain path (Mapper.apply, Cache.update's torch.cat),
                   timed in the same rounds; --plain times everything on the plain path
  + recompute f    (with --recompute) the transfer, then the target recomputing a fraction f of the
                   mapped slots itself (recompute.Recompute; timed on the last f of the slots, since
                   the cost depends on their number, not on which ones attention would choose)
Each is warmed up, synchronized before every clock read, and the median of `repeats` runs; at each
length a direction's target prefill and transfer are timed in turn, so host drift moves both alike. Timing
needs no trained weights, so models and mappers may be random, built from named shapes alone:

    python -m kvt.harness.bench --pair qwen3-0.6b:1.7b --lengths 512,1024,2048,4096 [--scope head] [--recompute 0.05,0.25] [--device cuda --dtype bfloat16]

A pair whose two models do not fit in memory together runs with --lean (bench_lean): the models are
built in turn and only their caches are kept between them.
"""
import argparse
import json
import resource
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from kvt.bench import median_time, per_round, time_side_by_side, token_ids, transfer_step
from kvt.config import KvtError, at_least, command, parse_pair, plain_requested, shape
from kvt.harness.dist import check_devices
from kvt.fast import keep_freed_memory, map_cache
from kvt.mapper import Mapper
from kvt.loading import build_model, layer_devices
from kvt.harness.plan import forward_flops, n_params, transfer_flops
from kvt.stats import KINDS, groups
from kvt.weights import check_pair_weights


def last_step_bytes(cfg, T, itemsize):
    """Bytes a target of shape cfg reads for one token after T cached slots: each of its weights once
    (of the input embedding one row; a tied one is read whole as the output layer) and the K and V of
    every slot. Memory bandwidth, not FLOPs, sets that step's time (rows: last_gbs)."""
    untied_embedding = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * T
    return (n_params(cfg) - untied_embedding + kv) * itemsize


def copier(device, mib=512):
    """(fn, bytes): fn copies `mib` MiB of float32 from one buffer to another on device, moving `bytes`
    (read plus written). Timed in turn with a prefill and a transfer, it gives the memory bandwidth of
    that moment, against which to read the last step's rate (a shared host's drifts from minute to minute)."""
    a = torch.ones(mib * 2**20 // 4, device=device)
    b = torch.empty_like(a)
    return (lambda: b.copy_(a)), a.nbytes + b.nbytes


def bf16_units():
    """The CPU's bf16 instructions (avx512_bf16, amx_bf16) from /proc/cpuinfo; [] when it has none (bf16
    matmuls are then emulated, slower than float32) or the flags cannot be read."""
    try:
        info = open("/proc/cpuinfo").read()
        flags = set(next(line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")))
    except (OSError, StopIteration):
        return []
    return [f for f in ("avx512_bf16", "amx_bf16") if f in flags]


def default_dtype(device):
    """bfloat16 on a GPU or on a CPU with bf16 units, else float32."""
    return "bfloat16" if torch.device(device).type == "cuda" or bf16_units() else "float32"


def hardware(device="cpu"):
    """The processor a table was measured on, in words: a GPU's name, or the CPU's model, its vector
    unit as torch sees it, whether it has bf16 instructions (avx512_bf16, amx_bf16) and the threads used."""
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    name = "unknown CPU"
    try:
        info = open("/proc/cpuinfo").read()
        name = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    bf16 = bf16_units()
    return (f"{name}, {torch.backends.cpu.get_cpu_capability()}, bf16 units: {' + '.join(bf16) if bf16 else 'none'}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}")


def random_mapper(src_cfg, tgt_cfg, scope="layer", k=8, dtype=torch.float32, device="cpu", seed=0, bias=0.0):
    """A Mapper of the right shapes with random weights (for timing, or wherever apply is what matters);
    bias: the std of random biases (0: zeros)."""
    k = min(k, src_cfg.n_layers)
    G, Bx, By = groups(src_cfg, tgt_cfg, scope)
    g = torch.Generator().manual_seed(seed)
    layers = torch.stack([torch.randperm(src_cfg.n_layers, generator=g)[:k].sort().values
                          for _ in range(tgt_cfg.n_layers)])                          # (Lt, k)
    W = torch.randn(tgt_cfg.n_layers, G, k * Bx, By, generator=g) / (k * Bx) ** 0.5  # (Lt, G, k*Bx, By)
    b = bias * torch.randn(tgt_cfg.n_layers, G, By, generator=g)
    m = Mapper(scope, src_cfg, tgt_cfg, {kind: layers for kind in KINDS}, {kind: W for kind in KINDS},
               {kind: b for kind in KINDS}, meta={"random": seed})   # bound to no weights: not checked
    return m._with(lambda x: x.to(device, dtype) if x.is_floating_point() else x)  # selections stay on the
    # host, as a fitted mapper's do: apply reads them with .tolist(), a host sync per read if on a GPU


def last_step_s(transfer, mapping):
    """The time of a transfer's last step, for two Timings taken in turn (median_times): the median
    over rounds of that round's transfer minus its map. The difference of the two medians would set a
    transfer from one round against a map from another, and a small difference of large, noisy
    times moves with every round the host slows down."""
    return statistics.median(x - y for x, y in zip(transfer.times, mapping.times, strict=True))


def reset_peak_memory(device):
    """Start peak_memory_gb's count afresh: CUDA's peak allocation, or on a CPU the process's peak
    resident memory (Linux: /proc/self/clear_refs; elsewhere the peak stays the process's)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_gb(device):
    """GiB at most allocated on a CUDA device, or resident in this process on a CPU, since the last
    reset_peak_memory (or the process's start)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20  # KiB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


@torch.no_grad()
def prefills(model, ids, lengths, repeats, name=""):
    """({n: median seconds of the prefill of ids[:, :n]}, the model's cache of all but the last token)."""
    device, times = next(model.parameters()).device, {}
    for n in tqdm(lengths, desc=f"prefill {name}", unit="length"):
        times[n] = median_time(lambda: model(ids[:, :n], last=True), device, repeats)
    return times, model(ids[:, :-1], last=True)[1]


def map_step(target, mapper, cache, ids, n, plain=False):
    """The first part of transfer_step alone: the map, as take_over calls it (fast.map_cache: fast.apply,
    or plain: Mapper.apply). What is left of the transfer is the target's last-token step, bound by
    reading its weights, not by FLOPs."""
    src, devices, dtype = cache.crop(0, n - 1), layer_devices(target), next(target.parameters()).dtype
    return map_cache(mapper, src, devices, dtype, room=1, plain=plain)


def roofline_per_round(prefill, transfer, copy, map_share, last_bytes, copy_bytes):
    """(median, min, max) over rounds of the fraction of the roofline a transfer reaches: that round's
    map at its prefill's FLOP rate (prefill * map_share, map FLOPs over prefill FLOPs) plus the last
    step's bytes at its copy's rate, over its transfer time. Three Timings taken in turn (median_times)."""
    fr = [(p * map_share + last_bytes * c / copy_bytes) / t
          for p, t, c in zip(prefill.times, transfer.times, copy.times, strict=True)]
    return statistics.median(fr), min(fr), max(fr)


def rows(prefill, transfer, mappers, device, recompute=None, mapping=None, itemsize=None, copies=None, plain=None):
    """Table rows, per length both directions: prefill {name: {n: s}}, transfer {(src, tgt): {n: s}},
    recompute {(src, tgt): {frac: {n: s}}} (transfer plus recomputing frac of the slots), mapping
    {(src, tgt): {n: s}} (mapper.apply alone, the part of the transfer before the target's last step),
    itemsize {(src, tgt): bytes per weight of the target}, copies {(src, tgt): {n: (s, bytes)}} (copier).
    flop_limit: the speedup if both sides ran at the same FLOP rate (plan.forward_flops / transfer_flops).
    rate_limit (with mapping): the speedup if the map ran at the prefill's measured FLOP rate and the
    rest of the transfer, the target's last-token step, took what it took. That step reads every weight
    of the target for one token, so memory bandwidth, not FLOPs, sets its time: what flop_limit leaves
    out. last_gbs (with mapping and itemsize): the rate at which that step reads, last_step_bytes over
    its time (last_step_s); copy_gbs (with copies): a plain copy's rate, taken in turn with it.
    roofline (with mapping, itemsize and copies): the speedup if the map ran at the prefill's FLOP rate
    and the last step at the copy's rate; of_roofline: the fraction reached per round
    (roofline_per_round). plain {(src, tgt): {n: s}}: the transfer on the plain path (plain_transfer_s)."""
    out, recompute, mapping, itemsize, copies = [], recompute or {}, mapping or {}, itemsize or {}, copies or {}
    plain = plain or {}
    for n in next(iter(prefill.values())):
        for (src, tgt), t in transfer.items():
            m = mappers[src, tgt]
            flops = forward_flops(m.tgt_cfg, n, last=True), transfer_flops(m.tgt_cfg, m.n_params(), n)
            speedup, map_s = prefill[tgt][n] / t[n], mapping.get((src, tgt), {}).get(n)
            map_at_prefill_rate = prefill[tgt][n] * 2 * m.n_params() * (n - 1) / flops[0]
            last_bytes = last_step_bytes(m.tgt_cfg, n, itemsize.get((src, tgt), 0))
            copy_s, copy_bytes = copies.get((src, tgt), {}).get(n, (None, 0))
            step = map_s and last_step_s(t[n], map_s)  # not positive when noise outweighs the step: no rate then
            roof = copy_s and last_bytes and prefill[tgt][n] / (map_at_prefill_rate + last_bytes * copy_s / copy_bytes)
            out.append({"direction": f"{src} -> {tgt}", "tokens": n, "source_prefill_s": prefill[src][n],
                        "target_prefill_s": prefill[tgt][n], "transfer_s": t[n], "speedup": speedup,
                        "speedup_per_round": per_round(prefill[tgt][n], t[n]),
                        "target_prefill_range": [prefill[tgt][n].min, prefill[tgt][n].max],
                        "transfer_range": [t[n].min, t[n].max], "map_s": map_s,
                        "flop_limit": flops[0] / flops[1], "of_limit": speedup * flops[1] / flops[0],
                        "rate_limit": prefill[tgt][n] / (map_at_prefill_rate + step) if map_s and step > 0 else None,
                        "last_gbs": last_bytes / step / 1e9 if map_s and last_bytes and step > 0 else None,
                        "copy_gbs": copy_s and copy_bytes / copy_s / 1e9,
                        "roofline": roof,
                        "of_roofline": roof and roofline_per_round(prefill[tgt][n], t[n], copy_s,
                                                                   map_at_prefill_rate / prefill[tgt][n],
                                                                   last_bytes, copy_bytes),
                        "plain_transfer_s": plain.get((src, tgt), {}).get(n),
                        "prefill_flops": flops[0], "transfer_flops": flops[1], "mapper_mb": m.nbytes() / 2**20,
                        "peak_gb": peak_memory_gb(device),
                        "recompute_s": {str(f): ts[n] for f, ts in recompute.get((src, tgt), {}).items()}})
    return out


def bench(small, large, fwd, back=None, lengths=(512, 1024, 2048, 4096), repeats=3, names=("small", "large"),
          fracs=(), both=False, plain=False):
    """Rows of timings (seconds) for small -> large with mapper `fwd`, and large -> small with `back`;
    fracs: recompute budgets to time as well; both: the plain path's transfer too; plain: every step
    on the plain path (Mapper.apply, Cache.update and Cache.attend)."""
    models = dict(zip(names, (small, large)))
    return bench_lean(models.get, names, fwd, back, lengths, repeats, fracs, both, plain)


@torch.no_grad()
def bench_lean(build, names, fwd, back=None, lengths=(512, 1024, 2048, 4096), repeats=3, fracs=(), both=False,
               plain=False):
    """bench() for a pair too large to hold together: build(name) makes each model in turn (small, large,
    then small again for `back`) and only one cache of each is kept, so memory peaks at the larger model
    plus the two caches. The same rows, timed in the same order in one process. The contexts are drawn
    from the small model's vocabulary (a family shares one). Each direction times, at each length and
    in turn (median_times), the target's own prefill, the transfer, the mapping alone and each
    recompute budget: the speedup divides two times taken side by side."""
    small = build(names[0])
    check_pair_weights(fwd, small, None, f"the mapper {names[0]} -> {names[1]}")   # a fitted mapper's pair (random: none)
    if back is not None:
        check_pair_weights(back, None, small, f"the mapper {names[1]} -> {names[0]}")
    device = next(small.parameters()).device
    reset_peak_memory(device)                                     # peak_gb: the bench's own peak
    ids = token_ids(lengths, small.config.vocab_size, device)
    prefill, transfer, recompute, mapping, itemsize, copies, plain_s = {}, {}, {}, {}, {}, {}, {}
    copy, copy_bytes = copier(device)
    mappers = {(names[0], names[1]): fwd}
    if back is None:  # else the way back times the small model's prefill, beside its transfers
        prefill[names[0]], c_small = prefills(small, ids, lengths, repeats, names[0])
    else:
        c_small = small(ids[:, :-1], last=True)[1]
    del small

    def direction(target, mapper, cache, src, tgt):
        mapper = mapper if mapper.placed else mapper.place(layer_devices(target))
        transfer[src, tgt], mapping[src, tgt], copies[src, tgt] = {}, {}, {}
        recompute[src, tgt], itemsize[src, tgt] = {f: {} for f in fracs}, next(target.parameters()).element_size()
        for n in tqdm(lengths, desc=f"{src} -> {tgt}: prefill, transfer", unit="length"):
            also = [lambda: map_step(target, mapper, cache, ids, n, plain), copy]     # in the same rounds
            also += [lambda f=f: transfer_step(target, mapper, cache, ids, n, f, plain) for f in fracs]
            also += [lambda: transfer_step(target, mapper, cache, ids, n, plain=True)] if both else []
            prefill.setdefault(tgt, {})[n], transfer[src, tgt][n], mapping[src, tgt][n], copy_s, *rc = \
                time_side_by_side(target, mapper, cache, ids, n, repeats, also, plain)
            copies[src, tgt][n] = copy_s, copy_bytes
            if both:
                plain_s.setdefault((src, tgt), {})[n] = rc.pop()
            for f, t in zip(fracs, rc):
                recompute[src, tgt][f][n] = t

    large = build(names[1])
    check_pair_weights(fwd, None, large, f"the mapper {names[0]} -> {names[1]}")
    if back is not None:
        check_pair_weights(back, large, None, f"the mapper {names[1]} -> {names[0]}")
    c_large = large(ids[:, :-1], last=True)[1]
    direction(large, fwd, c_small, *names)
    del large, c_small
    if back is not None:
        mappers[names[1], names[0]] = back
        direction(build(names[0]), back, c_large, names[1], names[0])
    return rows(prefill, transfer, mappers, device, recompute, mapping, itemsize, copies, plain_s)


def format_rows(rows):
    """A markdown table of bench rows."""
    fracs = list(rows[0].get("recompute_s", {})) if rows else []
    plain = bool(rows and rows[0].get("plain_transfer_s"))
    pct = lambda m: f"{100 * m[0]:.0f}% ({100 * m[1]:.0f}-{100 * m[2]:.0f})" if m else "-"  # noqa: E731
    out = ["| direction | tokens | source prefill s | target prefill s (min-max) | transfer s (min-max) | speedup "
           "| per round (min-max) | of which map s | FLOP limit | reached | at prefill's rate | last step GB/s "
           "| copy GB/s | roofline | reached per round (min-max) | mapper MB |"
           + "".join(f" + {float(f):.0%} recompute s |" for f in fracs) + (" plain transfer s |" if plain else ""),
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * (len(fracs) + plain)]
    rounds = lambda m: f"{m[0]:.1f}x ({m[1]:.1f}-{m[2]:.1f})"  # noqa: E731
    span = lambda r, k: f"{r[k + '_s']:.3f} ({r[k + '_range'][0]:.3f}-{r[k + '_range'][1]:.3f})"  # noqa: E731
    dash = lambda x, fmt, unit="": "-" if x is None else f"{x:{fmt}}{unit}"  # noqa: E731
    for r in rows:
        out.append(f"| {r['direction']} | {r['tokens']} | {r['source_prefill_s']:.3f} | {span(r, 'target_prefill')} "
                   f"| {span(r, 'transfer')} | {r['speedup']:.1f}x | {rounds(r['speedup_per_round'])} "
                   f"| {r.get('map_s') or float('nan'):.3f} "
                   f"| {r['flop_limit']:.1f}x | {100 * r['of_limit']:.0f}% "
                   f"| {dash(r.get('rate_limit'), '.1f', 'x')} | {dash(r.get('last_gbs'), '.1f')} "
                   f"| {r.get('copy_gbs') or float('nan'):.1f} | {dash(r.get('roofline'), '.1f', 'x')} "
                   f"| {pct(r.get('of_roofline'))} | {r['mapper_mb']:.1f} |"
                   + "".join(f" {r['recompute_s'][f]:.3f} |" for f in fracs)
                   + (f" {r['plain_transfer_s']:.3f} |" if plain else ""))
    if any(r.get("map_s") and r.get("last_gbs") is None for r in rows):
        out += ["", "-: a round's transfer minus its map (the last step), median over rounds, was not positive: the "
                "step is shorter than the timing noise here, so no rate is given; time longer contexts or more rounds "
                "(python -m kvt.harness.bench --repeats)"]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kvt bench", description="Time target prefill vs KV transfer on random "
                                 "weights of named shapes.")
    ap.add_argument("--pair", default="qwen3-0.6b:1.7b", help="FAMILY-SRC:TGT of known shapes (default qwen3-0.6b:1.7b)")
    ap.add_argument("--lengths", default="512,1024,2048,4096", help="comma-separated context lengths to time")
    ap.add_argument("--scope", default="layer", choices=["layer", "head"], help="layer: the paper's (default)")
    ap.add_argument("--k", type=int, default=8, help="source layers per target layer (paper: 8)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement, after a warm-up (the median)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="default: bfloat16 on a GPU or a CPU with bf16 units (bench.bf16_units), else float32")
    ap.add_argument("--lean", action="store_true", help="hold one model at a time (a pair too large for memory)")
    ap.add_argument("--recompute", default="", help="also time transfer + recomputing these fractions, e.g. 0.05,0.25")
    ap.add_argument("--plain", action="store_true", help="time every step's plain path (= KVT_PLAIN=1)")
    ap.add_argument("--both", action="store_true", help="also time the plain path's transfer, in the same rounds")
    ap.add_argument("--json", type=Path, help="also write the rows, settings and processor here (kvt figures scaling)")
    args = ap.parse_args(argv)
    at_least("k", args.k, why=" (source layers per target layer; the paper uses 8)")
    at_least("repeats", args.repeats)
    def numbers(text, kind):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            return None
    lengths, fracs = numbers(args.lengths, int), numbers(args.recompute, float)
    if not lengths or min(lengths) < 2:
        raise KvtError(f"--lengths {args.lengths!r}: give comma-separated context lengths of at least 2 tokens, "
                       "e.g. 512,1024,2048")
    if fracs is None or not all(0 < f <= 1 for f in fracs):
        raise KvtError(f"--recompute {args.recompute!r}: give comma-separated fractions of the prompt in (0, 1], "
                       "e.g. 0.05,0.25")
    check_devices([args.device])
    keep_freed_memory()                # process-wide, both sides alike: a cache of the last one's size costs no page faults
    plain = args.plain or plain_requested()  # --plain or KVT_PLAIN=1: every step's plain path
    names = parse_pair(args.pair)
    args.dtype = args.dtype or default_dtype(args.device)
    dtype = getattr(torch, args.dtype)
    build = lambda name: build_model(name, dtype=dtype, device=args.device, seed=names.index(name))  # noqa: E731
    fwd = random_mapper(shape(names[0]), shape(names[1]), args.scope, args.k, dtype, args.device)
    back = random_mapper(shape(names[1]), shape(names[0]), args.scope, args.k, dtype, args.device, seed=1)
    if args.lean:
        table = bench_lean(build, names, fwd, back, lengths, args.repeats, fracs, args.both, plain)
    else:
        table = bench(build(names[0]), build(names[1]), fwd, back, lengths, args.repeats, names, fracs, args.both, plain)
    print(f"{args.pair}, {args.scope} scope, k={args.k}, {args.dtype}{', plain path' if plain else ''} on "
          f"{hardware(args.device)}; median of "
          f"{args.repeats} after a warm-up{', one model at a time' if args.lean else ''}; "
          f"peak memory {max(r['peak_gb'] for r in table):.1f} GiB")
    print(format_rows(table))
    if args.json:
        args.json.write_text(json.dumps({"pair": args.pair, "scope": args.scope, "k": args.k, "dtype": args.dtype,
                                         "hardware": hardware(args.device), "repeats": args.repeats,
                                         "plain": plain, "rows": table},
                                        indent=1))


if __name__ == "__main__":
    command(main)  # as `kvt bench`: an error is one line
