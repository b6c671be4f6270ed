"""Answer extraction and text metrics: how a generated answer is compared with the gold one.

    gsm8k_score(output, gold)     gsm8k-cot.yaml's two filters (strict "The answer is N.", flexible: the
                                  last number), each followed by its exact_match
    token_f1, exact_match         SQuAD's, on normalized answers; coqa_f1 / coqa_em add the harness's
                                  leave-one-out over several gold answers (coqa/utils.py compute_scores)
A generate_until task's `score` is any function (output, gold) -> {metric: value} (kvt/harness/tasks.py);
the default, kvt.evals.stripped_match, is the stripped text equal to the gold.
"""
import re
import string
from collections import Counter
from functools import partial


# ---------------------------------------------------------------------------------------- gsm8k

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


def gsm8k_score(output, gold):
    """Both filters and their exact match: em_strict, em_flexible (and what each filter extracted)."""
    strict, flexible = gsm8k_strict(output), gsm8k_flexible(output)
    return {"strict": strict, "flexible": flexible,
            "em_strict": gsm8k_exact_match(strict, gold), "em_flexible": gsm8k_exact_match(flexible, gold)}


# ----------------------------------------------------------------------------------------- squad

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
