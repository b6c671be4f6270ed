"""Calibration data: n token sequences of one length, drawn deterministically (seeded) from local text.

Accepted files: .txt (the whole file is one document), .jsonl (one document per line, field "text"),
and .json lists of records (field "text", or CodeAlpaca's instruction / input / output). A folder is
read in sorted name order, skipping README/SOURCES/LICENSE files. All documents are joined into one
text; each sequence starts at a seeded random character offset and keeps its first `length` tokens
(after the tokenizer's BOS when it has one, so calibration looks like the prompts the models see).
"""
import json
import random
from pathlib import Path

import torch

from kvt.config import KvtError

SKIP = ("README", "SOURCES", "LICENSE")


def read_documents(paths_or_dir):
    """A list of document strings from files or folders (see the module docstring)."""
    paths = [paths_or_dir] if isinstance(paths_or_dir, (str, Path)) else list(paths_or_dir)
    files = []
    for p in map(Path, paths):
        if not p.exists():
            raise KvtError(f"calibration data {p} does not exist; pass a .txt/.jsonl/.json file or a folder of them")
        found = sorted(p.iterdir()) if p.is_dir() else [p]
        files += [f for f in found if f.suffix in (".txt", ".jsonl", ".json") and not f.name.startswith(SKIP)]
    if not files:
        raise KvtError(f"no .txt, .jsonl or .json files in {paths_or_dir}; point the calibration corpus at text files")
    docs = []
    for f in files:
        if f.suffix == ".txt":
            docs.append(f.read_text(encoding="utf-8", errors="replace"))
        elif f.suffix == ".jsonl":
            lines = f.read_text(encoding="utf-8").splitlines()
            docs += [_record_text(json.loads(line), f) for line in lines if line.strip()]
        else:
            docs += [_record_text(r, f) for r in json.loads(f.read_text(encoding="utf-8"))]
    return [d for d in docs if d.strip()]


def _record_text(r, f):
    if "text" in r:
        return r["text"]
    if "instruction" in r:  # CodeAlpaca
        return "\n\n".join(r[k] for k in ("instruction", "input", "output") if r.get(k))
    raise KvtError(f"{f}: records need a 'text' field (or CodeAlpaca's instruction/input/output)")


def calibration_sequences(paths_or_dir, tokenizer, n, length, seed=0, *, documents=None):
    """LongTensor (n, length) of token ids; the same arguments always give the same tensor.
    documents: a list of texts to draw from instead of files (e.g. the toy corpus)."""
    text = "\n\n".join(documents if documents is not None else read_documents(paths_or_dir))
    bos = getattr(tokenizer, "bos_id", None)
    need = length - (bos is not None)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(max(1, len(text) - 8 * need))     # ~4 characters a token: leave room
        start = text.find(" ", start) + 1 if " " in text[start:start + 64] else start  # begin on a word
        chars = 8 * need
        while True:  # widen the window until it holds enough tokens or reaches the end of the text
            ids = tokenizer.encode(text[start:start + chars], special=False)
            if len(ids) >= need or start + chars >= len(text):
                break
            chars *= 2
        if len(ids) < need:
            raise KvtError(f"calibration text has too few tokens for sequences of {length} "
                           f"(got {len(ids)} from offset {start}); use a larger corpus or a smaller --calib-len")
        out.append(([bos] if bos is not None else []) + ids[:need])
    return torch.tensor(out, dtype=torch.long)  # (n, length)


def check_same_tokenizer(src_tok, tgt_tok):
    """Transfer needs one tokenizer for both models: compare vocabulary fingerprints."""
    if src_tok.fingerprint() != tgt_tok.fingerprint():
        raise KvtError(f"source and target tokenizers differ (fingerprints {src_tok.fingerprint()} vs "
                       f"{tgt_tok.fingerprint()}); KV transfer needs two models of one family sharing a tokenizer")
