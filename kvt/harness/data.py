"""Calibration data: token windows from local text, in three disjoint regions, drawn deterministically.

    calib = calibration_sequences(paths, tokenizer, n=500, length=1024)
    calib.fit    (500, 1024)  the sequences the statistics (and the MLP) are fitted on
    calib.val    (50, 1024)   validation: layer selection, the ridge lambda, MLP early stopping
    calib.diag   (25, 1024)   diagnostics and the gate only: no choice ever sees them

How. Files are read into documents: a text file is one document, except that WikiText's article
headings (" = Title = ") start a new one and a Project Gutenberg book keeps only the text between its
"*** START OF" and "*** END OF" lines; a .jsonl holds one document per line (field "text"); a .json
is a list of records ("text", or CodeAlpaca's instruction / input / output). A file named on its own
is text whatever its name; a folder is read in sorted name order, its .txt, .jsonl and .json files,
skipping README/SOURCES/LICENSE files. The documents are shuffled with the seed and
dealt out whole: diagnostics take documents until they hold enough tokens, then validation, and fit
gets every document left, so no document is shared by two regions. Within a region the documents are
joined ("\n\n") into one token stream, cut into consecutive windows, and the windows used are a seeded
sample of those: no window overlaps another. Each sequence is the tokenizer's BOS (when it has one) and
then length - 1 tokens of its window, so calibration looks like the prompts the models see.

Tokenizing millions of tokens of text takes minutes, so with `cache` (a folder, run.py passes its
output folder) every document's ids are kept in calib-tokens-<key>.safetensors, written atomically and
keyed by a hash of the documents' text and of the tokenizer: a rerun or a resume reads them back.
"""
import hashlib
import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from kvt.config import KvtError

SKIP = ("README", "SOURCES", "LICENSE")
WIKITEXT_ARTICLE = re.compile(r"^ = [^=].* = $", re.M)   # " = Robert Boulter = "; sections have " = = "
GUTENBERG = re.compile(r"^\*\*\* START OF.*?$(.*?)^\*\*\* END OF", re.M | re.S)


@dataclass
class Calibration:
    """Token ids (n, T) of the three regions (see the module docstring)."""
    fit: torch.Tensor
    val: torch.Tensor
    diag: torch.Tensor

    def hash(self):
        """A short id of every token of the three regions: what statistics and mappers are keyed by."""
        h = hashlib.sha256()
        for ids in (self.fit, self.val, self.diag):
            h.update(str(tuple(ids.shape)).encode() + ids.cpu().numpy().tobytes())
        return h.hexdigest()[:16]


def split_text(text):
    """One .txt file -> its documents (WikiText articles; a Gutenberg book without its license text)."""
    book = GUTENBERG.search(text)
    if book:
        return [book.group(1)]
    starts = [m.start() for m in WIKITEXT_ARTICLE.finditer(text)]
    if len(starts) < 2:
        return [text]
    return [text[a:b] for a, b in zip([0] + starts, starts + [len(text)])]


def read_documents(paths_or_dir, option="--calib"):
    """A list of document strings from files or folders (see the module docstring). A file named on its
    own is read as text whatever its name (a .jsonl or .json one as records); in a folder only .txt,
    .jsonl and .json files count. option: where the paths came from, for the messages (--heldout)."""
    paths = [paths_or_dir] if isinstance(paths_or_dir, (str, Path)) else list(paths_or_dir)
    files = []
    for p in map(Path, paths):
        if not p.exists():
            raise KvtError(f"{option} {p} does not exist; pass a text file (.jsonl, .json: records) or a folder "
                           "of them")
        if not p.is_dir():
            files.append(p)
            continue
        found = [f for f in sorted(p.iterdir()) if f.suffix in (".txt", ".jsonl", ".json") and not f.name.startswith(SKIP)]
        if not found:
            raise KvtError(f"{option} {p}: no .txt, .jsonl or .json files in this folder; point {option} at text files")
        files += found
    docs = []
    for f in files:
        if f.suffix == ".jsonl":
            lines = f.read_text(encoding="utf-8").splitlines()
            docs += [_record_text(json.loads(line), f) for line in lines if line.strip()]
        elif f.suffix == ".json":
            docs += [_record_text(r, f) for r in json.loads(f.read_text(encoding="utf-8"))]
        else:
            text = f.read_text(encoding="utf-8", errors="replace")
            if "\0" in text:
                raise KvtError(f"{option} {f} is not text (it holds NUL bytes); pass a text file")
            docs += split_text(text)
    return [d for d in docs if d.strip()]


def _record_text(r, f):
    if "text" in r:
        return r["text"]
    if "instruction" in r:  # CodeAlpaca
        return "\n\n".join(r[k] for k in ("instruction", "input", "output") if r.get(k))
    raise KvtError(f"{f}: records need a 'text' field (or CodeAlpaca's instruction/input/output)")


def region_sizes(n):
    """(validation, diagnostics) sequences for n fit sequences: a tenth and a twentieth, at least 2 each."""
    return max(2, round(n / 10)), max(2, round(n / 20))


