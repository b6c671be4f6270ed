"""Task evaluation: how much accuracy a transferred cache keeps, on the same items as the baselines.

Prompts, answer extraction and metrics follow lm-evaluation-harness v0.4 task yamls:
  hellaswag      validation; utils.preprocess ("[title]", brackets, double spaces); acc, acc_norm
  arc_easy,      test; "Question: {question}\\nAnswer:" + " {choice}"; acc, acc_norm
  arc_challenge
  mmlu           test; "The following are multiple choice questions (with answers) about {subject}.\\n\\n",
                 5 shots from dev (first_n, same subject) by default; " A".." D"; acc, acc_norm
  gsm8k          gsm8k-cot.yaml (version 3.0): the 8 standard chain-of-thought exemplars, "Q: ...\\nA:",
                 greedy until "Q:"; exact match after the strict ("The answer is N.") and flexible
                 (last number) filters
  coqa           coqa/utils.py prompt (story, then "Q: ...\\n\\nA: ...\\n\\n" with gold history), first
                 line of the greedy answer, SQuAD token F1 with the harness's leave-one-out over answers
Multiple choice is scored by loglikelihood: acc picks the highest sum of log-probabilities, acc_norm
divides it by the length of the choice first (the harness documents this as byte length; its code
divides by len(choice) in characters, which we copy; they agree on ASCII text).

A condition says where the context's cache comes from; a model then scores or generates from it:
    target    the target prefills the context itself
    transfer  prefill(ids) -> (last logits (1, V), target cache), e.g. source prefill + mapper (handoff.py)
    source    the source model alone
    floor     the target with only the task's minimal prefix (BOS, "Answer:", "A:"): what it knows
              without the context, so retention can be read against it
Each item is scored under every condition, so the comparison is paired. load_task() gives a task's
items in one fixed seeded order, stratified (MMLU by subject, HellaSwag and CoQA by source), so the
first N are a representative sample and a smaller N is a prefix of a larger one. evaluate() yields one
plain dict per (item, condition), keyed by the item's id, which run.py appends to a jsonl and uses to
resume; summarize() turns records into accuracy, n, 95% intervals and retention per task, and
average_retention() into the mean over tasks of each task's primary-metric retention.
"""
import json
import math
import os
import random
import re
import string
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from kvt import toy
from kvt.config import KvtError
from kvt.handoff import handoff
from kvt.model import generate


# ---------------------------------------------------------------------------------------- data

# data file -> how to get it (the Hugging Face data set whose field names we read), and the fields every row needs
SOURCES = {
    "hellaswag/validation.jsonl": ('load_dataset("Rowan/hellaswag", split="validation")',
                                   ("ind", "activity_label", "ctx_a", "ctx_b", "endings", "label", "source_id")),
    "arc_easy/test.jsonl": ('load_dataset("allenai/ai2_arc", "ARC-Easy", split="test")',
                            ("id", "question", "choices", "answerKey")),
    "arc_challenge/test.jsonl": ('load_dataset("allenai/ai2_arc", "ARC-Challenge", split="test")',
                                 ("id", "question", "choices", "answerKey")),
    "mmlu/test.jsonl": ('load_dataset("cais/mmlu", "all", split="test")', ("subject", "question", "choices", "answer")),
    "mmlu/dev.jsonl": ('load_dataset("cais/mmlu", "all", split="dev")', ("subject", "question", "choices", "answer")),
    "gsm8k/test.jsonl": ('load_dataset("openai/gsm8k", "main", split="test")', ("question", "answer")),
    "coqa/validation.jsonl": ('load_dataset("EleutherAI/coqa", split="validation")', ("id", "story", "questions", "answers")),
}


def default_data_dir():
    """$KVT_DATA, else data/ (tests and CI point it at ../shared/data)."""
    return os.environ.get("KVT_DATA", "data")


def read_jsonl(data_dir, name):
    """The rows of data_dir/name, e.g. name="arc_easy/test.jsonl"."""
    path = Path(data_dir) / name
    how, fields = SOURCES.get(name, ("load_dataset(...)", ()))
    if not path.exists():
        raise KvtError(f"missing {path}: write it with `datasets.{how}.to_json('{path}')`, "
                       f"or point --data-dir (or KVT_DATA) at a folder that has it, e.g. ../shared/data")
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise KvtError(f"{path}, line {i}: not valid JSON ({e.msg}); fix the line or write the file again")
            lacks = [k for k in fields if not isinstance(row, dict) or k not in row]
            if lacks:
                raise KvtError(f"{path}, line {i}: no field {', '.join(map(repr, lacks))}; write the file again "
                               f"with `datasets.{how}.to_json(...)`")
            rows.append(row)
    return rows


