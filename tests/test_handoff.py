"""handoff.py: an exact pair and the identity pair hand over without changing the target's predictions."""
import pytest
import torch
from conftest import calib_of, function_preserving_twin, tiny_config

import kvt
from kvt.handoff import handoff
from kvt.harness.diagnose import diagnose, format_diagnostics, gate, kl
from kvt.calibrate import calibrate

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.randint(0, 128, (14, 24), generator=torch.Generator().manual_seed(0))
CALIB = calib_of(IDS)
PROMPTS = torch.randint(0, 128, (3, 30), generator=torch.Generator().manual_seed(9))


def assert_close(actual, expected, what, atol=1e-4):
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= atol, f"{what}: max abs error {err:.2e} > {atol:.0e}"


@pytest.fixture(scope="module")
def exact():
    source = kvt.build_model(tiny_config("qwen3", n_layers=3), seed=0)
    target = function_preserving_twin(source, seed=1)
    mapper, _ = calibrate(source, target, CALIB, scope="head", k=1, lam=1e-9)
    return source, target, mapper


def test_exact_pair_handoff_reproduces_the_targets_logits(exact):
    source, target, mapper = exact
    logits, cache = handoff(source, target, mapper, PROMPTS)
    own, own_cache = target(PROMPTS)
    assert logits.shape == (3, 1, 128) and len(cache) == PROMPTS.shape[1]
    assert_close(logits[:, -1], own[:, -1], "first logits after handoff")
    nxt = own[:, -1].argmax(-1, keepdim=True)                               # (B, 1)
    assert_close(target(nxt, cache=cache)[0], target(nxt, cache=own_cache)[0], "next step from the handed-over cache")


def test_exact_pair_diagnostics_and_gate(exact):
    source, target, mapper = exact
    d = diagnose(source, target, mapper, PROMPTS)
    assert min(d["r2_k"] + d["r2_v"]) > 1 - 1e-6, format_diagnostics(d)
    assert min(d["attn_cos"]) > 1 - 1e-5 and abs(d["kl"]) < 1e-6, format_diagnostics(d)
    assert gate(d) == (True, [])


def test_identity_pair_keeps_the_next_token_distribution():
    model = kvt.build_model(tiny_config("llama", n_layers=3), seed=4)
    mapper, report = calibrate(model, model, CALIB)   # k = 8 -> all 3 layers, lambda per layer
    logits, _ = handoff(model, model, mapper, PROMPTS)
    own, _ = model(PROMPTS)
    div = kl(own[:, -1], logits[:, -1])
    assert div < 1e-4, f"KL(own || handoff) {div:.2e} at lambda {report['lambda']}"


def test_handoff_of_a_left_padded_batch_matches_each_prompt_alone(exact):
    source, target, mapper = exact
    short = PROMPTS[1, 5:]                                                  # 25 tokens, padded to 30 on the left
    ids = torch.stack([PROMPTS[0], torch.cat([torch.zeros(5, dtype=torch.long), short])])
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :5] = False
    logits, _ = handoff(source, target, mapper, ids, mask=mask)
    assert_close(logits[1], handoff(source, target, mapper, short[None])[0][0], "padded row")
    assert_close(logits[0], handoff(source, target, mapper, PROMPTS[:1])[0][0], "full row")


def test_gate_flags_an_unrelated_pair_and_thresholds_are_settable():
    source = kvt.build_model(tiny_config("llama", n_layers=2), seed=0)
    target = kvt.build_model(tiny_config("llama", n_layers=2), seed=1)     # unrelated weights
    mapper, _ = calibrate(source, target, CALIB)
    d = diagnose(source, target, mapper, PROMPTS)
    ok, reasons = gate(d, min_attn_cos=0.999, max_kl=1e-6)
    assert not ok and len(reasons) == 2, reasons
    assert gate(d, min_attn_cos=-1.0, max_kl=float("inf"))[0]
    assert "attn cos" in format_diagnostics(d)


def test_diagnostics_pool_over_sequences_like_one_batch(exact):
    """diagnose runs one sequence at a time (the queries of every layer are held for one only); its R^2
    pools the sequences as one batch would. Guards: averaging per-sequence R^2, or centering each
    sequence on its own mean."""
    source, _, _ = exact
    target = kvt.build_model(tiny_config("qwen3", n_layers=3), seed=5)  # an unrelated model: R^2 < 1
    mapper, _ = calibrate(source, target, CALIB)
    d = diagnose(source, target, mapper, PROMPTS)
    _, src = source(PROMPTS)
    _, true = target(PROMPTS)
    mapped = mapper.apply(src)
    def r2(pred, y):                                                   # pooled over the batch, written out
        y, pred = y.double(), pred.double()
        return 1 - ((y - pred) ** 2).sum().item() / ((y - y.mean((0, 2), keepdim=True)) ** 2).sum().item()
    want = [r2(mapped.values[l], true.values[l]) for l in range(3)]
    assert max(abs(a - b) for a, b in zip(d["r2_v"], want)) < 1e-9, (d["r2_v"], want)
    assert min(want) < 0.999


