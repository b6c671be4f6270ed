"""The KV cache: plain data, passed in and out of the model, never hidden inside it.

For every layer l it holds keys[l] and values[l] of shape (B, Hkv, T, D). Keys are stored AFTER RoPE,
as a serving engine stores them, so each key carries its position; `positions` records those
positions and `mask` which slots hold real tokens (False marks left padding). A transfer produces
exactly this object for the target model, which then simply continues from it. kvt's model stores
each layer head by head, contiguous (B, Hkv, T, D), the order in which the mapper reads it.

Who owns the memory. keys[l] may be a view: select, expand and crop return caches that share
storage with the original (scoring n continuations of one context, or a prefix of a longer cache,
costs no copy), so nothing may write into a cache's tensors in place unless it owns them. reserve(n)
makes a cache that does: its tensors are the first T slots of buffers of T + n slots, `room` slots
beyond them are free, and the model appends a step's keys and values there in place (the gpt-fast
way) instead of concatenating, which would copy all T slots at every step of a decode. Such a cache is
used once: continue from the cache each step returns (generate does), since a second step from the
same one would write into the same free slots. Every other cache has room 0, and the model then
concatenates into new tensors, leaving the old ones untouched.

Where the memory comes from. On Linux, glibc's malloc hands a large freed block back to the system, so
the next cache of that size is written into fresh pages, each one a page fault. keep_freed_memory()
makes this process keep blocks up to 32 MiB for reuse (kvt's commands call it, as a serving engine
keeps a KV pool).

A cache as a file (save_kv, load_kv): one sequence's keys and values per layer, its positions and token
ids, and the fingerprints of the model and tokenizer that made it, as safetensors; what a source serving
engine writes for a target engine's connector to map (kvt/serving.py).
"""
import ctypes
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from kvt.config import KvtError
from kvt.weights import write_safetensors


def keep_freed_memory():
    """Make glibc's malloc keep freed blocks of up to 32 MiB (its largest mmap threshold) in the heap for
    reuse, and never trim the heap back below 2 GiB, so that a cache of the size of the last ones costs
    no page faults (a one-off count: about 90K per mapping of 4K tokens, qwen3-0.6b -> 1.7b head scope
    in bf16, without it). For this process only; a no-op returning False without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3                   # glibc's malloc.h
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1))


@dataclass
class Cache:
    keys: list          # L x (B, Hkv, T, D), post-RoPE
    values: list        # L x (B, Hkv, T, D)
    positions: torch.Tensor  # (B, T) long
    mask: torch.Tensor       # (B, T) bool, True = real token
    queries: list | None = None  # L x (B, H, T, D) post-RoPE queries, only when asked for (diagnostics)
    room: int = 0       # free slots this cache owns after its T (reserve); 0: it owns no spare memory
    full: bool = False  # known to hold no padding (mask all True), so decode needs no attention mask

    def __len__(self):
        return self.positions.shape[1]

    @property
    def next_positions(self):
        """(B,) the position the next token of each row takes: the count of real tokens so far."""
        return self.mask.sum(1)

    def _map(self, fn, time_fn=None):
        """A new Cache with fn applied to every tensor (keys/values/queries on dim 0 and 2, the rest on 0/1).
        It owns no room: its tensors may be views of this cache's."""
        queries = None if self.queries is None else [fn(q) for q in self.queries]
        return Cache([fn(k) for k in self.keys], [fn(v) for v in self.values],
                     (time_fn or fn)(self.positions), (time_fn or fn)(self.mask), queries, 0, self.full)

    def select(self, idx):
        """Rows idx of the batch."""
        return self._map(lambda t: t[idx])

    def expand(self, n):
        """A batch-1 cache repeated n times (views, no copy): one context, n continuations."""
        assert self.positions.shape[0] == 1, "expand needs a batch-1 cache"
        return self._map(lambda t: t.expand(n, *t.shape[1:]))

    def crop(self, t0, t1):
        """Time slots [t0, t1)."""
        return self._map(lambda t: t[:, :, t0:t1], time_fn=lambda t: t[:, t0:t1])

    def to(self, device=None, dtype=None):
        def move(t):
            return t.to(device=device, dtype=dtype if t.is_floating_point() else None)
        return self._map(move)

    def reserve(self, n):
        """A copy that owns room for n more slots per layer: the model then appends in place."""
        def grow(t):                                                   # (B, Hkv, T, D) -> view of (B, Hkv, T + n, D)
            buf = t.new_empty(t.shape[0], t.shape[1], t.shape[2] + n, t.shape[3])
            buf[:, :, :t.shape[2]] = t
            return buf[:, :, :t.shape[2]]
        return Cache([grow(k) for k in self.keys], [grow(v) for v in self.values], self.positions, self.mask,
                     None, n, self.full)