@dataclass
class Item:
    """One prompt. Multiple choice: `choices` and the index `gold`. Generation: the answer `gold`."""
    id: str                # unique within its task: records are keyed by (task, condition, id)
    context: str           # everything before the answer, few-shot examples included
    gold: object           # MC: int index; gsm8k: the number as a string
    choices: list = None   # MC continuations without the leading space (the harness's doc_to_choice)
    floor: str = ""        # the minimal prefix the `floor` condition sees instead of the context
    until: tuple = ()      # exact match: stop strings of the generation
    stratum: str = ""      # the group a sample keeps in proportion (MMLU subject, HellaSwag source)


@dataclass
class Conversation:
    """One CoQA story and its turns; answers[t] lists the distinct gold answers of turn t."""
    id: str
    story: str
    questions: list
    answers: list = field(default_factory=list)
    stratum: str = ""      # the story's source: mctest, race, cnn, wikipedia, gutenberg


def hellaswag_preprocess(text):
    """The harness's hellaswag/utils.py cleanup; brackets are artifacts of the WikiHow part."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag(data_dir):
    """Every item in file order: ActivityNet rows first, then WikiHow. `ind` repeats across the two
    sources (9,609 distinct of 10,042), so the id is "activitynet/24", "wikihow/1"."""
    items = []
    for row in read_jsonl(data_dir, "hellaswag/validation.jsonl"):
        source = row["source_id"].split("~")[0]  # "activitynet~v_0bosp4-pyTM" -> "activitynet"
        ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
        items.append(Item(f"{source}/{row['ind']}", hellaswag_preprocess(row["activity_label"] + ": " + ctx),
                          int(row["label"]), [hellaswag_preprocess(e) for e in row["endings"]], stratum=source))
    return items


def arc(data_dir, subset="arc_easy"):
    items = []
    for row in read_jsonl(data_dir, f"{subset}/test.jsonl"):
        labels = row["choices"]["label"]
        items.append(Item(row["id"], f"Question: {row['question']}\nAnswer:", labels.index(row["answerKey"]),
                          list(row["choices"]["text"]), floor="Answer:"))
    return items


def _mmlu_question(row):
    letters = "".join(f"\n{l}. {c}" for l, c in zip("ABCD", row["choices"]))
    return f"{row['question'].strip()}{letters}\nAnswer:"


def mmlu(data_dir, shots=5):
    """Every test item in file order (sorted by subject); the shots are the subject's first dev items."""
    dev = {}
    for row in read_jsonl(data_dir, "mmlu/dev.jsonl"):
        dev.setdefault(row["subject"], []).append(row)
    items = []
    for i, row in enumerate(read_jsonl(data_dir, "mmlu/test.jsonl")):
        subject = row["subject"]
        header = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
        examples = "".join(_mmlu_question(d) + " " + "ABCD"[d["answer"]] + "\n\n" for d in dev[subject][:shots])
        items.append(Item(f"{subject}/{i}", header + examples + _mmlu_question(row), row["answer"],
                          ["A", "B", "C", "D"], floor="Answer:", stratum=subject))
    return items


GSM8K_SHOTS = [  # gsm8k-cot.yaml fewshot_config.samples, in order
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are "
     "done, there will be 21 trees. How many trees did the grove workers plant today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must "
     "have been 21 - 15 = 6. The answer is 6."),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5."),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating "
     "35, they had 74 - 35 = 39. The answer is 39."),
    ("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops "
     "did Jason give to Denny?",
     "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8. "
     "The answer is 8."),
    ("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he "
     "have now?",
     "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. "
     "5 + 4 = 9. The answer is 9."),
    ("There were nine computers in the server room. Five more computers were installed each day, from monday "
     "to thursday. How many computers are now in the server room?",
     "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 "
     "computers were added. 9 + 20 is 29. The answer is 29."),
    ("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many "
     "golf balls did he have at the end of wednesday?",
     "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 "
     "more, he had 35 - 2 = 33 golf balls. The answer is 33."),
    ("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
     "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 "
     "dollars left. 23 - 15 is 8. The answer is 8."),
]
GSM8K_UNTIL = ("Q:", "</s>", "<|im_end|>")