def token_file(docs, tokenizer, cache):
    """Where the documents' token ids are kept in the folder `cache`: calib-tokens-<key>.safetensors, the key a
    hash of the documents' text and of the whole tokenizer (tokenizer.hash())."""
    h = hashlib.sha256(tokenizer.hash().encode())
    for d in docs:
        h.update(hashlib.sha256(d.encode("utf-8", errors="replace")).digest())
    return Path(cache) / f"calib-tokens-{h.hexdigest()[:16]}.safetensors"


def read_tokens(file):
    """Every document's ids from a token file, or None when there is none or it cannot be read (then it is
    made again)."""
    try:
        t = load_file(file)
        ids, starts = t["ids"].tolist(), t["starts"].tolist()             # (N,) all documents' ids, (D + 1,)
        return [ids[a:b] for a, b in zip(starts, starts[1:])]
    except (FileNotFoundError, SafetensorError, KeyError):
        return None


def write_tokens(file, tokens):
    """Keep every document's ids (lists) in `file`, written atomically."""
    starts = torch.tensor([0] + [len(ids) for ids in tokens]).cumsum(0)   # (D + 1,) where each document starts
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")                # ranks of one run may race here
    save_file({"ids": torch.tensor([i for ids in tokens for i in ids], dtype=torch.int32), "starts": starts}, tmp)
    tmp.replace(file)


def calibration_sequences(paths_or_dir, tokenizer, n, length, seed=0, *, documents=None, n_val=None, n_diag=None,
                          cache=None, progress=False):
    """A Calibration of n fit, n_val validation and n_diag diagnostics sequences of `length` tokens
    (defaults: region_sizes(n)); the same arguments always give the same ids. documents: a list of
    texts to draw from instead of files (e.g. the toy corpus). cache: a folder keeping the documents'
    token ids (token_file), read when there, written once the sequences are made (a refusal writes nothing)."""
    if n < 1 or length < 2:
        raise KvtError(f"calibration needs at least 1 sequence of at least 2 tokens (got {n} x {length})")
    docs = documents if documents is not None else read_documents(paths_or_dir)
    defaults = region_sizes(n)
    wanted = {"diag": defaults[1] if n_diag is None else n_diag, "val": defaults[0] if n_val is None else n_val,
              "fit": n}
    bos = getattr(tokenizer, "bos_id", None)
    need = length - (bos is not None)                        # tokens taken from the text per sequence
    rng = random.Random(seed)
    order = rng.sample(range(len(docs)), len(docs))          # documents in a seeded order
    sep = tokenizer.encode("\n\n", special=False)
    file = None if cache is None else token_file(docs, tokenizer, cache)
    tokens = None if file is None else read_tokens(file)
    fresh = tokens is None
    if fresh:
        tokens = [tokenizer.encode(d, special=False) for d in tqdm(docs, "tokenizing", disable=not progress)]
    streams, i = {}, 0
    for region in ("diag", "val", "fit"):                    # fit last: it takes every document left
        stream = []
        while i < len(order) and (region == "fit" or len(stream) < wanted[region] * need):
            stream += tokens[order[i]] + sep
            i += 1
        streams[region] = stream
    out = {}
    for region, stream in streams.items():
        slots = len(stream) // need                          # consecutive, non-overlapping windows
        if slots < wanted[region]:
            total = sum(len(s) // need for s in streams.values())
            raise KvtError(f"calibration text holds {slots} windows of {length} tokens for its {region} region "
                           f"({total} in all, {len(docs)} documents) but {wanted[region]} are asked for; "
                           "ask for fewer or shorter sequences (--calib-seqs, --calib-len) or add text (--calib)")
        picked = sorted(rng.sample(range(slots), wanted[region]))
        out[region] = torch.tensor([([bos] if bos is not None else []) + stream[s * need:(s + 1) * need]
                                    for s in picked], dtype=torch.long).view(-1, length)   # (count, length)
    if file is not None and fresh:
        write_tokens(file, tokens)
    return Calibration(out["fit"], out["val"], out["diag"])


def check_same_tokenizer(src_tok, tgt_tok):
    """Transfer needs one tokenizer for both models: compare vocabulary fingerprints."""
    if src_tok.fingerprint() != tgt_tok.fingerprint():
        raise KvtError(f"source and target tokenizers differ (fingerprints {src_tok.fingerprint()} vs "
                       f"{tgt_tok.fingerprint()}); KV transfer needs two models of one family sharing a tokenizer")


def heldout_windows(paths_or_dir, tokenizer, count, length, documents=None):
    """`count` windows (count, length) of token ids from held-out text (files, or `documents`, a list of
    strings), the documents' ids joined end to end, the windows evenly spaced and never overlapping;
    fewer when the text holds fewer. For the context-gain measure (diagnose.next_nll)."""
    docs = documents if documents is not None else read_documents(paths_or_dir, option="--heldout")
    ids = [i for d in docs for i in tokenizer.encode(d)]
    slots = len(ids) // length
    if slots < 1:
        raise KvtError(f"held-out text {paths_or_dir or 'given'} has {len(ids)} tokens, fewer than one window of "
                       f"{length}; pass a longer text or a shorter --nll-context")
    picks = [i * slots // min(count, slots) for i in range(min(count, slots))]   # evenly spaced slots
    return torch.tensor([ids[p * length:(p + 1) * length] for p in picks], dtype=torch.long)
