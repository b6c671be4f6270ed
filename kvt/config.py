"""Model configuration: read a checkpoint's config.json exactly, or build one from a named shape.

Three dense families share one decoder (see model.py); config.json tells them apart:
  qwen3       Qwen3ForCausalLM      per-head RMSNorm on q and k before RoPE, head_dim given explicitly
  llama       LlamaForCausalLM      "llama3" frequency scaling of RoPE (3.1: factor 8, 3.2: factor 32)
  ministral3  Mistral3ForConditionalGeneration (text part only)  YaRN RoPE + query temperature past 16K

Both transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) spellings are read.
What kvt does not implement is refused with a one-line KvtError naming the key, never ignored.
Beside the model's: the checks a fit's statistics and ridge systems pass (ridge.py), and the options
of the method's steps, calibrate's Run and mlp.train's Schedule.
"""
import hashlib
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch


class KvtError(Exception):
    """A problem the user can fix; run.py prints it as one line and exits with code 2."""


def command(main, argv=None, resumes=False):
    """Run a command's main(argv) as `kvt` runs it (kvt/cli.py; `python -m kvt.harness.bench` and the like too): a
    KvtError ends as one line `kvt: ...` on stderr with exit status 2; Ctrl-C with exit status 130 and a
    line saying whether a rerun resumes (resumes: the command keeps checkpoints a rerun picks up)."""
    try:
        return main(argv)
    except KvtError as e:
        print(f"kvt: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\nkvt: interrupted; " + ("run the same command again to resume where it stopped" if resumes
                                      else "nothing was kept: run the same command again to start over"),
              file=sys.stderr)
        sys.exit(130)


def at_least(name, value, least=1, why=""):
    """Refuse a command-line number below `least`: `--name value: must be at least least (why)`."""
    if value is not None and value < least:
        raise KvtError(f"--{name} {value}: must be at least {least}{why}")


def plain_requested():
    """Whether the environment asks for the plain path of every step (KVT_PLAIN=1): read by the entry
    points alone (run.py, kvt bench, the serving connector), beside their --plain, which then pass
    plain=True (or the plain functions) to what they call; kvt/fast.py holds the fast twins."""
    return os.environ.get("KVT_PLAIN", "0") not in ("", "0")


ARCHITECTURES = {  # config.json "architectures"[0] -> family
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Mistral3ForConditionalGeneration": "ministral3",
    "Ministral3ForCausalLM": "ministral3",
}


