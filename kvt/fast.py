"""The fast path: every speed trick kvt keeps, in one file after the method's stages.

Each function here is the twin of a plain function a student reads in the tutorial, with the same
result within the dtype's tolerance (tests/test_fast.py), and is kept only while it saves at least 5%
of its own benchmark (`python -m tests.bench_fast`; docs/speed.md has the rows):

    plain (what the tutorial teaches)          fast twin (here)
    cache.Cache.update (torch.cat)             Reserved.update: appended in place into owned free slots
    cache.Cache.attend (torch's fused kernel)  Reserved.attend: one bf16/fp16 query, a CPU without AMX, in float32
    nn.Linear's forward (F.linear)             one_row_linears: one bf16/fp16 row, a CPU with AMX, as torch.mv
    decode.generate                            generate: one Reserved copy, then appends in place
    stats.add_batches (Sums.add_, float64)     add_batches: centered float32 products, upper part, Pending
    Mapper.apply / Mapper.map_layer            apply / map_layer: tiles, one GEMM with the bias, in place
    rope.rotate (in apply)                     rotate_into: float32, no cat or neg, rounded once into the cache
    (glibc's default malloc)                   keep_freed_memory: a freed cache's memory kept for the next

Which path runs is one switch, the keyword `plain`, with one default everywhere: the fast twins.
Three functions here branch on it: map_cache (Mapper.apply or apply), generate (decode.generate or the
reserved-cache one) and adder (stats.add_batches or add_batches); a fourth branch is handoff.take_over's, which
runs the last token inside one_row_linears unless plain. Every function that calls them (handoff,
take_over, diagnose, kvt.generate, evals' conditions, hf.transfer; calibrate in its Run) takes `plain=False`
and passes it down. A Reserved cache brings its own attention (Reserved.attend), so the model's files hold no hook
for it. The entry points (run.py, kvt bench, the serving connector, lm_eval) set plain=True for
--plain (or KVT_PLAIN=1 in the environment, read by them alone).
"""
import ctypes
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import partial

import torch

from kvt import decode
from kvt import rope
from kvt.cache import Cache
from kvt.capture import layer_features, unfeatures
import kvt.stats
from kvt.stats import KINDS, Sums, batch_features, groups

# ---- the cache: appended in place (gpt-fast's k_out[:, :, input_pos] = k_val) --------------------------


@dataclass
class Reserved(Cache):
    """A Cache that owns `room` free slots per layer after its T: a step of t <= room tokens writes its
    keys and values there in place, where Cache.update's torch.cat copies all T slots at every step.
    Used once: continue from the cache each step returns (generate does), since a second step from the
    same one would write into the same free slots. select, expand, crop and to return plain Caches, and
    so does a step with no room left (grow), which then runs the plain update and attention."""
    room: int = 0

    def grow(self, positions, mask, full):
        t = positions.shape[1] - len(self)                      # this step's new slots
        new = super().grow(positions, mask, full)
        if t > self.room:                                       # no room for them: the plain update
            return Cache(**{f.name: getattr(new, f.name) for f in fields(Cache)})
        new.room = self.room - t
        return new

    def update(self, l, k, v, slots=None):
        if slots is not None:
            return super().update(l, k, v, slots)
        self.keys[l], self.values[l] = append_in_place(self.keys[l], k), append_in_place(self.values[l], v)
        return self.keys[l], self.values[l]

    def attend(self, q, k, v, attn_mask, causal):
        """Cache.attend, with one bf16 or fp16 query on a CPU without AMX (a decode step, the handoff's
        last token) in one_query_attention, where torch's fused CPU kernel is slow for a single query."""
        if one_token_step(q) and not AMX:
            return one_query_attention(q, k, v, attn_mask)
        return super().attend(q, k, v, attn_mask, causal)


