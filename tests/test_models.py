"""kvt's three families against transformers: logits and every layer's K and V, prefill and continuation.

The tiny checkpoints and transformers' outputs live in tests/golden (made by make_golden.py), so the
check runs without transformers; where transformers is installed it is also recomputed live.
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kvt
from kvt.config import KvtError, config_from_dict, parse_pair, check_matched_kv, shape
from kvt.fast import reserve
from tests.conftest import tiny_config

GOLDEN = Path(__file__).parent / "golden"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "expected.safetensors").exists())
PREFILL = 16


def assert_close(actual, expected, what, atol=1e-4):
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= atol, f"{what}: max abs error {err:.2e} > {atol:.0e}"


def kvt_outputs(model, ids):
    """kvt's logits for ids: prefill PREFILL tokens, then continue from the cache."""
    logits1, cache = model(ids[:, :PREFILL])
    logits2, cache = model(ids[:, PREFILL:], cache=cache)
    return torch.cat([logits1, logits2], 1), cache


def check(model, expected, ids):
    """Prefill then continuation, and (row 0) one token at a time after the prefill: a single token
    takes the one-token path of every layer (a wrong cache update there fails the last check)."""
    logits, cache = kvt_outputs(model, ids)
    assert_close(logits, expected["logits"], "logits")
    for l in range(model.config.n_layers):
        assert_close(cache.keys[l], expected[f"keys.{l}"], f"layer {l} keys")
        assert_close(cache.values[l], expected[f"values.{l}"], f"layer {l} values")
    _, cache = model(ids[:1, :PREFILL])
    for t in range(PREFILL, ids.shape[1]):
        step, cache = model(ids[:1, t:t + 1], cache=cache)
        assert_close(step[0, 0], expected["logits"][0, t], f"row 0, token {t} alone")


def test_cases_present():
    assert {"qwen3", "llama3-factor8", "llama3-factor32-tied", "ministral3-yarn", "mistral3-multimodal"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_matches_golden(case):
    expected = load_file(GOLDEN / case / "expected.safetensors")
    check(kvt.load_model(GOLDEN / case), expected, expected["ids"])


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers_live(case, tmp_path):
    pytest.importorskip("transformers")
    import sys
    sys.path.insert(0, str(GOLDEN))
    import make_golden
    model = make_golden.hf_model(case)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(7))
    expected = make_golden.hf_outputs(model, ids)
    model.save_pretrained(tmp_path)
    check(kvt.load_model(tmp_path), expected, ids)


def test_query_temperature_is_exercised():
    """The Ministral case runs past original_max_position_embeddings (16), where queries get hotter."""
    cfg = kvt.load_config(GOLDEN / "ministral3-yarn")
    assert cfg.rope["original_max_position_embeddings"] < 24
    t = kvt.rope.query_temperature(cfg, torch.arange(24)[None])
    assert t[0, 0, 0, 0] == 1 and t[0, 0, -1, 0] > 1


def test_left_padding_matches_unpadded():
    model = kvt.load_model(GOLDEN / "qwen3")
    ids = torch.randint(0, 96, (1, 10))
    alone, _ = model(ids)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.tensor([[False] * 3 + [True] * 10])
    logits, cache = model(padded, mask=mask)
    assert_close(logits[:, 3:], alone, "left-padded logits")
    assert cache.positions[0, 3:].tolist() == list(range(10))
    more, _ = model(ids[:, :2], cache=cache)  # continuing a padded row
    ref, _ = model(torch.cat([ids, ids[:, :2]], 1))
    assert_close(more, ref[:, 10:], "continuation after padding")


def test_bf16_close_to_fp32():
    ids = torch.randint(0, 96, (1, 16))
    ref, _ = kvt.load_model(GOLDEN / "llama3-factor8")(ids)
    out, cache = kvt.load_model(GOLDEN / "llama3-factor8", dtype=torch.bfloat16)(ids)
    assert out.dtype == cache.keys[0].dtype == torch.bfloat16
    assert_close(out, ref, "bf16 logits", atol=0.15 * ref.abs().max().item())


def test_generate_greedy_matches_argmax_loop():
    """Guards: decode diverging from a full rerun, a stop token kept, and logprobs taken at the wrong
    position or unnormalized."""
    model = kvt.load_model(GOLDEN / "qwen3")
    ids = torch.randint(0, 96, (1, 5))
    logits, cache = model(ids)
    out = kvt.generate(model, logits[:, -1], cache, max_new_tokens=6)[0]
    seq = ids
    for _ in range(6):  # the slow way: rerun the whole sequence each step
        seq = torch.cat([seq, model(seq)[0][:, -1:].argmax(-1)], 1)
    assert out == seq[0, 5:].tolist()
    stopped = kvt.generate(model, logits[:, -1], cache, 6, stop_ids={out[2]})[0]
    assert stopped == out[:out.index(out[2])]
    lps = [[]]                                      # the confidence kvt/teach/cascade.py reads
    kvt.generate(model, logits[:, -1], cache, 6, logprobs=lps)
    want = model(seq)[0][0, 4:-1].log_softmax(-1).gather(-1, seq[0, 5:, None])[:, 0]  # each token given those before
    assert torch.allclose(torch.tensor(lps[0]), want, atol=1e-5), (lps[0], want)


