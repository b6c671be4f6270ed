"""The memory plan: what a run will hold on each device, printed and checked before any heavy work.

    p = plan(src_cfg, tgt_cfg, scope="layer", k=8, context=32768, dtype=torch.bfloat16, devices=["cuda:0", "cuda:1"])
    print(format_plan(p, capacity(p.devices)))
    check_plan(p, capacity(p.devices))   # one-line KvtError saying which option would fit, if it does not

    p = split_to_fit(p, capacity(p.devices))  # layer scope: statistics in as few passes as fit

    python -m kvt.plan --pair qwen3-14b:32b --gpu h200 --count 1   # without the hardware
    python -m kvt.plan --pair qwen3-14b:32b --summary              # H100/H200 x 1, 2, 4, 8

Every row is a closed-form count of numbers times bytes per number, on the device where kvt puts it.
model.place splits n devices by contiguous layers: layer l on devices[l * n // L], the embedding on
the first, the final norm and lm_head on the last. With C = dim, F = ffn_dim, V = vocab, N = B * T:

  weights      embedding V*C; per layer C*(2*H*D + 2*Hkv*D) + 3*C*F + 2*C (+ 2*D: Qwen3's q/k norms);
               final norm C; lm_head V*C (one shared tensor when tied and on one device)
  statistics   per pass 4 * (G*F^2 + G*F*O + G*F + 2*G*O + 1) sums (K, V x fit, validation; G groups,
               F features, O outputs; see stats.memory_plan), plus one batch of features, on the
               statistics' device (the first). Layer scope may split its second pass into several
               passes over groups of target layers (split_to_fit): more passes over the data, less memory
  KV           2 * N * Hkv * D per layer, with its layer (3x while calibration strips RoPE from keys)
  mapper       2 * G * (k*Bx*By + By) float32 per target layer (K and V), with that layer
  transfer     the source's position-free KV in float32 (2 * N * Hkv * D per source layer) with each
               source layer, and at most one copy of each on every other device that maps target layers
  activations  one layer's forward: N * (3*F + 4*C) in the model dtype, on each device holding layers

  diagnostics  source, target and mapped KV of one calibration-length sequence, and the target's queries

A device needs its weights plus the largest of its phases: calibration pass 1, calibration pass 2
(one after the other; the first is freed), diagnostics and transfer (source KV, mapped KV, mapper,
working set, activations). A check leaves 5% of each device for the CUDA context and allocator slack. Not counted:
attention scores when SDPA has no fused kernel (CPU prefill holds B*H*T^2 of them), full-sequence
logits (kvt asks for the last position's only), and the MLP backstop.
"""
import argparse
import os
from dataclasses import dataclass

import torch

from kvt.config import KvtError, check_matched_kv, matched_kv, parse_pair, shape
from kvt.stats import candidate_layers, groups, memory_plan

GPUS = {"h100": 81559 * 2**20, "h200": 143771 * 2**20}  # total memory of an 80 GB H100 and of an H200 (nvidia-smi)
USABLE = 0.95                                            # of each device; the rest: CUDA context, fragmentation
GiB = 2**30


@dataclass
class Plan:
    options: dict   # the arguments plan() was called with (check_plan re-plans with other options)
    rows: list      # (phase, what, {device: bytes})
    devices: list   # the distinct devices, in order

    def total(self, phase, device):
        """Bytes of one phase's rows on one device."""
        return sum(where.get(device, 0) for ph, _, where in self.rows if ph == phase)

    def phases(self):
        return {ph for ph, _, _ in self.rows} - {"weights"}

    def need(self):
        """{device: bytes}: the weights plus the largest phase on that device."""
        return {d: self.total("weights", d) + max((self.total(ph, d) for ph in self.phases()), default=0)
                for d in self.devices}


def canonical(device):
    """'cuda' -> 'cuda:0'; other names as torch spells them."""
    d = torch.device(device)
    return f"cuda:{d.index or 0}" if d.type == "cuda" else str(d)


def nbytes(dtype):
    return torch.empty((), dtype=dtype).element_size()


