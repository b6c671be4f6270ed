"""kvt.integrations.hf against kvt itself: a handoff between transformers models gives what kvt's handoff gives.

The oracle is kvt's own handoff (handoff.py) + kvt.generate on kvt models loaded from the same
checkpoint folders; the transformers side is the user's: kvt.integrations.hf.transfer, then target.generate.
"""
from types import SimpleNamespace

import pytest
import torch

import kvt
from kvt.harness import toy
from kvt.cache import Cache
from kvt.config import KvtError
from kvt.harness.data import calibration_sequences
from kvt.handoff import handoff
from kvt.calibrate import calibrate
from tests.conftest import ROOT, calib_of, tiny_config

transformers = pytest.importorskip("transformers")
from kvt.integrations import hf  # noqa: E402  (imports transformers

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def assert_close(actual, expected, what, atol=1e-4):
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= atol, f"{what}: max abs error {err:.2e} > {atol:.0e}"


def pair(folders, calib):
    """kvt and transformers models of the checkpoint folders (source, target), and a mapper fitted with kvt."""
    ks, kt = (kvt.load_model(f) for f in folders)
    hs, ht = (transformers.AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval() for f in folders)
    mapper, _ = calibrate(ks, kt, calib)
    return SimpleNamespace(ks=ks, kt=kt, hs=hs, ht=ht, mapper=mapper)


@pytest.fixture(scope="module")
def toy_pair(one_thread):
    """The trained toy pair toy-s -> toy-m, a mapper on a small calibration, and a prompt of 38 tokens that
    ends at a roster name ("... so rosa"), so the next tokens need the transferred context."""
    tok = kvt.load_tokenizer(ROOT / "weights" / "toy-m")
    calib = calibration_sequences(None, tok, 40, 128, documents=toy.corpus(500, seed=99))
    p = pair([ROOT / "weights" / n for n in ("toy-s", "toy-m")], calib)
    p.ids = torch.tensor([tok.encode(toy.corpus(1, seed=5)[0])[:38]])       # (1, 38)
    p.eos = tok.eos_id
    return p


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread):
    """Per family, tiny random source (2 layers) and target (3 layers, wider) saved with kvt.save_model."""
    out = {}
    for family, rope in (("qwen3", None), ("llama", LLAMA3)):
        root = tmp_path_factory.mktemp(family)
        kw = {"rope": rope} if rope else {}
        for name, cfg, seed in (("source", tiny_config(family, **kw), 0),
                                ("target", tiny_config(family, **kw, n_layers=3, dim=96), 1)):
            kvt.save_model(kvt.build_model(cfg, seed=seed, std=0.1), root / name)
        ids = torch.randint(0, 128, (10, 32), generator=torch.Generator().manual_seed(2))
        out[family] = pair([root / "source", root / "target"], calib_of(ids))
    return out


def hf_generate(p, ids, n, mask=None):
    """transformers' greedy continuation after kvt.integrations.hf.transfer: (first-step logits (B, V), new tokens (B, n'))."""
    T = ids.shape[1]
    state = hf.transfer(p.hs, p.ht, p.mapper, ids, mask)
    assert state[hf.CACHE].get_seq_length() == T - 1, "transfer hands over T - 1 slots; the target runs the last token"
    out = p.ht.generate(ids, **state, max_new_tokens=n, do_sample=False, output_logits=True,
                        return_dict_in_generate=True, pad_token_id=0)
    new = out.sequences[:, T:]
    # each token ran once: the last prompt token, then every new one but the last (a 2D attention mask
    # shorter than the cache would silently hide any extra slots, so count them)
    assert state[hf.CACHE].get_seq_length() == T + new.shape[1] - 1
    return out.logits[0], new


def test_round_trip_is_exact(tiny):
    """Guards a conversion that loses or garbles the cache: keys and values swapped, layers reordered,
    a (B, T, H, D) layout, default positions not 0..T-1. Cache -> DynamicCache -> Cache is exact, and a
    transformers prefill read by to_kvt is kvt's own prefill cache of the same weights."""
    g = torch.Generator().manual_seed(0)
    kv = [torch.randn(2, 2, 5, 4, generator=g) for _ in range(6)]      # 3 layers x (B, Hkv, T, D)
    pos = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])
    mask = torch.tensor([[False, False, True, True, True], [True] * 5])
    cache = Cache(kv[:3], kv[3:], pos, mask)
    dyn = hf.to_hf(cache)
    assert isinstance(dyn, transformers.DynamicCache) and dyn.get_seq_length() == 5
    back = hf.to_kvt(dyn, pos, mask)
    for a, b in zip(back.keys + back.values + [back.positions, back.mask], cache.keys + cache.values + [pos, mask]):
        assert torch.equal(a, b)

    p = tiny["qwen3"]
    ids = torch.randint(0, 128, (2, 9), generator=g)
    theirs = hf.to_kvt(getattr(p.ht(ids, use_cache=True), hf.CACHE))
    _, ours = p.kt(ids)
    assert torch.equal(theirs.positions, ours.positions) and torch.equal(theirs.mask, ours.mask)
    for l in range(3):
        assert_close(theirs.keys[l], ours.keys[l], f"layer {l} keys", atol=1e-5)
        assert_close(theirs.values[l], ours.values[l], f"layer {l} values", atol=1e-5)
    again = hf.to_hf(theirs)
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
               for a, b in zip(again.layers, getattr(p.ht(ids, use_cache=True), hf.CACHE).layers))