def reserve(cache, n):
    """A copy of cache (a Reserved) whose every layer owns room for n more slots."""
    def grow(t):                                                   # (B, Hkv, T, D) -> view of (B, Hkv, T + n, D)
        buf = t.new_empty(t.shape[0], t.shape[1], t.shape[2] + n, t.shape[3])
        buf[:, :, :t.shape[2]] = t
        return buf[:, :, :t.shape[2]]
    return Reserved([grow(k) for k in cache.keys], [grow(v) for v in cache.values], cache.positions, cache.mask,
                    full=cache.full, room=n)


def append_in_place(past, new):
    """past (B, Hkv, T, D) followed by new (B, Hkv, t, D), written into past's buffer, which must own room
    for t more slots (reserve)."""
    T, t = past.shape[2], new.shape[2]      # past is the first T slots of a longer buffer: the same strides,
    whole = past.as_strided((*past.shape[:2], T + t, past.shape[3]), past.stride(), past.storage_offset())
    whole[:, :, T:] = new                   # T + t long, reach into it
    return whole


def keep_freed_memory():
    """Make glibc's malloc keep freed blocks of up to 32 MiB (its largest mmap threshold) in the heap for
    reuse, and never trim the heap back below 2 GiB, so that a cache of the size of the last ones costs
    no page faults (glibc hands a large freed block back to the system, and the next one of that size
    is written into fresh pages). For this process only: entry points call it (kvt bench, run.py), as a
    serving engine keeps a KV pool, never a library import. A no-op returning False without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3                   # glibc's malloc.h
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1))


# ---- the model: one token's step, and decoding ----------------------------------------------------------
#
# One token's step (a decode step, the handoff's last token) reads every weight and the whole cache
# once, and which kernels read them fastest in bf16 depends on the CPU (docs/speed.md, issue #57). On
# an AMD EPYC without AMX, one_query_attention beats torch's fused kernel and F.linear beats torch.mv;
# on an Intel Xeon with AMX tiles both go the other way (torch.mv 1.2-1.6x as fast as F.linear for one
# row, whose oneDNN kernel is slow there). AMX picks which: tests set it both ways.
AMX = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def one_token_step(x):
    """True for the input of a one-token bf16/fp16 step on a CPU: one row (a query (B, H, 1, D), a
    linear's (1, 1, C))."""
    return x.shape[-2] == 1 and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)


def one_row_linear(linear, x):
    """linear(x); for a one-row bf16/fp16 x (1, 1, C) on a CPU with AMX, torch.mv (the same float32
    accumulation, rounded once; kvt's models have no biases)."""
    if AMX and linear.bias is None and x.numel() == x.shape[-1] and one_token_step(x):
        return torch.mv(linear.weight, x.reshape(-1)).view(*x.shape[:-1], -1)
    return torch.nn.functional.linear(x, linear.weight, linear.bias)


@contextmanager
def one_row_linears(model):
    """Inside it, every nn.Linear of model runs one_row_linear (its forward, for this model only)."""
    mine = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and "forward" not in vars(m)]
    for m in mine:
        m.forward = partial(one_row_linear, m)
    try:
        yield model
    finally:
        for m in mine:
            del m.forward


