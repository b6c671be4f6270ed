"""evals.py: cache scoring against a one-pass oracle, metrics on hand-built cases, prompts and
answer extraction on real data (../shared/data, or $KVT_SHARED/data)."""
import json

import pytest
import torch
from conftest import SHARED, function_preserving_twin, tiny_config

from kvt import evals as E
from kvt.config import KvtError
from kvt.mapper import calibrate
from kvt.model import build_model

DATA = SHARED / "data"
needs_data = pytest.mark.skipif(not DATA.exists(), reason=f"no shared data at {DATA}")


class CharTok:
    """A tokenizer of one id per character (ASCII), enough to drive a tiny random model."""
    eos_id = 3

    def encode(self, text, special=True):
        return [ord(c) % 128 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def tiny(family="llama", seed=0):
    return build_model(tiny_config(family), seed=seed, std=0.2)  # std 0.2: logits that vary


# ------------------------------------------------------------------ scoring from a cache = one pass

@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_scoring_from_cache_equals_one_pass(family):
    model = tiny(family)
    ctx = [5, 17, 99, 23, 8, 64, 1]
    conts = [[40], [7, 7, 120, 3], [88, 2], [11, 12, 13, 14, 15, 16]]  # lengths 1..6: right padding
    lls, greedy = E.loglikelihoods(E.Condition(model), ctx, conts)
    for cont, ll, g in zip(conts, lls, greedy):
        logits, _ = model(torch.tensor([ctx + cont]))                 # (1, T + Tc, V)
        logp = logits[0, len(ctx) - 1:-1].float().log_softmax(-1)     # positions predicting cont
        want = logp[torch.arange(len(cont)), cont].sum().item()
        assert abs(ll - want) < 1e-4, f"{family}: cache {ll} vs one pass {want}"
        assert g == (logp.argmax(-1).tolist() == cont)


def test_scoring_uses_the_given_prefill():
    """A condition's prefill decides the cache: a chunked prefill gives the same scores, another
    context's cache gives different ones."""
    model = tiny()
    ctx, conts = [5, 17, 99, 23, 8, 64, 1], [[40, 41], [7, 3, 9]]

    def chunked(ids):  # the context in two pieces, the second continuing from the first's cache
        _, cache = model(ids[:, :4])
        logits, cache = model(ids[:, 4:], cache=cache)
        return logits[:, -1], cache

    own = E.loglikelihoods(E.Condition(model), ctx, conts)[0]
    assert torch.allclose(torch.tensor(E.loglikelihoods(E.Condition(model, chunked), ctx, conts)[0]),
                          torch.tensor(own), atol=1e-4)
    other = E.loglikelihoods(E.Condition(model, lambda ids: E.Condition(model)(ids.flip(1))), ctx, conts)[0]
    assert max(abs(a - b) for a, b in zip(own, other)) > 1e-3


def test_mc_metrics_hand_built():
    choices = ["a long answer", "b", "cc"]   # lengths 13, 1, 2
    m = E.mc_metrics([-10.0, -9.0, -12.0], choices, gold=0)
    # acc: -9 is the largest; acc_norm: -10/13 = -0.77 beats -9/1 and -12/2 = -6
    assert (m["pred"], m["pred_norm"], m["acc"], m["acc_norm"]) == (1, 0, 0.0, 1.0)
    assert E.mc_metrics([-1.0, -1.0, -3.0], ["x", "y", "z"], gold=1)["pred"] == 0  # ties: first, as np.argmax
    # the harness divides by len(choice), characters: -4.4/4 < -3/3 (by UTF-8 bytes it would be -4.4/8 > -1)
    assert E.mc_metrics([-4.4, -3.0], ["\u00e9\u00e9\u00e9\u00e9", "abc"], gold=1)["pred_norm"] == 1


def test_encode_pair_moves_trailing_space():
    tok = CharTok()
    assert E.encode_pair(tok, "Answer: ", "B") == (tok.encode("Answer:"), tok.encode(" B"))
    assert E.encode_pair(tok, "", " end") == ([tok.eos_id], tok.encode(" end"))


# ------------------------------------------------------------------------------- data and prompts

@needs_data
def test_hellaswag_preprocess_real_items():
    items = E.hellaswag(DATA)
    rows = [json.loads(line) for line in open(DATA / "hellaswag/validation.jsonl")]
    assert len(items) == len(rows) == 10042
    it = items[3243]  # a WikiHow item: [header], [title], [step] and [substeps] markers
    assert rows[3243]["ctx_a"].startswith("[header] How to become a fashion consultant [title] Obtain")
    assert it.context == ("Personal Care and Style: How to become a fashion consultant. Obtain your high "
                          "school diploma or ged. This job requires a high school diploma or equivalent, so make "
                          "sure to apply yourself and finish school. If your high school offers these classes, "
                          "take art, design, and sewing to familiarize yourself with foundational concepts in "
                          "fashion.")
    # strip() comes first, so a removed leading "[substeps]" leaves a space, as in the harness
    assert it.choices[0] == (" Many high schools have classes offered for their students who do not have a high "
                             "school diploma, so be sure to register to take these classes and find a job in your "
                             "field.. Search for entry-level positions in fashion industries.")
    assert items[0].context == "Roof shingle removal: A man is sitting on a roof. He"
    assert items[0].choices[3] == "starts pulling up roofing on a roof." and items[0].gold == 3
    assert not any("[" in i.context or "  " in i.context for i in items)


@needs_data
def test_prompts_follow_the_harness():
    arc = E.arc(DATA, "arc_easy", limit=1)[0]
    assert arc.context == ("Question: Which statement best explains why photosynthesis is the foundation of "
                           "most food webs?\nAnswer:")
    assert arc.gold == 0 and arc.floor == "Answer:"
    m5, m0 = E.mmlu(DATA, limit=1)[0], E.mmlu(DATA, shots=0, limit=1)[0]
    head = "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
    q = ("Find the degree for the given field extension Q(sqrt(2), sqrt(3), sqrt(18)) over Q.\n"
         "A. 0\nB. 4\nC. 2\nD. 6\nAnswer:")
    assert m0.context == head + q and m0.choices == ["A", "B", "C", "D"] and m0.gold == 1
    assert m5.context.startswith(head + "Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field.\n")
    assert m5.context.endswith("Find the characteristic of the ring 2Z.\nA. 0\nB. 3\nC. 12\nD. 30\nAnswer: A\n\n" + q) and m5.context.count("Answer:") == 6
    g = E.gsm8k(DATA, limit=1)[0]
    assert g.context.startswith("Q: There are 15 trees in the grove.") and g.context.count("\nA: ") == 8
    assert g.context.endswith("\n\nQ: Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every "
                              "morning and bakes muffins for her friends every day with four. She sells the "
                              "remainder at the farmers' market daily for $2 per fresh duck egg. How much in "
                              "dollars does she make every day at the farmers' market?\nA:")
    assert g.gold == "18"


@needs_data
def test_coqa_pieces_make_the_harness_prompt():
    conv = E.coqa(DATA, limit=1)[0]
    assert len(conv.questions) == 10 and all(len(a) >= 1 for a in conv.answers)
    pieces = E.coqa_segments(conv)
    for t in (1, 4):  # the harness's doc_to_text for turn t: story, gold history, "Q: q_t\n\nA:"
        want = conv.story + "\n\n" + "".join(f"Q: {conv.questions[i]}\n\nA: {conv.answers[i][0]}\n\n"
                                             for i in range(t - 1)) + f"Q: {conv.questions[t - 1]}\n\nA:"
        assert "".join(pieces[:t]) == want


def test_missing_file_names_it_and_how_to_get_it(tmp_path):
    with pytest.raises(KvtError) as e:
        E.load_task("arc_challenge", tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "arc_challenge/test.jsonl") in msg
    assert 'load_dataset("allenai/ai2_arc", "ARC-Challenge", split="test")' in msg
    assert "to_json" in msg and "../shared/data" in msg
    with pytest.raises(KvtError, match="unknown task"):
        E.load_task("piqa", tmp_path)


# --------------------------------------------------------------------------- GSM8K answer extraction

def test_gsm8k_extraction_hand_cases():
    out = " Janet sells 16 - 3 - 4 = 9 duck eggs a day. She makes 9 * 2 = $18 every day. The answer is 18.\n\n"
    assert (E.gsm8k_strict(out), E.gsm8k_flexible(out)) == ("18", "18.")
    assert E.gsm8k_exact_match("18.", "18") == 1.0
    assert E.gsm8k_strict("so it costs $1,200. The answer is 1,200.") == "1,200"
    assert E.gsm8k_exact_match(E.gsm8k_flexible("it is $1,200."), "1200") == 1.0
    assert E.gsm8k_strict("The answer is -3 dollars") == "-3"
    assert E.gsm8k_strict("The answer is 18") == "1"   # the yaml's final "." takes a character: harness quirk
    assert E.gsm8k_strict("I do not know.") == E.gsm8k_flexible("no digits") == "[invalid]"
    assert E.gsm8k_exact_match("[invalid]", "18") == 0.0
    assert E.gsm8k_flexible("5 + 4 = 9 toys, 3 left") == "3"


@needs_data
def test_gsm8k_extraction_real_answers():
    rows = [json.loads(line) for line in open(DATA / "gsm8k/test.jsonl")][:300]
    for row in rows:
        reasoning, gold = row["answer"].split("####")
        gold = gold.strip()
        # the reference solution itself ends in "#### N": the flexible filter takes N
        assert E.gsm8k_exact_match(E.gsm8k_flexible(row["answer"]), gold) == 1.0, row["answer"]
        # the same reasoning in the exemplars' style, then the stop string that generation cuts at
        out = " " + reasoning.replace("\n", " ").strip() + f" The answer is {gold}.\n\nQ:"
        text = out.split("Q:")[0]
        assert E.gsm8k_exact_match(E.gsm8k_strict(text), gold) == 1.0, text
        assert E.gsm8k_exact_match(E.gsm8k_flexible(text), gold) == 1.0, text
        wrong = str(int(gold.replace(",", "")) + 1)
        assert E.gsm8k_exact_match(E.gsm8k_strict(f"The answer is {wrong}."), gold) == 0.0


# -------------------------------------------------------------------------------------- generation

def test_converse_extends_the_cache_like_a_fresh_prefill():
    """Answers from the growing cache equal answers from prefilling each turn's whole prompt anew."""
    model, tok = tiny(seed=1), CharTok()
    conv = E.Conversation("c", "Tom has a red ball. He plays.", ["What color?", "Who plays?", "Where?"],
                          [["red"], ["Tom"], ["unknown"]])
    answers = E.converse(E.Condition(model), tok, conv, start=2, max_new_tokens=6)
    pieces = E.coqa_segments(conv)
    for t, a in zip((2, 3), answers):
        ids = torch.tensor([tok.encode("".join(pieces[:t]))])
        logits, cache = model(ids)
        out = E.generate(model, logits[:, -1], cache, 6, stop_ids=(tok.eos_id,), stop=("\n",),
                         decode=lambda x: tok.decode(x).lstrip())[0]
        assert a == tok.decode(out).strip().split("\n")[0]
    assert len(answers) == 2


def test_generate_until_cuts_at_stop_strings():
    model, tok = tiny(seed=2), CharTok()
    tok.eos_id = -1  # no end token: only the stop strings and max_new_tokens end generation
    full = E.generate_until(E.Condition(model), tok, "Q: 1+1?\nA:", until=(), max_new_tokens=12)
    assert len(full) == 12
    stop = full[5]
    cut = E.generate_until(E.Condition(model), tok, "Q: 1+1?\nA:", until=(stop,), max_new_tokens=12)
    assert cut == full.split(stop)[0]


# ----------------------------------------------------------------------------- records and summary

@needs_data
def test_evaluate_records_resume_and_identity_transfer():
    model, tok = tiny(seed=3), CharTok()
    items = E.arc(DATA, "arc_easy", limit=3)
    conds = E.conditions(model, transfer=lambda ids: E.Condition(model)(ids))  # an identity "transfer"
    recs = list(E.evaluate("arc_easy", items, tok, conds, progress=False))
    assert [(r["idx"], r["condition"]) for r in recs][:3] == [(0, "target"), (0, "floor"), (0, "transfer")]
    for r in recs:
        assert set(r) >= {"task", "condition", "idx", "id", "lls", "acc", "acc_norm"}
        json.dumps(r)  # plain data: one jsonl line
    same = {(r["condition"], r["idx"]): r["lls"] for r in recs}
    assert all(same[("transfer", i)] == same[("target", i)] for i in range(3))
    rest = list(E.evaluate("arc_easy", items, tok, conds, done=[("target", 0), ("floor", 1)], progress=False))
    assert len(rest) == len(recs) - 2 and ("target", 0) not in {(r["condition"], r["idx"]) for r in rest}
    s = E.summarize(recs, n_boot=50)["arc_easy"]
    assert s["target"]["n"] == 3 and s["retention"]["acc_norm"]["n"] == 3
    if s["target"]["acc"] > 0:
        assert s["retention"]["acc"]["ratio"] == 1.0


def test_summary_retention_and_intervals():
    def recs(cond, accs):
        return [{"task": "arc_easy", "condition": cond, "idx": i, "acc": a, "acc_norm": a} for i, a in enumerate(accs)]
    records = recs("target", [1, 1, 1, 1, 0, 0, 0, 0]) + recs("transfer", [1, 1, 1, 0, 0, 0, 0, 0]) \
        + recs("floor", [1, 0, 0, 0, 0, 0, 0, 0])
    s = E.summarize(records, n_boot=200)["arc_easy"]
    assert s["target"]["acc"] == 0.5 and s["target"]["n"] == 8
    lo, hi = s["target"]["acc_ci"]
    assert abs(lo - 0.2152) < 1e-3 and abs(hi - 0.7848) < 1e-3   # Wilson, 4 of 8
    r = s["retention"]["acc"]
    assert r["ratio"] == 0.75 and abs(r["floor_normalized"] - 2 / 3) < 1e-12   # (3-1)/(4-1)
    assert r["ratio_ci"][0] <= 0.75 <= r["ratio_ci"][1]
    lo, hi = E.wilson(5, 10)
    assert abs(lo - 0.2366) < 1e-3 and abs(hi - 0.7634) < 1e-3
    assert E.wilson(0, 60)[0] >= 0.0 and E.wilson(60, 60)[1] <= 1.0               # never past the ends


def test_squad_f1_and_coqa_agreement():
    assert E.token_f1("the cat sat", "A cat sat down.") == pytest.approx(0.8)   # "cat sat" vs "cat sat down"
    assert E.token_f1("", "") == 1.0 and E.token_f1("yes", "") == 0.0
    # two golds: leave each out in turn, max over the rest, then average (harness compute_scores)
    assert E.coqa_f1(["white", "a white kitten"], "white") == pytest.approx((2 / 3 + 1.0) / 2)
    records = [{"task": "coqa", "condition": c, "idx": 0, "turns": [2, 3, 4], "answers": a}
               for c, a in [("target", ["red", "Tom", "park"]), ("transfer", ["red", "Tom went", "home"])]]
    agree = E.coqa_agreement(records)
    assert agree["turns"] == [2, 3, 4] and agree["f1"] == pytest.approx([100, 200 / 3, 0])
    assert agree["drift_per_turn"] == pytest.approx(-50.0)


def test_exact_pair_transfer_keeps_every_answer():
    """Source -> its function-preserving twin through a fitted mapper: the transfer condition scores
    and answers exactly as the target's own prefill (retention 1), on MC items and a conversation."""
    source = tiny("qwen3", seed=4)
    target = function_preserving_twin(source, seed=1)
    ids = torch.randint(0, 128, (12, 24), generator=torch.Generator().manual_seed(0))
    mapper, _ = calibrate(source, target, ids, k=1, lam=1e-9, progress=False)
    tok = CharTok()
    conds = E.conditions(target, source, transfer=E.transfer(source, target, mapper))
    items = [E.Item(str(i), f"Question: what is {i} plus {i}?\nAnswer:", i % 3, [str(2 * i), "seven", "no idea"],
                    floor="Answer:") for i in range(4)]
    recs = {(r["condition"], r["idx"]): r for r in E.evaluate("arc_easy", items, tok, conds, progress=False)}
    for i in range(4):
        err = max(abs(a - b) for a, b in zip(recs[("transfer", i)]["lls"], recs[("target", i)]["lls"]))
        assert err < 1e-3, f"item {i}: transfer vs target loglikelihood error {err:.2e}"
        assert recs[("transfer", i)]["pred"] == recs[("target", i)]["pred"]
    s = E.summarize(recs.values(), n_boot=50)["arc_easy"]
    assert s["transfer"]["acc"] == s["target"]["acc"] and s["target"]["n"] == 4
    conv = E.Conversation("c", "Tom has a red ball. He plays in the park.", ["What color?", "Who?", "Where?"],
                          [["red"], ["Tom"], ["the park"]])
    crecs = list(E.evaluate("coqa", [conv], tok, conds, progress=False, max_new_tokens=5))
    assert {r["condition"] for r in crecs} == {"target", "source", "transfer"}  # no floor for CoQA
    answers = {r["condition"]: r["answers"] for r in crecs}
    assert answers["transfer"] == answers["target"], answers
    agree = E.coqa_agreement(crecs)
    assert agree["turns"] == [2, 3] and agree["f1"] == [100.0, 100.0] and agree["drift_per_turn"] == 0.0
