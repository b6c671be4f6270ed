"""kvt's own files: statistics, fits, MLP checkpoints and mappers, written and read one way.

    save(path, tensors, FORMAT, {"key": key, ...})                 # safetensors, atomically
    tensors, meta = load(path, FORMAT, "fit checkpoint", "delete it to fit again", key=key)  # None: no file

A file is safetensors (never pickle) whose metadata holds a `format` (the kind of file and its version)
and, where it depends on a pair and its settings, the caller's `key`. Reading refuses, in one line that
ends in what to do, a file that is unreadable or truncated, one of another format or version, and one
made for another key.
"""
import os

from safetensors import SafetensorError, safe_open

from kvt.config import KvtError
from kvt.weights import write_safetensors


def save(path, tensors, format, meta=None):
    """Write {name: tensor} to path atomically (weights.write_safetensors), metadata {"format": format, **meta}
    (strings)."""
    write_safetensors({name: t.contiguous() for name, t in tensors.items()}, path,
                      metadata={"format": format, **(meta or {})})


def unreadable(path, what, fix, e):
    return KvtError(f"{path} is not a readable {what} file (unreadable or truncated: {str(e).splitlines()[0]}); {fix}")


def open_(path, format, what, fix, key=None, device="cpu", other="another pair or settings"):
    """(f, meta): the open file (f.get_tensor(name) reads one tensor, so a caller can read a large file
    tensor by tensor) and its metadata, once checked: its format, and with `key` the key it was made for
    (`other` says what another key means)."""
    try:
        f = safe_open(str(path), "pt", device=str(device))
    except (SafetensorError, OSError) as e:
        raise unreadable(path, what, fix, e)
    meta = f.metadata() or {}
    if meta.get("format") != format:
        raise KvtError(f"{path} is not a kvt {what} of this version (format {meta.get('format', 'unknown')}, "
                       f"need {format}); {fix}")
    if key is not None and meta.get("key") != key:
        raise KvtError(f"{what} {path} was made for {other} ({meta.get('key') or 'no key'}, not {key or 'no key'}); "
                       f"{fix}")
    return f, meta


def load(path, format, what, fix, key=None, device="cpu", other="another pair or settings"):
    """({name: tensor}, meta) of a file save wrote, or None when there is no file at path; refuses one
    that open_ refuses."""
    if not path or not os.path.exists(path):
        return None
    f, meta = open_(path, format, what, fix, key, device, other)
    try:
        with f:
            return {name: f.get_tensor(name) for name in f.keys()}, meta
    except (SafetensorError, OSError) as e:
        raise unreadable(path, what, fix, e)