def gsm8k(data_dir, shots=8):
    examples = "".join(f"Q: {q}\nA: {a}\n\n" for q, a in GSM8K_SHOTS[:shots])
    return [Item(str(i), examples + f"Q: {row['question']}\nA:", row["answer"].split("####")[-1].strip(),
                 floor="A:")
            for i, row in enumerate(read_jsonl(data_dir, "gsm8k/test.jsonl"))]


def coqa(data_dir, turns=10):
    """Conversations cut to their first `turns` turns (HF stanfordnlp/coqa or EleutherAI/coqa fields)."""
    convs = []
    for row in read_jsonl(data_dir, "coqa/validation.jsonl"):
        text = lambda x: x["input_text"] if isinstance(x, dict) else x  # noqa: E731 (HF nests input_text)
        questions, answers = text(row["questions"])[:turns], text(row["answers"])[:turns]
        extra = [text(a) for a in (row.get("additional_answers") or {}).values()]
        golds = []
        for t, a in enumerate(answers):  # the harness's doc_to_target: distinct answers, case-insensitive
            golds.append([a])
            for other in extra:
                if t < len(other) and other[t].lower() not in map(str.lower, golds[t]):
                    golds[t].append(other[t])
        convs.append(Conversation(row["id"], row["story"], questions, golds, stratum=row.get("source", "")))
    return convs


def toy_task(data_dir, name, n=1000):
    """A task of the toy family (kvt/toy.py): a fixed pool of n items generated from a fixed seed, no data
    files. The floor sees only the context's last clause (the question without the facts it asks about)."""
    items = []
    for i, r in enumerate(toy.toy_tasks(name, n)):
        context = r.get("context", r.get("prompt"))
        floor = context.rsplit(".", 1)[-1] if "." in context else context
        if "choices" in r:
            items.append(Item(f"{name}/{i}", context, r["label"], [c.removeprefix(" ") for c in r["choices"]], floor))
        else:
            items.append(Item(f"{name}/{i}", context, r["answer"], floor=floor, until=tuple(r["until"])))
    return items


TASKS = {  # name -> (loader, kind, primary metric: the one average_retention reads)
    "hellaswag": (hellaswag, "mc", "acc_norm"),
    "arc_easy": (partial(arc, subset="arc_easy"), "mc", "acc_norm"),
    "arc_challenge": (partial(arc, subset="arc_challenge"), "mc", "acc_norm"),
    "mmlu": (mmlu, "mc", "acc"),
    "gsm8k": (gsm8k, "gen", "em_strict"),
    "coqa": (coqa, "coqa", "f1"),
    **{f"toy_{t}": (partial(toy_task, name=t), *(("mc", "acc") if t in ("recall", "count") else ("em", "em")))
       for t in toy.TASKS},
}


def sample_order(strata, seed=0):
    """A fixed order of items whose every prefix is a stratified sample: indices into `strata` (one label
    per item). Items are shuffled within each stratum; the order starts with one item of each stratum (in
    a seeded order, so a prefix of >= #strata items has them all), then at each step takes the next item
    of the stratum furthest below its quota p_s * n (n items after this step, p_s its share of all items;
    ties go to the earlier stratum of that first round). One stratum: a plain seeded shuffle."""
    rng = random.Random(seed)
    groups = {}  # stratum -> its item indices, shuffled
    for i, s in enumerate(strata):
        groups.setdefault(s, []).append(i)
    for s in sorted(groups):
        rng.shuffle(groups[s])
    names = sorted(groups)
    rng.shuffle(names)
    N, taken = len(strata), dict.fromkeys(names, 1)
    order = [groups[s][0] for s in names]
    while len(order) < N:
        n = len(order) + 1
        # deficit p_s * n - taken_s, times N to stay in integers
        s = max((s for s in names if taken[s] < len(groups[s])), key=lambda s: len(groups[s]) * n - taken[s] * N)
        order.append(groups[s][taken[s]])
        taken[s] += 1
    return order


