"""Evaluation in batches: every kind of task under every condition (target, floor, source, transfer) gives
per item what batch 1 gives, within float32 rounding, on the trained toy pair and on a tiny Qwen3 pair with
the real tokenizer (conftest.hub_cache); and generation ends at the checkpoint's end tokens."""
import json

import pytest
import torch
from conftest import ROOT, calib_of

import kvt
from kvt.harness import evals as E
import kvt.evals
from kvt.harness import toy
from kvt.harness import tasks as T
from kvt.harness.data import calibration_sequences
from kvt.calibrate import calibrate
from kvt.tokenizer import end_ids

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-4  # float32: a padded batch runs other kernels (sums in another order) than one row alone


def assert_same(batched, single, what):
    """Records equal key by key: numbers within TOL (loglikelihoods are sums over tokens), the rest exactly."""
    assert batched.keys() == single.keys(), what
    for key, want in single.items():
        got = batched[key]
        if isinstance(want, float):
            assert abs(got - want) <= TOL, f"{what} {key}: batch {got} vs one {want}"
        elif isinstance(want, list) and want and isinstance(want[0], float):
            err = max(abs(a - b) for a, b in zip(got, want))
            assert len(got) == len(want) and err <= TOL, f"{what} {key}: max error {err:.2e}"
        else:
            assert got == want, f"{what} {key}: batch {got!r} vs one {want!r}"


def compare(task, items, tok, conds, size, **options):
    """evaluate() at batch `size` against batch 1: the same records, per (condition, item)."""
    one = {(r["condition"], r["id"]): r for r in E.evaluate(task, items, tok, conds, progress=False, **options)}
    many = {(r["condition"], r["id"]): r
            for r in E.evaluate(task, items, tok, conds, progress=False, batch_size=size, **options)}
    assert one.keys() == many.keys() and len(one) == len(items) * len(conds) - (task == "coqa") * len(items)
    for key in one:
        assert_same(many[key], one[key], f"{task} {key}")
    return one


def padded(tok, contexts):
    """The contexts differ in length: a batch of them is left-padded (else the test would prove nothing)."""
    return len({len(tok.encode(c)) for c in contexts}) > 1


@pytest.fixture(scope="module")
def toy_run():
    """toy-s -> toy-m with a mapper fitted on a small toy calibration: the four standard conditions."""
    source, target = (kvt.load_model(ROOT / "weights" / n) for n in ("toy-s", "toy-m"))
    tok = kvt.load_tokenizer(ROOT / "weights" / "toy-m")
    calib = calibration_sequences(None, tok, 24, 64, documents=toy.corpus(300, seed=99))
    mapper, _ = calibrate(source, target, calib, k=2)
    return tok, E.conditions(target, source, E.transfer(source, target, mapper)), mapper


ROLLING = T.Task("batch_rolling", lambda: [], "loglikelihood_rolling")
INPUTS = T.Task("batch_inputs", lambda: [], "multiple_input")


def test_toy_batches_equal_batch_one(toy_run, monkeypatch):
    """Bug guarded: a batch whose padding leaks into the scores (a prefill or a transfer that ignores the
    mask, positions counted from the padded start, a continuation read from another item's cache): every
    kind, every condition, batches of 4 and 3 (a ragged last batch), on the trained toy pair."""
    tok, conds, _ = toy_run
    for name, kind_task in (("batch_rolling", ROLLING), ("batch_inputs", INPUTS)):
        monkeypatch.setitem(T.TASKS, name, kind_task)
    mc, gen = T.load_task("toy_recall", None, 6, n=40), T.load_task("toy_recall_gen", None, 5, n=40)
    docs = toy.corpus(5, seed=7)
    rolling = [T.Item(str(i), d[:40 + 9 * i], continuation=d[40 + 9 * i:140], floor="so") for i, d in enumerate(docs)]
    inputs = [T.Item(str(i), "", i % 2, [d[:30 + 7 * i] + " anna", d[:22 + 5 * i] + " ben"], floor=["anna", "ben"],
                     continuation="cat , tom dog .") for i, d in enumerate(docs)]
    assert padded(tok, [it.context for it in mc]) and padded(tok, [it.context for it in gen])
    for size in (4, 3):
        compare("toy_recall", mc, tok, conds, size)
        compare("toy_recall_gen", gen, tok, conds, size, max_new_tokens=8)
        compare("batch_rolling", rolling, tok, conds, size)
        compare("batch_inputs", inputs, tok, conds, size)


