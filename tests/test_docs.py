"""README.md and docs/*.md stay true to the repository: every relative link leads to a file (and its
#anchor to a heading), every repository path they name exists (tutorial.md's too), and every command
in their ```bash blocks is accepted by kvt's own argument parsers, parsed without running anything
(tests/test_commands.py, a slow check, runs every command they and tutorial.md show: shown_commands).

What counts as a path: a whitespace-separated word inside `backticks` or a ```bash block whose first
component is one of REPO_DIRS (`kvt/mapper.py`, `tests/test_x.py`, `docs/x.md`, `weights/toy-s`).
Words that start elsewhere (`../shared/data`, `report.md`, `kvt.integrations.hf.transfer`) are not checked. A
`<placeholder>` ends the part that is checked (`weights/<name>/` checks `weights/`); a `*` is a glob that
must match. What runs create (RUNTIME) is allowed without existing.
"""
import argparse
import contextlib
import importlib
import inspect
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

from kvt.cli import COMMANDS as KVT_COMMANDS

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*DOCS, ROOT / "tutorial.md"]  # whose links and paths are checked too
README_LIMIT = 15_000  # characters: README is the front door; tables and discussions go to docs/

REPO_DIRS = ("kvt", "tests", "docs", "weights", "runs", ".ci")
RUNTIME = (
    "runs/",                       # run folders and bench JSON, written by run.py, kvt bench, kvt cascade
    "weights/smollm2-135m",        # built by ../shared/tools/smollm2.py and kvt family build (.ci/run)
    "weights/qwen3-", "weights/llama3", "weights/ministral3-",  # downloaded (weights/README.md)
)
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.M)
PROCESS = re.compile(r"\bissues? \d+\b|\bthis round\b|\bruns? \d+(-\d+)? of\b", re.I)


def text_of(doc):
    return doc.read_text()


def prose(text):
    """The text outside fenced blocks (links and inline code live there)."""
    return FENCE.sub("", text)


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")


def anchors(doc):
    """Every #anchor a heading of doc makes (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen, out = {}, set()
    for h in HEADING.findall(prose(text_of(doc))):
        s = slug(h)
        out.add(f"{s}-{seen[s]}" if s in seen else s)
        seen[s] = seen.get(s, 0) + 1
    return out


def links(doc):
    """[(target, file it resolves to or None for this doc, anchor)] for every relative link."""
    out = []
    for target in LINK.findall(CODE.sub("", prose(text_of(doc)))):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        out.append((target, (doc.parent / path).resolve() if path else doc, anchor))
    return out


def repo_paths(words):
    """The words that name repository paths, cut at a <placeholder>, trailing punctuation dropped."""
    out = []
    for word in words:
        word = word.split("=")[-1].split("::")[0].strip("(),;:'\"")  # tests/test_x.py::test_y names a file
        if "/" in word and word.split("/")[0] in REPO_DIRS:
            out.append(word.split("<")[0])
    return out


def missing_paths(doc):
    """Repository paths named in doc's inline code and bash blocks that do not exist."""
    text = text_of(doc)
    words = [w for code in CODE.findall(prose(text)) for w in code.split()]
    words += [w for lang, body in FENCE.findall(text) if lang == "bash" for w in body.split()]
    out = []
    for p in repo_paths(words):
        if p.startswith(RUNTIME):
            continue
        found = list(ROOT.glob(p)) if "*" in p else [ROOT / p] if (ROOT / p).exists() else []
        if not found:
            out.append(p)
    return sorted(set(out))


COMMAND_WORDS = ("python", "kvt", "torchrun", "pip", "bash", "/usr/bin/time")  # what a shown command starts with


def starts_a_command(line):
    """Whether line's first word, after any VAR=value and a `$ ` prompt, is one of COMMAND_WORDS."""
    words = [w for w in line.split() if not re.match(r"^[A-Z_]+=", w)]
    return bool(words) and words[0 if words[0] != "$" else 1:][:1] in ([w] for w in COMMAND_WORDS)