def test_toy_generate_matches_kvt_handoff(toy_pair):
    """Guards the handoff protocol across the two libraries: a cache of the wrong length (the source
    prefilling the last prompt token too, or transfer running it and generate() running it again), or
    the last token at the wrong position. On the trained toy pair (few near-ties), the target's first
    logits match kvt's handoff within 1e-4 and its 12 greedy tokens are kvt.generate's."""
    p = toy_pair
    logits, cache = handoff(p.ks, p.kt, p.mapper, p.ids)
    want = kvt.generate(p.kt, logits[:, -1], cache, 12, stop_ids={p.eos})[0]
    first, new = hf_generate(p, p.ids, 12)
    assert_close(first, logits[:, -1], "first logits")
    got = new[0].tolist()
    assert len(want) == 12 and got == want, f"transformers {got} != kvt {want}"


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tiny_logits_match_kvt_handoff(tiny, family):
    """Guards a family or padding the transfer gets wrong: Llama 3's scaled RoPE read differently from
    transformers' config, or a left-padded row whose source prefill or positions ignore the mask. On
    tiny random checkpoints (near-ties: logits only) the first logits of a batch with one left-padded
    row match kvt's handoff within 1e-4."""
    p = tiny[family]
    ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 20, dtype=torch.bool)
    ids[1, :3], mask[1, :3] = 0, False                                  # row 1: 3 pads on the left
    logits, _ = handoff(p.ks, p.kt, p.mapper, ids, mask)
    first, _ = hf_generate(p, ids, 1, mask.long())
    assert_close(first, logits[:, -1], f"{family} first logits")


def test_mapper_for_another_pair_refused(tiny):
    """Guards a transfer that maps with a mapper fitted for other models (it would run and emit
    garbage): another family's pair, or source and target swapped, is refused with one line."""
    q, llama = tiny["qwen3"], tiny["llama"]
    ids = torch.randint(0, 128, (1, 8))
    for source, target, what in ((llama.hs, llama.ht, "source"), (q.ht, q.hs, "source"), (q.hs, q.hs, "target")):
        with pytest.raises(KvtError, match=f"another {what} model") as e:
            hf.transfer(source, target, q.mapper, ids)
        assert "\n" not in str(e.value)


def test_right_padding_refused(tiny):
    """Guards a right-padded batch (transformers tokenizers' default side): the target would run a pad
    as the row's last prompt token and continue from it. Refused with one line naming padding_side."""
    p = tiny["qwen3"]
    ids, mask = torch.randint(1, 128, (2, 8)), torch.ones(2, 8, dtype=torch.long)
    mask[1, -2:] = 0
    with pytest.raises(KvtError, match="padding_side='left'") as e:
        hf.transfer(p.hs, p.ht, p.mapper, ids, mask)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("ids,mapper,words", [
    (torch.zeros(8, dtype=torch.long), True, ["shape (batch, tokens)", "ids[None]"]),
    (torch.zeros(1, 8), True, ["integer token ids", "torch.float32"]),
    (torch.zeros(1, 0, dtype=torch.long), True, ["shape (batch, tokens)", "(1, 0)"]),
    (torch.tensor([[1, 2, 10 ** 6]]), True, ["token id 1000000 is outside", "this model's tokenizer"]),
    (torch.zeros(1, 8, dtype=torch.long), None, ["mapper must be a kvt Mapper", "NoneType"]),
], ids=["1-D ids", "float ids", "zero tokens", "id beyond the vocabulary", "mapper None"])
def test_bad_transfer_input_is_one_line(tiny, ids, mapper, words):
    """Guards: kvt.integrations.hf.transfer ending in a traceback deep in transformers or the mapper for 1-D or float
    ids, zero tokens, a token id of 10**6, or mapper None."""
    p = tiny["qwen3"]
    with pytest.raises(KvtError) as e:
        hf.transfer(p.hs, p.ht, p.mapper if mapper else None, ids)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
