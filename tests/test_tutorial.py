"""tutorial.md runs as written: its ```python blocks execute in order in one namespace, and what each
block prints matches the ```text block right after it (numbers within a small tolerance), so neither
the code nor the numbers in the tutorial can go stale.

    python tests/test_tutorial.py > /tmp/tutorial.py     # every block as one script, to run or edit
    python tests/test_tutorial.py --update               # rewrite each text block with what its code prints

After --update, read the diff: the prose around a block may quote a number that has changed.
"""
import contextlib
import io
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ROOT / "tutorial.md"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
RTOL = 0.02  # thread counts and CPUs move results in their last digits; real drift is far larger

pytestmark = pytest.mark.usefixtures("one_thread")


def blocks(text):
    """[(line, code, expected output or None)] for every python block, in order. A text block is the
    expected output of the python block just before it when nothing but blank lines separates them."""
    out, prev = [], None
    for m in FENCE.finditer(text):
        lang, body = m.group(1), m.group(2)
        if lang == "python":
            out.append([text.count("\n", 0, m.start()) + 1, body, None])
        elif lang == "text" and prev is not None and prev.group(1) == "python":
            if not text[prev.end():m.start()].strip():  # only blank lines between the two blocks
                out[-1][2] = body
        prev = m
    return out


def tolerance(text):
    """How far a printed number may move: RTOL of its value, or half a unit of its last printed digit if
    that is more (so "0.9510" allows 0.019, "40" allows 0.8, "3.1e-05" allows 6e-07: a small value is
    checked on its own scale, not waved through by an absolute tolerance). Rounding noise (1e-6 and the
    like) is printed by the tutorial as a bound, never as a value."""
    mantissa, _, exponent = text.lower().partition("e")
    digits = len(mantissa.split(".")[1]) if "." in mantissa else 0
    unit = 10.0 ** (int(exponent or 0) - digits)
    return max(RTOL * abs(float(text)), unit / 2)


BOUNDED = re.compile(f"({NUMBER.pattern})(?:±({NUMBER.pattern}))?")  # an expected number, "0.003±0.003" bounded


def compare(got, want):
    """None if the printed output matches the expected text, else a message naming the first difference.
    Runs of whitespace count as one space; numbers must agree within tolerance(expected), or within the
    bound written after one in the expected text: "0.003±0.003" is a number that float32 rounding moves
    from one CPU to another (the tutorial says which), printed as 0.003 on one and 0.001 on another."""
    got_lines, want_lines = got.rstrip().splitlines(), want.rstrip().splitlines()
    if len(got_lines) != len(want_lines):
        return f"{len(got_lines)} lines printed, {len(want_lines)} expected"
    for i, (g, w) in enumerate(zip(got_lines, want_lines)):
        gw, ww = " ".join(NUMBER.split(g)).split(), " ".join(BOUNDED.split(w)[::3]).split()
        gn, wn = NUMBER.findall(g), BOUNDED.findall(w)                # wn: (number, its bound or "")
        if gw != ww or len(gn) != len(wn):
            return f"line {i + 1}: printed {g!r}, expected {w!r}"
        for a, (b, bound) in zip(gn, wn):
            if abs(float(a) - float(b)) > (float(bound) if bound else tolerance(b)):
                return f"line {i + 1}: printed {g!r}, expected {w!r} ({a} vs {b})"
    return None


@pytest.fixture(scope="module")
def toy_family():
    """The tutorial runs on the committed toy family; say how to build it when it is missing."""
    missing = [m for m in ("toy-s", "toy-m", "toy-l") if not (ROOT / "weights" / m / "model.safetensors").exists()]
    if missing:
        pytest.skip(f"no weights/{missing[0]}: build the toy family with `python -m kvt.harness.toy train --out weights`")


