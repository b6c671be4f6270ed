"""The task registry and its kinds: a task of each kind defined here runs through run.py (this file is
its --task-file), each kind's scoring against a one-pass oracle, user task files, the lm-eval layout,
and the toy trainer scoring as the evals do."""
import json
import math
import statistics

import pytest
import torch
from conftest import SHARED, tiny_config

import kvt
from kvt.harness import pipeline as run
from kvt.harness import evals as E
import kvt.evals
from kvt.harness import toy
from kvt.harness import summary as S
from kvt.harness import tasks as T
from kvt.config import KvtError
from kvt.harness.tasks import Conversation, Item, Source, Task

# ---- the tasks of test_every_kind_runs_through_run_main: this file is its --task-file -----------------------
# (module-level Task objects, which load_task_file registers; nothing is registered when pytest imports it)


def my_mc(rows):
    return [Item(r["id"], f"the pets : {r['fact']} . so {r['name']}", r["answer"], r["options"],
                 floor=f" so {r['name']}") for r in rows]


def my_inputs():
    pairs = [("anna", "ben"), ("carl", "dora"), ("emma", "finn"), ("gina", "hugo")]
    return [Item(str(i), "", i % 2, [f"the pets : {a} cat , {b} dog . so {n}" for n in (a, b)],
                 floor=[f" so {a}", f" so {b}"], continuation="dog .") for i, (a, b) in enumerate(pairs)]


def first_word(output, gold):
    words = output.split()
    return {"first": float(bool(words) and words[0] == gold), "said": float(bool(words))}


def my_gen():
    return [Item(str(i), f"copy : {w} red . again :", w, floor=" again :", until=(".",))
            for i, w in enumerate(["cat", "dog", "fish", "bird"])]


def my_rolling():
    return [Item(str(i), f"the pets : {a} cat , {b} dog .", continuation=f" so {b} dog , {a} cat .", floor=" so")
            for i, (a, b) in enumerate([("anna", "ben"), ("carl", "dora"), ("emma", "finn")])]


def my_coqa():
    return [Conversation(str(i), f"the pets : {a} cat , {b} dog .", [f"{a} ?", f"{b} ?", f"{a} ?"],
                         [["cat"], ["dog"], ["cat"]]) for i, (a, b) in enumerate([("anna", "ben"), ("carl", "dora")])]


MC = Task("my_mc", my_mc, sources=(Source("mine/test.jsonl", "me/my_pets", "test", fields=("id", "fact", "name",
                                                                                            "options", "answer")),))
INPUTS = Task("my_inputs", my_inputs, "multiple_input")
GEN = Task("my_gen", my_gen, "generate_until", ("first", "said"), score=first_word, max_new_tokens=4)
ROLLING = Task("my_rolling", my_rolling, "loglikelihood_rolling", primary="bits_per_byte")
COQA = Task("my_coqa", my_coqa, "coqa", max_new_tokens=4)
MINE = [MC, INPUTS, GEN, ROLLING, COQA]