def append_in_place(past, new):
    """The fast path's cache update: past (B, Hkv, T, D) followed by new (B, Hkv, t, D), written in place
    into past's buffer, which must own room for t more slots (reserve; see the module docstring). The
    plain update, torch.cat([past, new], dim=2), copies all T slots at every step."""
    T, t = past.shape[2], new.shape[2]      # past is the first T slots of a longer buffer: the same strides,
    whole = past.as_strided((*past.shape[:2], T + t, past.shape[3]), past.stride(), past.storage_offset())
    whole[:, :, T:] = new                   # T + t long, reach into it: k_out[:, :, input_pos] = k_val
    return whole


def empty(n_layers, batch, device=None):
    """A cache with no slots yet."""
    none = torch.empty(batch, 0, dtype=torch.long, device=device)
    return Cache([None] * n_layers, [None] * n_layers, none, none.bool(), full=True)


# ---- a cache as a file: what a serving engine saves for another to load (kvt/serving.py) -----------------

KV_FORMAT = "kvt-kv-1"


def save_kv(path, cache, ids, model_fingerprint, tokenizer_fingerprint):
    """Write a batch-1 Cache of T slots (keys after RoPE, positions 0..T-1) and its T token ids (list of
    int) as safetensors, atomically, with the source model's and tokenizer's fingerprints."""
    tensors = {"ids": torch.tensor(ids, dtype=torch.long), "positions": cache.positions[0].cpu().contiguous()}
    for l, (k, v) in enumerate(zip(cache.keys, cache.values)):
        tensors[f"k.{l}"], tensors[f"v.{l}"] = k[0].cpu().contiguous(), v[0].cpu().contiguous()  # (Hkv, T, D)
    write_safetensors(tensors, path, {"format": KV_FORMAT, "model": model_fingerprint,
                                      "tokenizer": tokenizer_fingerprint, "layers": str(len(cache.keys))})


def kv_header(path):
    """(metadata dict, token ids LongTensor (T,)) of a KV file, without reading its KV; KvtError if it is none."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            ids = f.get_tensor("ids") if "ids" in f.keys() else None
    except (SafetensorError, OSError) as e:
        raise KvtError(f"{path} is not a readable KV file ({str(e).splitlines()[0]}); save it again from the source")
    if meta.get("format") != KV_FORMAT or ids is None:
        raise KvtError(f"{path} is not a kvt KV file (format {meta.get('format', 'unknown')}, need {KV_FORMAT}); "
                       "save it with kvt.cache.save_kv or the connector's source side")
    return meta, ids


def load_kv(path, n=None):
    """The batch-1 Cache of the first n slots (default all) of a KV file."""
    meta, _ = kv_header(path)
    t = load_file(str(path))
    L = int(meta["layers"])
    n = n or t["positions"].shape[0]
    keys = [t[f"k.{l}"][None, :, :n] for l in range(L)]                       # L x (1, Hkv, n, D)
    values = [t[f"v.{l}"][None, :, :n] for l in range(L)]
    return Cache(keys, values, t["positions"][None, :n], torch.ones(1, n, dtype=torch.bool), full=True)