@dataclass(frozen=True)
class Config:
    family: str          # "qwen3" | "llama" | "ministral3"
    vocab_size: int      # V
    dim: int             # C, hidden_size
    n_layers: int        # L
    n_heads: int         # H
    n_kv_heads: int      # Hkv
    head_dim: int        # D, always from config.json when it is there
    ffn_dim: int         # intermediate_size
    norm_eps: float
    rope: dict = field(default_factory=dict)  # rope_type, rope_theta and that type's parameters
    tie_embeddings: bool = False
    max_seq_len: int = 4096    # max_position_embeddings
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    prefix: str = "model."     # where the decoder's tensors live in the checkpoint

    @property
    def qk_norm(self):  # Qwen3 normalizes each head of q and k   <-- the one Qwen3 difference
        return self.family == "qwen3"

    def fingerprint(self):
        """A short hash of everything that shapes the model's KV; two checkpoints of one model share it."""
        keys = ("family", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "rope")
        blob = json.dumps({k: asdict(self)[k] for k in keys}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_hf(self):
        """The config.json transformers writes for this shape (5.x rope_parameters form)."""
        arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "ministral3": "Ministral3ForCausalLM"}
        return {
            "architectures": [arch[self.family]], "model_type": self.family, "vocab_size": self.vocab_size,
            "hidden_size": self.dim, "num_hidden_layers": self.n_layers, "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim, "intermediate_size": self.ffn_dim,
            "rms_norm_eps": self.norm_eps, "rope_parameters": dict(self.rope), "hidden_act": "silu",
            "tie_word_embeddings": self.tie_embeddings, "max_position_embeddings": self.max_seq_len,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "attention_bias": False, "mlp_bias": False,
        }


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_POSITIVE_INT = ("a positive integer", lambda v: _int(v) and v > 0)
_NUMBER = ("a finite number", _number)
_BOOL = ("true or false", lambda v: isinstance(v, bool))
_OBJECT = ("an object {...}", lambda v: isinstance(v, dict))
_TOKEN_ID = ("a token id (an integer, at least 0)", lambda v: _int(v) and v >= 0)
FIELDS = {  # every config.json key kvt reads: (what it must be, the test); a null or absent key is checked elsewhere
    "architectures": ('a list of class names, e.g. ["Qwen3ForCausalLM"]',
                      lambda v: isinstance(v, list) and bool(v) and all(isinstance(a, str) for a in v)),
    "text_config": _OBJECT,
    "vocab_size": _POSITIVE_INT, "hidden_size": _POSITIVE_INT, "num_hidden_layers": _POSITIVE_INT,
    "num_attention_heads": _POSITIVE_INT, "num_key_value_heads": _POSITIVE_INT, "intermediate_size": _POSITIVE_INT,
    "head_dim": ("a positive even integer (RoPE rotates channel pairs)", lambda v: _int(v) and v > 0 and v % 2 == 0),
    "max_position_embeddings": _POSITIVE_INT, "original_max_position_embeddings": _POSITIVE_INT,
    "sliding_window": _POSITIVE_INT,
    "rms_norm_eps": ("a positive number below 1", lambda v: _number(v) and 0 < v < 1),
    "rope_theta": ("a number above 1", lambda v: _number(v) and v > 1),
    "rope_parameters": _OBJECT, "rope_scaling": _OBJECT,
    "hidden_act": ("a name, e.g. \"silu\"", lambda v: isinstance(v, str)),
    "use_sliding_window": _BOOL, "attention_bias": _BOOL, "mlp_bias": _BOOL, "tie_word_embeddings": _BOOL,
    "num_experts": ("an integer", _int), "num_local_experts": ("an integer", _int), "n_routed_experts": ("an integer", _int),
    "bos_token_id": _TOKEN_ID,
    "eos_token_id": ("a token id or a list of them", lambda v: _TOKEN_ID[1](v) or (isinstance(v, list) and all(map(_TOKEN_ID[1], v)))),
}
ROPE_FIELDS = {  # the keys of rope_parameters (or rope_scaling) kvt reads
    "rope_type": ('a name, e.g. "default"', lambda v: isinstance(v, str)), "type": ('a name, e.g. "default"', lambda v: isinstance(v, str)),
    "rope_theta": FIELDS["rope_theta"], "original_max_position_embeddings": _POSITIVE_INT,
    "factor": ("a number at least 1", lambda v: _number(v) and v >= 1),
    "low_freq_factor": ("a positive number", lambda v: _number(v) and v > 0),
    "high_freq_factor": ("a positive number", lambda v: _number(v) and v > 0),
    "beta_fast": ("a positive number", lambda v: _number(v) and v > 0),
    "beta_slow": ("a positive number", lambda v: _number(v) and v > 0), "mscale": _NUMBER, "mscale_all_dim": _NUMBER,
    "attention_factor": _NUMBER, "llama_4_scaling_beta": _NUMBER, "truncate": _BOOL,
}
ROPE_NEEDS = {"default": (), "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",)}


def _show(v):
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def check_fields(c, fields=FIELDS, where="config.json"):
    """Every key of `fields` that `c` sets (not null) has the type and range kvt needs; else one KvtError
    naming the key, its value and what is expected. The one place config values are checked."""
    for key, (expected, ok) in fields.items():
        v = c.get(key)
        if v is not None and not ok(v):
            raise KvtError(f"{where}: {key} is {_show(v)}, expected {expected}; use the config.json that came with "
                           "the checkpoint")