def test_toy_conversations_batch_like_one(toy_run):
    """CoQA in a batch: conversations of different lengths (3 and 2 turns) extend one cache with padding in
    the middle; each answers as it does alone, under target, source and transfer."""
    tok, conds, _ = toy_run
    story = toy.corpus(3, seed=11)
    convs = [T.Conversation("a", story[0][:120], ["so anna", "so ben", "so tom"], [["cat"], ["dog"], ["cow"]]),
             T.Conversation("b", story[1][:60], ["so rosa", "so leo"], [["red"], ["lima"]]),
             T.Conversation("c", story[2][:90], ["so ray", "so ned", "so ada"], [["oslo"], ["rome"], ["lima"]])]
    recs = compare("coqa", convs, tok, conds, 3, max_new_tokens=4)
    assert [len(recs[("target", c.id)]["answers"]) for c in convs] == [2, 1, 2]


@pytest.fixture(scope="module")
def qwen3_run(hub_cache):
    """The tiny Qwen3 pair of the cache (2 -> 3 layers, the real tokenizer), float32, a mapper fitted on
    random ids: the four standard conditions."""
    _, repos = hub_cache
    source, target = (kvt.load_model(repos[r][0]) for r in ("Qwen/Qwen3-14B", "Qwen/Qwen3-32B"))
    tok = kvt.load_tokenizer(repos["Qwen/Qwen3-32B"][0])
    ids = torch.randint(0, 151643, (16, 48), generator=torch.Generator().manual_seed(0))
    mapper, _ = calibrate(source, target, calib_of(ids), k=2)
    return tok, E.conditions(target, source, E.transfer(source, target, mapper))


def test_qwen3_batches_equal_batch_one(qwen3_run, monkeypatch):
    """The same on real shapes' layout and tokenizer: ARC-style multiple choice, GSM8K's prompt format and
    stop strings, a rolling text and a conversation, batch 3 against batch 1."""
    tok, conds = qwen3_run
    monkeypatch.setitem(T.TASKS, "batch_rolling", ROLLING)
    questions = ["Which gas do plants take in?", "What is 2 + 3?", "Where does the sun rise?",
                 "Which of these is a mammal that lives in the sea?"]
    mc = [T.Item(str(i), f"Question: {q}\nAnswer:", i % 4, ["oxygen", "carbon dioxide", "the east", "a whale"],
                 floor="Answer:") for i, q in enumerate(questions)]
    shots = "".join(f"Q: {q}\nA: {a}\n\n" for q, a in T.GSM8K_SHOTS[:2])
    gen = [T.Item(str(i), shots + f"Q: {q}\nA:", "5", floor="A:", until=T.GSM8K_UNTIL) for i, q in enumerate(questions)]
    rolling = [T.Item(str(i), q + " ", continuation="It is a question people ask.", floor="So") for i, q in enumerate(questions)]
    assert padded(tok, [it.context for it in mc])
    compare("arc_easy", mc, tok, conds, 3)
    compare("gsm8k", gen, tok, conds, 3, max_new_tokens=10)
    compare("batch_rolling", rolling, tok, conds, 3)
    convs = [T.Conversation(str(i), f"A story about {q.lower()} It is short.", [q, "Why?", "Who said so?"][:2 + i % 2],
                            [["yes"], ["because"], ["Tom"]]) for i, q in enumerate(questions[:3])]
    compare("coqa", convs, tok, conds, 3, max_new_tokens=4)


def test_recompute_by_row_runs_one_item_at_a_time(toy_run):
    """A transfer that recomputes the first or the most attended slots picks them per row: evaluate gives it
    one item at a time (else the first slots of a padded row would be padding), the same records."""
    tok, conds, mapper = toy_run
    assert conds["transfer"].batched and conds["target"].batched
    source, target = conds["source"].model, conds["target"].model
    for budget in (E.Recompute(first=2), E.Recompute(frac=0.2)):
        cond = {"transfer": E.Condition(target, E.transfer(source, target, mapper, budget))}
        assert not cond["transfer"].batched
        compare("toy_recall", T.load_task("toy_recall", None, 4, n=40), tok, cond, 4)


# ------------------------------------------------------------------------------------------- end tokens

class Steps:
    """The scripted model's cache: how many tokens it has emitted."""
    def __init__(self, n):
        self.n = n


class Script(torch.nn.Module):
    """A model that emits `tokens`, one a step, whatever it reads (each row of a batch the same)."""
    def __init__(self, tokens, vocab):
        super().__init__()
        self.tokens, self.vocab = tokens, vocab
        self.anchor = torch.nn.Parameter(torch.zeros(1))               # where evals looks for the device

    def forward(self, ids, cache=None, mask=None, last=False):
        n = 0 if cache is None else cache.n + 1
        logits = torch.full((ids.shape[0], 1, self.vocab), -30.0)
        logits[:, :, self.tokens[min(n, len(self.tokens) - 1)]] = 0.0
        return logits, Steps(n)


