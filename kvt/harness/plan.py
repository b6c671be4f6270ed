"""The memory plan: what a run will hold on each device, printed and checked before any heavy work.

    p = plan(src_cfg, tgt_cfg, Options(scope="layer", k=8, context=32768, dtype=torch.bfloat16,
                                       devices=("cuda:0", "cuda:1")))
    print(format_plan(p, capacity(p.devices)))   # every row; plan_line(p, cap): one line, what run.py prints
    check_plan(p, capacity(p.devices))   # one-line KvtError saying which option would fit, if it does not

    p = split_to_fit(p, capacity(p.devices))  # layer scope: statistics in as few passes as fit

    kvt plan --pair qwen3-14b:32b --device h200    # the headline run on paper: memory, host, disk, time (costs.py)

Every row is a closed-form count of numbers times bytes per number, on the device where kvt puts it.
loading.place splits n devices by contiguous layers (loading.layer_device: layer l on devices[l * n // L]),
the embedding on the first, the final norm and lm_head on the last. With C = dim, F = ffn_dim, V = vocab,
N = B * T:

  weights      embedding V*C; per layer C*(2*H*D + 2*Hkv*D) + 3*C*F + 2*C (+ 2*D: Qwen3's q/k norms);
               final norm C; lm_head V*C (one shared tensor when tied and on one device)
  statistics   per pass 4 * (G*F^2 + G*F*O + G*F + 2*G*O + 1) sums (K, V x fit, validation; G groups,
               F features, O outputs; see memory_plan), plus one batch of features, on the
               statistics' device (the first). Layer scope may split its second pass into several
               passes over groups of target layers (split_to_fit): more passes over the data, less memory
  KV           2 * N * Hkv * D per layer, with its layer (3x while calibration strips RoPE from keys)
  mapper       2 * G * (k*Bx*By + By) float32 per target layer (K and V), with that layer
  transfer     the source's position-free KV in float32 (2 * N * Hkv * D per source layer) with each
               source layer, and at most one copy of each on every other device that maps target layers
  activations  one layer's forward: N * (3*F + 4*C) in the model dtype, on each device holding layers

  diagnostics  source, target and mapped KV of one calibration-length sequence, and the target's queries
  ridge fits   after each pass, beside its sums: the largest sub-fit's selections, eigh's matrices and
               R^2's Gram matrix (ridge_bytes; each fitted W leaves the device in float32 as it is made)
  host         a statistics checkpoint while safetensors writes it, and the fitted W and b (float32)
  bench        both models' KV of the longest context kept, each direction's timed steps, both mappers

A device needs its weights plus the largest of its phases: each calibration pass, then its fits (one
after the other; each pass is freed before the next), diagnostics, transfer (source KV, mapped KV,
mapper, working set, activations) and the bench. A check leaves 8% of each device for the CUDA context,
cuBLAS and cuSOLVER workspaces and allocator slack. disk_plan counts the output folder's files at most
at once; costs.py adds the time of each phase and prints it all (`kvt plan`). Not counted:
attention scores when SDPA has no fused kernel (CPU prefill holds B*H*T^2 of them), full-sequence
logits (kvt asks for the last position's only), and the MLP backstop.
"""
import dataclasses
import os
from dataclasses import dataclass

import torch

from kvt.config import KvtError, check_matched_kv, matched_kv
from kvt.fast import holds
from kvt.loading import layer_device
from kvt.stats import groups

GPUS = {"h100": 81559 * 2**20, "h200": 143771 * 2**20}  # total memory of an 80 GB H100 and of an H200 (nvidia-smi)
USABLE = 0.92                                            # of each device; the rest: CUDA context, cuBLAS and
                                                         # cuSOLVER workspaces, the allocator's fragmentation
GiB = 2**30


