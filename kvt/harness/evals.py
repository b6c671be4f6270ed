"""Evaluation: how much accuracy a transferred cache keeps, every item under every condition.

    conds = conditions(target, source, transfer(source, target, mapper))
    records = list(evaluate("arc_easy", tasks.load_task("arc_easy", data_dir, 200), tok, conds))
    summary.summarize(records)       # kvt/harness/summary.py: accuracy, 95% intervals, retention

A condition says where the context's cache comes from; a model then scores or generates from it:
    target    the target prefills the context itself
    transfer  prefill(ids) -> (last logits (1, V), target cache), e.g. source prefill + mapper (handoff.py)
    source    the source model alone
    floor     the target with only the item's minimal prefix (BOS, "Answer:", "A:"): what it knows
              without the context, so retention can be read against it
How a condition meets each kind of task (kvt/harness/tasks.py):
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

Batches: evaluate(..., batch_size=8) hands each scorer 8 items at once. Their contexts are left-padded
into one prefill (a transfer's source prefill, mapper and target's last-token step included), their
continuations or generations run as one batch, and each record equals the one batch 1 gives within the
dtype's rounding (tests/test_batch.py). A GPU at batch 1 waits on kernel launches, not arithmetic.
Generation stops at the checkpoint's end-of-sequence tokens (tok.stop_ids) and the item's stop strings.
"""
import itertools
import re
from dataclasses import dataclass

import torch
from tqdm import tqdm

from kvt import fast
import kvt.evals
from kvt.harness import tasks
from kvt.harness.answers import coqa_em, coqa_f1
from kvt.config import KvtError
from kvt.handoff import handoff
from kvt.harness.recompute import Recompute


# ---------------------------------------------------------------------------------- conditions

@dataclass
class Condition:
    """Where the context's cache comes from (`prefill`) and which model continues from it."""
    model: object           # scores continuations / generates after the prefill
    prefill: object = None  # (ids (B, T)[, mask (B, T)]) -> (last logits (B, V), cache); None: the model's own
    floor: bool = False     # prefill the item's minimal prefix instead of its context
    plain: bool = False     # fast.generate's: decode with decode.generate, not its fast twin

    def __call__(self, ids, mask=None):
        return kvt.evals.prefill(self.model, ids, self.prefill, mask)  # (B, V), cache

    @property
    def batched(self):
        """Whether the prefill reads a left-padded batch (a transfer that recomputes the first or the most
        attended slots picks them per row, so it reads one item at a time)."""
        return getattr(self.prefill, "batched", True)

    def generate(self, logits, cache, max_new_tokens, **kw):
        """Greedy decoding by this condition's model from a prefilled state (fast.generate)."""
        return fast.generate(self.model, logits, cache, max_new_tokens, plain=self.plain, **kw)


def transfer(source, target, mapper, recompute=Recompute(), plain=False):
    """The transfer prefill: the source reads the context, the mapper carries its cache to the target,
    which runs the last context token itself (kvt.handoff.handoff), and recomputes the `recompute`
    budget of slots first when one is given (kvt's option); plain: handoff's."""
    def prefill(ids, mask=None):
        logits, cache = handoff(source, target, mapper, ids, mask, recompute, plain)  # (B, 1, V), the target's cache
        return logits[:, -1], cache
    prefill.batched = not (recompute.first or recompute.frac)
    return prefill


def conditions(target, source=None, transfer=None, plain=False):
    """The standard set on one target: target, floor, and source / transfer when given.
    transfer: a prefill, e.g. evals.transfer(source, target, mapper); plain: each Condition's."""
    out = {"target": Condition(target, plain=plain), "floor": Condition(target, floor=True, plain=plain)}
    if source is not None:
        out["source"] = Condition(source, plain=plain)
    if transfer is not None:
        out["transfer"] = Condition(target, transfer, plain=plain)
    return out


def _device(model):
    return next(model.parameters()).device


# ------------------------------------------------------------------------------ loglikelihood

def score_choice(cond, tok, items, task):
    """multiple_choice: kvt.evals.score_choice_batch, the scorer toy.choice_accuracy uses too."""
    triples = [(item.floor if cond.floor else item.context, item.choices, item.gold) for item in items]
    return kvt.evals.score_choice_batch(cond.model, tok.encode, triples, tok.prefix_id, cond.prefill)