# ---- config and weights: every bad input is one line that says what to do ----

def hf_config(**kw):
    return {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128, "intermediate_size": 8,
            "rms_norm_eps": 1e-6, "rope_theta": 1e6, **kw}


def test_head_dim_from_config_not_derived():
    assert config_from_dict(hf_config()).head_dim == 128


def test_rope_4x_and_5x_forms_agree():
    old = config_from_dict(hf_config(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}))
    new = config_from_dict(hf_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                      "original_max_position_embeddings": 8}))
    assert old.rope == new.rope


@pytest.mark.parametrize("extra,key", [
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"num_experts": 8}, "num_experts"),
    ({"attention_bias": True}, "attention_bias"),
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    ({"rope_scaling": {"rope_type": "longrope"}}, "longrope"),
])
def test_refuses_what_is_not_implemented(extra, key):
    with pytest.raises(KvtError, match=key):
        config_from_dict(hf_config(**extra))


def test_refuses_short_sliding_window():
    with pytest.raises(KvtError, match="sliding_window"):
        config_from_dict(hf_config(sliding_window=64, use_sliding_window=True), context=1024)
    config_from_dict(hf_config(sliding_window=64, use_sliding_window=False), context=1024)


def test_overlong_context_refused():
    model = kvt.load_model(GOLDEN / "qwen3")
    with pytest.raises(KvtError, match="max_position_embeddings"):
        model(torch.zeros(1, model.config.max_seq_len + 1, dtype=torch.long))


def test_missing_folder_names_download_command(tmp_path):
    with pytest.raises(KvtError, match="hf download Qwen/Qwen3-14B"):
        kvt.load_model(tmp_path / "qwen3-14b")
    with pytest.raises(KvtError, match="python -m kvt.harness.toy train --out .* --members toy-l"):
        kvt.load_model(tmp_path / "toy-l")  # the toy family is trained, not downloaded


def test_truncated_and_missing_shards(tmp_path):
    src = GOLDEN / "qwen3"
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    data = (src / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(KvtError, match="truncated|unreadable"):
        kvt.load_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(KvtError, match="shard model-00001-of-00002.safetensors is missing"):
        kvt.load_model(tmp_path)


def test_sharded_checkpoint_loads(tmp_path):
    from safetensors.torch import load_file as load, save_file
    tensors = load(GOLDEN / "qwen3" / "model.safetensors")
    names = sorted(tensors)
    halves = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / file)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, ks in halves.items() for k in ks}}))
    (tmp_path / "config.json").write_text((GOLDEN / "qwen3" / "config.json").read_text())
    ids = torch.randint(0, 96, (1, 8))
    assert torch.equal(kvt.load_model(tmp_path)(ids)[0], kvt.load_model(GOLDEN / "qwen3")(ids)[0])


def test_shape_mismatch(tmp_path):
    cfg = json.loads((GOLDEN / "qwen3" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 50}))
    (tmp_path / "model.safetensors").write_bytes((GOLDEN / "qwen3" / "model.safetensors").read_bytes())
    with pytest.raises(KvtError, match="shape"):
        kvt.load_model(tmp_path)


def test_save_model_roundtrip(tmp_path):
    model = kvt.build_model(shape("qwen3-0.6b").__class__(**{**kvt.load_config(GOLDEN / "qwen3").__dict__, "tie_embeddings": True}), seed=3)
    kvt.save_model(model, tmp_path)
    ids = torch.randint(0, 96, (1, 8))
    assert torch.equal(kvt.load_model(tmp_path)(ids)[0], model(ids)[0])


def test_named_pairs_checked_before_download():
    assert parse_pair("qwen3-14b:32b") == ("qwen3-14b", "qwen3-32b")
    check_matched_kv(shape("qwen3-14b"), shape("qwen3-32b"))
    check_matched_kv(shape("llama3.1-8b"), shape("llama3.1-70b"))
    with pytest.raises(KvtError, match="matched-KV"):
        check_matched_kv(shape("llama3.2-1b"), shape("llama3.1-8b"))  # head dim 64 vs 128
    with pytest.raises(KvtError, match="unknown model"):
        shape("qwen3-15b")


