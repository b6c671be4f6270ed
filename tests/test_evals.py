"""The evaluation modules (scoring, answers, tasks, evals, summary): cache scoring against a one-pass
oracle, metrics on hand-built cases, prompts and answer extraction on real data (../shared/data, or
$KVT_SHARED/data)."""
import json
from collections import Counter

import pytest
import torch
from conftest import SHARED, SMOLLM2, calib_of, function_preserving_twin, tiny_config

import kvt
from kvt.harness import answers as A
from kvt.harness import evals as E
import kvt.evals
from kvt.harness import summary as S
from kvt.harness import tasks as T
from kvt.config import KvtError
from kvt.calibrate import calibrate
from kvt.loading import build_model

DATA = SHARED / "data"
needs_data = pytest.mark.skipif(not DATA.exists(), reason=f"no shared data at {DATA}")


class CharTok:
    """A tokenizer of one id per character (ASCII), enough to drive a tiny random model."""
    eos_id = 3
    stop_ids = (3,)  # what generation stops at (a real tokenizer: the checkpoint's end tokens, tokenizer.end_ids)
    prefix_id = 2  # what an empty context becomes (a real tokenizer's BOS, else EOS): not eos_id here

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
    [(lls, greedy)] = kvt.evals.loglikelihoods(model, [(ctx, conts)])
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

    own = kvt.evals.loglikelihoods(model, [(ctx, conts)])[0][0]
    assert torch.allclose(torch.tensor(kvt.evals.loglikelihoods(model, [(ctx, conts)], chunked)[0][0]),
                          torch.tensor(own), atol=1e-4)
    other = kvt.evals.loglikelihoods(model, [(ctx, conts)], lambda ids: kvt.evals.prefill(model, ids.flip(1)))[0][0]
    assert max(abs(a - b) for a, b in zip(own, other)) > 1e-3


def test_mc_metrics_hand_built():
    choices = ["a long answer", "b", "cc"]   # lengths 13, 1, 2
    m = kvt.evals.mc_metrics([-10.0, -9.0, -12.0], choices, gold=0)
    # acc: -9 is the largest; acc_norm: -10/13 = -0.77 beats -9/1 and -12/2 = -6
    assert (m["pred"], m["pred_norm"], m["acc"], m["acc_norm"]) == (1, 0, 0.0, 1.0)
    assert kvt.evals.mc_metrics([-1.0, -1.0, -3.0], ["x", "y", "z"], gold=1)["pred"] == 0  # ties: first, as np.argmax
    # the harness divides by len(choice), characters: -4.4/4 < -3/3 (by UTF-8 bytes it would be -4.4/8 > -1)
    assert kvt.evals.mc_metrics([-4.4, -3.0], ["\u00e9\u00e9\u00e9\u00e9", "abc"], gold=1)["pred_norm"] == 1


def test_encode_pair_moves_trailing_space():
    """Bugs: a trailing space left on the context; an empty context made of EOS instead of the harness's
    prefix token (BOS where the tokenizer names one), for scoring and for generation alike."""
    tok = CharTok()
    assert kvt.evals.encode_pair(tok.encode, "Answer: ", "B", tok.prefix_id) == (tok.encode("Answer:"), tok.encode(" B"))
    assert kvt.evals.encode_pair(tok.encode, "", " end", tok.prefix_id) == ([tok.prefix_id], tok.encode(" end"))
    model, seen = tiny(), []

    def spy(ids):  # a prefill that notes what it was asked to read
        seen.append(ids.tolist())
        return E.Condition(model)(ids)
    E.generate_until(E.Condition(model, spy), tok, "", until=(), max_new_tokens=1)
    assert seen == [[[tok.prefix_id]]]


@pytest.mark.parametrize("name, prefix, bos_id", [
    ("qwen3", ("<|im_end|>", 151645), None),              # names no BOS: EOS
    ("llama3", ("<|begin_of_text|>", 128000), 128000),
    ("smollm2", ("<|im_start|>", 1), None),               # names a BOS, its post-processor adds none
])
def test_prefix_id_is_the_harness_prefix_token(name, prefix, bos_id):
    """Bug: an empty context made of EOS for every family; lm-evaluation-harness (HFLM.prefix_token_id)
    uses the BOS that tokenizer_config.json names and EOS only when it names none. bos_id, what the
    post-processor adds, stays as it was."""
    path = SMOLLM2 if name == "smollm2" else SHARED / "tokenizers" / name
    if name == "smollm2" and not (path / "tokenizer_config.json").exists():
        pytest.skip(f"no SmolLM2 tokenizer at {path}")
    tok = kvt.load_tokenizer(path)
    assert (tok.tok.id_to_token(tok.prefix_id), tok.prefix_id) == prefix
    assert tok.bos_id == bos_id


