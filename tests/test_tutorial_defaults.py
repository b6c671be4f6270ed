"""Every "by default" tutorial.md states about kvt's code holds: each mention of a default in its prose is
inside one of the claims below, and each claim is checked against the code. (The tutorial once said
`accumulate` takes the fast twin by default while it took the plain one: nothing ran that sentence.)"""
import inspect
import re
from pathlib import Path

import torch

import kvt
from kvt import fast, rope
from kvt.calibrate import Run, calibrate
from kvt.config import Config
from kvt.handoff import handoff, take_over
from kvt.harness.recompute import RANK, Recompute, rank_basis
from kvt.harness import evals
from kvt.harness.diagnose import MAX_KL, MIN_ATTN_COS, diagnose, gate
from kvt.harness.pipeline import Settings
from kvt.mapper import Mapper
from kvt.mlp import Schedule

ROOT = Path(__file__).resolve().parents[1]


def default(fn, name):
    return inspect.signature(fn).parameters[name].default


def config(rope_params):
    return Config("qwen3", 8, 64, 1, 2, 2, 32, 64, 1e-6, rope=rope_params, max_seq_len=65536)


def yarn_default(name, value):
    """YaRN's frequencies without `name` in the config equal those with name=value."""
    p = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 4096}
    a, _ = rope.frequencies(config(p))
    b, _ = rope.frequencies(config({**p, name: value}))
    return bool((a == b).all())


def plain_rope():
    """The default frequencies are base^(-2i/D), i = 0 .. D/2 - 1, and no scale."""
    inv, scale = rope.frequencies(config({"rope_theta": 1e6}))
    return scale == 1.0 and torch.allclose(inv, 1e6 ** (-torch.arange(0, 32, 2) / 32), rtol=1e-6)


# A phrase of tutorial.md's prose holding the word "default" -> a check that the default it states holds.
CLAIMS = {
    "torch's default of one thread per core": lambda: True,            # torch's, not kvt's
    "many times as long with the default threads": lambda: True,       # torch's, as above
    "The default θᵢ = base^(-2i/D)": plain_rope,
    "`beta_fast` (default 32)": lambda: yarn_default("beta_fast", 32),
    "`beta_slow` (default 1)": lambda: yarn_default("beta_slow", 1),
    "`calibrate`\nadds through its fast twin by default": lambda: default(calibrate, "run").plain is False
    and fast.adder(False) is fast.add_batches,
    "(the paper's, and kvt's default)": lambda: default(calibrate, "scope") == "layer" and Settings().scope == "layer",
    "at `positions` (default: the source's)": lambda: default(Mapper.apply, "positions") is None,
    "rather than the default 1,024": lambda: Schedule().batch == 1024,
    "At full size on the default pair": lambda: Settings().pair == "toy-s:m",
    "`handoff` takes `plain=False`: by default the map is `fast.apply`": lambda: all(
        default(f, "plain") is False for f in (handoff, take_over, diagnose, kvt.generate, fast.map_cache)),
    "a default floor of\n0.886": lambda: MIN_ATTN_COS == 0.886 and default(gate, "min_attn_cos") == MIN_ATTN_COS,
    "the default limit of 0.15 (both defaults are": lambda: MAX_KL == 0.15 and default(gate, "max_kl") == MAX_KL,
    "Layer scope, the default, can map": lambda: default(calibrate, "scope") == "layer",
    '`by="attention"` (the default), those the source attended to most': lambda: Recompute().by == "attention",
    "(`recompute.rank_basis`, r = 128 by default)": lambda: RANK == 128 and default(rank_basis, "r") == RANK,
    "takes the same keyword, `plain=False`": lambda: all(
        default(f, "plain") is False for f in (handoff, take_over, diagnose, kvt.generate)) and not Run().plain
    and evals.Condition.__dataclass_fields__["plain"].default is False,
}


def prose():
    text = (ROOT / "tutorial.md").read_text()
    return re.sub(r"```.*?```", lambda m: " " * len(m.group(0)), text, flags=re.S)  # blocks blanked, offsets kept


def test_every_default_the_tutorial_states_is_a_checked_claim():
    """Guards: a sentence about a default added (or reworded) without a check here."""
    text = prose()
    spans = []
    for phrase in CLAIMS:
        at = text.find(phrase)
        assert at >= 0, f"tutorial.md no longer says {phrase!r}: update CLAIMS with what it says now"
        spans.append((at, at + len(phrase)))
    loose = [text[max(0, m.start() - 60):m.end() + 40].replace("\n", " ") for m in re.finditer(r"default", text)
             if not any(a <= m.start() < b for a, b in spans)]
    assert not loose, f"tutorial.md states defaults nothing checks: {loose}"


def test_every_default_claim_holds():
    """Guards: a default changed in the code (calibrate's scope, the fast switch, the gate's thresholds)
    while the tutorial still states the old one."""
    wrong = [phrase for phrase, check in CLAIMS.items() if not check()]
    assert not wrong, f"tutorial.md states defaults the code does not have: {wrong}"