class CharTok:
    """A tokenizer of one id per character (ASCII), enough to drive a tiny random model."""
    eos_id, prefix_id, stop_ids = 3, 2, (3,)

    def encode(self, text, special=True):
        return [ord(c) % 128 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@pytest.fixture
def registry(monkeypatch):
    """A copy of the registry for one test: what it registers is gone after it."""
    monkeypatch.setattr(T, "TASKS", dict(T.TASKS))
    return T.TASKS


def one_pass(model, prefix_ids, cont_ids):
    """The oracle: log p(cont | prefix) from one forward pass over the whole sequence."""
    logits, _ = model(torch.tensor([prefix_ids + cont_ids]))               # (1, T, V)
    logp = logits[0, len(prefix_ids) - 1:-1].float().log_softmax(-1)       # positions predicting cont
    return logp[torch.arange(len(cont_ids)), cont_ids].sum().item()


# ---------------------------------------------------------------------------------------- end to end

def test_every_kind_runs_through_run_main(tiny_pair, tmp_path, registry):
    """A user's tasks of every kind, from a --task-file, through run.py on the exact pair: every condition
    scores every item, the transfer matches the target, and results.json holds kvt's summary, the same
    numbers in lm-eval's layout and the versions, as strict JSON. Guards: a kind run.py cannot take, a
    registry that --task-file does not reach, an lm_eval block that disagrees with kvt's own numbers."""
    (tmp_path / "mine").mkdir()
    rows = [{"id": f"q{i}", "fact": f"{a} cat , {b} dog", "name": n, "options": ["cat", "dog", "frog"], "answer": ans}
            for i, (a, b, n, ans) in enumerate([("anna", "ben", "anna", 0), ("carl", "dora", "dora", 1),
                                                ("emma", "finn", "finn", 1), ("gina", "hugo", "gina", 0)])]
    (tmp_path / "mine" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "calib.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in toy.corpus(300, seed=99)))
    out = tmp_path / "out"
    results = run.main(["--source", str(tiny_pair / "source"), "--target", str(tiny_pair / "twin"), "--out", str(out),
                        "--task-file", __file__, "--tasks", ",".join(t.name for t in MINE), "--data-dir", str(tmp_path),
                        "--calib", str(tmp_path / "calib.jsonl"), "--limit", "4", "--calib-seqs", "20",
                        "--calib-len", "48", "--k", "2", "--lam", "1e-6", "--no-bench"])
    recs = {(r["task"], r["condition"], r["id"]): r for f in out.glob("records-*.jsonl")
            for r in map(json.loads, f.read_text().splitlines()[1:])}
    sizes = {"my_mc": 4, "my_inputs": 4, "my_gen": 4, "my_rolling": 3, "my_coqa": 2}
    for task in MINE:
        conds = ["target", "transfer", "source"] + (["floor"] if task.kind != "coqa" else [])
        s = results["tasks"][task.name]
        assert set(s) == set(conds) | {"retention"}, task.name
        for c in conds:
            assert s[c]["n"] == sizes[task.name], (task.name, c)
            assert all(s[c][m] is not None for m in task.metrics), (task.name, c, s[c])
        for (t, c, i), r in recs.items():  # the exact pair: transfer answers as the target does
            if t == task.name and c == "transfer":
                mine = recs[(t, "target", i)]
                for key in ("lls", "ll"):
                    if key in r:
                        assert torch.allclose(torch.tensor(r[key]), torch.tensor(mine[key]), atol=1e-3), (t, i)
                for key in ("pred", "output", "answers"):
                    assert r.get(key) == mine.get(key), (t, i, key)
        lm = results["lm_eval"]["transfer"]["results"][task.name]
        assert all(lm[f"{m},none"] == s["transfer"][m] for m in task.metrics), task.name
    vals = [r["acc"] for (t, c, _), r in recs.items() if (t, c) == ("my_mc", "target")]
    assert results["lm_eval"]["target"]["results"]["my_mc"]["acc_stderr,none"] == pytest.approx(
        statistics.stdev(vals) / math.sqrt(len(vals)))
    rolling = [r for (t, c, _), r in recs.items() if (t, c) == ("my_rolling", "target")]
    assert results["tasks"]["my_rolling"]["target"]["word_perplexity"] == pytest.approx(
        math.exp(-sum(r["ll"] for r in rolling) / sum(r["words"] for r in rolling)))
    assert results["tasks"]["my_rolling"]["retention"]["word_perplexity"]["ratio"] == pytest.approx(1.0, abs=1e-3)
    assert results["lm_eval"]["target"]["results"]["my_rolling"]["word_perplexity_stderr,none"] == "N/A"
    assert results["lm_eval"]["target"]["higher_is_better"]["my_rolling"]["bits_per_byte"] is False
    assert results["average_retention"]["skipped"]["my_rolling"].startswith("its primary metric bits_per_byte")
    text = (out / "results.json").read_text()
    strict = json.loads(text, parse_constant=lambda c: pytest.fail(f"results.json holds {c}"))
    assert strict["lm_eval"] == json.loads(json.dumps(results["lm_eval"]))
    assert {"kvt", "torch", "transformers", "hardware"} <= set(strict["versions"])
    assert strict["versions"]["kvt"] == kvt.__version__ and strict["settings"]["task_file"] == [__file__]


def test_task_file_errors_are_one_line(tiny_pair, tmp_path, registry):
    """A missing --task-file, or one whose task takes a built-in name, is a KvtError before any work."""
    argv = ["--source", str(tiny_pair / "source"), "--target", str(tiny_pair / "twin"), "--out", str(tmp_path / "o"),
            "--tasks", "toy_recall", "--no-bench"]
    with pytest.raises(KvtError, match="no such file"):
        run.main(argv + ["--task-file", str(tmp_path / "nope.py")])
    (tmp_path / "clash.py").write_text("from kvt.harness.tasks import Task\nARC = Task('arc_easy', lambda: [])\n")
    with pytest.raises(KvtError, match="'arc_easy' is built in"):
        run.main(argv + ["--task-file", str(tmp_path / "clash.py")])
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------- registry

def test_task_file_registers_or_defines(tmp_path, registry):
    """A task file may call register() or just define Task objects; imported again (a second run in one
    process) it replaces its own tasks. Guards: defined tasks never registered; a second import refused
    as a clash with itself; a file of no tasks passing silently; a file imported without a sys.modules
    entry (its dataclasses fail under `from __future__ import annotations`)."""
    (tmp_path / "a.py").write_text("from kvt.harness.tasks import Item, Task, register\n"
                                   "register(Task('reg_a', lambda: [Item('1', 'x', 0, ['y', 'z'])]))\n")
    (tmp_path / "b.py").write_text("from __future__ import annotations\nfrom dataclasses import dataclass\n"
                                   "from kvt.harness.tasks import Item, Task\n"  # its dataclass needs it in sys.modules
                                   "@dataclass\nclass Note:\n    text: str\n"
                                   "B = Task('def_b', lambda n=2: [Item(str(i), 'x', 0, ['y']) for i in range(n)])\n")
    assert T.load_task_file(tmp_path / "a.py") == ["reg_a"] and T.load_task_file(tmp_path / "b.py") == ["def_b"]
    first = registry["reg_a"]
    assert T.load_task_file(tmp_path / "a.py") == ["reg_a"] and registry["reg_a"] is not first
    assert len(T.load_task("def_b", None)) == 2 and len(T.load_task("def_b", None, n=3)) == 3  # options: the loader
    (tmp_path / "none.py").write_text("X = 1\n")
    with pytest.raises(KvtError, match="defines no task"):
        T.load_task_file(tmp_path / "none.py")


@pytest.mark.parametrize("kw, words", [
    (dict(name="arc_easy"), "is built in"),
    (dict(name="a,b"), "without commas or spaces"),
    (dict(kind="loglikelihood"), "unknown kind 'loglikelihood'"),
    (dict(primary="f1"), "primary metric 'f1' is not one of its metrics"),
    (dict(metrics=("acc", "f1")), "reports some of"),
    (dict(sources=("mine/test.jsonl",)), "sources kvt.harness.tasks.Source"),
])
def test_registry_refuses_bad_tasks(kw, words, registry):
    """Each a KvtError naming the problem: a built-in shadowed (arc_easy would change under every later
    run), a name --tasks cannot hold, a kind no scorer reads, a primary metric no record carries."""
    with pytest.raises(KvtError, match=words):
        T.register(Task(**{"name": "ok", "load": lambda: [], **kw}))


@pytest.mark.parametrize("kind, item, words", [
    ("loglikelihood_rolling", Item("r", "It rained", " all day."), "needs its continuation"),  # text given as gold
    ("multiple_input", Item("w", "", 0, ["Tom", "Ann"], continuation="ran."), None),
    ("multiple_input", Item("w", "", 0, ["Tom", "Ann"], floor=["Tom"], continuation="ran."), "1 floors for 2"),
    ("multiple_choice", Item("q", "Question: 1+1?\nAnswer:", 4, ["1", "2"]), "gold, the index"),
    ("coqa", Item("c", "story"), "returns Conversations"),
])
def test_items_a_kind_cannot_score_are_refused_at_load(kind, item, words, registry):
    """load_task checks every item against its kind before any model runs. Guards: a rolling item whose
    text went into `gold` (Item's third field) failing only after calibration, or scoring nothing."""
    T.register(Task("mine", lambda: [item], kind))
    if words is None:
        assert T.load_task("mine", None) == [item]
        return
    with pytest.raises(KvtError, match=words):
        T.load_task("mine", None)


def test_every_kind_has_a_scorer_and_every_builtin_its_source():
    """Guards: a kind added to the registry that evaluate cannot score; a built-in task whose data file
    names no Hugging Face data set to fetch it from."""
    assert set(E.SCORERS) == set(T.KINDS)
    for task in (T.TASKS[name] for name in T.BUILTIN):             # not the tasks other tests register
        assert task.name.startswith("toy_") or task.sources, task.name
        for s in task.sources:
            assert s.load_dataset().startswith(f'load_dataset("{s.path}"') and s.fields, task.name


@pytest.mark.skipif(not (SHARED / "data").exists(), reason="no shared data")
def test_builtin_item_ids_and_order_are_unchanged():
    """The first items of each built-in task's seeded sample, as before the registry: records on disk
    are keyed by these ids, so a loader or sampler that changed them would resume the wrong items."""
    want = {"hellaswag": ["activitynet/3991", "wikihow/17597", "wikihow/35096"],
            "arc_easy": ["MCAS_2004_9_21", "MCAS_2001_5_19", "NYSEDREGENTS_2013_8_14"],
            "arc_challenge": ["Mercury_7030555", "MCAS_2005_8_12", "Mercury_SC_401783"],
            "mmlu": ["jurisprudence/6627", "college_biology/819", "world_religions/14005"],
            "gsm8k": ["1101", "120", "474"],
            "coqa": ["3nc5l260mom9579b3nffiyo4px4ofh", "352ythgrovdpfaqzfto67lucoosh4f",
                     "3kxir214i4gl0knhw8lzkhoaz9342l"],
            "toy_recall": ["recall/439", "recall/621", "recall/160"], "toy_copy": ["copy/439", "copy/621", "copy/160"]}
    for name, ids in want.items():
        assert [i.id for i in T.load_task(name, SHARED / "data", 3)] == ids, name


def test_winogrande_follows_the_harness():
    """winogrande/preprocess_winogrande.py: each option fills the blank and ends its context, the rest
    of the sentence (stripped) is the shared continuation, answer "2" is index 1."""
    row = {"sentence": "The trophy doesn't fit into the brown suitcase because the _ is too large.",
           "option1": "trophy", "option2": "suitcase", "answer": "1"}
    it = T.winogrande([row, dict(row, answer="2")])
    assert it[0].choices == ["The trophy doesn't fit into the brown suitcase because the trophy",
                             "The trophy doesn't fit into the brown suitcase because the suitcase"]
    assert it[0].continuation == "is too large." and (it[0].gold, it[1].gold) == (0, 1)
    assert it[0].floor == ["trophy", "suitcase"] and [i.id for i in it] == ["0", "1"]


# ---------------------------------------------------------------------------------------- kinds

def test_multiple_input_scores_the_shared_continuation_after_each_context():
    """Each option's score is log p(" " + continuation | that option's context), one pass as the oracle;
    the floor reads each context's own minimal prefix. Guards: scoring the contexts instead of the
    continuation, every option from the first context's cache, a continuation without its delimiter."""
    model, tok = kvt.build_model(tiny_config("llama"), seed=0, std=0.2), CharTok()
    item = Item("w", "", 1, ["Tom gave Ann a ball because Tom", "Tom gave Ann a ball because Ann"],
                floor=["Tom", "Ann"], continuation="was kind.")
    for cond, contexts in [(E.Condition(model), item.choices), (E.Condition(model, floor=True), item.floor)]:
        r = E.score_inputs(cond, tok, [item], T.TASKS["winogrande"])[0]
        want = [one_pass(model, tok.encode(c), tok.encode(" was kind.")) for c in contexts]
        assert r["lls"] == pytest.approx(want, abs=1e-4)
        assert r["pred"] == max(range(2), key=want.__getitem__) and r["acc"] == float(r["pred"] == 1)


def test_rolling_scores_the_same_text_after_each_prefix():
    """The text after the prefix is scored whatever the condition reads (its trailing space moves to
    the text, as the harness moves it); words and bytes are the harness's counts. Guards: scoring the
    prefix too, an off-by-one at the boundary, a floor that scores other text than the context does."""
    model, tok = kvt.build_model(tiny_config("llama"), seed=1, std=0.2), CharTok()
    item = Item("r", "It rained all day ", continuation="so the match was off.", floor="So")
    task = Task("roll", lambda: [], "loglikelihood_rolling")
    own = E.score_rolling(E.Condition(model), tok, [item], task)[0]
    floor = E.score_rolling(E.Condition(model, floor=True), tok, [item], task)[0]
    text = " so the match was off."
    assert own["ll"] == pytest.approx(one_pass(model, tok.encode("It rained all day"), tok.encode(text)), abs=1e-4)
    assert floor["ll"] == pytest.approx(one_pass(model, tok.encode("So"), tok.encode(text)), abs=1e-4)
    for r in (own, floor):
        assert (r["tokens"], r["words"], r["bytes"]) == (len(text), len(text.split(" ")), len(text))


def test_perplexity_is_corpus_level_and_lower_is_better(registry):
    """word_perplexity = exp(-sum ll / sum words) over the items, as the harness's weighted_perplexity,
    and its retention is target / transfer. Guards: a mean of per-item perplexities (5.05 here, not
    6.75) or of per-item mean loglikelihoods (4.48); a retention above 1 for a transfer that is worse."""
    def rec(cond, i, ll, words):
        return {"task": "roll", "condition": cond, "id": str(i), "ll": ll, "words": words, "bytes": 4 * words}
    records = [rec("target", 0, -20.0, 10), rec("target", 1, -1.0, 1),
               rec("transfer", 0, -30.0, 10), rec("transfer", 1, -1.0, 1),
               rec("floor", 0, -40.0, 10), rec("floor", 1, -2.0, 1)]
    T.register(Task("roll", lambda: [], "loglikelihood_rolling"))
    s = S.summarize(records, n_boot=50)["roll"]
    tgt, tr, fl = math.exp(21 / 11), math.exp(31 / 11), math.exp(42 / 11)
    assert s["target"]["word_perplexity"] == pytest.approx(tgt)
    assert s["target"]["bits_per_byte"] == pytest.approx(21 / 44 / math.log(2))
    r = s["retention"]["word_perplexity"]
    assert r["ratio"] == pytest.approx(tgt / tr) and r["ratio"] < 1
    assert r["floor_normalized"] == pytest.approx((tr - fl) / (tgt - fl))
    assert s["target"]["word_perplexity_stderr"] is None
    json.dumps(s, allow_nan=False)


# ---------------------------------------------------------------------------------------- lm-eval layout

def test_lm_eval_results_layout():
    """Keys "metric,filter" and "metric_stderr,filter" per task, one block per condition; the stderr is
    the harness's mean_stderr (sample standard deviation, n - 1). Guards: the population deviation (n),
    gsm8k's two filters collapsed into one key, a retention row read as a condition."""
    accs = [1, 1, 0, 1, 0]
    records = [{"task": "arc_easy", "condition": c, "id": str(i), "acc": a, "acc_norm": 1 - a}
               for c in ("target", "transfer") for i, a in enumerate(accs)]
    records += [{"task": "gsm8k", "condition": "target", "id": str(i), "em_strict": a, "em_flexible": 1}
                for i, a in enumerate(accs)]
    lm = S.lm_eval_results(S.summarize(records, n_boot=20))
    assert set(lm) == {"target", "transfer"}
    arc = lm["target"]["results"]["arc_easy"]
    assert arc["alias"] == "arc_easy" and arc["acc,none"] == 0.6 and arc["acc_norm,none"] == pytest.approx(0.4)
    assert arc["acc_stderr,none"] == pytest.approx(statistics.stdev(accs) / math.sqrt(5))      # 0.2449
    g = lm["target"]["results"]["gsm8k"]
    assert g["exact_match,strict-match"] == 0.6 and g["exact_match,flexible-extract"] == 1.0
    assert g["exact_match_stderr,flexible-extract"] == 0.0
    assert lm["target"]["higher_is_better"]["gsm8k"] == {"exact_match": True}
    assert lm["transfer"]["n-samples"]["arc_easy"] == {"effective": 5} and "gsm8k" not in lm["transfer"]["results"]
    json.dumps(lm, allow_nan=False)


# ---------------------------------------------------------------------------------------- one scorer

def test_toy_trainer_scores_as_the_evals(tiny_pair, monkeypatch):
    """toy.choice_accuracy (the trainer's held-out recall and toy_train.json) and the evals' toy_recall
    call the one scorer, kvt.evals.score_choice_batch (score_choices is its batch of one), with the same
    contexts, choices and golds, so they give the same accuracy, with the context (target) and without it
    (floor). Guards: a second scorer in toy.py or evals.py, and the two floors that differed (the text after
    the last " . " against after the last ".")."""
    model, tok = kvt.load_model(tiny_pair / "source"), kvt.load_tokenizer(tiny_pair / "source")
    calls, real = [], kvt.evals.score_choice_batch
    monkeypatch.setattr(kvt.evals, "score_choice_batch",
                        lambda model, encode, items, *a: calls.extend(items) or real(model, encode, items, *a))
    records, items = toy.toy_tasks("recall", 12), T.load_task("toy_recall", None, n=12)
    for context, cond in [(True, "target"), (False, "floor")]:
        calls.clear()
        acc = toy.choice_accuracy(model, tok.encode, records, context=context)
        by_toy = sorted(calls)
        calls.clear()
        recs = list(E.evaluate("toy_recall", items, tok, {cond: E.conditions(model)[cond]}, progress=False))
        assert by_toy == sorted(calls) and len(calls) == 12, cond
        assert acc == pytest.approx(sum(r["acc"] for r in recs) / 12), cond
