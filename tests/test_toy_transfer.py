"""The default pair (toy-s -> toy-m), as `python run.py` runs it: the trained target is far above chance
on recall, needs the context for it, and the transfer keeps at least 90% of its recall accuracy."""
import torch

import kvt
from kvt.harness import evals, toy
from kvt.harness.data import calibration_sequences
from kvt.calibrate import calibrate
from kvt.harness.summary import summarize
from kvt.harness.tasks import load_task
from tests.conftest import ROOT


def test_transfer_keeps_recall():  # measured: target 1.00, transfer 0.92, floor 0.30 (100 sampled items, layer scope)
    torch.manual_seed(0)
    source, target = (kvt.load_model(ROOT / "weights" / n) for n in ("toy-s", "toy-m"))
    tok = kvt.load_tokenizer(ROOT / "weights" / "toy-m")
    calib = calibration_sequences(None, tok, 100, 256, documents=toy.corpus(1000, seed=99))
    mapper, _ = calibrate(source, target, calib)          # the paper's layer scope, k = 8 -> 2
    conds = evals.conditions(target, source, evals.transfer(source, target, mapper))
    items = load_task("toy_recall", None, 100)
    summary = summarize(list(evals.evaluate("toy_recall", items, tok, conds, progress=False)))["toy_recall"]
    own, moved, floor = (summary[c]["acc"] for c in ("target", "transfer", "floor"))
    print(f"\ntoy recall, 100 items: target {own:.2f}, transfer {moved:.2f}, floor {floor:.2f}")
    assert own >= 0.8, f"the target is not far above chance (0.25): {own:.2f}"
    assert floor <= 0.45, f"the target answers without the context: {floor:.2f}"
    assert moved >= 0.9 * own, f"transfer keeps {moved / own:.0%} of the target's recall accuracy, under 90%"