def test_text_after_an_end_token_never_reaches_the_gsm8k_filter(hub_cache):
    """Bug: generation stopped only at tokenizer_config's EOS (<|im_end|> for Qwen3), so a model ending its
    answer with <|endoftext|> ran on, and the flexible filter took the last number after the end token. Qwen3's
    generation_config.json lists both: the answer ends there, at batch 1 and in a batch."""
    _, repos = hub_cache
    tok = kvt.load_tokenizer(repos["Qwen/Qwen3-32B"][0])
    answer = tok.encode(" 3 + 2 = 5. The answer is 5.") + [151643] + tok.encode(" A box holds 42 eggs and 7 hens")
    model = Script(answer, 151936)
    items = [T.Item(str(i), f"Q: What is 3 + {i}?\nA:", "5", floor="A:", until=T.GSM8K_UNTIL) for i in range(3)]
    for size in (1, 3):
        recs = list(E.evaluate("gsm8k", items, tok, {"target": E.Condition(model, plain=True)}, progress=False,
                                batch_size=size))
        for r in recs:
            assert r["output"] == " 3 + 2 = 5. The answer is 5." and r["flexible"] == "5." and r["em_flexible"] == 1.0, r


def test_end_ids_from_generation_config_then_config(tmp_path):
    """generation_config.json's eos_token_id (a list or one id) wins; without it, config.json's; neither: ()."""
    def write(name, obj):
        (tmp_path / name).write_text(json.dumps(obj))
    assert end_ids(tmp_path) == ()
    write("config.json", {"eos_token_id": 151643})
    assert end_ids(tmp_path) == (151643,)
    write("generation_config.json", {"eos_token_id": [151645, 151643]})
    assert end_ids(tmp_path) == (151645, 151643)
    write("generation_config.json", {"eos_token_id": 2})
    assert end_ids(tmp_path) == (2,)


def test_contexts_scored_together_equal_each_alone():
    """loglikelihoods of three contexts in one call (left-padded into one prefill, each continuation on its
    own context's rows) against each context alone, and left_pad's layout: padding first, no mask when
    nothing is padded. Guards: a continuation read from another context's cache row, or padding that
    leaks into the scores."""
    ids, mask = kvt.evals.left_pad([[5, 6, 7], [8]])
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[True] * 3, [False, False, True]]
    assert kvt.evals.left_pad([[1, 2], [3, 4]])[1] is None
    from conftest import tiny_config
    model = kvt.build_model(tiny_config("qwen3"), seed=3, std=0.2)
    pairs = [([5, 17, 99, 23, 8, 64, 1], [[40], [7, 7, 120, 3], [88, 2]]), ([9, 4], [[11, 12, 13], [1]]),
             ([100, 2, 3, 4, 5], [[6]])]
    for pair, (lls, greedy) in zip(pairs, kvt.evals.loglikelihoods(model, pairs)):
        [(want, want_greedy)] = kvt.evals.loglikelihoods(model, [pair])
        assert max(abs(a - b) for a, b in zip(lls, want)) <= TOL and greedy == want_greedy


def test_default_batch_follows_the_prompts_and_the_plan(toy_run):
    """run.py's default --batch-size: eval_shape reads the longest prompt, the most choices and the most new
    tokens of every kind (a conversation has no choices: it broke on CoQA once); plan.eval_batch gives 8 on a
    CPU and on an H200 for Qwen3-14B -> 32B a power of two that shrinks as prompts grow, 1 where only the
    weights fit (an H100)."""
    from kvt.config import shape
    from kvt.harness.pipeline import eval_shape
    from kvt.harness.plan import CPU_EVAL_BATCH, Options, capacity, eval_batch
    tok = toy_run[0]
    conv = T.Conversation("c", "the pets : anna cat .", ["anna ?", "ben ?"], [["cat"], ["dog"]])
    items = {"toy_recall": T.load_task("toy_recall", None, 3, n=40), "coqa": [conv]}
    longest, choices, new = eval_shape(items, tok)
    want = max(len(tok.encode(it.context + max(it.choices, key=len))) for it in items["toy_recall"])
    assert (longest, choices, new) == (want, 4, T.get("coqa").max_new_tokens)
    src, tgt = shape("qwen3-14b"), shape("qwen3-32b")
    assert eval_batch(src, tgt, capacity(["cpu"]), 1000) == CPU_EVAL_BATCH
    h200 = capacity(["cuda:0"], "h200")
    on_gpu = Options(devices=["cuda:0"])
    sizes = [eval_batch(src, tgt, h200, n, 1, 256, on_gpu) for n in (500, 1000, 4000, 16000)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] >= 16 and all(b & (b - 1) == 0 for b in sizes), sizes
    assert eval_batch(src, tgt, capacity(["cuda:0"], "h100"), 1000, options=on_gpu) == 1
