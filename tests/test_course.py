"""The course kit (kvt/course.py): every assignment scores 0 with its stubs and full marks with the
reference bodies, and a typical student mistake, planted by editing the generated copy, costs exactly the
points of its own function. About a minute on one core: each grade is a pytest subprocess."""
import ast
import shutil

import pytest

from kvt import course
from kvt.cli import entry

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def solutions(tmp_path_factory):
    """Every assignment made with --solution (the reference bodies kept): {name: folder}."""
    root = tmp_path_factory.mktemp("solutions")
    return {name: course.make(name, root / name, solution=True) for name in course.ASSIGNMENTS}


def grade(folder, capsys):
    """`kvt course grade folder`: (exit status, what it printed)."""
    try:
        entry(["course", "grade", str(folder)])
        status = 0
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().out


def score(printed):
    """(earned, possible) from the table's last line, '  9 / 12 total'."""
    earned, _, possible, _ = printed.strip().splitlines()[-1].split()
    return int(earned), int(possible)


@pytest.mark.parametrize("name", list(course.ASSIGNMENTS))
def test_stubs_score_zero(name, tmp_path, capsys):
    """Guards: a stub that keeps part of the reference body, a grader that passes a function which raises,
    or one that grades the repository's kvt instead of the copy (every function would pass); and a
    student copy that lacks what the README promises or ships kvt's tests and runs."""
    folder = course.make(name, tmp_path / name)
    a = course.ASSIGNMENTS[name]
    status, printed = grade(folder, capsys)
    assert status == 1 and score(printed) == (0, a.points), printed
    for f in a.functions:
        assert f"NotImplementedError: {f.name}: implement this (tutorial section {f.section})" in printed, printed
    for path in ("kvt/course.py", "tutorial.md", "run.py", "requirements.txt", "weights/toy-s/model.safetensors",
                 "grading/expected.safetensors", f"grading/test_{name}.py", "README.md"):
        assert (folder / path).exists(), f"{path} missing from the student copy"
    assert not (folder / "tests").exists() and not (folder / "runs").exists()
    assert all(f"`{f.name}`" in (folder / "README.md").read_text() for f in a.functions)


@pytest.mark.parametrize("name", list(course.ASSIGNMENTS))
def test_reference_bodies_score_full_marks(name, solutions, capsys):
    """Guards: a case whose expected numbers are not reproducible in a fresh process (unseeded inputs,
    a tolerance below the reference's own rounding), and a swap to the reference that breaks the
    function under test (patching the wrong name, or a reference module that cannot load)."""
    status, printed = grade(solutions[name], capsys)
    assert status == 0 and score(printed) == (course.ASSIGNMENTS[name].points,) * 2, printed


def plant(solutions, tmp_path, name, file, old, new):
    """A copy of assignment `name`'s solution with one mistake: `old` replaced by `new` in `file`."""
    folder = shutil.copytree(solutions[name], tmp_path / name)
    text = (folder / file).read_text()
    assert text.count(old) == 1, f"{old!r} is not in {file} once: update this test to the code"
    (folder / file).write_text(text.replace(old, new))
    return folder


def assert_costs_exactly(folder, function, capsys):
    """The mistake fails `function` alone: the score is full marks minus its points."""
    status, printed = grade(folder, capsys)
    a = next(a for a in course.ASSIGNMENTS.values() if function in [f.name for f in a.functions])
    points = next(f.points for f in a.functions if f.name == function)
    assert status == 1 and score(printed) == (a.points - points, a.points), printed
    assert [line.split()[3] for line in printed.splitlines() if "FAIL" in line] == [function], printed


def test_strip_with_the_wrong_sign_costs_its_points(solutions, tmp_path, capsys):
    """Guards: a strip that rotates forward again (+sin) instead of back passing, or costing more than
    strip's own points."""
    folder = plant(solutions, tmp_path, "rope", "kvt/rope.py",
                   "rotate(y.to(work), cos, -sin)", "rotate(y.to(work), cos, sin)")
    assert_costs_exactly(folder, "rope.strip", capsys)


def test_ridge_without_centering_costs_eigens_points(solutions, tmp_path, capsys):
    """Guards: a ridge fit on the raw second moments x x^T / n (lambda added to an uncentered Gram
    matrix) passing; and that mistake costing weights' points too, though weights calls eigen in its
    case: it must be graded with the reference eigen."""
    folder = plant(solutions, tmp_path, "ridge", "kvt/ridge.py",
                   "cxx = s.gram() / s.n - mx[:, :, None] * mx[:, None, :]", "cxx = s.gram() / s.n")
    assert_costs_exactly(folder, "ridge.eigen", capsys)