@pytest.mark.parametrize("queries", [False, True])
def test_queries_are_kept_only_when_asked(queries):
    """forward(queries=False) lets each layer's queries go as soon as the next layer runs. Guards:
    appending every layer's q to a list whether asked or not, which holds them all until the pass ends
    (about 32 GiB at 32K tokens on Qwen3-32B in bf16, memory the plan does not count)."""
    import weakref
    model = kvt.build_model(tiny_config(n_layers=3))
    refs, alive = [], []
    for block in model.model.layers:
        block.self_attn.register_forward_hook(lambda m, i, out: refs.append(weakref.ref(out[1])))
    model.model.norm.register_forward_pre_hook(lambda m, i: alive.append([r() is not None for r in refs]))
    with torch.no_grad():
        _, cache = model(torch.randint(0, 128, (1, 8)), queries=queries)
    assert alive[0][:2] == [queries, queries], alive  # layers 0 and 1, when the final norm runs
    assert (cache.queries is not None) == queries


def test_a_prefill_cache_keeps_each_heads_slots_together():
    """A prefill's keys and values are (B, Hkv, T, D) in memory, the layout the mapper's batched matmuls
    read. Guards: keeping the projections' token-major views (B, T, Hkv, D), which every transfer then
    copies, and decode's attention reads with a stride."""
    model = kvt.build_model(tiny_config(n_layers=2), seed=0)
    _, cache = model(torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0)))
    assert all(t.is_contiguous() for t in cache.keys + cache.values), [t.stride() for t in cache.keys]


def test_decode_appends_in_place_into_owned_room_and_never_into_views():
    """Decoding from a reserved cache (fast.reserve, fast.Reserved) writes each step's K and V into its buffer (no copy of the T slots
    before it), one token at a time gives the logits of one prefill, and a view (crop, expand) is never
    written into. Guards: concatenating at every step (O(T) copies per token), an in-place write into
    storage a crop or expand shares with another cache, and a decode step that needs an attention
    mask and gets none."""
    model = kvt.build_model(tiny_config(n_layers=2), seed=0, std=0.2)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    want, whole = model(ids)
    _, cache = model(ids[:, :6])
    owned = reserve(cache, 6)
    buffer = owned.keys[0].data_ptr()
    for t in range(6, 12):
        logits, owned = model(ids[:, t:t + 1], cache=owned)
        assert_close(logits[:, -1], want[:, t], f"step {t}")
        assert owned.keys[0].data_ptr() == buffer and owned.room == 11 - t, "the step copied the cache"
    assert_close(owned.keys[1], whole.keys[1], "keys written in place")
    before = [k.clone() for k in cache.keys]
    prefix = owned.crop(0, 8)
    model(ids[:, 8:10], cache=prefix)                              # a view: it must concatenate, not write
    assert_close(owned.keys[0][:, :, 8:], whole.keys[0][:, :, 8:], "the owner's slots after a crop was continued")
    assert all(torch.equal(a, b) for a, b in zip(cache.keys, before)), "reserve changed the cache it copied"
    padded, pmask = torch.cat([torch.zeros(2, 3, dtype=torch.long), ids[:, :6]], 1), torch.ones(2, 9, dtype=torch.bool)
    pmask[:, :3] = False                                           # left padding: decode must keep masking it
    _, pc = model(padded, mask=pmask)
    logits, _ = model(ids[:, 6:7], cache=reserve(pc, 1))
    assert_close(logits[:, -1], want[:, 6], "a step after left padding")


FAULTS = """
import resource, sys, torch
from kvt.fast import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
faults = []
for _ in range(4):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    layers = [torch.ones(2 << 20) for _ in range(16)]          # a cache's worth of 8 MiB layers, written
    del layers
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(*faults)
"""


@pytest.mark.skipif(not Path("/lib/x86_64-linux-gnu/libc.so.6").exists() and not Path("/lib64/libc.so.6").exists(),
                    reason="keep_freed_memory tunes glibc's malloc only")
def test_keep_freed_memory_spares_a_second_cache_its_page_faults():
    """A cache of the size of the last ones reuses their freed memory instead of faulting in fresh pages
    (the mapping at 4K tokens took ~90K page faults per transfer): from the third cache on, none (the
    second still grows the heap by part of its size). Guards: mallopt constants or values that glibc
    rejects or ignores, which leave every later cache page-faulting as the first did."""
    import subprocess
    import sys
    run = lambda how: [int(f) for f in subprocess.run([sys.executable, "-c", FAULTS, how], capture_output=True,  # noqa: E731
                                                       text=True, check=True).stdout.split()]
    default, kept = run("default"), run("keep")
    assert default[1] > 0.5 * default[0], f"glibc's default no longer faults a second cache in: {default}"
    assert max(kept[2:]) < 0.1 * kept[0], f"page faults per round with keep_freed_memory: {kept}"