@dataclass(frozen=True)
class Options:
    """What a plan is asked (check_plan re-plans with some of it changed, dataclasses.replace): the mapper
    (scope, k of `candidates` source layers); the transfer of `batch` contexts of `context` tokens with
    both models in `dtype` split over `devices` by loading.place; calibration, unless calibrate=False (a
    saved mapper is reused): batches of calib_batch x calib_len tokens into statistics of stats_dtype,
    layer scope in passes of at most `group` target layers' worth (split_to_fit); with `bench`,
    kvt.harness.bench's timing at that context too."""
    scope: str = "layer"
    k: int = 8
    candidates: int | None = None
    context: int = 4096
    batch: int = 1
    dtype: torch.dtype = torch.bfloat16
    devices: tuple = ("cpu",)
    calibrate: bool = True
    calib_len: int = 1024
    calib_batch: int = 1
    stats_dtype: torch.dtype = torch.float64
    group: int | None = None
    bench: bool = False

    def __post_init__(self):
        object.__setattr__(self, "devices", tuple(self.devices))   # a list given: kept as a tuple (frozen)


@dataclass
class Plan:
    src_cfg: object
    tgt_cfg: object
    options: Options  # what plan() was asked
    rows: list        # (phase, what, {device: bytes})
    devices: list     # the distinct devices, in order

    def total(self, phase, device):
        """Bytes of one phase's rows on one device."""
        return sum(where.get(device, 0) for ph, _, where in self.rows if ph == phase)

    def phases(self):
        return {ph for ph, _, _ in self.rows} - {"weights"}

    def host(self):
        """Bytes of host memory at most: the largest phase of the HOST column (weights stream in from
        memory-mapped files one tensor at a time, not counted)."""
        return max((self.total(ph, HOST) for ph in self.phases()), default=0)

    def need(self):
        """{device: bytes}: the weights plus the largest phase on that device."""
        return {d: self.total("weights", d) + max((self.total(ph, d) for ph in self.phases()), default=0)
                for d in self.devices}


