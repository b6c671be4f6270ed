"""Evaluation: how much accuracy a transferred cache keeps, every item under every condition.

    conds = conditions(target, source, transfer(source, target, mapper))
    records = list(evaluate("arc_easy", load_task("arc_easy", data_dir, 200), tok, conds))
    summarize(records)               # kvt/summary.py: accuracy, 95% intervals, retention

A condition says where the context's cache comes from; a model then scores or generates from it:
    target    the target prefills the context itself
    transfer  prefill(ids) -> (last logits (1, V), target cache), e.g. source prefill + mapper (handoff.py)
    source    the source model alone
    floor     the target with only the item's minimal prefix (BOS, "Answer:", "A:"): what it knows
              without the context, so retention can be read against it
How a condition meets each kind of task (kvt/tasks.py):
    multiple_choice        it reads the context; its model scores every choice from that cache
    multiple_input         it reads each option's context in turn; its model scores the shared
                           continuation from each cache (floor: each context's minimal prefix)
    generate_until         it reads the context; its model generates from that cache
    loglikelihood_rolling  it reads the prefix (Item.context); its model scores the rest of the text from
                           that cache: for transfer, the source reads the prefix and the target scores
                           the rest from the mapped cache. Every condition scores the same text (the
                           floor after the prefix token alone), so perplexity per word and per byte
                           compares them whatever the tokens at the boundary
    coqa                   it reads the story and the turns before `start`; its model answers from there,
                           extending its own cache (no floor: without the story there is nothing to answer)
Each item is scored under every condition, so the comparison is paired. evaluate() yields one plain
dict per (item, condition), keyed by the item's id, which run.py appends to a jsonl and uses to resume.
"""
import re
from dataclasses import dataclass

import torch
from tqdm import tqdm

from kvt import scoring, tasks
from kvt.answers import coqa_em, coqa_f1
from kvt.config import KvtError
from kvt.handoff import Recompute, handoff
from kvt.model import generate
# Also here, so that `from kvt import evals` reaches a whole evaluation (tutorial.md, section 10):
from kvt.scoring import mc_metrics  # noqa: F401
from kvt.summary import average_retention, bootstrap, summarize  # noqa: F401
from kvt.tasks import load_task  # noqa: F401


# ---------------------------------------------------------------------------------- conditions

@dataclass
class Condition:
    """Where the context's cache comes from (`prefill`) and which model continues from it."""
    model: object           # scores continuations / generates after the prefill
    prefill: object = None  # ids (1, T) -> (last logits (1, V), cache); None: the model's own prefill
    floor: bool = False     # prefill the item's minimal prefix instead of its context

    def __call__(self, ids):
        return scoring.prefill(self.model, ids, self.prefill)  # (1, V), cache


def transfer(source, target, mapper, recompute=Recompute()):
    """The transfer prefill: the source reads the context, the mapper carries its cache to the target,
    which runs the last context token itself (kvt.handoff.handoff), and recomputes the `recompute`
    budget of slots first when one is given (kvt's option)."""
    def prefill(ids):
        logits, cache = handoff(source, target, mapper, ids, recompute=recompute)  # (1, 1, V), the target's cache
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


# ------------------------------------------------------------------------------ loglikelihood

def score_choice(cond, tok, item, task):
    """multiple_choice: kvt.scoring.score_choices, the scorer toy.choice_accuracy uses too."""
    context = item.floor if cond.floor else item.context
    return scoring.score_choices(cond.model, tok.encode, context, item.choices, item.gold, tok.prefix_id, cond.prefill)


def score_inputs(cond, tok, item, task):
    """multiple_input: the loglikelihood of the shared continuation (after the delimiter " ") after each
    option's context, each context read by the condition; the highest wins (acc)."""
    contexts = item.choices
    if cond.floor:
        contexts = item.floor if isinstance(item.floor, list) else [item.floor] * len(item.choices)
    lls = []
    for context in contexts:
        ctx, cont = scoring.encode_pair(tok.encode, context, " " + item.continuation, tok.prefix_id)
        lls += scoring.loglikelihoods(cond.model, ctx, [cont], cond.prefill)[0]
    m = scoring.mc_metrics(lls, contexts, item.gold)
    return {"gold": item.gold, "lls": lls, "pred": m["pred"], "acc": m["acc"]}


def score_rolling(cond, tok, item, task):
    """loglikelihood_rolling: the summed loglikelihood `ll` of the text after the prefix, with the text's
    length in tokens, words (split on whitespace, as the harness counts) and UTF-8 bytes."""
    prefix = item.context.rstrip()
    text = item.context[len(prefix):] + item.continuation  # the prefix's trailing space belongs to the text
    ctx, cont = scoring.encode_pair(tok.encode, item.floor if cond.floor else prefix, text, tok.prefix_id)
    if not cont:
        raise KvtError(f"{task.name} item {item.id}: no text to score after the prefix (Item.continuation)")
    (ll,), _ = scoring.loglikelihoods(cond.model, ctx, [cont], cond.prefill)
    return {"ll": ll, "tokens": len(cont), "words": len(re.split(r"\s+", text)), "bytes": len(text.encode("utf-8"))}