def test_tutorial_runs_and_prints_what_it_says(monkeypatch, toy_family):
    monkeypatch.chdir(ROOT)  # the tutorial reads weights/ relative to the repository root
    namespace = {"__name__": "tutorial"}
    found = blocks(TUTORIAL.read_text())
    assert len(found) > 10, "tutorial.md has too few python blocks; did the fences change?"
    for line, code, expected in found:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                exec(compile(code, f"tutorial.md:{line}", "exec"), namespace)
            except Exception as e:
                pytest.fail(f"the python block at tutorial.md:{line} raised {type(e).__name__}: {e}")
        if expected is not None:
            problem = compare(out.getvalue(), expected)
            assert problem is None, (f"the block at tutorial.md:{line} printed other output than the text block "
                                     f"after it: {problem}\n--- printed:\n{out.getvalue()}")


def test_figures_command_draws_the_map(capsys):  # on the committed pair toy-s -> toy-m
    from kvt.harness import figures
    figures.main(["r2", "--pair", "toy-s:m", "--calib-seqs", "6", "--calib-len", "64", "--k", "1", "--kind", "k"])
    out = capsys.readouterr().out
    assert "keys (K)" in out and "<- target layer" in out and "*" in out, out


def test_heatmap_marks_the_selected_cells():
    import torch

    from kvt.harness.figures import heatmap
    r2 = torch.tensor([[0.9, 0.3, -0.5], [0.5, 0.7, 0.3]])                  # (Ls=2, Lt=3)
    text = heatmap(r2, selected=torch.tensor([[0], [1], [1]]))
    rows = text.splitlines()[1:3]
    assert rows == ["  0  ██*░░░", "  1  ▒▒▒▓▓*░░*"], rows
    assert heatmap(r2, values=True).splitlines()[1].split() == ["0", "0.90", "0.30", "-0.50"]


def test_compare_tolerates_noise_but_not_drift():
    """Guards: an absolute tolerance (0.02 passed any value near 1e-5, whatever it was)."""
    assert compare("R^2 0.9312  n 40\n", "R^2 0.9301   n 40") is None
    assert compare("R^2 0.71", "R^2 0.93") is not None
    assert compare("KL 3.1e-05", "KL 1.2e-05") is not None and compare("KL 0.00003", "KL 0.00001") is not None
    assert compare("n 41", "n 40") is not None and compare("T = 59", "T = 59") is None
    assert compare("acc 0.9", "loss 0.9") is not None


def test_a_bound_in_the_text_replaces_the_tolerance():
    """Guards: a number the tutorial marks as moved by the CPU ("0.003±0.003") compared at 2%, failing on
    another CPU (it printed 0.001), and a bound that stops checking the number at all."""
    assert compare("gap 0.001 nats; next 0.004", "gap 0.003±0.003 nats; next 0.005±0.003") is None
    assert compare("gap 0.007 nats; next 0.004", "gap 0.003±0.003 nats; next 0.005±0.003") is not None
    assert compare("gap 0.001 nats", "gap 0.003 nats") is not None        # unmarked: 2% or half a unit
    assert compare("gap 0.001 nats ±", "gap 0.003±0.003 nats") is not None
    assert compare("a\nb", "a") is not None


def update():
    """Run every block (from the repository root) and write what it prints into the text block after it."""
    import os

    import torch
    os.chdir(ROOT)
    torch.set_num_threads(1)
    text, namespace, printed = TUTORIAL.read_text(), {"__name__": "tutorial"}, {}
    for line, code, expected in blocks(text):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"tutorial.md:{line}", "exec"), namespace)
        if expected is not None:
            printed[line] = out.getvalue().rstrip() + "\n"
        sys.stderr.write(f"ran tutorial.md:{line}\n")
    pieces, pos, after = [], 0, None
    for m in FENCE.finditer(text):  # replace the body of each text block that follows a python block
        line = text.count("\n", 0, m.start()) + 1
        if m.group(1) == "python":
            after = line
        elif m.group(1) == "text" and after in printed:
            start = m.start(2)
            pieces += [text[pos:start], printed.pop(after)]
            pos = m.end(2)
            after = None
        else:
            after = None
    TUTORIAL.write_text("".join(pieces) + text[pos:])


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        update()
    else:
        for line, code, _ in blocks(TUTORIAL.read_text()):
            sys.stdout.write(f"# ---- tutorial.md:{line}\n{code}\n")
