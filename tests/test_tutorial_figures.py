"""Every speed figure in tutorial.md's prose says where it comes from: a command that produces it (`python ...`,
`kvt ...`, `bash ...`), the docs page whose row holds it (docs/<page>.md), or the paper it quotes. The tutorial is
read beside the code; a ratio or a time with no command beside it cannot be rerun, and drifts (issue #66 found
"1.5x / 2.0x" for Mapper.apply that no command or doc produced)."""
import re

from tests.conftest import ROOT

TUTORIAL = ROOT / "tutorial.md"
# A speed figure: a ratio (1.5x, 4 to 25x, 1.58-1.64x; not a shape such as 8 x 128) or a time or rate (0.28 s,
# 10 minutes, 3 GB/s). Percentages are left out: most of them are accuracies.
NUMBER = r"(?<![\w.])\d[\d,.]*(?:[-–]\d[\d,.]*)?"
FIGURE = re.compile(NUMBER + r"(?:(?:x|×)(?![\w\d]|\s?\d)"
                    r"| ?(?:s|ms|µs|minutes?|seconds?|hours?|h|GB/s|tok/s|tokens/s|TFLOP/s)(?![\w/]))")
SOURCE = re.compile(r"`(?:python|kvt|bash|pytest|OMP_NUM_THREADS=\d+ python) |docs/[\w-]+\.md|\bthe paper\b", re.I)


def prose_units(text):
    """[(first line number, text)] of tutorial.md's prose: each paragraph, list item and table row, outside
    fenced and indented blocks (code and printed output carry their own commands)."""
    units, cur, fence = [], [], False

    def flush():
        if cur:
            units.append((cur[0][0], " ".join(line for _, line in cur)))
            cur.clear()

    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
            flush()
        elif fence or not line.strip() or line.startswith("#") or (line.startswith("    ") and not cur):
            flush()
        else:
            if re.match(r"(- |\* |\d+\. |\| )", line):
                flush()
            cur.append((n, line))
    flush()
    return units


def unsourced(text):
    """[(line, figures)] of the prose units that state a speed figure and name no command, docs page or paper."""
    return [(n, FIGURE.findall(unit)) for n, unit in prose_units(text) if FIGURE.search(unit) and not SOURCE.search(unit)]


def test_every_speed_figure_in_the_tutorial_names_its_source():
    """Guards: a speed figure written into the tutorial from a scratch run (the 1.5x and 2.0x of Mapper.apply
    at 1K tokens, which no command or doc produced), or one whose command was dropped in an edit."""
    bad = unsourced(TUTORIAL.read_text())
    assert not bad, f"tutorial.md states speed figures without the command or docs row behind them: {bad}"


def test_the_figure_check_sees_figures_and_sources():
    """The check above would pass vacuously if it found no figures (a regex that matched nothing) or counted
    anything as a source."""
    text = TUTORIAL.read_text()
    assert sum(bool(FIGURE.search(u)) for _, u in prose_units(text)) >= 5, "found almost no speed figures"
    assert unsourced("The map took 1.5x as long, and 0.3 s.\n\nShapes 8 × 128 and 95% are not figures.\n") == \
        [(1, ["1.5x", "0.3 s"])]
    assert not unsourced("It took 1.5x as long (`python -m tests.bench_fast apply`).\n\n"
                         "The paper measured 6.98 s.\n\n- 2.0x in bf16 (docs/speed.md)\n")