# ---------------------------------------------------------------------------------- generation

@torch.no_grad()
def generate_until(cond, tok, context, until, max_new_tokens, logprobs=None):
    """Greedy text after the context, cut at the first of the stop strings (the harness's generate_until).
    logprobs: an empty list, filled with the log-probability of each generated token."""
    ids = tok.encode(context) or [tok.prefix_id]
    last, cache = cond(torch.tensor([ids], device=_device(cond.model)))
    out = generate(cond.model, last, cache, max_new_tokens, stop_ids=(tok.eos_id,), stop=until,
                   decode=tok.decode, logprobs=None if logprobs is None else [logprobs])[0]
    text = tok.decode(out)
    for s in until:
        text = text.split(s)[0]
    return text


def score_generation(cond, tok, item, task, max_new_tokens=None):
    """generate_until: the greedy output, scored by the task's score(output, gold) (kvt/answers.py), and
    the mean log-probability of its tokens (`logprob`: the model's confidence, kvt/cascade.py)."""
    context = item.floor if cond.floor else item.context
    lps = []
    output = generate_until(cond, tok, context, item.until, max_new_tokens or task.max_new_tokens, lps)
    try:
        scores = task.score(output, item.gold)
    except Exception as e:  # the user's score function: one line, before a record is written
        raise KvtError(f"{task.name}: its score function raised {type(e).__name__}: {' '.join(str(e).split())} "
                       f"on output {output[:60]!r} and gold {item.gold!r}; fix it") from e
    if not isinstance(scores, dict) or not set(task.metrics) <= set(scores):
        raise KvtError(f"{task.name}: its score function returned {scores!r}, which lacks its metrics {task.metrics}")
    if not all(isinstance(scores[m], (int, float)) for m in task.metrics):
        raise KvtError(f"{task.name}: its score function returned {scores!r}; each metric's value is a number "
                       "(1.0 right, 0.0 wrong)")
    return {"gold": item.gold, "output": output, **scores, "logprob": sum(lps) / max(1, len(lps))}


@torch.no_grad()
def converse(cond, tok, conv, start=2, max_new_tokens=64):
    """Answers to turns start..n (1-based) of a conversation, handed over before turn `start`.

    `cond` prefills the prompt of turn `start` (for a transfer: the other model read the story and turns
    before it; the mapper moves its cache across). From then on cond.model holds the conversation: it
    answers, then extends its own cache with the gold answer and the next question. History is gold, as
    in the harness, so every condition sees the same text and only whose KV holds it differs."""
    model, dev = cond.model, _device(cond.model)
    pieces = tasks.coqa_segments(conv)
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


def score_coqa(cond, tok, conv, task, start=2, max_new_tokens=None):
    answers = converse(cond, tok, conv, start, max_new_tokens or task.max_new_tokens)
    turns = list(range(start, start + len(answers)))
    f1 = [coqa_f1(conv.answers[t - 1], a) for t, a in zip(turns, answers)]
    em = [coqa_em(conv.answers[t - 1], a) for t, a in zip(turns, answers)]
    return {"turns": turns, "answers": answers, "f1_turns": f1, "em_turns": em,
            "f1": sum(f1) / max(1, len(f1)), "em": sum(em) / max(1, len(em))}


# ------------------------------------------------------------------------------------- running

SCORERS = {"multiple_choice": score_choice, "multiple_input": score_inputs, "generate_until": score_generation,
           "loglikelihood_rolling": score_rolling, "coqa": score_coqa}  # kind (tasks.KINDS) -> scorer


def evaluate(task, items, tok, conds, done=(), progress=True, **options):
    """Yield one record {"task", "condition", "id", ...scores} per (item, condition), item by item,
    skipping the (condition, item id) pairs in `done`, so a resumed run may list its items in any order.
    task: a registered name (kvt.tasks). options: max_new_tokens (generation, coqa; default the task's),
    start (coqa: the turn that follows the handoff). CoQA has no floor: floor conditions are skipped."""
    task = tasks.get(task)
    score, done = SCORERS[task.kind], set(map(tuple, done))
    for item in tqdm(items, desc=task.name, disable=not progress):
        for name, cond in conds.items():
            if (name, item.id) in done or (task.kind == "coqa" and cond.floor):
                continue
            yield {"task": task.name, "condition": name, "id": item.id, **score(cond, tok, item, task, **options)}