def one_query_attention(q, k, v, attn_mask=None):
    """Attention of one query q (B, H, 1, D) over k, v (B, Hkv, S, D) in float32: the H / Hkv query heads
    that share a KV head as the rows of one product with its keys, a softmax, a product with its
    values, rounded once. attn_mask: None or bool (B, 1, 1, S), True = attend."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    scores = q.reshape(B, Hkv, H // Hkv, D).float() @ k.float().transpose(-1, -2) * D ** -0.5  # (B, Hkv, H/Hkv, S)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype).view(B, H, 1, D)


def generate(model, logits, cache, max_new_tokens, plain=False, **kw):
    """Greedy decoding, decode.generate's (its keywords in kw): by default from one copy of the cache that
    owns room for every new token (reserve), each step appended in place and attended by
    Reserved.attend, its linears in one_row_linears; plain: decode.generate itself, on `cache`."""
    if plain:
        return decode.generate(model, logits, cache, max_new_tokens, **kw)
    with one_row_linears(model):
        return decode.generate(model, logits, reserve(cache, max(0, max_new_tokens - 1)), max_new_tokens, **kw)


# ---- calibration statistics: centered float32 products, held between flushes --------------------------

CHUNK = 256        # features per row chunk of the upper part of xx
FLUSH = 8192       # tokens of products held in the products' dtype before they are added to the sums


def path_line(plain=False):
    """The line run.py prints first and report.md keeps: which path ran, the fast twins or the plain one."""
    if plain:
        return ("path: plain (--plain): every step runs the reading order's own functions (Sums.add_, Mapper.apply, "
                "Cache.update and Cache.attend, decode.generate); no twin of kvt/fast.py runs")
    return ("path: fast twins (kvt/fast.py, each tested equal to its plain function): fast.add_batches for Sums.add_, "
            "fast.apply for Mapper.apply, a reserved cache for Cache.update; --plain runs the reading order's own")


def adder(plain=False):
    """How calibration adds its batches to the statistics: stats.add_batches (float64 products) when
    plain, else its twin add_batches."""
    return kvt.stats.add_batches if plain else add_batches


def add_batches(stats, stream, products=torch.float32):
    """stats.add_batches, faster: each batch through add_batch into Pending products, all of them
    flushed at the end (so a caller that adds its batches in runs, as the harness's resumable
    accumulate does, flushes where each run ends). products: their dtype
    (functools.partial(add_batches, products=torch.float64) for float64 ones). Returns stats."""
    pending = {}
    for split, src_kv, tgt_kv in stream:
        add_batch(stats, split, src_kv, tgt_kv, pending, products)
    flush(pending.values())
    return stats


def add_batch(stats, split, src_kv, tgt_kv, pending, products=torch.float32):
    """One batch of stats.add_batches, through `pending` (the caller's dict of Pending, one per sums; flush(pending.values())
    completes the sums), what is pending for the other split flushed first, so that one split's
    products are held at a time."""
    flush(p for name, p in pending.items() if not name.endswith(split))
    for name, x, y in batch_features(stats, split, src_kv, tgt_kv):
        pending.setdefault(name, Pending(stats.sums[name], products)).add_(x, y)


def flush(pending):
    """Add what each Pending of `pending` holds back to its sums (Pending.flush_)."""
    for p in pending:
        p.flush_()


def holds(device, dtype, products=torch.float32):
    """Whether float32 products are held apart from sums of `dtype` on `device` (Pending; the memory plan,
    harness/plan.py, counts them): on a CPU, where adding them to float64 sums batch by batch cost as
    much as the products themselves."""
    return torch.device(device).type == "cpu" and dtype != products


def add_fast_(sums, x, y, products=torch.float32):
    """Sums.add_, faster: x and y centered on their batch mean, the products in `products` (upper part of
    xx only, then mirrored), the mean's share added back in the sums' dtype. Returns sums."""
    return Pending(sums, products, hold=False).add_(x, y).flush_()


class Pending:
    """Products of a few batches in the products' dtype, centered on one shift m (the first batch's mean),
    added to `sums` every FLUSH tokens and by flush_(), the shift's share added back exactly in the sums'
    dtype:  sum x x^T = sum xc xc^T + n m m^T + m s^T + s m^T  (xc = x - m, s = sum xc). The products then
    run in float32 on numbers of the size of the features' spread, not of their mean. On a CPU (holds())
    the float64 sums are read and written once per flush, not once per batch; elsewhere (a GPU, whose
    memory goes to the statistics) the products go into the sums batch by batch and only the shift's
    share waits. Until flush_(), `sums` lacks what is pending."""

    def __init__(self, sums, products=torch.float32, hold=None):
        self.sums, self.products, self.buf = sums, products, None
        self.hold = holds(sums.xx.device, sums.xx.dtype, products) if hold is None else hold

    def add_(self, x, y):
        """Add tokens x (G, N, F) and y (G, N, O), centered on the shift."""
        p, s = self.products, self.sums
        if self.buf is None:
            self.mx, self.my = x.mean(1, keepdim=True).to(p), y.mean(1, keepdim=True).to(p)
            (G, _, F), O = x.shape, y.shape[2]
            zeros = lambda *shape: torch.zeros(shape, dtype=p, device=x.device)
            self.buf = Sums(zeros(G, F, F) if self.hold else s.xx, zeros(G, F, O) if self.hold else s.xy,
                            zeros(G, F), zeros(G, O), zeros(G, O), zeros())    # not held: into the sums
        add_raw_(self.buf, x.to(p) - self.mx, y.to(p) - self.my)
        if self.buf.n >= FLUSH:
            self.flush_()
        return self

    def flush_(self):
        """Add what is pending to the sums, and mirror the upper part of their xx onto its lower part, so
        that they hold the full sum x x^T again (stats.Sums); returns them."""
        if self.buf is not None:
            add_shifted_(self.sums, self.buf, self.mx, self.my)
            mirror_(self.sums.xx)
            self.buf = None
        return self.sums


def add_raw_(sums, x, y):
    """Add tokens x (G, N, F) and y (G, N, O) as they are: the products in x's dtype (of xx its upper part,
    rows in chunks of CHUNK features, each from its own diagonal on), added in the sums' dtype."""
    xt = x.transpose(1, 2)                                             # (G, F, N)
    for i in range(0, x.shape[2], CHUNK):                              # rows i:i+CHUNK, columns i:
        _addmm(sums.xx[:, i:i + CHUNK, i:], xt[:, i:i + CHUNK], x[:, :, i:])
    _addmm(sums.xy, xt, y)                                             # (G, F, N) @ (G, N, O)
    sums.sx += x.sum(1)
    sums.sy += y.sum(1)
    sums.syy += (y * y).sum(1)
    sums.n += x.shape[1]
    return sums