def layer_device(l, n_layers, devices):
    return devices[l * len(devices) // n_layers]                  # model.place's rule


def per_layer(n_layers, devices, count):
    """{device: sum of count(l)} over the layers l on each device."""
    out = {}
    for l in range(n_layers):
        d = layer_device(l, n_layers, devices)
        out[d] = out.get(d, 0) + count(l)
    return out


def weight_bytes(cfg, devices, dtype):
    """{device: bytes} of a model's weights placed on devices."""
    C, H, Hkv, D, F, V = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
    layer = C * (2 * H * D + 2 * Hkv * D) + 3 * C * F + 2 * C + (2 * D if cfg.qk_norm else 0)
    out = per_layer(cfg.n_layers, devices, lambda l: layer)
    first, last = devices[0], devices[-1]
    out[first] = out.get(first, 0) + V * C                       # embedding
    out[last] = out.get(last, 0) + C                             # final norm
    if not (cfg.tie_embeddings and first == last):
        out[last] += V * C                                       # lm_head (a copy of a tied one elsewhere)
    return {d: n * nbytes(dtype) for d, n in out.items()}


def kv_bytes(cfg, devices, tokens, dtype, copies=2):
    """{device: bytes} of `copies` (B, Hkv, T, D) tensors per layer (keys and values) for N = B*T tokens."""
    return per_layer(cfg.n_layers, devices, lambda l: copies * tokens * cfg.n_kv_heads * cfg.head_dim * nbytes(dtype))


def activation_bytes(cfgs, devices, tokens, dtype):
    """{device: bytes}: one layer's forward of the widest model holding layers there."""
    out = {}
    for cfg in cfgs:
        for d in per_layer(cfg.n_layers, devices, lambda l: 1):
            out[d] = max(out.get(d, 0), tokens * (3 * cfg.ffn_dim + 4 * cfg.dim) * nbytes(dtype))
    return out


def mapper_bytes(src_cfg, tgt_cfg, scope, k, devices, dtype=torch.float32):
    """{device: bytes} of a ridge mapper's weights, K and V, each target layer's on its device."""
    G, bx, by = groups(src_cfg, tgt_cfg, scope)
    return per_layer(tgt_cfg.n_layers, devices, lambda l: 2 * G * (k * bx * by + by) * nbytes(dtype))


def working_bytes(src_cfg, tgt_cfg, devices, tokens, dtype=torch.float32):
    """{device: bytes} of Mapper.apply's inputs: the source's position-free KV in the mapper's dtype with
    each source layer, plus (at most) a copy of every source layer kept elsewhere on each device that
    maps target layers."""
    one = 2 * tokens * src_cfg.n_kv_heads * src_cfg.head_dim * nbytes(dtype)   # K and V of one source layer
    own = per_layer(src_cfg.n_layers, devices, lambda l: one)                   # {device: bytes}
    maps = per_layer(tgt_cfg.n_layers, devices, lambda l: 1)                    # devices that map target layers
    out = {}
    for d in dict.fromkeys(devices):
        copies = one * src_cfg.n_layers - own.get(d, 0) if d in maps else 0    # the source layers kept elsewhere
        out[d] = own.get(d, 0) + copies
    return out


def plan(src_cfg, tgt_cfg, scope="layer", k=8, context=4096, dtype=torch.bfloat16, devices=("cpu",), batch=1,
         calib_len=1024, calib_batch=1, stats_dtype=torch.float64, candidates=None, calibrate=True, group=None):
    """The memory plan of a run (see the module docstring): calibration (unless calibrate=False, when a
    saved mapper is reused) and transfer of `batch` contexts of `context` tokens, with both models in
    `dtype` split over `devices` by model.place. group: layer-scope statistics in passes of at most
    this many target layers' worth (see split_to_fit). Returns a Plan."""
    options = dict(scope=scope, k=k, context=context, dtype=dtype, devices=list(devices), batch=batch,
                   calib_len=calib_len, calib_batch=calib_batch, stats_dtype=stats_dtype, candidates=candidates,
                   calibrate=calibrate, group=group)
    check_matched_kv(src_cfg, tgt_cfg, scope)
    devices = [canonical(d) for d in devices]
    name = str(dtype).replace("torch.", "")
    rows = [("weights", f"source weights ({name})", weight_bytes(src_cfg, devices, dtype)),
            ("weights", f"target weights ({name})", weight_bytes(tgt_cfg, devices, dtype))]
    k = min(k, len(candidate_layers(src_cfg.n_layers, candidates)))
    if calibrate:
        n = calib_len * calib_batch
        passes = memory_plan(src_cfg, tgt_cfg, scope, k, n, candidates, stats_dtype, group, devices[0])
        for i, (what, size) in enumerate(passes, 1):
            phase = f"calibration pass {i}"
            rows.append((phase, f"{what}, {str(stats_dtype).replace('torch.', '')}", {devices[0]: size}))
            kv = [kv_bytes(cfg, devices, n, dtype, copies=3) for cfg in (src_cfg, tgt_cfg)]
            rows.append((phase, f"KV of a calibration batch, {n} tokens", add(*kv)))
            rows.append((phase, "activations, one layer", activation_bytes((src_cfg, tgt_cfg), devices, n, dtype)))
        kv = [kv_bytes(cfg, devices, calib_len, dtype, copies=c) for cfg, c in ((src_cfg, 2), (tgt_cfg, 4))]
        queries = per_layer(tgt_cfg.n_layers, devices, lambda l: calib_len * tgt_cfg.n_heads * tgt_cfg.head_dim * nbytes(dtype))
        rows.append(("diagnostics", f"source, target and mapped KV, {calib_len} tokens", add(*kv)))
        rows.append(("diagnostics", "target queries, every layer", queries))
    n = batch * context
    rows += [("transfer", f"source KV, {batch} x {context} tokens", kv_bytes(src_cfg, devices, n, dtype)),
             ("transfer", f"mapped KV, {batch} x {context} tokens", kv_bytes(tgt_cfg, devices, n, dtype)),
             ("transfer", f"mapper, {scope} scope, k={k} (float32)", mapper_bytes(src_cfg, tgt_cfg, scope, k, devices)),
             ("transfer", "position-free source KV (float32)", working_bytes(src_cfg, tgt_cfg, devices, n)),
             ("transfer", "activations, one layer", activation_bytes((src_cfg, tgt_cfg), devices, n, dtype))]
    return Plan(dict(options, src_cfg=src_cfg, tgt_cfg=tgt_cfg), rows, list(dict.fromkeys(devices)))


def add(*dicts):
    out = {}
    for d in dicts:
        for key, v in d.items():
            out[key] = out.get(key, 0) + v
    return out


def capacity(devices, gpu=None):
    """{device: bytes} of memory: a named GPU's ("h100", "h200") for every CUDA device when `gpu` is
    given (to plan without the hardware), else the hardware's (CUDA total memory; host RAM for cpu;
    meta unbounded)."""
    out = {}
    for d in map(canonical, devices):
        kind = torch.device(d).type
        if kind == "cuda":
            out[d] = GPUS[gpu] if gpu else torch.cuda.get_device_properties(torch.device(d)).total_memory
        elif kind == "cpu":
            out[d] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        else:
            out[d] = float("inf")
    return out


def fits(p, cap):
    return all(need <= USABLE * cap[d] for d, need in p.need().items())


def check_plan(p, cap):
    """Raise a one-line KvtError when a device would need more than USABLE of its memory `cap[d]`,
    naming the options that would fit: head scope, float32 statistics, fewer candidate source layers,
    more devices like these (alone, or with the fewest devices that make the others fit). Layer-scope
    statistics are split into passes first (split_to_fit), as run.py does."""
    p = split_to_fit(p, cap)
    need = p.need()
    over = [d for d in p.devices if need[d] > USABLE * cap[d]]
    if not over:
        return
    d = over[0]
    peak = max(p.phases(), key=lambda ph: p.total(ph, d))                # the phase that sets d's need
    what, size = max(((what, where.get(d, 0)) for ph, what, where in p.rows if ph in ("weights", peak)),
                     key=lambda row: row[1])                              # its biggest row, or the weights
    fixes = alternatives(p, cap)
    raise KvtError(f"memory plan does not fit: {d} needs {need[d] / GiB:.1f} GiB of {USABLE * cap[d] / GiB:.1f} GiB "
                   f"usable (largest: {what}, {size / GiB:.1f} GiB); "
                   + (f"would fit: {'; '.join(fixes)}" if fixes else
                      "no option fits (head scope, float32 statistics, fewer candidates, more devices); "
                      "use devices with more memory or a shorter --context"))


def alternatives(p, cap, most=16):
    """Descriptions of the options that make plan p fit, each with the fewest devices it needs."""
    o = dict(p.options, group=None)
    src_cfg, tgt_cfg = o.pop("src_cfg"), o.pop("tgt_cfg")
    n0, per = len(p.devices), min(cap[d] for d in p.devices)
    grow = all(torch.device(d).type == "cuda" for d in p.devices)  # more devices: more GPUs like these

    def fewest(**change):
        """The fewest devices (n0 ..) on which the plan with `change` fits, or None."""
        for n in range(n0, (most if grow else n0) + 1):
            devices = [f"cuda:{i}" for i in range(n)] if n > n0 else p.devices
            caps = {d: per for d in devices}
            if fits(split_to_fit(plan(src_cfg, tgt_cfg, **{**o, **change, "devices": devices}), caps), caps):
                return n
        return None

    out = []
    alone = fewest() or most + 1                                 # devices alone
    if alone <= most:
        out.append(f"{alone} devices of {per / GiB:.0f} GiB (--devices)")
    changes = []
    matched = matched_kv(src_cfg, tgt_cfg)
    if o["calibrate"] and o["scope"] == "layer" and matched:
        changes.append(("--scope head", {"scope": "head"}))
    if o["calibrate"] and o["stats_dtype"] == torch.float64:
        changes.append(("--stats-dtype float32", {"stats_dtype": torch.float32}))
    for text, change in changes:
        n = fewest(**change)
        if n and n < alone:                                      # only if it needs fewer devices than more devices do
            out.append(text if n == n0 else f"{text} on {n} devices")
    if o["calibrate"]:
        C = len(candidate_layers(src_cfg.n_layers, o["candidates"]))
        for c in range(C - 1, max(o["k"], 2) - 1, -1):           # the most candidates that fit these devices
            if fits(split_to_fit(plan(src_cfg, tgt_cfg, **{**o, "candidates": c}), cap), cap):
                out.append(f"--candidates {c}")
                break
    return out


def calibration_passes(p):
    """At most how many passes over the calibration data the plan's calibration makes."""
    o = p.options
    if not o["calibrate"]:
        return 0
    matched = matched_kv(o["src_cfg"], o["tgt_cfg"])
    if o["scope"] == "head" or not matched:
        return 1
    group = o["group"] or o["tgt_cfg"].n_layers
    return 1 + -(-o["tgt_cfg"].n_layers // group)


def split_to_fit(p, cap):
    """The plan with layer-scope statistics split into as few passes as fit `cap` (the largest group of
    target layers per pass whose statistics fit); p itself when it fits or is not layer scope; the most
    split plan (one target layer a pass) when nothing fits, so what is left to fix shows."""
    o = dict(p.options)
    src_cfg, tgt_cfg = o.pop("src_cfg"), o.pop("tgt_cfg")
    matched = matched_kv(src_cfg, tgt_cfg)
    if fits(p, cap) or not (o["calibrate"] and o["scope"] == "layer" and matched):
        return p
    for group in range(tgt_cfg.n_layers - 1, 0, -1):
        q = plan(src_cfg, tgt_cfg, **{**o, "group": group})
        if fits(q, cap):
            return q
    return q


CPU_EVAL_BATCH = 8    # items per evaluation batch on a CPU, where memory is not what limits it (docs/evaluation.md)
CONT_TOKENS = 64      # tokens per scored continuation the evaluation plan allows for (a HellaSwag ending: ~40)


def eval_batch(src_cfg, tgt_cfg, cap, context, choices=4, new_tokens=256, scope="layer", k=8, dtype=torch.bfloat16,
               devices=("cpu",), most=64):
    """Items per evaluation batch (run.py --batch-size's default): CPU_EVAL_BATCH on a CPU; on GPUs the largest
    power of two up to `most` that fits `cap` beside both models' weights: the transfer plan of that many
    contexts of context + new_tokens tokens (plan(..., calibrate=False): source KV, mapped KV, the mapper,
    its float32 working set, activations), plus a copy of the target's KV for each of an item's `choices`
    (every continuation reads its own item's cache) and their float32 log-probabilities (CONT_TOKENS each)."""
    if all(torch.device(d).type == "cpu" for d in devices):
        return CPU_EVAL_BATCH
    best, b = 1, 1
    while b <= most:
        p = plan(src_cfg, tgt_cfg, scope, k, context + new_tokens, dtype, devices, batch=b, calibrate=False)
        rows = b * choices
        p.rows += [("transfer", f"continuations' caches, {rows} x {context} tokens",
                    kv_bytes(tgt_cfg, p.devices, rows * context, dtype)),
                   ("transfer", "log-probabilities (float32)",
                    {p.devices[-1]: 2 * rows * CONT_TOKENS * tgt_cfg.vocab_size * 4})]
        if not fits(p, cap):
            break
        best, b = b, 2 * b
    return best


def format_plan(p, cap=None, title="source -> target"):
    """The plan as a table: one column per device, GiB; with `cap`, the usable memory and the verdict."""
    o = p.options
    k = min(o["k"], len(candidate_layers(o["src_cfg"].n_layers, o["candidates"])))   # the k actually used
    passes = calibration_passes(p)
    head = (f"memory plan: {title}, {o['scope']} scope, k={k}, {o['batch']} x {o['context']} tokens" +
            (f", calibration {o['calib_batch']} x {o['calib_len']} tokens in {passes} pass{'es' * (passes > 1)}"
             if o["calibrate"] else ""))
    cols = "".join(f"{d:>10}" for d in p.devices)
    lines = [head, f"{'phase':<20} {'what':<70}{cols}   GiB"]
    for phase, what, where in p.rows:
        lines.append(f"{phase:<20} {what:<70}" + "".join(f"{where.get(d, 0) / GiB:10.2f}" for d in p.devices))
    need = p.need()
    lines.append(f"{'need':<20} {'weights + largest phase':<70}" + "".join(f"{need[d] / GiB:10.2f}" for d in p.devices))
    if cap:
        lines.append(f"{'usable':<20} {f'{USABLE:.0%} of each device':<70}" +
                     "".join(f"{USABLE * cap[d] / GiB:10.2f}" for d in p.devices))
        lines.append("fits" if fits(p, cap) else "does NOT fit")
    return "\n".join(lines)


def summary(src_cfg, tgt_cfg, counts=(1, 2, 4, 8), gpus=("h100", "h200"), **kw):
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
                p = split_to_fit(plan(src_cfg, tgt_cfg, scope=scope, stats_dtype=sd, devices=devices, **kw), cap)
                worst, passes = max(p.need().values()), calibration_passes(p)
                cells.append(f"{worst / GiB:.0f}" + (f", {passes} passes" if passes > 2 else "")
                             + ("" if fits(p, cap) else " (no)"))
            lines.append(f"| {scope} | {str(sd).replace('torch.', '')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Print the memory plan of a pair on named GPUs (no hardware needed).")
    ap.add_argument("--pair", default="qwen3-14b:32b")
    ap.add_argument("--scope", default="layer", choices=["head", "layer"], help="layer: the paper's (default)")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calib-len", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--stats-dtype", default="float64", choices=["float64", "float32"])
    ap.add_argument("--candidates", type=int, default=None)
    ap.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    ap.add_argument("--count", type=int, default=1, help="how many of those GPUs")
    ap.add_argument("--summary", action="store_true", help="a table over scopes, statistics dtypes, H100/H200 x 1-8")
    args = ap.parse_args(argv)
    src, tgt = (shape(n) for n in parse_pair(args.pair))
    kw = dict(k=args.k, context=args.context, batch=args.batch, calib_len=args.calib_len,
              dtype=getattr(torch, args.dtype), candidates=args.candidates)
    if args.summary:
        print(f"{args.pair}: GiB the fullest device needs, bf16 weights unless --dtype, k={args.k}, "
              f"{args.batch} x {args.context} tokens; (no) = over {USABLE:.0%} of the GPU")
        print(summary(src, tgt, **kw))
        return
    devices = [f"cuda:{i}" for i in range(args.count)]
    cap = capacity(devices, args.gpu)
    p = split_to_fit(plan(src, tgt, scope=args.scope, stats_dtype=getattr(torch, args.stats_dtype), devices=devices,
                          **kw), cap)
    title = f"{args.pair} on {args.count} x {args.gpu.upper()} ({GPUS[args.gpu] / GiB:.1f} GiB each)"
    print(format_plan(p, cap, title))
    try:
        check_plan(p, cap)
    except KvtError as e:
        print(e)


if __name__ == "__main__":
    main()
