"""config.json and the safetensors headers are checked before anything is allocated: a bad value ends in
one KvtError naming the key, its value and what is expected, never in a TypeError deep in a forward pass.

The fuzz below mutates every key kvt reads, of a real toy checkpoint copied to a temporary folder, in every
way a file can go wrong (deleted, null, wrong type, zero, negative, huge, NaN, string, list, object), one
key at a time and then a few at a time (seeded). Each mutated checkpoint is loaded and runs a few tokens:
the only exception allowed is KvtError, on one line, and what loads computes finite logits. Removing any
check of config.check_fields' tables (FIELDS, ROPE_FIELDS) that guards against a crash makes a case of this fuzz end in another
exception (TypeError, ValueError, ZeroDivisionError, an allocator error) or in NaN logits.
"""
import json
import math
import random
import shutil

import pytest
import torch

import kvt
from kvt import loading as model_module
from kvt.config import KvtError, config_from_dict
from tests.conftest import ROOT

pytestmark = pytest.mark.usefixtures("one_thread")

TOY = ROOT / "weights" / "toy-s"
VALUES = [None, "x", [1, 2], {"a": 1}, 0, -1, -0.5, 3, 2 ** 40, math.nan, True]
ROPES = {  # the toy's own RoPE, and the other two kinds kvt implements (their parameters get fuzzed too)
    "default": {"rope_type": "default"},  # theta at the top level, as the 4.x spelling has it (the toy's 10000)
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 256,
             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1},
}
KEYS = [  # every config.json key kvt reads, written out here (not taken from config.FIELDS, so that a key
          # dropped from that table still gets fuzzed)
    "architectures", "text_config", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "head_dim", "max_position_embeddings", "original_max_position_embeddings",
    "sliding_window", "use_sliding_window", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
    "hidden_act", "attention_bias", "mlp_bias", "tie_word_embeddings", "num_experts", "num_local_experts",
    "n_routed_experts", "quantization_config", "bos_token_id", "eos_token_id"]
ROPE_KEYS = ["rope_type", "type", "rope_theta", "original_max_position_embeddings", "factor", "low_freq_factor",
             "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
             "llama_4_scaling_beta", "truncate"]