# ------------------------------------------------------------------------------- data and prompts

@needs_data
def test_hellaswag_preprocess_real_items():
    items = T.TASKS["hellaswag"].items(DATA)
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
    arc = T.TASKS["arc_easy"].items(DATA)[0]
    assert arc.context == ("Question: Which statement best explains why photosynthesis is the foundation of "
                           "most food webs?\nAnswer:")
    assert arc.gold == 0 and arc.floor == "Answer:"
    m5, m0 = T.TASKS["mmlu"].items(DATA)[0], T.TASKS["mmlu"].items(DATA, shots=0)[0]
    head = "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
    q = ("Find the degree for the given field extension Q(sqrt(2), sqrt(3), sqrt(18)) over Q.\n"
         "A. 0\nB. 4\nC. 2\nD. 6\nAnswer:")
    assert m0.context == head + q and m0.choices == ["A", "B", "C", "D"] and m0.gold == 1
    assert m5.context.startswith(head + "Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field.\n")
    assert m5.context.endswith("Find the characteristic of the ring 2Z.\nA. 0\nB. 3\nC. 12\nD. 30\nAnswer: A\n\n" + q) and m5.context.count("Answer:") == 6
    g = T.TASKS["gsm8k"].items(DATA)[0]
    assert g.context.startswith("Q: There are 15 trees in the grove.") and g.context.count("\nA: ") == 8
    assert g.context.endswith("\n\nQ: Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every "
                              "morning and bakes muffins for her friends every day with four. She sells the "
                              "remainder at the farmers' market daily for $2 per fresh duck egg. How much in "
                              "dollars does she make every day at the farmers' market?\nA:")
    assert g.gold == "18"


@needs_data
def test_coqa_pieces_make_the_harness_prompt():
    conv = T.TASKS["coqa"].items(DATA)[0]
    assert len(conv.questions) == 10 and all(len(a) >= 1 for a in conv.answers)
    pieces = T.coqa_segments(conv)
    for t in (1, 4):  # the harness's doc_to_text for turn t: story, gold history, "Q: q_t\n\nA:"
        want = conv.story + "\n\n" + "".join(f"Q: {conv.questions[i]}\n\nA: {conv.answers[i][0]}\n\n"
                                             for i in range(t - 1)) + f"Q: {conv.questions[t - 1]}\n\nA:"
        assert "".join(pieces[:t]) == want


def test_missing_file_names_it_and_how_to_get_it(tmp_path):
    with pytest.raises(KvtError) as e:
        T.load_task("arc_challenge", tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "arc_challenge/test.jsonl") in msg
    assert 'load_dataset("allenai/ai2_arc", "ARC-Challenge", split="test")' in msg
    assert "to_json" in msg and "../shared/data" in msg
    with pytest.raises(KvtError, match="unknown task"):
        T.load_task("piqa", tmp_path)


# ------------------------------------------------------------------------------------------- samples

def assert_proportional(strata, start):
    """Every prefix of n >= start of `strata` (labels in sampled order) holds each stratum within one
    item of its exact quota n * (its share of the whole list), so also within one of the rounded quota."""
    sizes, count = Counter(strata), Counter()
    for n, s in enumerate(strata, 1):
        count[s] += 1
        if n >= start:
            off = max(abs(count[t] - n * sizes[t] / len(strata)) for t in sizes)
            assert off < 1, f"the first {n} items hold a stratum {off:.2f} items off its quota"