def mirror_(xx):
    """Copy the upper part of xx (G, F, F) onto its lower part, in place, CHUNK rows at a time (no F x F
    temporary): the full symmetric sum from the upper part that add_raw_ fills. Returns xx."""
    F = xx.shape[-1]
    for i in range(0, F, CHUNK):
        j = min(i + CHUNK, F)
        xx[:, j:, i:j] = xx[:, i:j, j:].transpose(1, 2)               # below the diagonal block, from above it
        d = xx[:, i:j, i:j]                                            # the diagonal block
        d.copy_(d.triu() + d.triu(1).transpose(1, 2))
    return xx


def _addmm(out, a, b):
    """out += a @ b, batched; in place when a and b have out's dtype already, else the product in theirs,
    added in out's."""
    if a.dtype == out.dtype:
        out.baddbmm_(a, b)
    else:
        out.add_(torch.bmm(a, b))


def add_shifted_(sums, other, mx, my):
    """Add `other`, sums of x - mx and y - my (in any dtype; mx (G, 1, F), my (G, 1, O)), to sums as sums
    of x and y, in sums' dtype:  sum x x^T = sum xc xc^T + n m m^T + m s^T + s m^T  (s = sum xc)."""
    dt, n = sums.sx.dtype, other.n.to(sums.sx.dtype)
    mx, my = mx.to(dt), my.to(dt)
    sxc, syc = other.sx.to(dt)[:, None], other.sy.to(dt)[:, None]     # (G, 1, F), (G, 1, O)
    ux, uy = n * mx + sxc, n * my + syc                                # = sum x, sum y
    a = torch.cat([mx, sxc], 1).transpose(1, 2)                       # (G, F, 2): one rank-2 update each
    if other.xx is not sums.xx:                                        # (else its products are in sums)
        sums.xx.add_(other.xx)
        sums.xy.add_(other.xy)
    sums.xx.baddbmm_(a, torch.cat([ux, mx], 1))                        # + n m m^T + m s^T + s m^T
    sums.xy.baddbmm_(a, torch.cat([uy, my], 1))
    sums.sx += ux[:, 0]
    sums.sy += uy[:, 0]
    sums.syy += other.syy.to(dt) + (2 * syc + n * my)[:, 0] * my[:, 0]  # sum (yc + m)^2
    sums.n += other.n.to(sums.n.dtype)
    return sums


# ---- the map: one GEMM per tile, rotated straight into the new cache ----------------------------------

