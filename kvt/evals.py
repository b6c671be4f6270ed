"""Scoring an item, as lm-evaluation-harness does: by loglikelihood from a cache, or by exact match.

    [(lls, greedy), ...] = loglikelihoods(model, [(ctx_ids, [cont_ids, ...]), ...])  # each context prefilled once
    record = score_choices(model, encode, context, choices, gold)     # acc, acc_norm as the harness
    stripped_match(output, gold)                                       # {"em": 1.0} when the answer is the gold

Several contexts are one left-padded prefill and every continuation of every context one right-padded
batch after it (a GPU reading one context at a time waits on kernel launches); each result equals the
one its context gets alone within the dtype's rounding (tests/test_batch.py).

The evaluation of tasks under conditions (kvt/harness/evals.py) scores every multiple-choice task with
score_choices, and so does the toy family's trainer (toy.choice_accuracy), so a toy model's held-out recall
and its evaluation are the same number; a generated answer is scored by its task's score function, by
default stripped_match (kvt/harness/answers.py has gsm8k's and SQuAD's). `prefill` is where a condition
enters: None reads the context with the model itself; a transfer reads it with the source and maps the
cache (kvt.harness.evals.transfer).
"""
import torch

from kvt.config import KvtError


def prefill(model, ids, via=None, mask=None):
    """(last logits (B, V), cache) after reading ids (B, T), mask (B, T) bool (False = left padding) or
    None: via(ids) (via(ids, mask) with a mask) if given (e.g. a transfer), else the model's own prefill."""
    if via is not None:
        return via(ids) if mask is None else via(ids, mask)
    logits, cache = model(ids, mask=mask, last=True)  # (B, 1, V)
    return logits[:, -1], cache                       # (B, V)


def left_pad(seqs, device=None):
    """Token lists as one left-padded batch: ids (B, T) long (0 at padding) and mask (B, T) bool, False at
    padding, or None when every row is as long as the longest (the model's plain path, as at batch 1)."""
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, s in enumerate(seqs):
        if s:
            ids[b, -len(s):], mask[b, -len(s):] = torch.tensor(s), True
    return ids.to(device), None if mask.all() else mask.to(device)


def encode_pair(encode, context, continuation, prefix_id=None):
    """Token ids of a context and its continuation, as the harness's _encode_pair: trailing spaces move
    to the continuation, and the continuation is what encoding both together adds after the context.
    encode: str -> ids (a kvt Tokenizer's encode); an empty context is [prefix_id] (BOS or EOS), as there."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    ctx = encode(context)
    whole = encode(context + continuation)
    if not ctx and prefix_id is None:
        raise KvtError("an empty context needs a prefix token, and this tokenizer names no BOS or EOS "
                       "(tokenizer_config.json); give the item a floor or prefix that is not empty")
    return ctx or [prefix_id], whole[len(ctx):]


@torch.no_grad()
def loglikelihoods(model, pairs, via=None):
    """Sum of log p(continuation | context), and whether it is the greedy one, for every continuation of
    every context: pairs [(ctx ids, [cont ids, ...]), ...] -> [(lls, greedy), ...], one per context. The
    contexts are prefilled once, as one left-padded batch (via: another prefill, see `prefill`); every
    continuation then runs as one right-padded batch from its own context's cache (views of the one
    cache when there is one context, a copy per row otherwise)."""
    dev = next(model.parameters()).device
    ids, mask = left_pad([ctx for ctx, _ in pairs], dev)
    last, cache = prefill(model, ids, via, mask)              # (B, V), a cache of T slots per context
    conts = [c for _, cs in pairs for c in cs]
    rows = torch.tensor([b for b, (_, cs) in enumerate(pairs) for _ in cs], device=dev)  # (n,) each one's context
    n, Tc = len(conts), max(len(c) for c in conts)
    cont = torch.zeros(n, Tc, dtype=torch.long, device=dev)  # (n, Tc), right padding
    real = torch.zeros(n, Tc, dtype=torch.bool, device=dev)  # (n, Tc), True at real tokens
    for i, c in enumerate(conts):
        cont[i, :len(c)], real[i, :len(c)] = torch.tensor(c), True
    # Off by one: logits[:, i] predict token i+1. The context's last position predicts continuation
    # token 0; continuation token j predicts token j+1, so the last token is never fed. Right padding
    # sits after every real token, so it cannot change their logits (attention is causal).
    pred = last[rows][:, None]                                # (n, 1, V)
    if Tc > 1:
        logits, _ = model(cont[:, :-1], cache=cache.expand(n) if len(pairs) == 1 else cache.select(rows))
        pred = torch.cat([pred, logits], 1)                   # (n, Tc, V)
    logp = pred.float().log_softmax(-1).gather(-1, cont[..., None])[..., 0]  # (n, Tc)
    ll = logp.masked_fill(~real, 0).sum(1).tolist()          # (n,)
    greedy = ((pred.argmax(-1) == cont) | ~real).all(1).tolist()
    out, i = [], 0
    for _, cs in pairs:                                       # back to one (lls, greedy) per context
        out.append((ll[i:i + len(cs)], greedy[i:i + len(cs)]))
        i += len(cs)
    return out


def mc_metrics(lls, choices, gold):
    """acc and acc_norm from the loglikelihood of each choice (first maximum wins, as np.argmax). acc_norm
    divides by len(choice) in characters, as the harness's code does (its docs say bytes; equal on ASCII)."""
    pred = max(range(len(lls)), key=lambda i: lls[i])
    pred_norm = max(range(len(lls)), key=lambda i: lls[i] / len(choices[i]))
    return {"pred": pred, "pred_norm": pred_norm, "acc": float(pred == gold), "acc_norm": float(pred_norm == gold)}


def score_choices(model, encode, context, choices, gold, prefix_id=None, via=None):
    """One multiple-choice item (the harness's output_type multiple_choice): each choice, after the
    target delimiter " ", scored by its summed loglikelihood after the context. choices: without the
    leading space (the harness's doc_to_choice); gold: the right one's index. A plain dict, one record."""
    return score_choice_batch(model, encode, [(context, choices, gold)], prefix_id, via)[0]


def score_choice_batch(model, encode, items, prefix_id=None, via=None):
    """score_choices for several items (context, choices, gold) at once (one loglikelihoods call): a record each."""
    pairs = []
    for context, choices, _ in items:
        encoded = [encode_pair(encode, context, " " + c, prefix_id) for c in choices]
        pairs.append((encoded[0][0], [cont for _, cont in encoded]))
    return [{"gold": gold, "lls": lls, "greedy": greedy, **mc_metrics(lls, choices, gold)}
            for (_, choices, gold), (lls, greedy) in zip(items, loglikelihoods(model, pairs, via))]


def stripped_match(output, gold):
    """Exact match of a generated output, stripped of surrounding whitespace (the toy tasks' score, and every
    generate_until task's default)."""
    return {"em": float(output.strip() == gold)}