def score_inputs(cond, tok, items, task):
    """multiple_input: the loglikelihood of the shared continuation (after the delimiter " ") after each
    option's context, each context read by the condition; the highest wins (acc)."""
    per_item, pairs = [], []
    for item in items:
        contexts = item.choices
        if cond.floor:
            contexts = item.floor if isinstance(item.floor, list) else [item.floor] * len(item.choices)
        per_item.append(contexts)
        for context in contexts:
            ctx, cont = kvt.evals.encode_pair(tok.encode, context, " " + item.continuation, tok.prefix_id)
            pairs.append((ctx, [cont]))
    results = iter(kvt.evals.loglikelihoods(cond.model, pairs, cond.prefill))
    out = []
    for item, contexts in zip(items, per_item):
        lls = [next(results)[0][0] for _ in contexts]
        m = kvt.evals.mc_metrics(lls, contexts, item.gold)
        out.append({"gold": item.gold, "lls": lls, "pred": m["pred"], "acc": m["acc"]})
    return out


def score_rolling(cond, tok, items, task):
    """loglikelihood_rolling: the summed loglikelihood `ll` of the text after the prefix, with the text's
    length in tokens, words (split on whitespace, as the harness counts) and UTF-8 bytes."""
    pairs, texts = [], []
    for item in items:
        prefix = item.context.rstrip()
        text = item.context[len(prefix):] + item.continuation  # the prefix's trailing space belongs to the text
        ctx, cont = kvt.evals.encode_pair(tok.encode, item.floor if cond.floor else prefix, text, tok.prefix_id)
        if not cont:
            raise KvtError(f"{task.name} item {item.id}: no text to score after the prefix (Item.continuation)")
        pairs.append((ctx, [cont]))
        texts.append(text)
    results = kvt.evals.loglikelihoods(cond.model, pairs, cond.prefill)
    return [{"ll": lls[0], "tokens": len(conts[0]), "words": len(re.split(r"\s+", text)), "bytes": len(text.encode("utf-8"))}
            for (_, conts), text, (lls, _) in zip(pairs, texts, results)]


# ---------------------------------------------------------------------------------- generation

@torch.no_grad()
def generate_until(cond, tok, contexts, until, max_new_tokens, logprobs=None):
    """Greedy text after each context, cut at the first of the stop strings (the harness's generate_until),
    ending at the checkpoint's end tokens (tok.stop_ids: nothing after one is kept). contexts: one string
    (returns one text) or a list (one left-padded batch; returns a list). logprobs: an empty list per
    context (or one for a string), filled with the log-probability of each generated token."""
    if isinstance(contexts, str):
        return generate_until(cond, tok, [contexts], until, max_new_tokens, None if logprobs is None else [logprobs])[0]
    ids, mask = kvt.evals.left_pad([tok.encode(c) or [tok.prefix_id] for c in contexts], _device(cond.model))
    last, cache = cond(ids, mask)                                        # (B, V)
    outs = cond.generate(last, cache, max_new_tokens, stop_ids=tok.stop_ids, stop=until,
                    decode=tok.decode, logprobs=logprobs)
    texts = []
    for out in outs:
        text = tok.decode(out)
        for s in until:
            text = text.split(s)[0]
        texts.append(text)
    return texts


def score_generation(cond, tok, items, task, max_new_tokens=None):
    """generate_until: the greedy output, scored by the task's score(output, gold) (kvt/harness/answers.py), and
    the mean log-probability of its tokens (`logprob`: the model's confidence, kvt/teach/cascade.py). Items
    with the same stop strings generate as one batch."""
    out = []
    for until, group in itertools.groupby(items, key=lambda item: tuple(item.until)):
        group = list(group)
        lps = [[] for _ in group]
        outputs = generate_until(cond, tok, [item.floor if cond.floor else item.context for item in group], until,
                                 max_new_tokens or task.max_new_tokens, lps)
        for item, output, lp in zip(group, outputs, lps):
            out.append({"gold": item.gold, "output": output, **checked_score(task, output, item.gold),
                        "logprob": sum(lp) / max(1, len(lp))})
    return out


def checked_score(task, output, gold):
    """task.score(output, gold), checked before a record is written: a dict holding each of the task's metrics
    as a number. The user's score function failing is one line, not a traceback."""
    try:
        scores = task.score(output, gold)
    except Exception as e:
        raise KvtError(f"{task.name}: its score function raised {type(e).__name__}: {' '.join(str(e).split())} "
                       f"on output {output[:60]!r} and gold {gold!r}; fix it") from e
    if not isinstance(scores, dict) or not set(task.metrics) <= set(scores):
        raise KvtError(f"{task.name}: its score function returned {scores!r}, which lacks its metrics {task.metrics}")
    if not all(isinstance(scores[m], (int, float)) for m in task.metrics):
        raise KvtError(f"{task.name}: its score function returned {scores!r}; each metric's value is a number "
                       "(1.0 right, 0.0 wrong)")
    return scores


