"""Tokenizer: the checkpoint's tokenizer.json through the `tokenizers` library.

The family's BOS handling comes from tokenizer.json itself: its post-processor adds
<|begin_of_text|> for Llama 3 and nothing for Qwen3, so encode(text) matches what the model was
trained on. Continuations that follow a context are encoded with special=False. An empty context
is one token, `prefix_id`: the BOS that tokenizer_config.json names, else EOS (as lm-evaluation-harness);
it can differ from `bos_id`, what the post-processor adds (SmolLM2 names a BOS but adds none).
Generation stops at any of `stop_ids`: the checkpoint's end-of-sequence tokens (end_ids) and EOS.
"""
import hashlib
import json
import os
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from kvt.config import KvtError, download_hint


class Tokenizer:
    def __init__(self, path):
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if file.is_symlink() and not file.exists():
            raise KvtError(f"{file} links to {os.readlink(file)}, which is gone (an interrupted download, or a pruned "
                           f"cache); download again with: {download_hint(file.parent)}")
        if not file.exists():
            raise KvtError(f"no tokenizer.json at {path}; the checkpoint folder should contain one")
        try:
            self.tok = _HFTokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library raises a bare Exception for a bad file
            raise KvtError(f"{file} is not a readable tokenizer.json ({str(e).splitlines()[0][:120]}); download the "
                           "checkpoint's tokenizer again")
        prefix = self.tok.encode("", add_special_tokens=True).ids  # what the post-processor puts first
        self.bos_id = prefix[0] if prefix else None                 # Llama 3: <|begin_of_text|>; Qwen3: None
        extra = file.with_name("tokenizer_config.json")
        try:
            conf = json.loads(extra.read_text()) if extra.exists() else {}
        except (json.JSONDecodeError, UnicodeDecodeError, IsADirectoryError) as e:
            raise KvtError(f"{extra} is not valid JSON ({e}); download the checkpoint's tokenizer files again")
        if not isinstance(conf, dict):
            raise KvtError(f"{extra} holds a {type(conf).__name__}, not an object {{...}}; download the checkpoint's "
                           "tokenizer files again")

        def named(key):  # the id of the token tokenizer_config.json names: "<|im_end|>", {"content": ...} or null
            token = conf.get(key)
            token = token.get("content") if isinstance(token, dict) else token
            return self.tok.token_to_id(token) if token else None
        self.eos_id = named("eos_token")
        # what an empty context is conditioned on, as lm-evaluation-harness's HFLM.prefix_token_id: the
        # config's BOS if it names one (Llama 3 <|begin_of_text|>, SmolLM2 <|im_start|>), else EOS (Qwen3)
        bos = named("bos_token")
        self.prefix_id = bos if bos is not None else self.eos_id
        ends = end_ids(file.parent) + ((self.eos_id,) if self.eos_id is not None else ())
        self.stop_ids = tuple(dict.fromkeys(ends))                   # generation ends at any of these

    def encode(self, text, special=True):
        """text -> token ids; special=True adds what the family's post-processor adds (Llama 3: BOS)."""
        return self.tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids):
        return self.tok.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab_size(self):
        return self.tok.get_vocab_size(with_added_tokens=True)

    def hash(self):
        """A hash of the whole tokenizer.json (vocabulary, merges, normalizer, pre-tokenizer): equal hashes,
        equal ids for any text (what cached token ids are keyed by, kvt/harness/data.py)."""
        return hashlib.sha256(self.tok.to_str().encode()).hexdigest()[:16]

    def fingerprint(self):
        """A hash of the vocabulary: two models can share KV only if they read text the same way."""
        vocab = sorted(self.tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def end_ids(folder):
    """The checkpoint's end-of-sequence ids: generation_config.json's eos_token_id (an id or a list: Qwen3
    ends a turn with <|im_end|> and a text with <|endoftext|>), else config.json's; () when neither names one."""
    for name in ("generation_config.json", "config.json"):
        f = Path(folder) / name
        try:
            conf = json.loads(f.read_text()) if f.exists() else {}
        except json.JSONDecodeError as e:
            raise KvtError(f"{f} is not valid JSON ({e}); download the checkpoint's files again")
        ids = conf.get("eos_token_id", (conf.get("text_config") or {}).get("eos_token_id"))
        if ids is not None:
            return tuple(ids) if isinstance(ids, list) else (ids,)
    return ()


def load_tokenizer(path):
    """The tokenizer of a checkpoint folder (or a tokenizer.json path)."""
    return Tokenizer(path)