DELETE = object()


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A copy of the toy-s checkpoint whose config.json each case rewrites, and that config as read."""
    folder = tmp_path_factory.mktemp("config") / "toy-s"
    shutil.copytree(TOY, folder)
    return folder, json.loads((TOY / "config.json").read_text())


def outcome(folder, config):
    """'ok', 'refused' or the exception (or NaN logits) that escaped, for `config` written as config.json."""
    (folder / "config.json").write_text(json.dumps(config))
    try:
        model = kvt.load_model(folder)
        logits, _ = model(torch.tensor([[1, 2, 3, 4, 5]]))
        return "ok" if torch.isfinite(logits).all() else "NaN logits"
    except KvtError as e:
        return "refused" if "\n" not in str(e) else f"a message of several lines: {e}"
    except Exception as e:  # what the fuzz exists to find
        return f"{type(e).__name__}: {str(e)[:120]}"


def mutated(base, path, value):
    config = json.loads(json.dumps(base))
    *parents, key = path
    holder = config
    for p in parents:
        holder = holder.get(p) if isinstance(holder, dict) else None
    if not isinstance(holder, dict):  # an earlier mutation replaced the object this key lives in
        return config
    if value is DELETE:
        holder.pop(key, None)
    else:
        holder[key] = value
    return config


def cases(base):
    """(config, what was done): every key x every value, on each kind of RoPE; then seeded multi-key mixes."""
    out = []
    for kind, rope in ROPES.items():
        start = {**base, "rope_parameters": rope}
        paths = [(key,) for key in KEYS] if kind == "default" else []
        paths += [("rope_parameters", key) for key in (ROPE_KEYS if kind == "default" else rope)]
        for path in paths:
            for value in VALUES + [DELETE]:
                out.append((mutated(start, path, value), f"{kind} rope: {'.'.join(path)} = "
                            f"{'deleted' if value is DELETE else repr(value)}"))
    rng = random.Random(0)
    for _ in range(100):
        config, done = {**base, "rope_parameters": rng.choice(list(ROPES.values()))}, []
        for _ in range(rng.randint(2, 4)):
            path = rng.choice([(key,) for key in KEYS] + [("rope_parameters", key) for key in ROPE_KEYS])
            value = rng.choice(VALUES + [DELETE])
            config = mutated(config, path, value)
            done.append(f"{'.'.join(path)} = {'deleted' if value is DELETE else repr(value)}")
        out.append((config, ", ".join(done)))
    return out


def test_fuzzed_config_ends_in_kvt_error_or_loads(toy):
    """Every mutation of every key kvt reads either loads (and computes finite logits) or ends in one
    KvtError line. Breaks that fail it (each a check dropped from config.FIELDS / ROPE_FIELDS): rms_norm_eps
    ('x': TypeError in the forward pass; -1: NaN logits), rope_theta ('x': TypeError), rope_parameters
    ('x': ValueError from dict()), vocab_size ('x': TypeError from torch.empty), head_dim, num_attention_heads,
    max_position_embeddings (TypeError), and the RoPE keys factor, low_freq_factor, mscale, beta_fast and
    original_max_position_embeddings (TypeError or math domain error)."""
    folder, base = toy
    all_cases = cases(base)
    assert len(all_cases) > 300
    bad = [f"{done}: {result}" for config, done in all_cases if (result := outcome(folder, config)) not in ("ok", "refused")]
    assert not bad, f"{len(bad)} of {len(all_cases)} cases escaped:\n" + "\n".join(bad[:20])
    (folder / "config.json").write_text(json.dumps(base))


@pytest.mark.parametrize("key, value, words", [
    ("architectures", "Qwen3ForCausalLM", ["architectures is 'Qwen3ForCausalLM'", "a list of class names"]),
    ("architectures", -1, ["architectures is -1", "a list of class names"]),
    ("rope_parameters", [1, 2], ["rope_parameters is [1, 2]", "an object"]),
    ("rope_scaling", "x", ["rope_scaling is 'x'", "an object"]),
    ("rms_norm_eps", -1, ["rms_norm_eps is -1", "a positive number below 1"]),
    ("rms_norm_eps", "1e-6", ["rms_norm_eps is '1e-6'", "a positive number below 1"]),
    ("rms_norm_eps", math.nan, ["rms_norm_eps is nan", "a positive number below 1"]),
    ("rope_theta", 0, ["rope_theta is 0", "a number above 1"]),
    ("head_dim", "32", ["head_dim is '32'", "a positive even integer"]),
    ("head_dim", 31, ["head_dim is 31", "a positive even integer"]),
    ("num_attention_heads", 4.0, ["num_attention_heads is 4.0", "a positive integer"]),
])
def test_a_bad_value_is_named_with_what_is_expected(toy, key, value, words):
    """One line names the key, the value and what is expected, and says what to do; never --dtype float32
    (the advice for NaN statistics, which an eps of -1 or a theta of 0 produced before they were checked)."""
    folder, base = toy
    config = {**base, key: value}
    if key == "rope_theta":
        config["rope_parameters"] = {"rope_type": "default"}  # the 4.x spelling: theta at the top level
    with pytest.raises(KvtError) as e:
        config_from_dict(config)
    for w in words + ["use the config.json that came with the checkpoint"]:
        assert w in str(e.value), f"{w!r} not in: {e.value}"
    assert "float32" not in str(e.value)


def test_a_config_json_that_is_not_an_object_is_refused(toy):
    """A config.json holding a list: AttributeError "'list' object has no attribute 'get'" before."""
    folder, base = toy
    (folder / "config.json").write_text(json.dumps([base]))
    with pytest.raises(KvtError, match="config.json holds list .*not an object"):
        kvt.load_model(folder)
    (folder / "config.json").write_text(json.dumps(base))


def test_huge_sizes_are_refused_from_the_headers_before_allocating(toy, monkeypatch):
    """vocab_size 10^9 on a 640-token checkpoint: the model was allocated first and the allocator failed
    ("can't allocate memory"); a head_dim of 2^40 failed building RoPE's table, a config of 10^7 layers
    building the empty model. The headers are compared before _materialize is called (and before the model
    is built at all, for the last two: removing check_outline fails them)."""
    folder, base = toy
    monkeypatch.setattr(model_module, "_materialize", lambda *a: pytest.fail("allocated before the headers were read"))
    for key, value, words in [("vocab_size", 10 ** 9, ["embed_tokens.weight has shape (640, 64)", "(1000000000, 64)"]),
                              ("intermediate_size", 10 ** 8, ["mlp.gate_proj.weight has shape (192, 64)", "(100000000, 64)"]),
                              ("head_dim", 2 ** 40, ["q_proj.weight has shape (128, 64)", "head_dim 1099511627776"]),
                              ("num_hidden_layers", 10 ** 7, ["config.json says 10000000 layers", "model.layers.9999999."])]:
        (folder / "config.json").write_text(json.dumps({**base, key: value}))
        with pytest.raises(KvtError) as e:
            kvt.load_model(folder)
        for w in words + ["config"]:
            assert w in str(e.value), f"{w!r} not in: {e.value}"
    (folder / "config.json").write_text(json.dumps(base))


@pytest.mark.parametrize("index, words", [
    ("{", ["is not a JSON object"]),
    ("[1, 2]", ["is not a JSON object"]),
    ("{}", ["has no weight_map"]),
    ('{"weight_map": [1]}', ["has no weight_map"]),
    ('{"weight_map": {"model.embed_tokens.weight": 3}}', ["has no weight_map"]),
])
def test_a_broken_shard_index_is_refused(toy, index, words):
    """model.safetensors.index.json that is not JSON, or lacks weight_map: JSONDecodeError / KeyError before."""
    folder, _ = toy
    (folder / "model.safetensors.index.json").write_text(index)
    try:
        with pytest.raises(KvtError) as e:
            kvt.load_model(folder)
        for w in words + ["download it again"]:
            assert w in str(e.value), f"{w!r} not in: {e.value}"
    finally:
        (folder / "model.safetensors.index.json").unlink()