def shown_commands(doc):
    """[(line number, command)] of every command doc shows: every line of its ```bash blocks, and every line
    that starts a command (COMMAND_WORDS) in its other code blocks: fenced (```text, ```console, a bare
    ```) or indented by 4 spaces; ```python blocks are code, not commands. Continuations are joined (the
    number is the first line's), `# comments` and a `$ ` prompt dropped, `a && b` split in two.

    Inline `code` in prose is not read: there a command is mostly named rather than shown (`kvt bench`,
    `kvt run --recompute-*`, `kvt cascade RECORDS [--recompute RECORDS]`), and telling a runnable one from
    a name would take a second, fuzzier parser."""
    text, lines = text_of(doc), []  # lines: (number, text, whether every line counts) of every code line
    for m in FENCE.finditer(text):
        if m.group(1) != "python":
            first = text.count("\n", 0, m.start()) + 2
            lines += [(first + i, line, m.group(1) == "bash") for i, line in enumerate(m.group(2).splitlines())]
    blank = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # the prose, lines where they were
    lines += [(i + 1, line, False) for i, line in enumerate(blank.splitlines()) if line.startswith("    ")]
    out, held = [], None  # held: (number, text so far) of a command continued with a trailing backslash
    for n, line, every in sorted(lines):
        if held:
            n, line, every = held[0], held[1] + " " + line.strip(), True
        line = line.split(" #")[0].strip().removeprefix("$ ")
        held = (n, line[:-1].strip()) if line.endswith("\\") else None
        if not held and line and not line.startswith("#") and (every or starts_a_command(line)):
            out += [(n, part.strip()) for part in line.split("&&")]
    return out


def commands(doc):
    """[(line number, command)] of every command in doc's ```bash blocks (see shown_commands)."""
    text = text_of(doc)
    bash = {text.count("\n", 0, m.start()) + 2 + i for m in FENCE.finditer(text) if m.group(1) == "bash"
            for i in range(m.group(2).count("\n"))}
    return [(n, c) for n, c in shown_commands(doc) if n in bash]


class Parsed(Exception):
    """Raised by the patched ArgumentParser.parse_args once the arguments parsed: nothing runs after."""


def dry_parse(module, argv, monkeypatch):
    """Run module.main up to its parse_args on argv and stop there; returns argparse's error or None."""
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", [module, *argv])  # for a main() that reads sys.argv
    main = importlib.import_module(module).main
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv) if inspect.signature(main).parameters else main()
        except Parsed:
            return None
        except SystemExit:
            return err.getvalue().strip() or "exited while parsing"
    return "main() returned without calling parse_args"


def check_command(argv, monkeypatch):
    """None when the command is fine, else what is wrong. Each kind of command has one rule."""
    while argv and re.match(r"^[A-Z_]+=", argv[0]):  # OMP_NUM_THREADS=1 python ...
        argv = argv[1:]
    if argv[:2] == ["pip", "install"] or argv[:4] == ["python", "-m", "pip", "install"]:
        reqs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-r"]  # installing is not parsed,
        gone = [r for r in reqs if not (ROOT / r).exists()]                # but its files must exist
        return f"no {gone}" if gone else None
    if argv[0] == "bash":
        return None if (ROOT / argv[1]).is_file() else f"no script {argv[1]}"
    if argv[0] == "torchrun":  # torchrun's own options come before the script
        script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
        argv = ["python", *argv[script:]]
    if argv[:2] == ["python", "run.py"]:
        return dry_parse("kvt.harness.pipeline", argv[2:], monkeypatch)
    if argv[0] == "kvt":
        if argv[1] not in KVT_COMMANDS:
            return f"kvt has no command {argv[1]!r}"
        return dry_parse(f"kvt.{KVT_COMMANDS[argv[1]]}", argv[2:], monkeypatch)
    if argv[:3] == ["python", "-m", "pytest"]:
        files = [a.split("::")[0] for a in argv[3:] if not a.startswith("-") and "/" in a]
        gone = [f for f in files if not (ROOT / f).exists()]
        return f"no {gone}" if gone else None
    if argv[:2] == ["python", "-m"] and argv[2].split(".")[0] in ("kvt", "tests"):
        return dry_parse(argv[2], argv[3:], monkeypatch)
    return "no rule for this kind of command: add one to tests/test_docs.py"


ALL_COMMANDS = [(doc, n, c) for doc in DOCS for n, c in commands(doc)]


def test_readme_is_a_front_door():
    """README grown back into a measurement log (it was 90,000 characters) fails here."""
    n = len(text_of(ROOT / "README.md"))
    assert n <= README_LIMIT, f"README.md has {n} characters (limit {README_LIMIT}): move detail to docs/"