def test_sample_order_hand_built():
    """Bugs: the file's first rows (one stratum), a plain shuffle (a prefix misses a stratum or drifts
    from its share), an order the seed does not fix. 6 a, 3 b, 1 c: one of each first, then every
    prefix within one item of its quota."""
    strata = ["a"] * 6 + ["b"] * 3 + ["c"]
    order = T.sample_order(strata, seed=0)
    assert sorted(order) == list(range(10)) and order == T.sample_order(strata, seed=0)
    assert order != T.sample_order(strata, seed=1)
    assert sorted(strata[i] for i in order[:3]) == ["a", "b", "c"]
    assert_proportional([strata[i] for i in order], start=3)


@needs_data
def test_task_samples_are_stratified_prefixes():
    """Bugs: the first N rows (MMLU's first 500 items cover 5 of 57 subjects; HellaSwag's are all
    ActivityNet); a plain shuffle (57 items miss subjects); a sample drawn anew for each limit (a larger
    --limit would not continue a smaller one, so resuming would change the items); a seed that does
    nothing. The first round puts MMLU up to 5 items off its quotas at 57; from 100 on, every prefix is
    within one item of each subject's quota (measured: from 71 on)."""
    mmlu = T.load_task("mmlu", DATA, shots=0)  # every item, in the sampled order
    ids = [i.id for i in mmlu]
    assert [i.id for i in T.load_task("mmlu", DATA, 500, shots=0)] == ids[:500]  # same seed, same prefix
    assert len({i.stratum for i in mmlu[:57]}) == 57 and len(Counter(i.stratum for i in mmlu)) == 57
    assert_proportional([i.stratum for i in mmlu], start=100)
    assert [i.id for i in T.load_task("mmlu", DATA, 500, seed=1, shots=0)] != ids[:500]
    hellaswag = T.load_task("hellaswag", DATA)
    assert [i.id for i in T.load_task("hellaswag", DATA, 100)] == [i.id for i in hellaswag[:100]]
    count = Counter(i.stratum for i in hellaswag[:500])
    assert abs(count["activitynet"] - 500 * 3243 / 10042) < 1 and abs(count["wikihow"] - 500 * 6799 / 10042) < 1
    assert_proportional([i.stratum for i in hellaswag], start=2)
    assert Counter(c.stratum for c in T.load_task("coqa", DATA, 50)) == dict.fromkeys(
        ["mctest", "race", "cnn", "wikipedia", "gutenberg"], 10)


@needs_data
def test_every_task_has_unique_ids_and_all_its_items():
    """Bug: HellaSwag's `ind` repeats across its ActivityNet and WikiHow parts (9,609 distinct of 10,042),
    so records keyed by it would overwrite each other and a resume would skip items never run. Loaders
    return every item, in file order (load_task samples from them)."""
    sizes = {"hellaswag": 10042, "arc_easy": 2376, "arc_challenge": 1172, "mmlu": 14042, "gsm8k": 1319, "coqa": 500}
    for name, task in T.TASKS.items():
        if name == "winogrande" and not (DATA / "winogrande").exists():
            continue  # not in the shared data
        items = task.items(DATA)
        assert len({i.id for i in items}) == len(items) == sizes.get(name, 1000), name


# --------------------------------------------------------------------------- GSM8K answer extraction

def test_gsm8k_extraction_hand_cases():
    out = " Janet sells 16 - 3 - 4 = 9 duck eggs a day. She makes 9 * 2 = $18 every day. The answer is 18.\n\n"
    assert (A.gsm8k_strict(out), A.gsm8k_flexible(out)) == ("18", "18.")
    assert A.gsm8k_exact_match("18.", "18") == 1.0
    assert A.gsm8k_strict("so it costs $1,200. The answer is 1,200.") == "1,200"
    assert A.gsm8k_exact_match(A.gsm8k_flexible("it is $1,200."), "1200") == 1.0
    assert A.gsm8k_strict("The answer is -3 dollars") == "-3"
    assert A.gsm8k_strict("The answer is 18") == "1"   # the yaml's final "." takes a character: harness quirk
    assert A.gsm8k_strict("I do not know.") == A.gsm8k_flexible("no digits") == "[invalid]"
    assert A.gsm8k_exact_match("[invalid]", "18") == 0.0
    assert A.gsm8k_flexible("5 + 4 = 9 toys, 3 left") == "3"


