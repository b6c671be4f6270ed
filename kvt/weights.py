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
import os
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

KV_TENSORS = ("embed_tokens.weight", "layers.")  # under the decoder: what shapes the cache (not the final norm, nor the head)
SCHEME = "w2"          # prefixes every id, "w2:<16 hex>"; w1 (unprefixed, kvt 0.2.0): 4 rows x 16 columns a tensor
SAMPLE_COLS = 8        # of each matrix: every row, at its 8 middle columns (one cache line a row: cheap in memory)
ROW_BLOCK = 1 << 24    # values read at a time from a checkpoint's tensor (64 MB in float32)
FP16_NORMAL = 2.0 ** -14                         # the smallest normal float16


def _decoder_name(name):
    """The decoder-relative name of a tensor ("layers.0.self_attn.k_proj.weight"), whatever prefix the
    checkpoint (LAYOUTS), kvt ("model.") or transformers gives it; None for tensors the cache does not read."""
    prefixes = sorted({p for layouts in LAYOUTS.values() for p, _ in layouts} | {"model."}, key=len, reverse=True)
    rest = next((name[len(p):] for p in prefixes if name.startswith(p)), None)
    return rest if rest is not None and rest.startswith(KV_TENSORS) else None


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


@torch.no_grad()
def weights_fingerprint(named):
    """A short id, "w2:<16 hex>", of the weights a KV cache depends on, from {name: tensor or
    safetensors slice}: the same for a checkpoint folder (folder_fingerprint) and for a model loaded
    from it (model_fingerprint), kvt's or transformers'. Tensors in the order of their decoder-relative
    names; of each matrix every row at its 8 middle columns, 1-D ones whole: an edit of one row changes
    the id, and a check reads a few values a row (SmolLM2-135M: 1.7M, 30 ms on a CPU core; Qwen3-14B
    shapes: 18M, 0.7 s). Values are hashed rounded to bfloat16, with magnitudes below float16's smallest
    normal as 0: a bf16 checkpoint gives one id loaded in float32, bfloat16 or float16, a float32 one in
    float32 or bfloat16 (float16 rounds it differently). Two trainings of one config (a base and its
    instruct model, a fine-tune, a function-preserving twin) get different ids."""
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


def comparable(recorded):
    """Can a fingerprint a mapper recorded be compared with weights_fingerprint's? Not one of an older
    scheme (w1, unprefixed: it would differ for the very weights it was taken of) nor a missing one."""
    return isinstance(recorded, str) and recorded.startswith(f"{SCHEME}:")


def folder_fingerprint(path):
    """weights_fingerprint of a checkpoint folder, read through its safetensors headers and memory map:
    8 values a row, a block of rows at a time (from a cold disk, that is a page a row: most of the file)."""
    files = shard_files(path)
    handles = {f: _open(f) for f in set(files.values())}
    try:
        return weights_fingerprint({name: handles[f].get_slice(name) for name, f in files.items()})
    except (SafetensorError, OSError) as e:
        raise KvtError(f"{path}: cannot read its weights ({e}); the file is truncated, download it again")


def model_fingerprint(model):
    """weights_fingerprint of a loaded model's parameters: a kvt model, or a transformers one."""
    return weights_fingerprint(dict(model.named_parameters()))


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
    """Copy every parameter of `model` from the checkpoint at `path` (tied lm_head shares embed_tokens)."""
    for name, (handle, key) in check_checkpoint(model, path).items():
        try:
            finite = _copy_in_chunks(model.get_parameter(name), handle.get_slice(key))
        except (SafetensorError, OSError) as e:
            raise KvtError(f"{path}: cannot read {key} ({e}); the file is truncated, download it again")
        if not finite:
            raise KvtError(f"{path}: {key} holds NaN or infinite values; the file is damaged, download it again")


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
