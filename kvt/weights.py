"""Load a Hugging Face safetensors checkpoint (one file or sharded) into a model, tensor by tensor.

Each tensor is read from its memory-mapped file straight into the parameter it belongs to, a block
of rows at a time, cast to the model's dtype on the way: loading never holds a second copy of the
model, nor of its largest tensor (SmolLM2's embedding is a fifth of the model). Names are the
checkpoint's own (model.py's modules follow them); the only renames live in `LAYOUTS`. Every tensor
of the checkpoint is accounted for: one the model lacks, or one the model has and the checkpoint
does not, is an error naming it, except the parts kvt knowingly leaves aside (`LEFT_ASIDE`).
"""
import hashlib
import json
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvt.config import KvtError, download_hint


def shard_files(path):
    """{tensor name: file} for a checkpoint folder, from model.safetensors.index.json or model.safetensors."""
    path = Path(path)
    if not path.is_dir():
        raise KvtError(f"no checkpoint folder {path}; get it with: {download_hint(path)}")
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise KvtError(f"{index} is not a JSON object ({e}); download it again with: {download_hint(path)}")
        if not (isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())):
            raise KvtError(f"{index} has no weight_map of tensor names to files; download it again with: "
                           f"{download_hint(path)}")
        missing = sorted({f for f in weight_map.values() if not (path / f).exists()})
        if missing:
            raise KvtError(f"{path}: shard {missing[0]} is missing ({len(missing)} of "
                           f"{len(set(weight_map.values()))}); download again with: {download_hint(path)}")
        return {name: path / f for name, f in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise KvtError(f"{path} has no model.safetensors (nor an index); get it with: {download_hint(path)}")
    return {name: single for name in _open(single).keys()}


def fingerprint(path):
    """A short hex id of a checkpoint's files: the sha256 of every byte of each safetensors file, the
    header included, so an edit of any value (one row of the embedding) gives another id. It reads the
    whole checkpoint once, its shards in parallel; loading reads it next, from the page cache where
    memory holds it. SmolLM2-135M's 538 MB: about 0.5 s warm (sha256 runs at 1.3 GB/s a core). A 14B
    checkpoint's 30 GB in 8 shards: what the disk takes to read them (15 s at 2 GB/s), 23 s on one core."""
    files = sorted(set(shard_files(path).values()))
    with ThreadPoolExecutor() as pool:                      # hashlib lets go of the GIL: one core per shard
        digests = list(pool.map(file_sha256, files))
    h = hashlib.sha256()
    for f, digest in zip(files, digests):
        h.update(f"{f.name} {digest}".encode())
    return h.hexdigest()[:12]


def file_sha256(file):
    """The sha256 of a file's bytes, in hex."""
    with open(file, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


# ---- the weights a KV cache depends on, fingerprinted (a mapper records its pair's) --------------------
#
# Two ids of the same tensors. The digest ("d1:"), every value of every tensor, is what binds a mapper to
# its pair: taken where the values are read anyway (load_weights, once each tensor is in) and kept on the
# model with each tensor's stamp, so a model is hashed once, and again only where a tensor was replaced or
# written in place. The sampled id ("w2:"), 8 values a row, is the cheap one, for where only a sample can
# be afforded; a mapper file older than the digests is checked by it, and a KV file carries both.

KV_TENSORS = ("embed_tokens.weight", "layers.")  # under the decoder: what shapes the cache (not the final norm, nor the head)
SCHEME = "w2"          # prefixes every sampled id, "w2:<16 hex>"; w1 (unprefixed, kvt 0.2.0): 4 x 16 values a tensor
DIGEST = "d1"          # prefixes every digest, "d1:<16 hex>": every value
SAMPLE_COLS = 8        # of each matrix: every row, at its 8 middle columns (one cache line a row: cheap in memory)
ROW_BLOCK = 1 << 24    # values read at a time from a checkpoint's tensor (64 MB in float32)
DIGEST_BLOCK = 1 << 18  # values a loading thread hashes at a time (its temporaries: 1 MB at most)
HASH_THREADS = 4        # at most, hashing while loading: 4 cores of sha256 (1-2 GB/s each) outrun most disks,
                        # and few threads keep few allocator arenas (loading stays within 1.2x: test_smollm2.py)
FP16_NORMAL = 2.0 ** -14                         # the smallest normal float16


def _decoder_name(name):
    """The decoder-relative name of a tensor ("layers.0.self_attn.k_proj.weight"), whatever prefix the
    checkpoint (LAYOUTS), kvt ("model.") or transformers gives it; None for tensors the cache does not read."""
    rest = next((name[len(p):] for p in PREFIXES if name.startswith(p)), None)
    return rest if rest is not None and rest.startswith(KV_TENSORS) else None


def _canonical(x):
    """x's values as the digest hashes them: rounded to bfloat16, magnitudes up to float16's smallest
    normal as 0 (-0.0 too; one fused op, hardshrink). A bf16 checkpoint gives the same values loaded in
    float32, bfloat16 or float16, a float32 one in float32 or bfloat16 (float16 rounds it differently)."""
    return torch.nn.functional.hardshrink(x.detach().to(torch.bfloat16), FP16_NORMAL)


def _samples(t, shape):
    """The values hashed from one tensor (a parameter or a safetensors slice of shape `shape`), in blocks:
    a 1-D tensor (a norm's weight, a bias) whole; a matrix, every row at its SAMPLE_COLS middle columns,
    ROW_BLOCK values at a time (a slice reads those alone)."""
    if len(shape) == 1:
        yield t[0:shape[0]]
        return
    rows, cols = shape                                                # every decoder tensor is 1-D or 2-D
    c0, step = max(0, (cols - SAMPLE_COLS) // 2), max(1, ROW_BLOCK // cols)
    for r in range(0, rows, step):
        yield t[r:r + step, c0:c0 + SAMPLE_COLS]                      # (step, SAMPLE_COLS)


def _rows(t, shape, block=ROW_BLOCK):
    """One tensor (a parameter or a safetensors slice of shape `shape`) whole, in blocks of `block` values."""
    step = max(1, block // math.prod(shape[1:]))
    for r in range(0, shape[0], step):
        yield t[r:r + step]


@torch.no_grad()
def weights_fingerprint(named):
    """The sampled id, "w2:<16 hex>", of the weights a KV cache depends on, from {name: tensor or
    safetensors slice}: the same for a checkpoint folder (folder_fingerprint) and for a model loaded
    from it (model_fingerprint), kvt's or transformers'. Tensors in the order of their decoder-relative
    names; of each matrix every row at its 8 middle columns, 1-D ones whole: an edit of one row changes
    the id, and a check reads a few values a row (SmolLM2-135M: 1.7M, 30 ms on a CPU core; Qwen3-14B
    shapes: 18M, 0.7 s); an edit of a few values elsewhere does not (the digest sees it). Values are
    hashed rounded to bfloat16, with magnitudes below float16's smallest normal as 0 (so dtypes match as
    for the digest, _canonical). Two trainings of one config (a base and its instruct model, a fine-tune, a
    function-preserving twin) get different ids."""
    h = hashlib.sha256()
    for key, name in sorted((k, n) for n in named if (k := _decoder_name(n)) is not None):
        t = named[name]
        shape = tuple(t.get_shape() if hasattr(t, "get_shape") else t.shape)
        h.update(f"{key} {shape}".encode())
        for x in _samples(t, shape):
            x = x.float().cpu().to(torch.bfloat16).float()
            x = torch.where(x.abs() < FP16_NORMAL, 0.0, x) + 0.0          # + 0.0: -0.0 hashes as 0.0
            h.update(x.numpy().tobytes())
    return f"{SCHEME}:{h.hexdigest()[:16]}"


def tensor_digest(blocks):
    """The sha256 (hex) of one tensor's values as _canonical reads them (2 bytes a value), from its blocks
    of whole rows in order: any block size gives the same digest."""
    h = hashlib.sha256()
    for x in blocks:
        h.update(_canonical(x).cpu().contiguous().view(torch.int16).numpy())   # bfloat16's 2 bytes a value
    return h.hexdigest()


def weights_digest(digests):
    """The digest, "d1:<16 hex>", of the weights a KV cache depends on, from {decoder-relative name:
    (shape, tensor_digest)}: every value of every tensor, so an edit of any one changes it."""
    h = hashlib.sha256()
    for key in sorted(digests):
        shape, digest = digests[key]
        h.update(f"{key} {tuple(shape)} {digest}\n".encode())
    return f"{DIGEST}:{h.hexdigest()[:16]}"


def comparable(recorded, scheme=SCHEME):
    """Can an id a mapper recorded be compared with this kvt's ids of `scheme` (SCHEME, DIGEST)? Not one of
    an older scheme (w1, unprefixed: it would differ for the very weights it was taken of) nor a missing one."""
    return isinstance(recorded, str) and recorded.startswith(f"{scheme}:")


def _slices(path):
    """{name: safetensors slice} of a checkpoint folder's decoder tensors."""
    files = shard_files(path)
    handles = {f: _open(f) for f in set(files.values())}
    return {name: handles[f].get_slice(name) for name, f in files.items() if _decoder_name(name) is not None}


def folder_fingerprint(path):
    """weights_fingerprint of a checkpoint folder, read through its safetensors headers and memory map:
    8 values a row, a block of rows at a time (from a cold disk, that is a page a row: most of the file)."""
    try:
        return weights_fingerprint(_slices(path))
    except (SafetensorError, OSError) as e:
        raise KvtError(f"{path}: cannot read its weights ({e}); the file is truncated, download it again")


@torch.no_grad()
def folder_digest(path):
    """weights_digest of a checkpoint folder: every value of its decoder tensors, read through the memory
    map a block of rows at a time (the serving connector's, of the folder its engine loads)."""
    try:
        return weights_digest({_decoder_name(name): (tuple(s.get_shape()), tensor_digest(_rows(s, s.get_shape())))
                               for name, s in _slices(path).items()})
    except (SafetensorError, OSError) as e:
        raise KvtError(f"{path}: cannot read its weights ({e}); the file is truncated, download it again")


def _stamp(p):
    """What says a tensor still holds the values it held when hashed: its storage address and version
    counter (torch counts every in-place write: copy_, add_, an indexed assignment, load_state_dict), dtype
    and shape. Writes behind torch's back (through .data, or a numpy view) are not counted. None for an
    inference tensor (made under torch.inference_mode), which has no version counter."""
    try:
        return p.data_ptr(), p._version, p.dtype, tuple(p.shape)
    except RuntimeError:
        return None


def _kept(model, what, stamp, compute):
    """compute(), or what it gave for `what` when its stamp was this one: kept on the model, in
    model.kvt_weights ({what: (stamp, value)}), so a model's tensors are hashed once while they hold."""
    kept = model.__dict__.setdefault("kvt_weights", {})
    if stamp is None or kept.get(what, (None,))[0] != stamp:
        kept[what] = (stamp, compute())
    return kept[what][1]


def _decoder_tensors(model):
    return [(name, p) for name, p in model.named_parameters() if _decoder_name(name) is not None]


@torch.no_grad()
def model_digest(model):
    """weights_digest of a loaded model's parameters (a kvt model, or a transformers one). Each tensor is
    hashed once: load_weights hashes it once it is in; a transformers model's, at its first check.
    A tensor replaced (model.to, place) or written in place since is hashed again (its _stamp changed);
    else a call walks the parameters and compares their stamps (SmolLM2-135M: tests/bench_weights.py)."""
    tensors = _decoder_tensors(model)
    stamps = tuple(_stamp(p) for _, p in tensors)
    return _kept(model, "digest", None if None in stamps else stamps, lambda: weights_digest(
        {_decoder_name(name): (tuple(p.shape), _kept(model, name, stamp, lambda p=p: tensor_digest(_rows(p, p.shape))))
         for (name, p), stamp in zip(tensors, stamps)}))


def model_fingerprint(model):
    """weights_fingerprint of a loaded model's parameters (a kvt model, or a transformers one), kept on the
    model while its tensors' stamps hold."""
    tensors = _decoder_tensors(model)
    stamps = tuple(_stamp(p) for _, p in tensors)
    return _kept(model, "sampled id", None if None in stamps else stamps, lambda: weights_fingerprint(dict(tensors)))


# ---- a mapper bound to its pair's weights ---------------------------------------------------------------

def weights_meta(source, target):
    """What every mapper kvt fits records of its pair's weights: their digests (src_digest, tgt_digest: every
    value) and sampled ids (src_weights, tgt_weights), which check_pair_weights compares with the models it meets."""
    return {"src_weights": model_fingerprint(source), "tgt_weights": model_fingerprint(target),
            "src_digest": model_digest(source), "tgt_digest": model_digest(target)}


SIDES = {"source": ("src_digest", "src_weights"), "target": ("tgt_digest", "tgt_weights")}


def other_weights(meta, side, digest, fingerprint):
    """(recorded, this) ids of the `side` ("source", "target") weights where a mapper (its meta) was fitted
    on others than those whose digest and sampled id are given (digest: a function giving it; fingerprint:
    likewise, asked only of a mapper without digests); None where they agree or nothing is recorded. The
    digests are compared where the mapper records them, else the sampled ids (unchecked() says so)."""
    d, w = SIDES[side]
    if comparable(meta.get(d), DIGEST):
        made, have = meta[d], digest()
    elif comparable(meta.get(w)):
        made, have = meta[w], fingerprint()
    else:
        return None
    return None if made == have else (made, have)


def unchecked(meta):
    """What a mapper (its meta) leaves unchecked of its pair's weights, or None: nothing (a mapper built by
    hand, or a file older than the fingerprints), or every value but a sample (a file older than the digests).
    bench.random_mapper's (meta "random") is bound to no weights by design: nothing to say."""
    if "random" in meta or all(comparable(meta.get(SIDES[side][0]), DIGEST) for side in SIDES):
        return None
    if all(comparable(meta.get(SIDES[side][1])) for side in SIDES):
        return ("records only sampled fingerprints of its pair's weights (a file older than kvt's digests), so an "
                "edit of a few values cannot be checked; calibrate again to have every value checked")
    if any(isinstance(meta.get(SIDES[side][1]), str) for side in SIDES):
        return ("records an older fingerprint of its pair's weights (kvt 0.2.0's, of 4 rows a tensor), so they "
                "cannot be checked; calibrate again to have them checked")
    return ("records no fingerprints of its pair's weights (a mapper built by hand, or a file older than them), "
            "so they cannot be checked; fit it with kvt.calibrate.calibrate or run.py to have them checked")


def warn_unchecked(mapper, name="the mapper"):
    """Print unchecked()'s line, once per mapper and its copies (meta["unchecked_warned"])."""
    why = unchecked(mapper.meta)
    if why and not mapper.meta.get("unchecked_warned"):
        print(f"warning: {name} {why}", file=sys.stderr)
        mapper.meta["unchecked_warned"] = True


def check_pair_weights(mapper, source, target, name="the mapper"):
    """Refuse, in one line naming the side, models whose weights are not those the mapper was fitted on:
    one config fits a base and its instruct model, a model and its fine-tune, a function-preserving twin,
    and the configs' fingerprints tell none of them apart. source, target: kvt or transformers models
    (None: not checked). Compares every value (model_digest: hashed once a model, so a check per request
    costs a walk over its parameters); a mapper that records less is checked on what it records, with a
    one-line warning once (warn_unchecked)."""
    for side, model in (("source", source), ("target", target)):
        other = model is not None and other_weights(mapper.meta, side, lambda: model_digest(model),
                                                    lambda: model_fingerprint(model))
        if other:
            raise KvtError(f"{name} was fitted on other {side} weights (fingerprint {other[0]}, this {side}'s "
                           f"{other[1]}; one config, other weights: a base and an instruct model, a fine-tune, or "
                           f"source and target swapped?); pass the {side} it was fitted on, or calibrate a mapper "
                           "for these models")
    if source is not None or target is not None:
        warn_unchecked(mapper, name)


def _open(file):
    try:
        return safe_open(file, framework="pt")
    except (SafetensorError, OSError) as e:
        raise KvtError(f"{file} is unreadable or truncated ({e}); download it again")


FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")  # safetensors' names of the dtypes a weight may be stored in

LEFT_ASIDE = (  # tensors kvt knowingly does not load (a checkpoint's other parts); anything else unused is an error
    "model.vision_tower.", "model.multi_modal_projector.",    # Ministral 3: the image encoder and its projector
    "vision_tower.", "multi_modal_projector.",                # the same, in the older multimodal layout
)

LAYOUTS = {  # cfg.prefix -> the (decoder prefix, lm_head name) pairs a checkpoint may use, in order
    "model.": [("model.", "lm_head.weight")],
    "model.language_model.": [("model.language_model.", "lm_head.weight"),            # Ministral 3 on the hub
                              ("language_model.model.", "language_model.lm_head.weight")],  # older multimodal layout
}


PREFIXES = sorted({p for layouts in LAYOUTS.values() for p, _ in layouts} | {"model."}, key=len, reverse=True)


def checkpoint_names(cfg, name):
    """kvt parameter name -> the checkpoint tensor names it may be stored under."""
    if name == "lm_head.weight":  # a tied head split from its embedding is loaded from the embedding
        tied = [prefix + "embed_tokens.weight" for prefix, _ in LAYOUTS[cfg.prefix]] if cfg.tie_embeddings else []
        return [head for _, head in LAYOUTS[cfg.prefix]] + tied
    return [prefix + name.removeprefix("model.") for prefix, _ in LAYOUTS[cfg.prefix]]


def _copy_in_chunks(param, src, chunk_bytes=8 << 20):
    """param <- src (a safetensors slice), a block of rows at a time: no full-size temporary is held.
    Returns False if a value is NaN or infinite (a damaged file: no trained weight is)."""
    step, finite = max(1, chunk_bytes // (param[0].numel() * 4)), True
    for i in range(0, param.shape[0], step):
        block = param[i:i + step].copy_(src[i:i + step])
        finite = finite and bool(block.sum().isfinite())  # NaN and inf survive a sum; checked while in cache
    return finite


def match_tensors(model, files, path):
    """{parameter name: checkpoint tensor name}, after checking that every tensor is accounted for: none
    of the model's is missing, and the checkpoint holds none that the config does not describe (extra
    layers, say) except the parts in LEFT_ASIDE."""
    found, missing = {}, []
    for name, _ in model.named_parameters():
        keys = [k for k in checkpoint_names(model.config, name) if k in files]
        if keys:
            found[name] = keys[0]
        else:
            missing.append(checkpoint_names(model.config, name)[0])
    tied = [prefix + "embed_tokens.weight" for prefix, _ in LAYOUTS[model.config.prefix]]
    used = set(found.values()) | (set(tied) if model.config.tie_embeddings else set())
    extra = sorted(k for k in files if k not in used and not k.startswith(LEFT_ASIDE)
                   and not (k.endswith("lm_head.weight") and model.config.tie_embeddings))
    cfg = model.config
    if missing:
        raise KvtError(f"{path}: {len(missing)} tensors that config.json implies are missing from the checkpoint "
                       f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); config.json says "
                       f"{cfg.n_layers} layers: is it this checkpoint's config, and is the download complete?")
    if extra:
        raise KvtError(f"{path}: the checkpoint holds {len(extra)} tensors config.json does not describe "
                       f"({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}); config.json says "
                       f"{cfg.n_layers} layers: use the config.json that came with these weights")
    return found


def check_outline(cfg, path):
    """The checkpoint holds the last layer config.json names, and its first query projection has the
    shape config.json implies: read from tensor names and one header, before even an empty model is built
    (a config of a million layers, or of a head dim of 2^40, whose RoPE table alone would not fit)."""
    files = shard_files(path)
    last = tuple(f"{prefix}layers.{cfg.n_layers - 1}." for prefix, _ in LAYOUTS[cfg.prefix])
    if not any(k.startswith(last) for k in files):
        raise KvtError(f"{path}: config.json says {cfg.n_layers} layers but {last[0]} is missing from the checkpoint; "
                       "is it this checkpoint's config, and is the download complete?")
    q = next((k for k in checkpoint_names(cfg, "model.layers.0.self_attn.q_proj.weight") if k in files), None)
    stored, implied = q and tuple(_open(files[q]).get_slice(q).get_shape()), (cfg.n_heads * cfg.head_dim, cfg.dim)
    if q and stored != implied:
        raise KvtError(f"{path}: {q} has shape {stored}, config.json implies "
                       f"{implied} ({cfg.n_heads} heads x head_dim {cfg.head_dim}, hidden_size {cfg.dim}); use the "
                       "config.json that came with these weights")


def check_checkpoint(model, path):
    """{parameter name: (file handle, tensor name)} after checking, from the safetensors headers alone (no
    tensor data is read), that every tensor is accounted for and has the shape config.json implies. `model`
    may live on the meta device, so a config that does not fit its weights is refused before anything is
    allocated."""
    files = shard_files(path)
    handles, out = {}, {}
    for name, key in match_tensors(model, files, path).items():
        if files[key] not in handles:
            handles[files[key]] = _open(files[key])
        try:
            stored, dtype = tuple(handles[files[key]].get_slice(key).get_shape()), handles[files[key]].get_slice(key).get_dtype()
        except (SafetensorError, OSError) as e:
            raise KvtError(f"{files[key]}: cannot read {key} ({e}); the file is truncated, download it again")
        if dtype not in FLOAT_DTYPES:
            raise KvtError(f"{path}: {key} is stored as {dtype}, not a float type; kvt loads unquantized (bf16/fp16/fp32) "
                           "checkpoints only: use the original weights")
        if stored != tuple(model.get_parameter(name).shape):
            raise KvtError(f"{path}: {key} has shape {stored}, config.json implies "
                           f"{tuple(model.get_parameter(name).shape)}; use the config.json that came with these weights")
        out[name] = (handles[files[key]], key)
    return out


@torch.no_grad()
def load_weights(model, path):
    """Copy every parameter of `model` from the checkpoint at `path` (tied lm_head shares embed_tokens),
    and hash each decoder tensor once it is in (model_digest's digests, kept on the model: a mapper's check
    then reads no weight again), in threads beside the copying, a tensor each (hashlib and torch let go of
    the GIL)."""
    kept, hashing = model.__dict__.setdefault("kvt_weights", {}), {}
    with ThreadPoolExecutor(min(HASH_THREADS, os.cpu_count() or 1)) as pool:
        for name, (handle, key) in check_checkpoint(model, path).items():
            p = model.get_parameter(name)
            try:
                finite = _copy_in_chunks(p, handle.get_slice(key))
            except (SafetensorError, OSError) as e:
                raise KvtError(f"{path}: cannot read {key} ({e}); the file is truncated, download it again")
            if not finite:
                raise KvtError(f"{path}: {key} holds NaN or infinite values; the file is damaged, download it again")
            if _decoder_name(name):
                hashing[name] = _stamp(p), pool.submit(tensor_digest, _rows(p, p.shape, DIGEST_BLOCK))
    kept.update({name: (stamp, job.result()) for name, (stamp, job) in hashing.items()})


def write_safetensors(tensors, path, metadata=None):
    """Write tensors to a safetensors file atomically (a .tmp file, then a rename), readable by all (0644)
    as the other files kvt writes are (safetensors itself makes its files 0600)."""
    from safetensors.torch import save_file
    tmp = f"{path}.tmp"
    save_file(tensors, tmp, metadata=metadata)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def save_model(model, path):
    """Write `model` as a Hugging Face checkpoint folder: config.json + model.safetensors (atomically)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    tensors = {checkpoint_names(cfg, n)[0]: p.detach().contiguous().cpu() for n, p in model.named_parameters()}
    write_safetensors(tensors, path / "model.safetensors", {"format": "pt"})  # a tied lm_head: not a parameter
    (path / "config.json.tmp").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    (path / "config.json.tmp").replace(path / "config.json")