@needs_data
def test_gsm8k_extraction_real_answers():
    rows = [json.loads(line) for line in open(DATA / "gsm8k/test.jsonl")][:300]
    for row in rows:
        reasoning, gold = row["answer"].split("####")
        gold = gold.strip()
        # the reference solution itself ends in "#### N": the flexible filter takes N
        assert A.gsm8k_exact_match(A.gsm8k_flexible(row["answer"]), gold) == 1.0, row["answer"]
        # the same reasoning in the exemplars' style, then the stop string that generation cuts at
        out = " " + reasoning.replace("\n", " ").strip() + f" The answer is {gold}.\n\nQ:"
        text = out.split("Q:")[0]
        assert A.gsm8k_exact_match(A.gsm8k_strict(text), gold) == 1.0, text
        assert A.gsm8k_exact_match(A.gsm8k_flexible(text), gold) == 1.0, text
        wrong = str(int(gold.replace(",", "")) + 1)
        assert A.gsm8k_exact_match(A.gsm8k_strict(f"The answer is {wrong}."), gold) == 0.0


# -------------------------------------------------------------------------------------- generation

def test_converse_extends_the_cache_like_a_fresh_prefill():
    """Answers from the growing cache equal answers from prefilling each turn's whole prompt anew."""
    model, tok = tiny(seed=1), CharTok()
    conv = T.Conversation("c", "Tom has a red ball. He plays.", ["What color?", "Who plays?", "Where?"],
                          [["red"], ["Tom"], ["unknown"]])
    answers = E.converse(E.Condition(model), tok, conv, start=2, max_new_tokens=6)
    pieces = T.coqa_segments(conv)
    for t, a in zip((2, 3), answers):
        ids = torch.tensor([tok.encode("".join(pieces[:t]))])
        logits, cache = model(ids)
        out = kvt.generate(model, logits[:, -1], cache, 6, stop_ids=tok.stop_ids, stop=("\n",),
                         decode=lambda x: tok.decode(x).lstrip())[0]
        assert a == tok.decode(out).strip().split("\n")[0]
    assert len(answers) == 2


def test_generate_until_cuts_at_stop_strings():
    model, tok = tiny(seed=2), CharTok()
    tok.stop_ids = ()  # no end token: only the stop strings and max_new_tokens end generation
    full = E.generate_until(E.Condition(model), tok, "Q: 1+1?\nA:", until=(), max_new_tokens=12)
    assert len(full) == 12
    stop = full[5]
    cut = E.generate_until(E.Condition(model), tok, "Q: 1+1?\nA:", until=(stop,), max_new_tokens=12)
    assert cut == full.split(stop)[0]


# ----------------------------------------------------------------------------- records and summary

def test_resume_skips_by_id_in_any_order():
    """Bug: records and resume keyed by position. A resumed run may list its items in another order (a
    new --limit, a new sample): it must skip exactly the (condition, id) pairs already done, however they
    are placed, and summarize must pair conditions by id. The transfer is another model's cache, so it
    moves the scores and retention is a ratio that can be computed by hand from the records."""
    target, other, tok = tiny(seed=3), tiny(seed=5), CharTok()
    golds = [1, 1, 3, 2, 3, 1, 3, 2]  # chosen so that both conditions get some items right
    items = [T.Item(f"q{i}", f"Question: is {i} more than {7 - i}?\nAnswer:", g, ["A", "B", "C", "D"],
                    floor="Answer:") for i, g in enumerate(golds)]
    conds = E.conditions(target, transfer=E.Condition(other))  # the target answers from the other's cache
    first = list(E.evaluate("arc_easy", items[:4], tok, conds, progress=False))  # stopped after 4 items,
    first += E.evaluate("arc_easy", items[4:6], tok, {"target": conds["target"]}, progress=False)  # mid-item
    for r in first:
        assert set(r) >= {"task", "condition", "id", "lls", "acc", "acc_norm"}
        json.dumps(r)  # plain data: one jsonl line
    done = {(r["condition"], r["id"]) for r in first}
    rest = list(E.evaluate("arc_easy", items[::-1], tok, conds, done=done, progress=False))
    assert [(r["id"], r["condition"]) for r in rest] == [
        ("q7", "target"), ("q7", "floor"), ("q7", "transfer"), ("q6", "target"), ("q6", "floor"),
        ("q6", "transfer"), ("q5", "floor"), ("q5", "transfer"), ("q4", "floor"), ("q4", "transfer")]
    recs = {(r["condition"], r["id"]): r for r in first + rest}
    assert len(recs) == 24 and any(recs[("transfer", i.id)]["lls"] != recs[("target", i.id)]["lls"] for i in items)
    acc = {c: sum(recs[(c, i.id)]["acc"] for i in items) for c in ("target", "transfer")}
    assert acc["target"] > 0 and acc["transfer"] != acc["target"], acc
    s = S.summarize(first + rest, n_boot=50)["arc_easy"]
    assert s["target"]["n"] == s["transfer"]["n"] == s["retention"]["acc"]["n"] == 8
    assert s["retention"]["acc"]["ratio"] == pytest.approx(acc["transfer"] / acc["target"])
    assert S.item_ids(first + rest) == {"arc_easy": ["q0", "q1", "q2", "q3", "q4", "q5", "q7", "q6"]}