def _rope_params(c):
    """The RoPE dict in 5.x form: {"rope_type", "rope_theta", ...type parameters}."""
    p = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    check_fields(p, ROPE_FIELDS, "config.json: rope_parameters")
    if "type" in p and "rope_type" not in p:  # older spelling
        p["rope_type"] = p.pop("type")
    p.setdefault("rope_type", "default")
    if p.get("rope_theta") is None:
        p["rope_theta"] = c.get("rope_theta") if c.get("rope_theta") is not None else 10000.0
    if p["rope_type"] not in ROPE_NEEDS:
        raise KvtError(f"config.json: rope type {p['rope_type']!r} is not implemented (kvt has default, llama3, yarn)")
    missing = [key for key in ROPE_NEEDS[p["rope_type"]] if p.get(key) is None]
    if missing:
        raise KvtError(f"config.json: rope_parameters of type {p['rope_type']!r} lack {', '.join(missing)}; use the "
                       "config.json that came with the checkpoint")
    if p["rope_type"] == "llama3" and p["high_freq_factor"] <= p["low_freq_factor"]:
        raise KvtError(f"config.json: rope_parameters high_freq_factor {p['high_freq_factor']} is not above "
                       f"low_freq_factor {p['low_freq_factor']}; use the config.json that came with the checkpoint")
    if (p["rope_type"] != "default" or p.get("llama_4_scaling_beta")) and p.get("original_max_position_embeddings") is None:
        p["original_max_position_embeddings"] = (  # the pretraining length, where transformers looks for it
            c.get("original_max_position_embeddings") or c.get("max_position_embeddings") or 4096)
    return p


def config_from_dict(hf, context=None):
    """Config from a parsed config.json. `context`: the longest sequence the caller plans to run."""
    if not isinstance(hf, dict):
        raise KvtError(f"config.json holds {type(hf).__name__} {_show(hf)}, not an object {{...}}; use the "
                       "config.json that came with the checkpoint")
    check_fields(hf, {key: FIELDS[key] for key in ("architectures", "text_config")})
    arch = (hf.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise KvtError(f"config.json: architecture {arch!r} is not supported (kvt has {', '.join(ARCHITECTURES)})")
    family = ARCHITECTURES[arch]
    c = hf.get("text_config") or hf if arch == "Mistral3ForConditionalGeneration" else hf
    prefix = "model.language_model." if arch == "Mistral3ForConditionalGeneration" else "model."
    check_fields(hf)
    check_fields(c)
    for key in ("quantization_config",):
        if key in hf or key in c:
            raise KvtError(f"config.json: {key!r} is set; kvt loads unquantized (bf16/fp32) checkpoints only")
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if c.get(key):
            raise KvtError(f"config.json: {key!r} is set; mixture-of-experts models are not implemented")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise KvtError(f"config.json: {key!r} is true; kvt implements bias-free projections only")
    if c.get("hidden_act", "silu") != "silu":
        raise KvtError(f"config.json: hidden_act {c['hidden_act']!r} is not implemented (kvt has silu)")
    window = c.get("sliding_window") if c.get("use_sliding_window", True) else None
    if window and context and window < context:
        raise KvtError(f"config.json: sliding_window {window} is shorter than the context {context}; "
                       "kvt implements full attention only")
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "rms_norm_eps")
    missing = [key for key in required if c.get(key) is None]
    if missing:
        raise KvtError(f"config.json: {', '.join(map(repr, missing))} missing or null; use the config.json that came "
                       f"with the {arch} checkpoint")
    n_heads = c["num_attention_heads"]
    if n_heads % (c.get("num_key_value_heads") or n_heads):
        raise KvtError(f"config.json: {n_heads} attention heads do not split into {c['num_key_value_heads']} KV heads")
    head_dim = c.get("head_dim") or c["hidden_size"] // n_heads  # Qwen3 and Ministral 3 give it explicitly
    if head_dim < 2 or head_dim % 2:
        raise KvtError(f"config.json: hidden_size {c['hidden_size']} / num_attention_heads {n_heads} gives a head "
                       f"dim of {head_dim}, expected a positive even integer; use the config.json that came with "
                       "the checkpoint")
    return Config(
        family=family, vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads") or n_heads, head_dim=head_dim,
        ffn_dim=c["intermediate_size"], norm_eps=c["rms_norm_eps"], rope=_rope_params(c),
        tie_embeddings=bool(hf.get("tie_word_embeddings", c.get("tie_word_embeddings"))),
        max_seq_len=c.get("max_position_embeddings") or 4096,
        bos_token_id=c.get("bos_token_id", hf.get("bos_token_id")),
        eos_token_id=c.get("eos_token_id", hf.get("eos_token_id")), prefix=prefix)