TILE = 256  # tokens per tile of the map on a CPU: its gathered features (G, TILE, k*Bx) fit an L3 cache
AMX_TILE = 4096  # the same for bf16/fp16 features on a CPU with AMX: 6-14% faster there (docs/speed.md)


def tile_tokens(dtype):
    """Tokens per tile of the map on a CPU, for features of dtype."""
    return AMX_TILE if AMX and dtype in (torch.bfloat16, torch.float16) else TILE


def map_cache(mapper, src_cache, devices=None, dtype=None, room=0, plain=False):
    """The target's cache for a source cache (devices, dtype: Mapper.apply's): by default apply's, a
    Reserved owning `room` free slots for the target's next step; plain: Mapper.apply's, a plain Cache."""
    if plain:
        return mapper.apply(src_cache, devices=devices, dtype=dtype)
    return apply(mapper, src_cache, devices=devices, dtype=dtype, room=room)


@torch.no_grad()
def apply(mapper, src_cache, positions=None, devices=None, dtype=None, room=0):
    """mapper.apply(src_cache, positions, devices, dtype), faster: the source keys stripped straight into
    the features' layout, then each target layer mapped by map_layer into a new cache that owns `room`
    slots after its T (a Reserved), so that the target's next step appends in place. Each source
    layer's features move at most once to each device that needs them. A bf16 mapper's GEMM accumulates
    in float32; rotations run in float32 or better and round once to their output's dtype."""
    s, t = mapper.src_cfg, mapper.tgt_cfg
    B, T = src_cache.positions.shape
    pos = src_cache.positions if positions is None else positions
    devices = [torch.device(d) for d in devices or mapper.devices(src_cache.keys[0].device)]
    work, out_dtype = mapper.W["k"][0].dtype, dtype or src_cache.keys[0].dtype
    exact = torch.promote_types(work, torch.float32)                     # what rotations compute in
    src_rope, tgt_rope = rotation(s, src_cache.positions, exact, inverse=True), rotation(t, pos, exact)
    used = {kind: sorted(set(mapper.layers[kind].flatten().tolist())) for kind in KINDS}  # source layers read
    G, Bx, By = groups(s, t, mapper.scope)

    def stripped(k):  # keys (B, Hkv, T, D), RoPE stripped, written straight into features (G, N, Bx)
        x = torch.empty(G, B * T, Bx, dtype=work, device=k.device)
        rotate_into(unfeatures(x, mapper.scope, B, T, s.n_kv_heads, s.head_dim), k, *src_rope(k.device))
        return x

    xs = {"k": {l: stripped(src_cache.keys[l]) for l in used["k"]},
          "v": {l: layer_features(src_cache.values[l].to(work), mapper.scope) for l in used["v"]}}
    keys, values = [None] * t.n_layers, [None] * t.n_layers
    for d in dict.fromkeys(devices):                                     # each device once, in layer order
        here = [l for l in range(t.n_layers) if devices[l] == d]
        for kind, out in (("k", keys), ("v", values)):
            need = sorted({src for l in here for src in mapper.layers[kind][l].tolist()})
            x = {src: xs[kind][src].to(d) for src in need}               # each source layer moved once to d
            for l in here:
                buf = torch.empty(B, t.n_kv_heads, T + room, t.head_dim, dtype=out_dtype, device=d)
                out[l] = buf[:, :, :T]                                   # (B, Hkv, T, D), room slots after it
                map_layer(mapper, kind, l, x, out[l], tgt_rope(d) if kind == "k" else None)
    return Reserved(keys, values, pos.to(devices[0]).clone(), src_cache.mask.to(devices[0]).clone(),
                    full=src_cache.full, room=room)