def load_task(name, data_dir, limit=None, seed=0, **options):
    """The first `limit` items of a task in its fixed seeded order (sample_order over the items' strata),
    so a smaller limit is a prefix of a larger one and a resumed run sees the same items.
    options go to its loader (mmlu: shots=0 for zero-shot; coqa: turns; toy tasks: n, the pool size)."""
    if name not in TASKS:
        raise KvtError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    if limit is not None and limit < 1:
        raise KvtError(f"--limit {limit}: evaluate at least 1 item per task")
    try:
        items = TASKS[name][0](data_dir, **options)
    except (KeyError, ValueError, TypeError, IndexError, AttributeError) as e:  # a field of the wrong form
        raise KvtError(f"{name}: a row of its data file in {data_dir} is malformed ({type(e).__name__}: {e}); "
                       "write the file again from the data set named in kvt/evals.py SOURCES")
    if len({item.id for item in items}) != len(items):
        raise KvtError(f"{name}: item ids repeat in its data file in {data_dir}; write the file again")
    return [items[i] for i in sample_order([item.stratum for item in items], seed)[:limit]]


# ---------------------------------------------------------------------------------- conditions

@dataclass
class Condition:
    """Where the context's cache comes from (`prefill`) and which model continues from it."""
    model: object           # scores continuations / generates after the prefill
    prefill: object = None  # ids (1, T) -> (last logits (1, V), cache); None: the model's own prefill
    floor: bool = False     # prefill the item's minimal prefix instead of its context

    def __call__(self, ids):
        if self.prefill is not None:
            return self.prefill(ids)
        logits, cache = self.model(ids, last=True)  # (1, 1, V)
        return logits[:, -1], cache                 # (1, V)


def transfer(source, target, mapper):
    """The transfer prefill: the source reads the context, the mapper carries its cache to the target,
    which runs the last context token itself (kvt.handoff.handoff)."""
    def prefill(ids):
        logits, cache = handoff(source, target, mapper, ids)  # (1, 1, V), the target's cache
        return logits[:, -1], cache
    return prefill


def conditions(target, source=None, transfer=None):
    """The standard set on one target: target, floor, and source / transfer when given.
    transfer: a prefill, e.g. evals.transfer(source, target, mapper)."""
    out = {"target": Condition(target), "floor": Condition(target, floor=True)}
    if source is not None:
        out["source"] = Condition(source)
    if transfer is not None:
        out["transfer"] = Condition(target, transfer)
    return out


def _device(model):
    return next(model.parameters()).device


# ------------------------------------------------------------------------------------- scoring