def download_hint(path):
    """The command that fetches the checkpoint a folder name suggests (see weights/README.md)."""
    name = Path(path).name
    if Path(path).parent.name == "snapshots" and Path(path).parent.parent.name.startswith("models--"):
        return "hf download " + Path(path).parent.parent.name.removeprefix("models--").replace("--", "/")  # the cache's
    if name.startswith("toy-"):  # the toy family is trained, not downloaded (kvt/harness/toy.py)
        return f"python -m kvt.harness.toy train --out {Path(path).parent} --members {name}"
    repo = SHAPES[name][0] if name in SHAPES else "<hub-repo>"
    return f"hf download {repo} --local-dir {path}"


def hub_caches():
    """The Hugging Face cache folders, in the order the hub client picks one: $HF_HUB_CACHE, $HF_HOME/hub,
    ~/.cache/huggingface/hub (each only when set; the last always)."""
    places = [os.environ.get("HF_HUB_CACHE"), os.environ.get("HF_HOME") and Path(os.environ["HF_HOME"]) / "hub",
              Path.home() / ".cache" / "huggingface" / "hub"]
    return [Path(p) for p in dict.fromkeys(places) if p]


def hub_snapshot(repo, cache):
    """The folder `hf download repo` filled in the cache: models--Org--Name/snapshots/<the commit refs/main
    names> (files there are links into blobs/), or the one snapshot when refs/main is missing; else None."""
    folder = Path(cache) / ("models--" + repo.replace("/", "--"))
    ref = folder / "refs" / "main"
    snapshots = sorted((folder / "snapshots").glob("*/")) if (folder / "snapshots").is_dir() else []
    if ref.is_file():
        commit = ref.read_text(errors="replace").strip()
        snapshot = folder / "snapshots" / commit
        if commit and "/" not in commit and snapshot.is_dir():
            return snapshot
        raise KvtError(f"{ref} names {_show(commit)}, which is no snapshot in {folder / 'snapshots'} (an interrupted "
                       f"download?); download again with: hf download {repo}")
    if len(snapshots) > 1:
        raise KvtError(f"{folder} holds {len(snapshots)} snapshots and no refs/main naming one; download again with: "
                       f"hf download {repo}, or give the snapshot folder you mean with --source/--target")
    return snapshots[0] if snapshots else None


def checkpoint_name(path):
    """The name a run calls a checkpoint folder by: the kvt name of a hub snapshot (.../models--Qwen--Qwen3-14B/
    snapshots/<commit> -> qwen3-14b, else the repo's name), or the folder's own name."""
    path = Path(path)
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        repo = path.parent.parent.name.removeprefix("models--").replace("--", "/")
        return next((name for name, (r, _) in SHAPES.items() if r == repo), repo.split("/")[-1].lower())
    return path.name


def find_weights(name, weights=None):
    """The checkpoint folder of the model called `name`: WEIGHTS/<name> when a folder of checkpoints is
    given, else the first that exists of ./weights/<name>, the weights/ beside kvt's own source (a
    working copy of the repository), <prefix>/share/kvt/weights/<name> (the toy family pip installs) and,
    for a named shape, its snapshot in a Hugging Face cache (hub_caches: what `hf download` fetched; read
    as files, no hub client, no network). None there: one line naming every place and the download."""
    if weights is not None:
        return Path(weights) / name
    places = [Path("weights"), Path(__file__).resolve().parent.parent / "weights",
              Path(sys.prefix) / "share" / "kvt" / "weights"]
    found = next((p / name for p in places if (p / name).is_dir()), None)
    if found is None and name in SHAPES:
        repo = SHAPES[name][0]
        found = next(filter(None, (hub_snapshot(repo, cache) for cache in hub_caches())), None)
    if found is not None:
        return found
    looked = [str(p / name) for p in places]
    if name in SHAPES:
        repo = SHAPES[name][0]
        looked += [str(cache / ("models--" + repo.replace("/", "--"))) for cache in hub_caches()]
        get = f"hf download {repo} (into the Hugging Face cache), or {download_hint(places[0] / name)}"
    else:
        get = download_hint(places[0] / name)
    raise KvtError(f"no checkpoint {name} in {', '.join(looked)}; get it with: {get}")