def test_summary_retention_and_intervals():
    def recs(cond, accs):
        return [{"task": "arc_easy", "condition": cond, "id": str(i), "acc": a, "acc_norm": a}
                for i, a in enumerate(accs)]
    records = recs("target", [1, 1, 1, 1, 0, 0, 0, 0]) + recs("transfer", [1, 1, 1, 0, 0, 0, 0, 0]) \
        + recs("floor", [1, 0, 0, 0, 0, 0, 0, 0])
    s = S.summarize(records, n_boot=200)["arc_easy"]
    assert s["target"]["acc"] == 0.5 and s["target"]["n"] == 8
    lo, hi = s["target"]["acc_ci"]
    assert abs(lo - 0.2152) < 1e-3 and abs(hi - 0.7848) < 1e-3   # Wilson, 4 of 8
    r = s["retention"]["acc"]
    assert r["ratio"] == 0.75 and abs(r["floor_normalized"] - 2 / 3) < 1e-12   # (3-1)/(4-1)
    assert r["ratio_ci"][0] <= 0.75 <= r["ratio_ci"][1]
    lo, hi = S.wilson(5, 10)
    assert abs(lo - 0.2366) < 1e-3 and abs(hi - 0.7634) < 1e-3
    assert S.wilson(0, 60)[0] >= 0.0 and S.wilson(60, 60)[1] <= 1.0               # never past the ends


def test_summary_undefined_values_are_none_and_strict_json():
    """Bugs: summarize raised when transfer and target share no item (a bootstrap over zero items), and a
    0/0 ratio wrote NaN into results.json, which strict JSON parsers reject."""
    def rec(task, cond, i, v):
        return {"task": task, "condition": cond, "id": i, "acc": v, "acc_norm": v}
    records = [rec("arc_easy", "target", i, 1.0) for i in "ab"] + [rec("arc_easy", "floor", i, 0.0) for i in "abcd"]
    records += [rec("arc_easy", "transfer", i, 1.0) for i in "cd"]  # no item in common with the target
    records += [rec("mmlu", c, i, 0.0) for c in ("target", "transfer", "floor") for i in "ab"]  # 0 / 0
    s = S.summarize(records, n_boot=50)
    r, m = s["arc_easy"]["retention"]["acc"], s["mmlu"]["retention"]["acc"]
    assert (r["n"], r["ratio"], r["ratio_ci"]) == (0, None, (None, None))
    assert (r["floor_normalized"], r["floor_normalized_ci"]) == (None, (None, None))
    assert (m["n"], m["ratio"], m["ratio_ci"], m["floor_normalized"]) == (2, None, (None, None), None)
    json.dumps(s, allow_nan=False)
    avg = S.average_retention(records, n_boot=50)
    assert avg["tasks"] == [] and set(avg["skipped"]) == {"arc_easy", "mmlu"} and avg["retention"] is None
    json.dumps(avg, allow_nan=False)