def test_scoring_off_by_one_costs_its_points(solutions, tmp_path, capsys):
    """Guards: scoring each continuation token with the logits at its own position (which predict the
    next token) instead of the position before it, passing."""
    folder = plant(solutions, tmp_path, "evals", "kvt/scoring.py",
                   "logits, _ = model(cont[:, :-1], cache=cache.expand(n))  # (n, Tc-1, V)\n"
                   "        pred = torch.cat([pred, logits], 1)",
                   "logits, _ = model(cont, cache=cache.expand(n))\n        pred = logits")
    assert_costs_exactly(folder, "scoring.loglikelihoods", capsys)


def test_mapped_keys_without_the_targets_rope_cost_applys_points(solutions, tmp_path, capsys):
    """Guards: Mapper.apply leaving mapped keys position-free passing, or costing handoff's points too
    (handoff calls apply: it must be graded with the reference apply)."""
    folder = plant(solutions, tmp_path, "mapper", "kvt/mapper.py",
                   "y = rope.apply(y, pos.to(d), tgt_inv, tgt_scale)", "y = y")
    assert_costs_exactly(folder, "mapper.Mapper.apply", capsys)


def test_every_graded_function_has_its_code_a_case_and_a_tutorial_section():
    """Guards: a kvt function renamed or moved, or the tutorial renumbered, leaving an assignment that
    cannot be made or that sends students to the wrong section; docs/course.md's tables drifting from
    the assignments' functions and points."""
    tutorial, docs = (course.ROOT / "tutorial.md").read_text(), (course.ROOT / "docs" / "course.md").read_text()
    for a in course.ASSIGNMENTS.values():
        for f in a.functions:
            module = (course.KVT / f"{f.module}.py").read_text()
            assert "raise NotImplementedError" in course.stub(module, [f]), f"{f.name} not found in kvt/{f.module}.py"
            assert f.name in course.CASES, f"{f.name} has no case"
            assert f"\n## {f.section}. " in tutorial, f"{f.name}: tutorial.md has no section {f.section}"
            assert f"| `{f.name}` | {f.points} |" in docs, f"docs/course.md lacks {f.name}'s row with its points"
        assert all(f"\n## {n}. " in tutorial for n in a.sections)


def test_stub_keeps_signature_docstring_and_shape_comments():
    """Guards: comments outside the graded bodies lost (as ast.unparse would), a body comment that gives
    the answer away (scoring's off-by-one note) surviving, standalone shape comments dropped, and line
    numbers going stale when two functions of one file are cut."""
    source = '''import torch


@torch.no_grad()
def f(x, n=2):  # the signature stays
    """Docstring stays."""
    # (B, T, D): a comment before the first statement stays
    y = x + 1  # the answer goes
    # off by one: this note goes too
    # (B, T): a standalone shape comment stays
    return y * n


class K:
    def g(self):
        """Method docstring."""
        return 3  # goes


# a comment between functions stays
def h():
    return 4
'''
    graded = [course.Graded("m.f", 1, 3, ""), course.Graded("m.K.g", 1, 5, "")]
    out = course.stub(source, graded)
    assert out == '''import torch


@torch.no_grad()
def f(x, n=2):  # the signature stays
    """Docstring stays."""
    # (B, T, D): a comment before the first statement stays
    # (B, T): a standalone shape comment stays
    raise NotImplementedError("m.f: implement this (tutorial section 3)")


class K:
    def g(self):
        """Method docstring."""
        raise NotImplementedError("m.K.g: implement this (tutorial section 5)")


# a comment between functions stays
def h():
    return 4
''', out
    scoring = (course.KVT / "scoring.py").read_text()
    stubbed = course.stub(scoring, [f for f in course.ASSIGNMENTS["evals"].functions if f.module == "scoring"])
    assert "Off by one" in scoring and "Off by one" not in stubbed
    assert "@torch.no_grad()\ndef loglikelihoods(model, ctx, conts, via=None):\n" in stubbed
    before, after = ({n.name: n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)}
                     for text in (scoring, stubbed))
    assert ast.get_docstring(after["loglikelihoods"]) == ast.get_docstring(before["loglikelihoods"])
    assert ast.dump(after["score_choices"]) == ast.dump(before["score_choices"])      # an ungraded function


def test_bad_input_is_one_line_and_exit_status_2(solutions, tmp_path, capsys):
    """Guards: a traceback (or a silent 0 / N score) for an unknown assignment, a missing folder, a folder
    that is not an assignment, or a make over an existing folder's files."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("mine")
    cases = [(["make", "--assignment", "nope", "--out", str(tmp_path / "x")], "no assignment 'nope'"),
             (["make", "--assignment", "rope", "--out", str(tmp_path / "plain")], "not an empty folder"),
             (["grade", str(tmp_path / "missing")], "no such folder"),
             (["grade", str(tmp_path / "plain")], "is not a kvt assignment")]
    for argv, words in cases:
        with pytest.raises(SystemExit) as e:
            entry(["course", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("kvt: ") and words in err and err.count("\n") == 1, err
    assert (tmp_path / "plain" / "notes.txt").read_text() == "mine" and not (tmp_path / "x").exists()