def load_config(path, context=None):
    """Config of the checkpoint folder `path` (its config.json)."""
    f = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise KvtError(f"no checkpoint folder {path}; get it with: {download_hint(path)}")
    if f.is_symlink() and not f.exists():
        raise KvtError(f"{f} links to {os.readlink(f)}, which is gone (an interrupted download, or a pruned cache); "
                       f"download again with: {download_hint(path)}")
    if not f.is_file():
        raise KvtError(f"no config.json in {path}; is this a Hugging Face checkpoint folder? (see weights/README.md)")
    try:
        hf = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KvtError(f"{f} is not valid JSON ({e}); download the checkpoint again")
    return config_from_dict(hf, context)


# Named shapes, transcribed from each model's published config.json (a loaded config.json always wins).
# Hugging Face repo, then the shape. Used to build random-weight models for benchmarks and to check a
# pair for matched KV before anything is downloaded.
_QWEN3 = dict(family="qwen3", vocab_size=151936, n_kv_heads=8, head_dim=128, norm_eps=1e-6, max_seq_len=40960,
              rope={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=None, eos_token_id=151645)
_LLAMA31 = dict(family="llama", vocab_size=128256, n_kv_heads=8, head_dim=128, norm_eps=1e-5, max_seq_len=131072,
                rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                bos_token_id=128000, eos_token_id=128001)
_LLAMA32 = dict(_LLAMA31, rope=dict(_LLAMA31["rope"], factor=32.0), tie_embeddings=True)
_MINISTRAL3 = dict(family="ministral3", vocab_size=131072, n_kv_heads=8, head_dim=128, norm_eps=1e-5,
                   max_seq_len=262144, prefix="model.language_model.", bos_token_id=1, eos_token_id=2,
                   rope={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                         "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1})
SHAPES = {  # name: (hub repo, Config)
    "qwen3-0.6b": ("Qwen/Qwen3-0.6B", Config(**_QWEN3, dim=1024, n_layers=28, n_heads=16, ffn_dim=3072, tie_embeddings=True)),
    "qwen3-1.7b": ("Qwen/Qwen3-1.7B", Config(**_QWEN3, dim=2048, n_layers=28, n_heads=16, ffn_dim=6144, tie_embeddings=True)),
    "qwen3-4b": ("Qwen/Qwen3-4B", Config(**_QWEN3, dim=2560, n_layers=36, n_heads=32, ffn_dim=9728, tie_embeddings=True)),
    "qwen3-8b": ("Qwen/Qwen3-8B", Config(**_QWEN3, dim=4096, n_layers=36, n_heads=32, ffn_dim=12288)),
    "qwen3-14b": ("Qwen/Qwen3-14B", Config(**_QWEN3, dim=5120, n_layers=40, n_heads=40, ffn_dim=17408)),
    "qwen3-32b": ("Qwen/Qwen3-32B", Config(**_QWEN3, dim=5120, n_layers=64, n_heads=64, ffn_dim=25600)),
    "llama3.1-8b": ("meta-llama/Llama-3.1-8B", Config(**_LLAMA31, dim=4096, n_layers=32, n_heads=32, ffn_dim=14336)),
    "llama3.1-70b": ("meta-llama/Llama-3.1-70B", Config(**_LLAMA31, dim=8192, n_layers=80, n_heads=64, ffn_dim=28672)),
    "llama3.2-1b": ("meta-llama/Llama-3.2-1B", Config(**dict(_LLAMA32, head_dim=64), dim=2048, n_layers=16, n_heads=32, ffn_dim=8192)),
    "llama3.2-3b": ("meta-llama/Llama-3.2-3B", Config(**_LLAMA32, dim=3072, n_layers=28, n_heads=24, ffn_dim=8192)),
    "ministral3-3b": ("mistralai/Ministral-3-3B-Base-2512", Config(**_MINISTRAL3, dim=3072, n_layers=26, n_heads=32, ffn_dim=9216, tie_embeddings=True)),
    "ministral3-8b": ("mistralai/Ministral-3-8B-Base-2512", Config(**_MINISTRAL3, dim=4096, n_layers=34, n_heads=32, ffn_dim=14336)),
    "ministral3-14b": ("mistralai/Ministral-3-14B-Base-2512", Config(**_MINISTRAL3, dim=5120, n_layers=40, n_heads=32, ffn_dim=16384)),
}


def shape(name):
    """The Config of a named shape, e.g. shape("qwen3-0.6b")."""
    if name not in SHAPES:
        raise KvtError(f"unknown model {name!r}; known: {', '.join(SHAPES)}")
    return SHAPES[name][1]


def parse_pair(pair):
    """'qwen3-14b:32b' -> ('qwen3-14b', 'qwen3-32b'); the target may also be spelled in full."""
    if pair.count(":") != 1:
        raise KvtError(f"--pair {pair!r}: expected FAMILY-SRC:TGT, e.g. qwen3-14b:32b")
    src, tgt = pair.split(":")
    if "-" not in tgt:
        tgt = src.rsplit("-", 1)[0] + "-" + tgt
    return src, tgt


def matched_kv(src, tgt):
    """Do two configs share the KV-head count and head dim (a matched-KV pair, as the paper's are)?"""
    return (src.n_kv_heads, src.head_dim) == (tgt.n_kv_heads, tgt.head_dim)


def check_matched_kv(src, tgt, scope="head"):
    """Head scope maps head h to head h: the pair must share the KV-head count and head dim."""
    if scope == "head" and not matched_kv(src, tgt):
        raise KvtError(f"not a matched-KV pair: source has {src.n_kv_heads} KV heads x {src.head_dim}, target "
                       f"{tgt.n_kv_heads} x {tgt.head_dim}; use --scope layer, which maps across shapes")


# ---- a model's input (model.Transformer.forward checks it) -------------------------------------------------

def check_input(cfg, ids, cache=None, appends=True):
    """Token ids (B, T) and the cache they continue from must suit a model of Config cfg: check_ids
    (the ids' values, a device sync, at prefill only), check_cache, and (appends: ids after the cache,
    not a recompute of its slots) no more positions than max_position_embeddings; else a KvtError."""
    check_ids(ids, cfg.vocab_size, values=cache is None or not len(cache))
    if cache is not None:
        check_cache(cache, cfg, ids.shape[0])
    n = ids.shape[1] + (len(cache) if cache is not None else 0)
    if appends and n > cfg.max_seq_len:
        raise KvtError(f"context of {n} tokens exceeds the model's max_position_embeddings {cfg.max_seq_len}; shorten it")


def check_ids(ids, vocab_size, values=True):
    """Token ids must be a (B, T) integer tensor with B, T >= 1 and (values=True) every id in the
    vocabulary; else a KvtError that says what to pass."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.long, torch.int32, torch.int16, torch.uint8):
        what = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise KvtError(f"input_ids must be integer token ids (a torch.long tensor), not {what}")
    if ids.dim() != 2 or 0 in ids.shape:
        raise KvtError(f"input_ids must have shape (batch, tokens), both at least 1, not {tuple(ids.shape)}; "
                       "for one sequence pass ids[None]")
    if values:
        lo, hi = ids.min().item(), ids.max().item()
        if lo < 0 or hi >= vocab_size:
            raise KvtError(f"token id {hi if hi >= vocab_size else lo} is outside the model's vocabulary of "
                           f"{vocab_size}; encode with this model's tokenizer")


def check_cache(cache, cfg, batch):
    """A cache to continue from must come from a model of this shape (layers, KV heads, head dim) and
    hold as many rows as the input; else a KvtError that says what differs."""
    have = next((k for k in cache.keys if k is not None), None)
    shape = None if have is None else (have.shape[1], have.shape[3])
    if len(cache.keys) != cfg.n_layers or (shape is not None and shape != (cfg.n_kv_heads, cfg.head_dim)):
        raise KvtError(f"the cache has {len(cache.keys)} layers" + (f" of {shape[0]} KV heads x {shape[1]}" if shape else "")
                       + f", this model {cfg.n_layers} of {cfg.n_kv_heads} x {cfg.head_dim}; map it with a mapper "
                       "made for this pair (kvt.mapper) before continuing from it")
    if cache.positions.shape[0] != batch:
        raise KvtError(f"the cache holds {cache.positions.shape[0]} rows, the input {batch}; pass one row per cached sequence")


# ---- calibration statistics and the ridge systems (ridge.py checks them) -------------------------------------

def check_sums(stats):
    """Statistics to fit on: validation tokens present (the lambda and layer choices read them), finite sums."""
    if stats.part("k", "val").n < 1:
        raise KvtError("no validation tokens; calibration needs a validation region (data.Calibration.val)")
    check_finite(stats)


def check_finite(stats):
    """NaN or inf in the sums means a model produced non-finite KV: refuse to fit on it."""
    for name, s in stats.sums.items():
        for f, t in vars(s).items():
            if not torch.isfinite(t).all():
                raise KvtError(f"calibration statistics {name}.{f} contain NaN/inf: a model produced non-finite KV; "
                               "run the models in float32 (--dtype float32) and recalibrate")


def solvable(eig, lams, what, skipped=None, at=None):
    """The lambdas of lams at which ridge.eigen()'s system can be solved (every e + lam > 0): a rank-deficient
    R has eigenvalues at zero, rounding can put some a hair below, so the smallest lambdas may fail where
    the larger ones are fine. The others are listed in skipped[at] (when given); none left is an error."""
    low = eig[0].min().item()
    good, bad = [lam for lam in lams if low + lam > 0], [lam for lam in lams if low + lam <= 0]
    if not good:
        raise KvtError(f"ridge system of {what} is singular at every lambda ({', '.join(f'{lam:g}' for lam in lams)}); "
                       "use a larger --lam or calibrate on more tokens")
    if bad and skipped is not None:
        skipped[at] = bad
    return good


# ---- options of the method's steps: calibrate's Run, mlp.train's Schedule -----------------------------------

@dataclass(frozen=True)
class Run:
    """How the steps run: what a long run passes in (each None is the plain step; a hook returns what its
    step would), the batch size and the path (plain)."""
    sums: Callable = None      # (name "pass1"/"pass2", scope, src_layers, tgt_layers) -> Stats summed over calib
    candidates: list = None    # the source layers to select from (None: all)
    select: Callable = None    # a layer-selection rule (stats, kind, k, lams) -> (Lt, k), instead of the paper's
    groups: Callable = None    # selected -> lists of target layers, one layer-level pass each (None: one pass)
    fitted: Callable = None    # (selected, targets, lams, fit) -> fit(), or the fits a run saved of it
    fit: Callable = None       # step 4 from the first pass: (stats, selected, lams, skipped) -> fits
    train_mlp: Callable = None  # (kind, l, train) -> train() or the MLP a run saved: (params, loss)
    batch_size: int = 1        # calibration sequences per forward pass
    plain: bool = False        # the plain path's float64 products (stats.add_batches), not fast.add_batches
    progress: bool = False


@dataclass(frozen=True)
class Schedule:
    """How train trains. The paper states no schedule: these defaults bound a CPU run of the paper's size
    to minutes per layer."""
    lr: float = 1e-3              # AdamW's learning rate
    weight_decay: float = 0.01
    batch: int = 1024             # tokens per step
    max_epochs: int = 30
    patience: int = 3             # epochs without a 1% gain in validation MSE before training stops
    seed: int = 0                 # of the initial weights and the batches' order
    sample_bytes: int = 2 * 2**30  # float32 features add_mlp samples from the fit region (a tenth from validation)
    progress: bool = False        # a progress bar while sampling them