@pytest.mark.parametrize("doc", LINKED, ids=lambda d: d.name)
def test_links_lead_somewhere(doc):
    """A link to a moved or renamed file, or to a heading that was reworded, fails here."""
    bad = [t for t, f, a in links(doc) if not f.exists() or (a and f.suffix == ".md" and a not in anchors(f))]
    assert not bad, f"{doc.name}: broken links {bad}"


@pytest.mark.parametrize("doc", LINKED, ids=lambda d: d.name)
def test_named_paths_exist(doc):
    """A file named in `backticks` or a command that was renamed or deleted fails here."""
    assert not missing_paths(doc), f"{doc.name} names paths that do not exist: {missing_paths(doc)}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_no_process_words(doc):
    """Docs describe the code, not how it was made: an issue number or "this round" fails here."""
    found = [m.group(0) for m in PROCESS.finditer(text_of(doc))]
    assert not found, f"{doc.name}: {found}"


def test_docs_open_with_what_they_are_for():
    """A doc that starts with a table or a list instead of a title and a sentence saying what it is for."""
    for doc in DOCS[1:]:
        title, blank, first = text_of(doc).split("\n")[:3]
        opens_with_prose = first.strip() and not first.startswith(("|", "-", "#", "```", "!", "    "))
        assert title.startswith("# ") and not blank and opens_with_prose, f"{doc.name} opens without a purpose line"


@pytest.mark.parametrize("doc, line, command", ALL_COMMANDS,
                         ids=[f"{d.name}:{n}" for d, n, _ in ALL_COMMANDS])
def test_commands_parse(doc, line, command, monkeypatch):
    """A flag that was renamed or removed, or a command kvt no longer has, fails here: each command is
    parsed by the parser its entry point builds (kvt/cli.py's COMMANDS), stopped before it runs."""
    problem = check_command(shlex.split(command), monkeypatch)
    assert problem is None, f"{doc.name}:{line}: {command}\n{problem}"


def test_readme_has_commands_to_check():
    """The parse check would pass vacuously if README's commands left ```bash blocks."""
    kinds = {c.split()[0] + " " + c.split()[1] for d, _, c in ALL_COMMANDS if d.name == "README.md"}
    assert {"python run.py", "bash .ci/run", "python -m"} <= kinds, kinds


def reading_order():
    """(file, lines README states) for each row of README's "Reading order" table."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Reading order\n(.*?)(?=^## )", text, re.M | re.S)
    assert section, "README needs a 'Reading order' section: the method's files, in the order to read them"
    return [(f, int(n)) for f, n in re.findall(r"^\| \d+ \| `(kvt/\w+\.py)` \| (\d+) \|", section.group(1), re.M)]


def test_reading_order_is_true_and_its_reading_time_follows_from_its_lines():
    """Guards: a method file that grew (or a new one) while README still promises the old reading time
    (it promised "about an hour" for 1,296 lines, 146 minutes at the pace it now states); each count is
    the file's `wc -l`, the stated minutes are the total at the stated lines a minute, and together they
    stay within 1,600 lines."""
    rows = reading_order()
    assert len(rows) >= 8, f"README's Reading order lists {len(rows)} files"
    wrong = {f: (n, len((ROOT / f).read_text().splitlines())) for f, n in rows
             if n != len((ROOT / f).read_text().splitlines())}
    assert not wrong, f"README's Reading order line counts (stated, actual): {wrong}"
    total = sum(n for _, n in rows)
    assert total <= 1600, f"the method's files hold {total} lines"
    text = (ROOT / "README.md").read_text()
    stated = re.search(r"^([\d,]+) lines in all", text, re.M)
    assert stated and int(stated.group(1).replace(",", "")) == total, "README's total of the method's lines"
    section = re.search(r"^## Reading order\n(.*?)(?=^\| # )", text, re.M | re.S).group(1)
    claim = re.search(r"about (\d+) minutes beside\s+\[tutorial.md\]\(tutorial.md\) at (\d+)\s+lines a minute", section)
    assert claim, "README's Reading order states no reading time (minutes at a stated lines-a-minute pace)"
    minutes, rate = int(claim.group(1)), int(claim.group(2))
    assert minutes == round(total / rate), f"README says {minutes} minutes; {total} lines at {rate} a minute are {total / rate:.0f}"
    fast = len((ROOT / "kvt" / "fast.py").read_text().splitlines())
    assert f"twins run too ({fast} lines, {round(fast / rate)} minutes)" in " ".join(section.split()), "fast.py's lines and minutes"