def test_average_retention_hand_built():
    """Bugs: the ratio of mean scores instead of the mean of per-task ratios (0.8 here, not 5/6); a metric
    other than the task's primary one (arc_easy's acc would give 4); a task whose target scores 0 entering
    the mean as NaN or inf instead of being named as skipped; an interval without its own estimate."""
    scores = {  # task -> condition -> {metric: per-item scores}, 8 items each
        "arc_easy": {"target": {"acc_norm": [1, 1, 1, 0], "acc": [1, 0, 0, 0]},     # primary: acc_norm
                     "transfer": {"acc_norm": [1, 1, 0, 0], "acc": [1, 1, 1, 1]},
                     "floor": {"acc_norm": [1, 0, 0, 0], "acc": [0, 0, 0, 0]}},
        "mmlu": {"target": {"acc": [1, 1, 0, 0]}, "transfer": {"acc": [1, 0, 1, 0]}, "floor": {"acc": [0, 0, 0, 0]}},
        "gsm8k": {"target": {"em_strict": [0, 0, 0, 0]}, "transfer": {"em_strict": [1, 0, 0, 0]},
                  "floor": {"em_strict": [0, 0, 0, 0]}},
    }
    records = [{"task": t, "condition": c, "id": str(i), **{m: v[i % 4] for m, v in ms.items()}}
               for t, conds in scores.items() for c, ms in conds.items() for i in range(8)]
    avg = S.average_retention(records, n_boot=300)
    assert avg["tasks"] == ["arc_easy", "mmlu"] and list(avg["skipped"]) == ["gsm8k"]
    assert avg["metric"] == {"arc_easy": "acc_norm", "mmlu": "acc"} and avg["n"] == {"arc_easy": 8, "mmlu": 8}
    assert avg["retention"] == pytest.approx((0.5 / 0.75 + 0.5 / 0.5) / 2)                       # 5/6
    assert avg["floor_normalized"] == pytest.approx(((0.5 - 0.25) / (0.75 - 0.25) + 1.0) / 2)    # 3/4
    assert avg["accuracy"] == pytest.approx({"target": 0.625, "transfer": 0.5, "floor": 0.125})
    for key in ("retention", "floor_normalized"):
        lo, hi = avg[key + "_ci"]
        assert lo <= avg[key] <= hi and lo < hi, (key, lo, hi)
    for c, (lo, hi) in avg["accuracy_ci"].items():
        assert lo <= avg["accuracy"][c] <= hi
    json.dumps(avg, allow_nan=False)


def test_squad_f1_and_coqa_agreement():
    assert A.token_f1("the cat sat", "A cat sat down.") == pytest.approx(0.8)   # "cat sat" vs "cat sat down"
    assert A.token_f1("", "") == 1.0 and A.token_f1("yes", "") == 0.0
    # two golds: leave each out in turn, max over the rest, then average (harness compute_scores)
    assert A.coqa_f1(["white", "a white kitten"], "white") == pytest.approx((2 / 3 + 1.0) / 2)
    records = [{"task": "coqa", "condition": c, "id": "s1", "turns": [2, 3, 4], "answers": a}
               for c, a in [("target", ["red", "Tom", "park"]), ("transfer", ["red", "Tom went", "home"])]]
    agree = S.coqa_agreement(records)
    assert agree["turns"] == [2, 3, 4] and agree["f1"] == pytest.approx([100, 200 / 3, 0])
    assert agree["drift_per_turn"] == pytest.approx(-50.0)


def test_coqa_exact_match_and_turns_hand_built():
    """Bugs: EM as a max over every gold (the harness leaves each gold out in turn, as for F1); per-turn
    means that count a conversation only one condition answered; the gap's sign (target - transfer);
    drift that is not a least-squares slope over turns."""
    assert A.coqa_em(["white", "a white kitten"], "White.") == 0.5  # without "white": 0; without the other: 1
    assert A.coqa_em(["the park"], "Park") == 1.0 and A.coqa_em(["Tom"], "Tom went") == 0.0

    def rec(cond, i, f1, em):
        return {"task": "coqa", "condition": cond, "id": i, "turns": [2, 3, 4], "f1_turns": f1, "em_turns": em}
    records = [rec("target", "s1", [1, 1, .5], [1, 1, 0]), rec("target", "s2", [1, .5, .5], [1, 0, 0]),
               rec("transfer", "s1", [1, .5, 0], [1, 0, 0]), rec("transfer", "s2", [1, .5, .5], [0, 0, 0]),
               rec("target", "s3", [0, 0, 0], [0, 0, 0])]  # s3: no transfer answers, so out of the comparison
    c = S.coqa_turns(records)
    assert c["turns"] == [2, 3, 4] and c["n"] == [2, 2, 2]
    assert set(c["f1"]) == set(c["em"]) == {"target", "transfer"}  # approx takes no dict of lists: per condition
    for cond, f1, em in (("target", [100, 75, 50], [100, 50, 0]), ("transfer", [100, 50, 25], [50, 0, 0])):
        assert c["f1"][cond] == pytest.approx(f1) and c["em"][cond] == pytest.approx(em), cond
    assert c["gap"] == pytest.approx([0, 25, 25]) and c["mean_gap"] == pytest.approx(75 - 350 / 6)
    assert c["mean"]["transfer"] == pytest.approx({"f1": 350 / 6, "em": 100 / 6})
    assert c["drift"] == pytest.approx({"target": -25, "transfer": -37.5, "gap": 12.5})
    json.dumps(c, allow_nan=False)


