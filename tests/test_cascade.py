"""cascade.py: the small -> large cascade read from a run's records, priced by the FLOP model."""
import json
import math

import pytest

from kvt.teach import cascade
from kvt.harness.plan import forward_flops
from kvt.config import KvtError, shape


def records(tmp_path, rows, name="records.jsonl"):
    """A records file like run.py's: rows of (small lls, small right, large right, transfer right)."""
    lines = [{"format": "kvt-records-2"}]
    for i, (lls, s, t, tr) in enumerate(rows):
        for cond, acc in (("source", s), ("target", t), ("transfer", tr), ("floor", 0.0)):
            lines.append({"task": "mc", "condition": cond, "id": f"q{i}", "lls": lls if cond == "source" else [0.0],
                          "acc": acc})
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_the_least_confident_items_escalate_first(tmp_path):
    """The small model is right where it is sure and wrong where it is not; escalating its least
    confident half then gives the large model's accuracy. Guards: escalating the most confident first,
    confidence taken from the wrong condition, or 0% and 100% not being the small and large alone."""
    sure, unsure = [0.0, -9.0, -9.0], [-1.0, -1.1, -1.2]
    rows = [(sure, 1.0, 1.0, 1.0)] * 5 + [(unsure, 0.0, 1.0, 0.0)] * 5
    table = cascade.sweep(cascade.items(cascade.read(records(tmp_path, rows))), 0.4,
                          {"prefill": 1.0, "transfer": 0.05, "recompute": 0.15})
    by_rate = {round(r["rate"], 2): r for r in table}
    assert by_rate[0.0]["accuracy"] == {"prefill": 0.5, "transfer": 0.5}
    assert by_rate[0.5]["accuracy"] == {"prefill": 1.0, "transfer": 0.5}          # the unsure five went up
    assert by_rate[1.0]["accuracy"] == {"prefill": 1.0, "transfer": 0.5}
    assert by_rate[0.5]["cost"]["prefill"] == pytest.approx(0.4 + 0.5) and by_rate[0.5]["cost"]["transfer"] == pytest.approx(0.425)
    assert cascade.confidence({"lls": unsure}) == pytest.approx(math.exp(-1.0) / sum(math.exp(x) for x in unsure))


def test_recompute_records_are_the_third_way_and_must_cover_the_items(tmp_path):
    """Guards: the recompute run's answers not used, and a recompute run of other items silently mixed in."""
    rows = [([0.0, -1.0], 0.0, 1.0, 0.0)] * 4
    base = cascade.read(records(tmp_path, rows))
    fixed = cascade.read(records(tmp_path, [(l, s, t, 1.0) for l, s, t, _ in rows], "rc.jsonl"))
    table = cascade.sweep(cascade.items(base, fixed), 0.4, {"prefill": 1.0, "transfer": 0.05, "recompute": 0.15})
    assert table[-1]["accuracy"] == {"prefill": 1.0, "transfer": 0.0, "recompute": 1.0}
    fewer = cascade.read(records(tmp_path, rows[:2], "rc2.jsonl"))
    with pytest.raises(KvtError, match="do not cover"):
        cascade.items(base, fewer)


def test_costs_are_in_large_prefills():
    """Guards: the small prefill priced as the large one, and transfer priced above a prefill."""
    small, large = shape("qwen3-0.6b"), shape("qwen3-1.7b")
    base, esc = cascade.costs(small, large, 4096, frac=0.25)
    assert base == pytest.approx(forward_flops(small, 4096, last=True) / forward_flops(large, 4096, last=True)) and 0.2 < base < 0.6
    assert esc["prefill"] == 1.0 and 0 < esc["transfer"] < 0.5     # layer scope: a mapper of 470M parameters
    assert esc["recompute"] == pytest.approx(esc["transfer"] + 0.25)
    _, head = cascade.costs(small, large, 4096, scope="head")
    assert 0 < head["transfer"] < esc["transfer"] / 4                # head scope's mapper is 8x smaller


def test_generation_confidence_is_the_answers_mean_token_probability(tmp_path):
    """Generation records carry `logprob`, the mean log-probability of the answer's tokens, and are right
    or wrong by the task's primary metric (em for toy_copy). Guards: generation items dropped from the
    cascade, or scored by a metric they do not have."""
    path = tmp_path / "g.jsonl"
    lines = [{"task": "toy_copy", "condition": c, "id": "g1", "output": "x", "em": e, "logprob": lp}
             for c, e, lp in (("source", 0.0, -0.5), ("target", 1.0, -0.1), ("transfer", 1.0, -0.2))]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (row,) = cascade.items(cascade.read(path))
    assert row[:4] == (pytest.approx(math.exp(-0.5)), 0.0, 1.0, 1.0)


def test_records_without_the_conditions_are_refused(tmp_path):
    """Guards: a run without transfer records giving an empty, silent table."""
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"task": "mc", "condition": "source", "id": "a", "lls": [0.0], "acc": 1.0}) + "\n")
    with pytest.raises(KvtError, match="source, target and transfer"):
        cascade.items(cascade.read(path))