def candidate_layers(n_layers, count=None):
    """`count` source layers spread evenly from the first to the last (all of them when count is None):
    fewer candidates for layer selection make smaller statistics."""
    if count is None or count >= n_layers:
        return list(range(n_layers))
    if count < 2:
        raise KvtError(f"--candidates {count}: layer selection needs at least 2 candidate source layers")
    return [i * (n_layers - 1) // (count - 1) for i in range(count)]


def canonical(device):
    """'cuda' -> 'cuda:0'; other names as torch spells them."""
    d = torch.device(device)
    return f"cuda:{d.index or 0}" if d.type == "cuda" else str(d)


def nbytes(dtype):
    return torch.empty((), dtype=dtype).element_size()


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


# ---- calibration's statistics: what each pass holds --------------------------------------------------

def sums_bytes(G, F, O, itemsize=8):
    """Bytes of the four Sums (K, V x fit, val) of one Stats (float64: itemsize 8; float32: 4)."""
    return 4 * itemsize * (G * F * F + G * F * O + G * F + 2 * G * O + 1)


def pass_bytes(G, F, O, batch_tokens, itemsize=8, held=False):
    """Sums of one pass, the float32 products held for K and V where they are (holds(); `held`), and one
    batch of features for K and V (and their centered copies)."""
    pending = sums_bytes(G, F, O, 4) // 2 if held else 0
    return sums_bytes(G, F, O, itemsize) + pending + 2 * 8 * batch_tokens * G * (F + O)


def layer_group_bound(src_cfg, tgt_cfg, k, group, candidates=None):
    """(source layers, target layers) at most in one layer-scope pass of `group` target layers: the
    union of their selections has at most min(candidates, k * group) source layers."""
    C = len(candidate_layers(src_cfg.n_layers, candidates))
    group = min(group or tgt_cfg.n_layers, tgt_cfg.n_layers)
    return min(C, k * group), group


def memory_plan(src_cfg, tgt_cfg, scope, k=8, batch_tokens=1024, candidates=None, dtype=torch.float64, group=None,
                device="cpu"):
    """[(pass, bytes)]: what calibration holds in memory, besides the two models.

    Head scope: one pass over the C candidate source layers (all L_src unless `candidates`). Layer scope
    on a matched-KV pair: a head-level pass to select layers, then layer-level passes, one per group of
    target layers, each over the union of its selected layers (a group of g target layers: at most
    min(C, k * g) source layers; `group` = g, default all target layers in one pass; the bound is what
    is shown). Layer scope on other pairs: one layer-level pass over the C candidates. The passes run one
    after the other (each is freed before the next). Each also holds one batch of features, and on a
    CPU `device` the float32 products of the batches since the last flush (Pending)."""
    check_matched_kv(src_cfg, tgt_cfg, scope)
    C, Lt = len(candidate_layers(src_cfg.n_layers, candidates)), tgt_cfg.n_layers
    matched = matched_kv(src_cfg, tgt_cfg)
    size, held = torch.empty((), dtype=dtype).element_size(), holds(device, dtype)
    rows = []
    if matched:  # head-level statistics over the candidate source layers (the whole of head scope)
        G, bx, by = groups(src_cfg, tgt_cfg, "head")
        rows.append((f"head statistics, {C} source layers", pass_bytes(G, C * bx, Lt * by, batch_tokens, size, held)))
    if scope == "layer":
        G, bx, by = groups(src_cfg, tgt_cfg, "layer")
        if matched:
            U, g = layer_group_bound(src_cfg, tgt_cfg, k, group, candidates)
            passes = -(-Lt // g)
            what = f"layer statistics, {g} target x <={U} source layers" + (f", <={passes} passes" if passes > 1 else "")
            rows.append((what, pass_bytes(G, U * bx, g * by, batch_tokens, size, held)))
        else:
            rows.append((f"layer statistics, {C} source layers",
                         pass_bytes(G, C * bx, Lt * by, batch_tokens, size, held)))
    return rows


def describe_plan(rows):
    """memory_plan's rows in one line: how many passes, and the largest."""
    name, most = max(rows, key=lambda row: row[1])
    return f"{len(rows)} pass{'es' * (len(rows) > 1)}, the largest {most / 2**30:.2f} GiB ({name})"


def plan(src_cfg, tgt_cfg, options=Options()):
    """The memory plan of a run (see the module docstring) asked as `options` say: calibration, the
    transfer and the bench. Host memory is planned in a column of its own (HOST). Returns a Plan."""
    o = options
    scope, k, context, dtype, batch, calib_len = o.scope, o.k, o.context, o.dtype, o.batch, o.calib_len
    candidates, stats_dtype = o.candidates, o.stats_dtype
    check_matched_kv(src_cfg, tgt_cfg, scope)
    devices = [canonical(d) for d in o.devices]
    host = "cpu" if "cpu" in devices else HOST                # a CPU run's host memory is its device's
    name = str(dtype).replace("torch.", "")
    rows = [("weights", f"source weights ({name})", weight_bytes(src_cfg, devices, dtype)),
            ("weights", f"target weights ({name})", weight_bytes(tgt_cfg, devices, dtype))]
    k = k_used(src_cfg, k, candidates)
    if o.calibrate:
        n = calib_len * o.calib_batch
        passes = memory_plan(src_cfg, tgt_cfg, scope, k, n, candidates, stats_dtype, o.group, devices[0])
        fits = fit_shapes(src_cfg, tgt_cfg, scope, k, candidates, o.group)
        mapper32 = sum(mapper_bytes(src_cfg, tgt_cfg, scope, k, ["cpu"]).values())
        for i, (what, size) in enumerate(passes, 1):
            phase = f"calibration pass {i}"
            rows.append((phase, f"{what}, {str(stats_dtype).replace('torch.', '')}", {devices[0]: size}))
            kv = [kv_bytes(cfg, devices, n, dtype, copies=3) for cfg in (src_cfg, tgt_cfg)]
            rows.append((phase, f"KV of a calibration batch, {n} tokens", add(*kv)))
            rows.append((phase, "activations, one layer", activation_bytes((src_cfg, tgt_cfg), devices, n, dtype)))
            rows.append((phase, "statistics checkpoint being written (safetensors)",
                         {host: size + largest_sum(size, fits[i - 1])}))
            fit = f"{phase}, its fits"                  # after the pass: its sums stay, the batch is gone
            rows.append((fit, f"{what}, {str(stats_dtype).replace('torch.', '')}", {devices[0]: size}))
            rows.append((fit, "ridge fit temporaries (float64: selections, eigh, R^2)",
                         {devices[0]: ridge_bytes(*fits[i - 1])}))
            if i == len(passes):                        # each W leaves the device as it is fitted
                for ph in (phase, fit):
                    rows.append((ph, f"fitted W and b (float32), up to all {tgt_cfg.n_layers} target layers",
                                 {host: mapper32}))
        kv = [kv_bytes(cfg, devices, calib_len, dtype, copies=c) for cfg, c in ((src_cfg, 2), (tgt_cfg, 4))]
        queries = per_layer(tgt_cfg.n_layers, devices, lambda l: calib_len * tgt_cfg.n_heads * tgt_cfg.head_dim * nbytes(dtype))
        rows.append(("diagnostics", f"source, target and mapped KV, {calib_len} tokens", add(*kv)))
        rows.append(("diagnostics", "target queries, every layer", queries))
    n = batch * context
    rows += [("transfer", f"source KV, {batch} x {context} tokens", kv_bytes(src_cfg, devices, n, dtype)),
             ("transfer", f"mapped KV, {batch} x {context} tokens", kv_bytes(tgt_cfg, devices, n, dtype)),
             ("transfer", f"mapper, {scope} scope, k={k} ({name}, as used)",
              mapper_bytes(src_cfg, tgt_cfg, scope, k, devices, dtype)),
             ("transfer", "position-free source KV (float32)", working_bytes(src_cfg, tgt_cfg, devices, n)),
             ("transfer", "activations, one layer", activation_bytes((src_cfg, tgt_cfg), devices, n, dtype))]
    if o.bench:  # kvt.harness.bench: both models' caches of the context kept, then each direction timed in turn
        T, act = context, activation_bytes((src_cfg, tgt_cfg), devices, context, dtype)
        mappers = add(mapper_bytes(src_cfg, tgt_cfg, scope, k, devices, dtype),
                      mapper_bytes(tgt_cfg, src_cfg, scope, min(k, tgt_cfg.n_layers), devices, dtype))
        for phase, a, b, kept in (("bench, forward", src_cfg, tgt_cfg, (src_cfg, tgt_cfg)),
                                  ("bench, back", tgt_cfg, src_cfg, (tgt_cfg,))):
            rows += [(phase, f"{'source and target' if len(kept) == 2 else 'target'} KV of {T} tokens, kept",
                      add(*(kv_bytes(c, devices, T, dtype) for c in kept))),
                     (phase, "timed: the prefill's KV and activations, or the map's KV and working set",
                      most(add(kv_bytes(b, devices, T, dtype), act),
                           add(kv_bytes(b, devices, T, dtype), working_bytes(a, b, devices, T)))),
                     (phase, f"mappers both ways ({name})", mappers),
                     (phase, "copy-rate buffers (bench.copier)", {devices[0]: 2 * 512 * 2**20})]
    return Plan(src_cfg, tgt_cfg, options, rows, list(dict.fromkeys(devices)))


HOST = "host"   # the host's memory, a column of its own beside the devices (not checked against a GPU's)


def fit_shapes(src_cfg, tgt_cfg, scope, k=8, candidates=None, group=None):
    """Per calibration pass, the largest ridge sub-fit it makes: (G, features in the pass, outputs in the
    pass, features of one sub-fit, outputs of one sub-fit), as ridge.single_layer_r2 (one source layer onto
    every target layer of the pass) and ridge.fit_layers (k source layers onto one target layer) cut them."""
    C, Lt = len(candidate_layers(src_cfg.n_layers, candidates)), tgt_cfg.n_layers
    k = min(k, C)
    matched = matched_kv(src_cfg, tgt_cfg)
    G, bx, by = groups(src_cfg, tgt_cfg, "head" if matched else "layer")
    single = (G, C * bx, Lt * by, bx, Lt * by)
    final = (G, C * bx, Lt * by, k * bx, by)
    out = [max(single, final, key=lambda f: ridge_bytes(*f))]
    if scope == "layer" and matched:
        G, bx, by = groups(src_cfg, tgt_cfg, "layer")
        U, g = layer_group_bound(src_cfg, tgt_cfg, k, group, candidates)
        out[0] = single                                        # the head-level pass only selects
        out.append((G, U * bx, g * by, k * bx, by))
    return out


def ridge_bytes(G, F_all, O_all, F, O):
    """Bytes at most held by one ridge sub-fit of F features onto O outputs out of sums over F_all
    features and O_all outputs (float64), G groups at once: the fit and validation selections
    (Sums.select, each F^2 + F O; the second made while the first is held, through an intermediate of
    F x F_all and F x O_all), then eigen's centered matrix, correlation matrix, eigenvectors and eigh's
    workspace (about 2 F^2) beside them, then R^2's full Gram matrix and W-sized products."""
    sel = F * F + F * O
    select = sel + F * F_all + F * O_all + sel
    eig = 2 * sel + 5 * F * F + F * O
    r2 = 2 * sel + F * F + F * O + 3 * F * F + 4 * F * O
    return 8 * G * max(select, eig, r2)


def largest_sum(size, fit):
    """The largest single tensor of a pass's sums (its xx, float64 at most), which safetensors holds a
    second copy of while it writes it."""
    G, F_all, O_all = fit[:3]
    return min(size, 8 * G * max(F_all * F_all, F_all * O_all))


def most(*dicts):
    """{device: the largest of the dicts' bytes there}."""
    out = {}
    for d in dicts:
        for key, v in d.items():
            out[key] = max(out.get(key, 0), v)
    return out


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
    o, src_cfg, tgt_cfg = dataclasses.replace(p.options, group=None), p.src_cfg, p.tgt_cfg
    n0, per = len(p.devices), min(cap[d] for d in p.devices)
    grow = all(torch.device(d).type == "cuda" for d in p.devices)  # more devices: more GPUs like these

    def fewest(**change):
        """The fewest devices (n0 ..) on which the plan with `change` fits, or None."""
        for n in range(n0, (most if grow else n0) + 1):
            devices = [f"cuda:{i}" for i in range(n)] if n > n0 else p.devices
            caps = {d: per for d in devices}
            if fits(split_to_fit(plan(src_cfg, tgt_cfg, dataclasses.replace(o, **change, devices=devices)), caps), caps):
                return n
        return None

    out = []
    alone = fewest() or most + 1                                 # devices alone
    if alone <= most:
        out.append(f"{alone} devices of {per / GiB:.0f} GiB (--devices)")
    changes = []
    matched = matched_kv(src_cfg, tgt_cfg)
    if o.calibrate and o.scope == "layer" and matched:
        changes.append(("--scope head", {"scope": "head"}))
    if o.calibrate and o.stats_dtype == torch.float64:
        changes.append(("--stats-dtype float32", {"stats_dtype": torch.float32}))
    for text, change in changes:
        n = fewest(**change)
        if n and n < alone:                                      # only if it needs fewer devices than more devices do
            out.append(text if n == n0 else f"{text} on {n} devices")
    if o.calibrate:
        C = len(candidate_layers(src_cfg.n_layers, o.candidates))
        for c in range(C - 1, max(o.k, 2) - 1, -1):              # the most candidates that fit these devices
            if fits(split_to_fit(plan(src_cfg, tgt_cfg, dataclasses.replace(o, candidates=c)), cap), cap):
                out.append(f"--candidates {c}")
                break
    return out


def calibration_passes(p):
    """At most how many passes over the calibration data the plan's calibration makes."""
    o, Lt = p.options, p.tgt_cfg.n_layers
    if not o.calibrate:
        return 0
    if o.scope == "head" or not matched_kv(p.src_cfg, p.tgt_cfg):
        return 1
    return 1 + -(-Lt // (o.group or Lt))


def split_to_fit(p, cap):
    """The plan with layer-scope statistics split into as few passes as fit `cap` (the largest group of
    target layers per pass whose statistics fit); p itself when it fits or is not layer scope; the most
    split plan (one target layer a pass) when nothing fits, so what is left to fix shows."""
    o = p.options
    if fits(p, cap) or not (o.calibrate and o.scope == "layer" and matched_kv(p.src_cfg, p.tgt_cfg)):
        return p
    for group in range(p.tgt_cfg.n_layers - 1, 0, -1):
        q = plan(p.src_cfg, p.tgt_cfg, dataclasses.replace(o, group=group))
        if fits(q, cap):
            return q
    return q


CPU_EVAL_BATCH = 8    # items per evaluation batch on a CPU, where memory is not what limits it (docs/evaluation.md)
CONT_TOKENS = 64      # tokens per scored continuation the evaluation plan allows for (a HellaSwag ending: ~40)


def eval_batch(src_cfg, tgt_cfg, cap, context, choices=4, new_tokens=256, options=Options(), most=64):
    """Items per evaluation batch (run.py --batch-size's default): CPU_EVAL_BATCH on a CPU; on GPUs the largest
    power of two up to `most` that fits `cap` beside both models' weights (the mapper's scope and k, the models'
    dtype and devices as `options` say): the transfer plan of that many
    contexts of context + new_tokens tokens (plan(..., calibrate=False): source KV, mapped KV, the mapper,
    its float32 working set, activations), plus a copy of the target's KV for each of an item's `choices`
    (every continuation reads its own item's cache) and their float32 log-probabilities (CONT_TOKENS each)."""
    scope, k, dtype, devices = options.scope, options.k, options.dtype, options.devices
    if all(torch.device(d).type == "cpu" for d in devices):
        return CPU_EVAL_BATCH
    best, b = 1, 1
    while b <= most:
        p = plan(src_cfg, tgt_cfg, Options(scope, k, context=context + new_tokens, batch=b, dtype=dtype,
                                           devices=devices, calibrate=False))
        rows = b * choices
        p.rows += [("transfer", f"continuations' caches, {rows} x {context} tokens",
                    kv_bytes(tgt_cfg, p.devices, rows * context, dtype)),
                   ("transfer", "log-probabilities (float32)",
                    {p.devices[-1]: 2 * rows * CONT_TOKENS * tgt_cfg.vocab_size * 4})]
        if not fits(p, cap):
            break
        best, b = b, 2 * b
    return best


def disk_plan(p):
    """[(what, bytes)] the output folder holds at most at once while the plan's mapper is made
    (calibration.calibrate with keep_stats=False, then run.py, which deletes the statistics once the mapper is
    saved): the first pass's statistics, kept to resume from, twice while its checkpoint is rewritten (a
    .tmp, then a rename), or beside one later pass's checkpoint (the previous one deleted before the
    next is written) and the fits of the passes done so far; then the mapper file (float32)."""
    o, src_cfg, tgt_cfg = p.options, p.src_cfg, p.tgt_cfg
    mapper32 = sum(mapper_bytes(src_cfg, tgt_cfg, o.scope, k_used(src_cfg, o.k, o.candidates), ["cpu"]).values())
    rows = [("mapper file (float32)", mapper32)]
    if not o.calibrate:
        return rows
    shapes = fit_shapes(src_cfg, tgt_cfg, o.scope, o.k, o.candidates, o.group)
    sizes = [sums_bytes(*f[:3], nbytes(o.stats_dtype)) for f in shapes]
    if len(sizes) == 1:
        return [("statistics: a checkpoint and its rewrite", 2 * sizes[0])] + rows
    later = sizes[1] + mapper32
    what = ("statistics of pass 1: a checkpoint and its rewrite" if 2 * sizes[0] >= sizes[0] + later else
            "statistics of pass 1, a later pass's checkpoint, the fits so far (float32)")
    return [(what, max(2 * sizes[0], sizes[0] + later))] + rows


def forward_flops(cfg, T, last=False):
    """FLOPs of one forward over T tokens without logits (calibration's capture): 2 per weight per token
    (the embedding looked up, not multiplied) plus attention's causal q.k and p.v over the causal half.
    last=True: a prefill with logits for the last position only (model(ids, last=True)), one output row more."""
    embed = cfg.vocab_size * cfg.dim
    per_token = sum(weight_bytes(cfg, ["cpu"], torch.int8).values()) - embed * (1 if cfg.tie_embeddings else 2)
    return 2 * per_token * T + 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * T * T + (2 * embed if last else 0)


def transfer_flops(tgt, mapper_params, T):
    """FLOPs of a handoff of T tokens to a target of shape tgt: the map for T - 1 tokens (2 per weight of
    the mapper, mapper.n_params(): its W, and its MLP if it has one), then the target's last token,
    which attends over T slots."""
    return 2 * mapper_params * (T - 1) + forward_flops(tgt, 1, last=True) + 4 * tgt.n_layers * tgt.n_heads * tgt.head_dim * T


def n_params(cfg):
    """Parameters of a model shape: every weight once, a tied embedding once (weight_bytes at one byte each)."""
    return sum(weight_bytes(cfg, ["cpu"], torch.int8).values())


def format_plan(p, cap=None, title="source -> target"):
    """The plan as a table: one column per device, GiB; with `cap`, the usable memory and the verdict."""
    o = p.options
    passes = calibration_passes(p)
    head = (f"memory plan: {title}, {o.scope} scope, k={k_used(p.src_cfg, o.k, o.candidates)}, "
            f"{o.batch} x {o.context} tokens" +
            (f", calibration {o.calib_batch} x {o.calib_len} tokens in {passes} pass{'es' * (passes > 1)}"
             if o.calibrate else ""))
    cols = [*p.devices, *([HOST] if HOST not in p.devices and p.host() else [])]
    lines = [head, "what each phase of the run holds on each device, one phase after another: a device needs its "
             "weights plus its largest phase",
             f"{'phase':<28} {'what':<72}" + "".join(f"{d:>10}" for d in cols) + "   GiB"]
    for phase, what, where in p.rows:
        lines.append(f"{phase:<28} {what:<72}" + "".join(f"{where.get(d, 0) / GiB:10.2f}" for d in cols))
    need = dict(p.need(), **{HOST: p.host()})
    lines.append(f"{'need':<28} {'weights + largest phase (host: largest phase)':<72}" +
                 "".join(f"{need[d] / GiB:10.2f}" for d in cols))
    if cap:
        lines.append(f"{'usable':<28} {f'{USABLE:.0%} of each device':<72}" +
                     "".join(f"{USABLE * cap[d] / GiB:10.2f}" for d in p.devices))
        spare = min(1 - need[d] / cap[d] for d in p.devices)
        lines.append(f"fits, {spare:.1%} of the fullest device to spare" if fits(p, cap) else "does NOT fit")
    return "\n".join(lines)


def fullest(p, cap):
    """(device, its share of usable memory the plan needs): the device the plan fills most."""
    need = p.need()
    return max(((d, need[d] / (USABLE * cap[d])) for d in p.devices), key=lambda x: x[1])


def plan_line(p, cap, title="source -> target"):
    """The plan in one line: what the fullest device needs of what it can use, and the phase that sets it."""
    d, _ = fullest(p, cap)
    largest = max(p.phases(), key=lambda ph: p.total(ph, d))
    where = f"{d} (the fullest of {len(p.devices)} devices)" if len(p.devices) > 1 else d
    return (f"memory plan: {title} needs {p.need()[d] / GiB:.2f} of {USABLE * cap[d] / GiB:.2f} GiB usable on {where}: "
            f"weights {p.total('weights', d) / GiB:.2f} GiB + the largest phase, \"{largest}\", "
            f"{p.total(largest, d) / GiB:.2f} GiB; --show-plan lists every row")


FULL_PLAN_SHARE = 0.5  # run.py lists every row when the plan fills more than this share of a device's usable memory


def nearly_full(p, cap):
    """Whether the plan fills more than FULL_PLAN_SHARE of some device's usable memory (run.py then lists it whole)."""
    return fullest(p, cap)[1] > FULL_PLAN_SHARE


def k_used(src_cfg, k, candidates=None):
    """The k a mapper is fitted with: at most the source layers there are to select from."""
    return min(k, len(candidate_layers(src_cfg.n_layers, candidates)))