@torch.no_grad()
def converse(cond, tok, convs, start=2, max_new_tokens=64):
    """Answers to turns start..n (1-based) of a conversation, handed over before turn `start`.

    `cond` prefills the prompt of turn `start` (for a transfer: the other model read the story and turns
    before it; the mapper moves its cache across). From then on cond.model holds the conversation: it
    answers, then extends its own cache with the gold answer and the next question. History is gold, as
    in the harness, so every condition sees the same text and only whose KV holds it differs.
    convs: one Conversation (returns its answers) or a list, one batch (returns a list of answer lists):
    each turn's pieces are left-padded, so padding sits inside the cache, masked, and a conversation
    that has ended reads padding only while the others go on."""
    if isinstance(convs, tasks.Conversation):
        return converse(cond, tok, [convs], start, max_new_tokens)[0]
    model, dev = cond.model, _device(cond.model)
    pieces = [tasks.coqa_segments(conv) for conv in convs]
    prompts = [tok.encode(p[0]) + [i for q in p[1:start] for i in tok.encode(q, special=False)] for p in pieces]
    last, cache = cond(*kvt.evals.left_pad(prompts, dev))                  # (B, V)
    answers = [[] for _ in convs]
    turns = max(len(p) for p in pieces)
    for t in range(start, turns + 1):
        # stop once the first non-blank line is complete: the harness keeps only that line
        outs = cond.generate(last, cache, max_new_tokens, stop_ids=tok.stop_ids, stop=("\n",),
                        decode=lambda x: tok.decode(x).lstrip())
        for b, out in enumerate(outs):
            if t <= len(pieces[b]):
                answers[b].append(tok.decode(out).split("\nQ:")[0].strip().split("\n")[0])
        if t < turns:
            nxt, mask = kvt.evals.left_pad([tok.encode(p[t], special=False) if t < len(p) else [] for p in pieces], dev)
            logits, cache = model(nxt, cache=cache, mask=mask)          # (B, Tp, V)
            last = logits[:, -1]
    return answers


def score_coqa(cond, tok, convs, task, start=2, max_new_tokens=None):
    out = []
    for conv, answers in zip(convs, converse(cond, tok, list(convs), start, max_new_tokens or task.max_new_tokens)):
        turns = list(range(start, start + len(answers)))
        f1 = [coqa_f1(conv.answers[t - 1], a) for t, a in zip(turns, answers)]
        em = [coqa_em(conv.answers[t - 1], a) for t, a in zip(turns, answers)]
        out.append({"turns": turns, "answers": answers, "f1_turns": f1, "em_turns": em,
                    "f1": sum(f1) / max(1, len(f1)), "em": sum(em) / max(1, len(em))})
    return out


# ------------------------------------------------------------------------------------- running

SCORERS = {"multiple_choice": score_choice, "multiple_input": score_inputs, "generate_until": score_generation,
           "loglikelihood_rolling": score_rolling, "coqa": score_coqa}  # kind (tasks.KINDS) -> scorer of a batch


def evaluate(task, items, tok, conds, done=(), progress=True, batch_size=1, **options):
    """Yield one record {"task", "condition", "id", ...scores} per (item, condition), item by item,
    skipping the (condition, item id) pairs in `done`, so a resumed run may list its items in any order.
    task: a registered name (kvt.harness.tasks). batch_size: items scored together under each condition (see
    the module docstring). options: max_new_tokens (generation, coqa; default the task's), start (coqa:
    the turn that follows the handoff). CoQA has no floor: floor conditions are skipped."""
    task = tasks.get(task)
    score, done = SCORERS[task.kind], set(map(tuple, done))
    pending = [item for item in items if any((name, item.id) not in done for name in conds)]  # batches are full
    bar = tqdm(total=len(items), initial=len(items) - len(pending), desc=task.name, disable=not progress)
    for i in range(0, len(pending), batch_size):
        chunk, records = pending[i:i + batch_size], {}
        for name, cond in conds.items():
            todo = [item for item in chunk if (name, item.id) not in done]
            if not todo or (task.kind == "coqa" and cond.floor):
                continue
            size = batch_size if cond.batched else 1
            for j in range(0, len(todo), size):
                batch = todo[j:j + size]
                records.update({(name, item.id): r for item, r in zip(batch, score(cond, tok, batch, task, **options))})
        for item in chunk:
            for name in conds:
                if (name, item.id) in records:
                    yield {"task": task.name, "condition": name, "id": item.id, **records[(name, item.id)]}
        bar.update(len(chunk))
    bar.close()