def test_recomputing_every_slot_is_the_targets_own_prefill():
    """Selective recompute of all T-1 mapped slots gives the target's own prefill (within 1e-4), for a
    map that is far from exact. Guards: recomputed tokens attending to mapped slots after them (a wrong
    causal mask over slots), K and V written to the wrong slots, or RoPE at the wrong positions."""
    from kvt.handoff import Recompute
    source = kvt.build_model(tiny_config("qwen3", n_layers=3), seed=0)
    target = kvt.build_model(tiny_config("qwen3", n_layers=3), seed=5)     # unrelated: the map alone is poor
    mapper, _ = calibrate(source, target, CALIB)
    ids = PROMPTS[:1]
    own, own_cache = target(ids)
    mapped, _ = handoff(source, target, mapper, ids)
    assert (mapped[:, -1] - own[:, -1]).abs().max() > 1e-2, "the test needs a map that is not already exact"
    logits, cache = handoff(source, target, mapper, ids, recompute=Recompute(first=ids.shape[1]))
    assert_close(logits[:, -1], own[:, -1], "logits after recomputing every slot")
    for l in range(3):
        assert_close(cache.keys[l], own_cache.keys[l], f"layer {l} keys after recomputing every slot")


def test_recomputing_a_suffix_is_the_target_running_it_from_the_mapped_prefix():
    """Recompute(last=r) equals the target running the last r + 1 prompt tokens itself on the cache
    mapped from the first T - r - 1 (a wider handoff). Guards: recomputed slots attending to mapped
    slots after them, or the suffix written at other positions."""
    from kvt.handoff import Recompute
    source = kvt.build_model(tiny_config("qwen3", n_layers=3), seed=0)
    target = kvt.build_model(tiny_config("qwen3", n_layers=3), seed=5)
    mapper, _ = calibrate(source, target, CALIB)
    ids, r = PROMPTS[:1], 6
    logits, cache = handoff(source, target, mapper, ids, recompute=Recompute(last=r))
    T = ids.shape[1]
    _, src = source(ids[:, :T - r - 1])
    want, want_cache = target(ids[:, T - r - 1:], cache=mapper.apply(src))
    assert_close(logits[:, -1], want[:, -1], "logits after recomputing the suffix")
    assert_close(cache.values[2], want_cache.values[2], "last layer values")


def test_recompute_budgets_pick_the_slots_they_name():
    from kvt.harness.recompute import Recompute, attention_mass
    scores = torch.tensor([0.1, 5.0, 0.2, 3.0, 0.3, 0.0, 0.4, 0.5, 0.6, 0.7])
    assert Recompute(last=2).slots(10).tolist() == [8, 9]
    assert Recompute(first=1, last=1).slots(10).tolist() == [0, 9]
    assert Recompute(frac=0.2).slots(10, scores).tolist() == [1, 3]
    assert Recompute(frac=0.2, by="suffix").slots(10).tolist() == [8, 9]                # the baseline for attention
    assert Recompute(frac=0.2, first=1, by="suffix").slots(10).tolist() == [0, 8, 9]
    model = kvt.build_model(tiny_config("qwen3", n_layers=2), seed=0)
    _, cache = model(PROMPTS[:1], queries=True)
    mass = attention_mass(cache, window=4)
    assert mass.shape == (30,) and abs(mass.sum().item() - 2 * 4 * 4) < 1e-3  # 2 layers x 4 heads x 4 queries, each sums to 1


def test_exact_pair_keeps_all_the_context_gain(exact):
    """next_nll on an exact pair: the transfer scores the tokens after the context as the target does,
    the floor (the last context token alone) is its own prefill; a random target gains nothing from the
    context, so context_gain gives no ratio (summary.context_gain's no_ratio) over the same NLLs. Guards: the
    target's or the transfer's logits scored one token off (predicting the token they were given), the
    transfer's first prediction (from the handoff) dropped."""
    from kvt.harness.diagnose import next_nll
    from kvt.harness.summary import context_gain
    source, target, mapper = exact
    ids, context = PROMPTS, 20
    nll = next_nll(source, target, mapper, ids, context)
    for i, seq in enumerate(ids):
        logits, _ = target(seq[None, :-1])
        lp = logits[0, context - 1:].log_softmax(-1)                       # predicts seq[context:]
        want = -lp.gather(1, seq[context:, None]).mean().item()
        assert abs(nll["target"][i].item() - want) < 1e-5, f"window {i}: target NLL {nll['target'][i]:.6f} != {want:.6f}"
        alone, _ = target(seq[None, context - 1:-1])
        want = -alone[0].log_softmax(-1).gather(1, seq[context:, None]).mean().item()
        assert abs(nll["floor"][i].item() - want) < 1e-5, f"window {i}: floor NLL"
    assert_close(nll["transfer"], nll["target"], "transfer NLL on an exact pair", 1e-4)
    gain = context_gain(nll)
    assert gain["gain"] is None and "not above its noise" in gain["no_ratio"] and gain["windows"] == 3, gain
    assert abs(gain["nll"]["transfer"] - gain["nll"]["target"]) < 1e-4, gain