def map_layer(mapper, kind, l, xs, out, cos_sin=None):
    """mapper.map_layer written into out (B, Hkv, T, D), rotated by cos_sin (the target's RoPE; keys) when
    given, a tile of TILE tokens of one sequence at a time on a CPU, so the tile's features and its
    outputs stay in the CPU's cache between the GEMM and the rotation. Each tile reads all of W again,
    which pays while W is the smaller operand (By < TILE: head scope); layer scope's W (k*Hkv*D, Hkv*D)
    is larger, and there, as on a GPU, the whole batch is one tile. Per tile: the k selected layers'
    features side by side (one torch.cat), then x @ W + b as one baddbmm in the features' dtype (for
    bf16 the sum over the k layers accumulates in float32 inside it and is rounded once; k GEMMs of one
    layer each, beta = 1, reading each layer where it lies, would save the copy but round the running
    sum after each layer, and in float32 they were no faster: docs/speed.md), then written into out,
    keys rotated on the way (rotate_into); with an MLP, mapper.map_layer on the tile."""
    sel = mapper.layers[kind][l].tolist()
    x0 = xs[sel[0]]
    G, N, Bx = x0.shape
    B, Hkv, T, D = out.shape
    W, b = mapper.W[kind][l].to(x0), mapper.b[kind][l].to(x0)[:, None]  # (G, k*Bx, By), (G, 1, By)
    tile = tile_tokens(x0.dtype) if out.device.type == "cpu" and W.shape[-1] < TILE else T  # each tile reads W again
    spans = ([(r, 1, t0, min(tile, T - t0)) for r in range(B) for t0 in range(0, T, tile)] if tile < T
             else [(0, B, 0, T)])                                       # (first row, rows, first slot, slots)
    for r, rows, t0, n in spans:
        n0, m = r * T + t0, rows * n                                      # features n0 .. n0 + m
        if mapper.mapper != "ridge":
            y = mapper.map_layer(kind, l, {src: xs[src][:, n0:n0 + m] for src in sel})
        else:
            x = torch.cat([xs[src][:, n0:n0 + m] for src in sel], dim=-1)  # (G, m, k*Bx)
            y = torch.baddbmm(b, x, W)                                    # (G, m, By)
        y = unfeatures(y, mapper.scope, rows, n, Hkv, D)                  # (rows, Hkv, n, D)
        o = out[r:r + rows, :, t0:t0 + n]
        if cos_sin is None:
            o.copy_(y)
        else:
            rotate_into(o, y, *(c[r:r + rows, :, t0:t0 + n] for c in cos_sin))  # rounded once to the cache's dtype


def rotate_into(out, x, cos, sin):
    """out = rope.rotate(x, cos, sin), computed in cos's dtype and rounded once to out's (out: any dtype,
    any strides, e.g. a view into a cache): x * cos, then each half's share of the other added in
    place, x1 cos - x2 sin and x2 cos + x1 sin, without rotate_half's negation and concatenation.
    Returns out."""
    h = x.shape[-1] // 2
    x = x.to(cos.dtype)
    y = x * cos
    y[..., :h].addcmul_(x[..., h:], sin[..., :h], value=-1)    # rotate_half(x)[:h] = -x2
    y[..., h:].addcmul_(x[..., :h], sin[..., h:])              # rotate_half(x)[h:] = x1
    return out.copy_(y)


def rotation(cfg, pos, dtype, inverse=False):
    """device -> (cos, sin) of cfg's RoPE at positions pos (B, T), computed once and copied once to each
    device asked for; inverse: the rotation that strips RoPE (strip_cos_sin)."""
    inv, scale = rope.frequencies(cfg)
    cos, sin = (strip_cos_sin if inverse else rope.cos_sin)(pos, inv, scale, dtype)   # (B, 1, T, D)
    made = {}

    def on(device):
        if device not in made:
            made[device] = cos.to(device), sin.to(device)
        return made[device]
    return on


def strip_cos_sin(pos, inv_freq, scale, dtype):
    """cos and sin of the rotation by -pos with the scale divided out: rope.rotate(y, *strip_cos_sin(...))
    is rope.strip(y) without its division by cos^2 + sin^2, equal to it up to rounding (that sum is 1
    exactly in exact arithmetic). The inverse precomputed once for many rotations (apply)."""
    cos, sin = rope.cos_sin(pos, inv_freq, 1 / scale, dtype)
    return cos, -sin