def test_exact_pair_transfer_keeps_every_answer():
    """Source -> its function-preserving twin through a fitted mapper: the transfer condition scores
    and answers exactly as the target's own prefill (retention 1), on MC items and a conversation."""
    source = tiny("qwen3", seed=4)
    target = function_preserving_twin(source, seed=1)
    ids = torch.randint(0, 128, (14, 24), generator=torch.Generator().manual_seed(0))
    mapper, _ = calibrate(source, target, calib_of(ids), k=1, lam=1e-9)
    tok = CharTok()
    conds = E.conditions(target, source, transfer=E.transfer(source, target, mapper))
    items = [T.Item(str(i), f"Question: what is {i} plus {i}?\nAnswer:", i % 3, [str(2 * i), "seven", "no idea"],
                    floor="Answer:") for i in range(4)]
    recs = {(r["condition"], r["id"]): r for r in E.evaluate("arc_easy", items, tok, conds, progress=False)}
    for i in map(str, range(4)):
        err = max(abs(a - b) for a, b in zip(recs[("transfer", i)]["lls"], recs[("target", i)]["lls"]))
        assert err < 1e-3, f"item {i}: transfer vs target loglikelihood error {err:.2e}"
        assert recs[("transfer", i)]["pred"] == recs[("target", i)]["pred"]
    s = S.summarize(recs.values(), n_boot=50)["arc_easy"]
    assert s["transfer"]["acc"] == s["target"]["acc"] and s["target"]["n"] == 4
    conv = T.Conversation("c", "Tom has a red ball. He plays in the park.", ["What color?", "Who?", "Where?"],
                          [["red"], ["Tom"], ["the park"]])
    crecs = list(E.evaluate("coqa", [conv], tok, conds, progress=False, max_new_tokens=5))
    assert {r["condition"] for r in crecs} == {"target", "source", "transfer"}  # no floor for CoQA
    answers = {r["condition"]: r["answers"] for r in crecs}
    assert answers["transfer"] == answers["target"], answers
    agree = S.coqa_agreement(crecs)
    assert agree["turns"] == [2, 3] and agree["f1"] == [100.0, 100.0] and agree["drift_per_turn"] == 0.0


def test_context_gain_is_the_share_of_the_floors_nll_the_transfer_takes_off():
    """context_gain = (floor - transfer) / (floor - target) over the windows' mean NLLs, with a seeded
    bootstrap interval over windows that holds the point. Guards: the ratio inverted or taken per window
    and averaged, an unseeded interval."""
    from kvt.harness.summary import context_gain
    g = torch.Generator().manual_seed(0)
    target = 2 + torch.rand(12, generator=g, dtype=torch.float64)
    floor = target + 1 + torch.rand(12, generator=g, dtype=torch.float64)
    transfer = target + (floor - target) * torch.rand(12, generator=g, dtype=torch.float64)
    nll = {"floor": floor, "transfer": transfer, "target": target}
    got = context_gain(nll, n_boot=200, seed=3)
    want = ((floor.mean() - transfer.mean()) / (floor.mean() - target.mean())).item()
    assert abs(got["gain"] - want) < 1e-12, (got["gain"], want)
    lo, hi = got["gain_ci"]
    assert lo < got["gain"] < hi and got["gain_ci"] == context_gain(nll, n_boot=200, seed=3)["gain_ci"]
    assert got["gain_ci"] != context_gain(nll, n_boot=200, seed=4)["gain_ci"], "the seed must reach the bootstrap"
    assert abs(got["nll"]["floor"] - floor.mean().item()) < 1e-12 and got["windows"] == 12