def encode_pair(tok, context, continuation):
    """Token ids of a context and its continuation, as the harness's _encode_pair: trailing spaces move
    to the continuation, and the continuation is what encoding both together adds after the context."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    ctx = tok.encode(context)
    whole = tok.encode(context + continuation)
    return ctx or [tok.prefix_id], whole[len(ctx):]  # an empty context is the prefix token (BOS or EOS), as there


@torch.no_grad()
def loglikelihoods(cond, ctx, conts):
    """Sum of log p(continuation | context) for n continuations, and whether each is the greedy one.
    The context is prefilled once; the continuations run as one right-padded batch from its cache."""
    dev = _device(cond.model)
    last, cache = cond(torch.tensor([ctx], device=dev))    # (1, V), a cache of T slots
    n, Tc = len(conts), max(len(c) for c in conts)
    cont = torch.zeros(n, Tc, dtype=torch.long, device=dev)  # (n, Tc), right padding
    real = torch.zeros(n, Tc, dtype=torch.bool, device=dev)  # (n, Tc), True at real tokens
    for i, c in enumerate(conts):
        cont[i, :len(c)], real[i, :len(c)] = torch.tensor(c), True
    # Off by one: logits[:, i] predict token i+1. The context's last position predicts continuation
    # token 0; continuation token j predicts token j+1, so the last token is never fed. Right padding
    # sits after every real token, so it cannot change their logits (attention is causal).
    pred = last[:, None].expand(n, 1, -1)                     # (n, 1, V)
    if Tc > 1:
        logits, _ = cond.model(cont[:, :-1], cache=cache.expand(n))  # (n, Tc-1, V)
        pred = torch.cat([pred, logits], 1)                   # (n, Tc, V)
    logp = pred.float().log_softmax(-1).gather(-1, cont[..., None])[..., 0]  # (n, Tc)
    ll = logp.masked_fill(~real, 0).sum(1)                    # (n,)
    greedy = ((pred.argmax(-1) == cont) | ~real).all(1)       # (n,)
    return ll.tolist(), greedy.tolist()


def mc_metrics(lls, choices, gold):
    """acc and acc_norm from the loglikelihood of each choice (first maximum wins, as np.argmax)."""
    pred = max(range(len(lls)), key=lambda i: lls[i])
    pred_norm = max(range(len(lls)), key=lambda i: lls[i] / len(choices[i]))
    return {"pred": pred, "pred_norm": pred_norm, "acc": float(pred == gold), "acc_norm": float(pred_norm == gold)}


def score_mc(cond, tok, item):
    context = item.floor if cond.floor else item.context
    pairs = [encode_pair(tok, context, " " + c) for c in item.choices]  # target_delimiter " "
    lls, greedy = loglikelihoods(cond, pairs[0][0], [cont for _, cont in pairs])
    return {"gold": item.gold, "lls": lls, "greedy": greedy, **mc_metrics(lls, item.choices, item.gold)}


# ---------------------------------------------------------------------------------- generation

@torch.no_grad()
def generate_until(cond, tok, context, until, max_new_tokens):
    """Greedy text after the context, cut at the first of the stop strings (the harness's generate_until)."""
    ids = tok.encode(context) or [tok.prefix_id]
    last, cache = cond(torch.tensor([ids], device=_device(cond.model)))
    out = generate(cond.model, last, cache, max_new_tokens, stop_ids=(tok.eos_id,), stop=until,
                   decode=tok.decode)[0]
    text = tok.decode(out)
    for s in until:
        text = text.split(s)[0]
    return text


def score_em(cond, tok, item, max_new_tokens=32):
    """Exact match of the greedy answer, cut at the item's stop strings and stripped (toy tasks)."""
    out = generate_until(cond, tok, item.floor if cond.floor else item.context, item.until, max_new_tokens).strip()
    return {"gold": item.gold, "output": out, "em": float(out == item.gold)}


def gsm8k_strict(text):
    """The "strict-match" filter: the first "The answer is N." ('.' is any character there, as in the yaml)."""
    m = re.findall(r"The answer is (\-?[0-9\.\,]+).", text)
    return m[0].strip() if m else "[invalid]"


def gsm8k_flexible(text):
    """The "flexible-extract" filter: the last number in the text."""
    m = re.findall(r"(-?[$0-9.,]{2,})|(-?[0-9]+)", text)
    if not m:
        return "[invalid]"
    found = [g for g in m[-1] if g]
    return found[0].strip() if found else "[invalid]"


def gsm8k_exact_match(pred, gold):
    """exact_match with the yaml's regexes_to_ignore (',', '$', '.*#### ', a final '.') and ignore_case."""
    def clean(s):
        for r in (",", "\\$", "(?s).*#### ", "\\.$"):
            s = re.sub(r, "", s)
        return s.lower()
    return float(clean(pred) == clean(gold))


def score_gsm8k(cond, tok, item, max_new_tokens=256):
    output = generate_until(cond, tok, item.floor if cond.floor else item.context, GSM8K_UNTIL, max_new_tokens)
    strict, flexible = gsm8k_strict(output), gsm8k_flexible(output)
    return {"gold": item.gold, "output": output, "strict": strict, "flexible": flexible,
            "em_strict": gsm8k_exact_match(strict, item.gold), "em_flexible": gsm8k_exact_match(flexible, item.gold)}


# ---------------------------------------------------------------------------------------- coqa

def squad_normalize(s):
    """SQuAD answer normalization: lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def token_f1(gold, pred):
    """SQuAD token F1 of a predicted answer against one gold answer (1.0 if both are empty)."""
    g, p = squad_normalize(gold).split(), squad_normalize(pred).split()
    if not g or not p:
        return float(g == p)
    same = sum((Counter(g) & Counter(p)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def exact_match(gold, pred):
    """SQuAD exact match: 1.0 if the answers are equal after squad_normalize."""
    return float(squad_normalize(gold) == squad_normalize(pred))


def coqa_score(score, golds, pred):
    """The harness's compute_scores: with several golds, the mean over leaving each one out of the max."""
    if len(golds) == 1:
        return score(golds[0], pred)
    return sum(max(score(g, pred) for g in golds[:i] + golds[i + 1:]) for i in range(len(golds))) / len(golds)


coqa_f1 = partial(coqa_score, token_f1)
coqa_em = partial(coqa_score, exact_match)


def coqa_segments(conv):
    """Prompt pieces: piece 0 is the story and question 1, piece t appends gold answer t and question t+1,
    so pieces 0..t-1 make the harness prompt of turn t (1-based) and the cache grows by one piece a turn."""
    pieces = [f"{conv.story}\n\nQ: {conv.questions[0]}\n\nA:"]
    for t in range(1, len(conv.questions)):
        pieces.append(f" {conv.answers[t - 1][0]}\n\nQ: {conv.questions[t]}\n\nA:")
    return pieces


@torch.no_grad()
def converse(cond, tok, conv, start=2, max_new_tokens=64):
    """Answers to turns start..n (1-based) of a conversation, handed over before turn `start`.

    `cond` prefills the prompt of turn `start` (for a transfer: the other model read the story and turns
    before it; the mapper moves its cache across). From then on cond.model holds the conversation: it
    answers, then extends its own cache with the gold answer and the next question. History is gold, as
    in the harness, so every condition sees the same text and only whose KV holds it differs."""
    model, dev = cond.model, _device(cond.model)
    pieces = coqa_segments(conv)
    ids = tok.encode(pieces[0]) + [i for p in pieces[1:start] for i in tok.encode(p, special=False)]
    last, cache = cond(torch.tensor([ids], device=dev))       # (1, V)
    answers = []
    for t in range(start, len(pieces) + 1):
        # stop once the first non-blank line is complete: the harness keeps only that line
        out = generate(model, last, cache, max_new_tokens, stop_ids=(tok.eos_id,), stop=("\n",),
                       decode=lambda x: tok.decode(x).lstrip())[0]
        answers.append(tok.decode(out).split("\nQ:")[0].strip().split("\n")[0])
        if t < len(pieces):
            nxt = torch.tensor([tok.encode(pieces[t], special=False)], device=dev)  # (1, Tp)
            logits, cache = model(nxt, cache=cache)
            last = logits[:, -1]
    return answers


def score_coqa(cond, tok, conv, start=2, max_new_tokens=64):
    answers = converse(cond, tok, conv, start, max_new_tokens)
    turns = list(range(start, start + len(answers)))
    f1 = [coqa_f1(conv.answers[t - 1], a) for t, a in zip(turns, answers)]
    em = [coqa_em(conv.answers[t - 1], a) for t, a in zip(turns, answers)]
    return {"turns": turns, "answers": answers, "f1_turns": f1, "em_turns": em,
            "f1": sum(f1) / max(1, len(f1)), "em": sum(em) / max(1, len(em))}


# ------------------------------------------------------------------------------------- running

METRICS = {"mc": ("acc", "acc_norm"), "gen": ("em_strict", "em_flexible"), "coqa": ("f1", "em"), "em": ("em",)}


def evaluate(task, items, tok, conds, done=(), progress=True, **options):
    """Yield one record {"task", "condition", "id", ...scores} per (item, condition), item by item,
    skipping the (condition, item id) pairs in `done`, so a resumed run may list its items in any order.
    options: max_new_tokens (gsm8k, coqa), start (coqa: the turn that follows the handoff).
    CoQA has no floor (without the story there is nothing to answer from); floor conditions are skipped."""
    kind = TASKS[task][1]
    score = {"mc": score_mc, "gen": score_gsm8k, "coqa": score_coqa, "em": score_em}[kind]
    done = set(map(tuple, done))
    for item in tqdm(items, desc=task, disable=not progress):
        for name, cond in conds.items():
            if (name, item.id) in done or (kind == "coqa" and cond.floor):
                continue
            yield {"task": task, "condition": name, "id": item.id, **score(cond, tok, item, **options)}


# --------------------------------------------------------------------------------------- stats
# Undefined numbers (a ratio over 0, an interval with no finite resample) are None, never NaN, so a
# summary is strict JSON.

def wilson(k, n, z=1.96):
    """95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, center - half), min(1.0, center + half))  # clipped: rounding can step past 0 or 1


def percentiles(stats):
    """95% percentile interval of resampled statistics (n_boot,), over the finite ones; (None, None) if none."""
    stats = stats[stats.isfinite()]
    if len(stats) == 0:
        return (None, None)
    return (stats.quantile(0.025).item(), stats.quantile(0.975).item())


def bootstrap(fn, columns, n_boot=1000, seed=0):
    """95% percentile interval of fn(*columns) over items resampled with replacement (paired columns).
    fn returns a number, or None where undefined (that resample is dropped)."""
    cols = [torch.tensor(c, dtype=torch.float64) for c in columns]
    if len(cols[0]) == 0:
        return (None, None)
    idx = torch.randint(len(cols[0]), (n_boot, len(cols[0])), generator=torch.Generator().manual_seed(seed))
    stats = [fn(*(c[i] for c in cols)) for i in idx]
    return percentiles(torch.tensor([math.nan if v is None else v for v in stats], dtype=torch.float64))


def _ratio(a, b):
    """mean(a) / mean(b); None without items or when mean(b) = 0."""
    return float(a.mean() / b.mean()) if len(b) and b.mean() != 0 else None


def _floor_ratio(a, b, f):
    """(mean(a) - mean(f)) / (mean(b) - mean(f)); None without items or when mean(b) = mean(f)."""
    return float((a.mean() - f.mean()) / (b.mean() - f.mean())) if len(b) and b.mean() != f.mean() else None


def _by_task(records):
    """task -> condition -> item id -> record."""
    by = {}
    for r in records:
        by.setdefault(r["task"], {}).setdefault(r["condition"], {})[r["id"]] = r
    return by


def _common(conds, names):
    """The item ids every one of the named conditions has, sorted (a fixed order for paired resampling);
    none if a condition has no records."""
    return sorted(set.intersection(*(set(conds.get(c, ())) for c in names)))


def item_ids(records):
    """task -> the ids of its items, in the order their first records appear (the sampled order)."""
    ids = {}
    for r in records:
        ids.setdefault(r["task"], {})[r["id"]] = None  # a dict keeps first-seen order
    return {task: list(seen) for task, seen in ids.items()}


def summarize(records, n_boot=1000):
    """{task: {condition: {metric: mean, metric_ci: (lo, hi), n}, "retention": {metric: {...}}}}.
    Retention = transfer / target and (transfer - floor) / (target - floor), on the item ids every one
    of the three conditions has, with a paired bootstrap interval; n = 0 and None when they share none."""
    out = {}
    for task, conds in _by_task(records).items():
        metrics = METRICS[TASKS[task][1]]
        out[task] = {}
        for name, recs in conds.items():
            row = {"n": len(recs)}
            for m in metrics:
                vals = [r[m] for r in recs.values()]
                row[m] = sum(vals) / len(vals)
                binary = all(v in (0.0, 1.0) for v in vals)
                row[m + "_ci"] = wilson(sum(vals), len(vals)) if binary else bootstrap(torch.mean, [vals], n_boot)
            out[task][name] = row
        if "transfer" in conds and "target" in conds:
            out[task]["retention"] = _retention(conds, metrics, n_boot)
    return out


def _retention(conds, metrics, n_boot):
    names = ["transfer", "target"] + (["floor"] if "floor" in conds else [])
    common = _common(conds, names)
    ret = {}
    for m in metrics:
        cols = [[conds[c][i][m] for i in common] for c in names]
        t = [torch.tensor(c, dtype=torch.float64) for c in cols]
        row = {"n": len(common), "ratio": _ratio(t[0], t[1]), "ratio_ci": bootstrap(_ratio, cols[:2], n_boot)}
        if "floor" in conds:
            row["floor_normalized"] = _floor_ratio(*t)
            row["floor_normalized_ci"] = bootstrap(_floor_ratio, cols, n_boot)
        ret[m] = row
    return ret


def average_retention(records, n_boot=1000, seed=0):
    """The paper's headline: the mean over tasks of each task's retention transfer / target on its
    primary metric (TASKS), the same for (transfer - floor) / (target - floor) over the tasks with a
    floor, and each condition's mean primary score over the same tasks ("accuracy").

    A task counts on the item ids all its conditions share. A task whose target scores 0 there has no
    ratio and stays out of every mean: "tasks" lists those that entered, "skipped" the others and why.
    95% intervals: a bootstrap that resamples items within each task (the same items for every
    condition) and recomputes the mean of the per-task ratios; a resample with an undefined ratio is
    dropped, as in bootstrap()."""
    cols, skipped = {}, {}  # task -> condition -> primary scores (n,), paired by item
    for task, conds in _by_task(records).items():
        metric, ids = TASKS[task][2], _common(conds, conds)
        if "target" not in conds or "transfer" not in conds:
            skipped[task] = "no target or no transfer records"
        elif not ids:
            skipped[task] = "no item that every condition has"
        elif sum(conds["target"][i][metric] for i in ids) == 0:
            skipped[task] = "the target scores 0: retention undefined"
        else:
            cols[task] = {c: torch.tensor([conds[c][i][metric] for i in ids], dtype=torch.float64) for c in conds}
    tasks = list(cols)
    floor_tasks = [t for t in tasks if "floor" in cols[t] and cols[t]["floor"].mean() != cols[t]["target"].mean()]
    names = [c for c in ("target", "transfer", "source", "floor") if all(c in cols[t] for t in tasks)]

    def means(score):  # task -> condition -> mean score, 0-d or (n_boot,) -> {quantity: mean over tasks}
        per_task = {"retention": [score[t]["transfer"] / score[t]["target"] for t in tasks],
                    "floor_normalized": [(score[t]["transfer"] - score[t]["floor"])
                                         / (score[t]["target"] - score[t]["floor"]) for t in floor_tasks],
                    **{c: [score[t][c] for t in tasks] for c in names}}
        return {k: torch.stack(v).mean(0) if v else None for k, v in per_task.items()}

    point = means({t: {c: v.mean() for c, v in col.items()} for t, col in cols.items()})
    g, resampled = torch.Generator().manual_seed(seed), {}
    for t, col in cols.items():
        n = len(col["target"])
        idx = torch.randint(n, (n_boot, n), generator=g)                 # (n_boot, n), shared by the conditions
        resampled[t] = {c: v[idx].mean(1) for c, v in col.items()}       # (n_boot,)
    boot = means(resampled)
    out = {"tasks": tasks, "skipped": skipped, "metric": {t: TASKS[t][2] for t in tasks},
           "n": {t: len(cols[t]["target"]) for t in tasks}, "floor_tasks": floor_tasks,
           "accuracy": {}, "accuracy_ci": {}}
    for k in point:
        value = None if point[k] is None else point[k].item()
        ci = (None, None) if boot[k] is None else percentiles(boot[k])
        if k in names:
            out["accuracy"][k], out["accuracy_ci"][k] = value, ci
        else:
            out[k], out[k + "_ci"] = value, ci
    return out


# ---------------------------------------------------------------------------------------- coqa turns

def _slope(xs, ys):
    """Least-squares slope of ys over xs; None with fewer than two points."""
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def coqa_turns(records, conds=("target", "transfer")):
    """Per turn, each condition's mean gold F1 and EM in points, on the conversations both conditions
    answered; the gap conds[0] - conds[1] in F1 per turn and over all turns (every turn of every
    conversation weighs the same, as the harness averages turns); and the drift: least-squares slopes
    over turns of each condition's F1 and of the gap, in points per turn."""
    a, b = conds
    by = _by_task(records).get("coqa", {})
    per_turn = {}  # turn -> condition -> metric -> scores
    for i in _common(by, conds):
        for c in conds:
            r = by[c][i]
            for t, f1, em in zip(r["turns"], r["f1_turns"], r["em_turns"]):
                d = per_turn.setdefault(t, {}).setdefault(c, {"f1": [], "em": []})
                d["f1"].append(100 * f1)
                d["em"].append(100 * em)
    turns = sorted(per_turn)
    mean = lambda v: sum(v) / len(v) if v else None  # noqa: E731
    f1 = {c: [mean(per_turn[t][c]["f1"]) for t in turns] for c in conds}
    em = {c: [mean(per_turn[t][c]["em"]) for t in turns] for c in conds}
    gap = [x - y for x, y in zip(f1[a], f1[b])]
    overall = {c: {m: mean([v for t in turns for v in per_turn[t][c][m]]) for m in ("f1", "em")} for c in conds}
    return {"turns": turns, "n": [len(per_turn[t][a]["f1"]) for t in turns], "f1": f1, "em": em, "gap": gap,
            "mean": overall, "mean_gap": None if not turns else overall[a]["f1"] - overall[b]["f1"],
            "drift": {**{c: _slope(turns, f1[c]) for c in conds}, "gap": _slope(turns, gap)}}


def coqa_agreement(records, cond="transfer", reference="target"):
    """Per turn, the mean F1 of `cond`'s answers scored against `reference`'s answers on the same
    conversations, and the drift: the least-squares slope of that F1 over turns, in F1 points per turn."""
    by = _by_task(records).get("coqa", {})
    per_turn = {}
    for i in _common(by, (cond, reference)):
        r, ref = by[cond][i], by[reference][i]
        for t, x, y in zip(r["turns"], r["answers"], ref["answers"]):
            per_turn.setdefault(t, []).append(token_f1(y, x))
    turns = sorted(per_turn)
    f1 = [100 * sum(per_turn[t]) / len(per_turn[t]) for t in turns]
    return {"turns": turns, "f1": f1, "n": [len(per_turn[t]) for t in turns],
            "mean": sum(f1) / len(f1) if f1 else None, "drift_per_turn": _slope(turns, f1)}