def test_context_gain_is_no_ratio_where_the_target_gains_nothing_from_context():
    """Guards a ratio over the target's own noise: the toy pair scored on English text (NLL about 20 nats,
    worse than uniform over its 640 tokens, 6.5) reported -332% [-675, -202] and 1,240% [-11,625, 11,700].
    Where the target gains from context above its noise and models the text, the ratio is printed; where
    the interval of floor - target reaches 0, or the target is worse than uniform, report.md and
    results.json say so instead (gain None)."""
    import json
    from kvt.harness.report import format_context_gain, strict
    from kvt.harness.summary import context_gain
    g = torch.Generator().manual_seed(0)

    def noise(scale=1.0):
        return scale * torch.rand(16, generator=g, dtype=torch.float64)
    target = 2 + noise()
    learns = {"floor": target + 1 + noise(), "transfer": target + 0.5 + noise(0.1), "target": target}
    no_gain = {"floor": target + noise(0.2) - 0.1, "transfer": target + 3 * noise(0.2), "target": target}
    lost = {c: 18 + x for c, x in learns.items()}                     # gains a nat from context, but at 19-21 nats
    rows = [{"text": name, "context": 128, "next": 64, **context_gain(nll, vocab_size=640, n_boot=200)}
            for name, nll in (("learns", learns), ("no gain", no_gain), ("lost", lost))]
    kept, noisy, far = rows
    assert kept["no_ratio"] is None and 0 < kept["gain"] < 1 and kept["target_gain_ci"][0] > 0, kept
    assert noisy["gain"] is None and noisy["gain_ci"] == (None, None) and noisy["target_gain_ci"][0] <= 0, noisy
    assert "not above its noise" in noisy["no_ratio"], noisy["no_ratio"]
    assert far["gain"] is None and "cannot model this text" in far["no_ratio"] and "(6.46)" in far["no_ratio"], far
    assert context_gain(lost)["gain"] is not None, "without a vocabulary only the noise is checked"
    table = format_context_gain(rows).splitlines()[2:]
    assert table[0].endswith(f"| {100 * kept['gain']:.1f}% [{100 * kept['gain_ci'][0]:.1f}, "
                             f"{100 * kept['gain_ci'][1]:.1f}] |"), table[0]
    for line, row in zip(table[1:], rows[1:]):
        assert line.endswith(f"| no ratio: {row['no_ratio']} |") and "%" not in line, line
    results = json.loads(json.dumps(strict({"context_gain": rows})))["context_gain"]
    assert [r["gain"] is None for r in results] == [False, True, True] and results[2]["no_ratio"] == far["no_ratio"]


def test_gap_recovered_is_the_share_of_the_source_to_target_gap():
    """(transfer - source) / (target - source), per task and averaged, beside retention: 86% retention can be a
    small share of the gap. Guards the gap taken against the floor (or the floor against the source), and a
    task whose source equals its target entering the mean as 0/0."""
    def recs(cond, accs, task="arc_easy"):
        return [{"task": task, "condition": cond, "id": str(i), "acc": a, "acc_norm": a} for i, a in enumerate(accs)]
    records = (recs("target", [1] * 7 + [0]) + recs("transfer", [1] * 6 + [0] * 2) + recs("source", [1] * 5 + [0] * 3)
               + recs("floor", [1] + [0] * 7))
    records += recs("target", [1, 0], "mmlu") + recs("transfer", [1, 0], "mmlu") + recs("source", [1, 0], "mmlu")
    r = S.summarize(records, n_boot=200)["arc_easy"]["retention"]["acc"]
    assert r["ratio"] == pytest.approx(6 / 7) and r["gap_recovered"] == pytest.approx((6 - 5) / (7 - 5))
    assert r["floor_normalized"] == pytest.approx((6 - 1) / (7 - 1))
    assert r["gap_recovered_ci"][0] <= 0.5 <= r["gap_recovered_ci"][1]
    avg = S.average_retention(records, n_boot=200)
    assert avg["gap_tasks"] == ["arc_easy"] and avg["gap_recovered"] == pytest.approx(0.5)
    json.dumps(avg, allow_nan=False)
