"""The course kit (kvt/teach/course.py): every assignment scores 0 with its stubs and full marks with the
reference bodies, a typical student mistake, planted by editing the generated copy, costs exactly the
points of its own function and says where it is, and the answer key stays in the grader folder. Each
grade is a pytest subprocess (about 7 s of CPU): a few minutes on one busy core."""
import ast
import shutil

import pytest
import torch

import kvt
from kvt.teach import course, grading
from tests import exercises
from kvt import ridge
from kvt.harness import toy
from kvt.cli import entry
from kvt.harness.calibration import CalibrationOptions, calibrate

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def solutions(tmp_path_factory):
    """Every assignment made with --solution (the reference bodies kept): {name: (student copy, grader)}."""
    root = tmp_path_factory.mktemp("solutions")
    return {name: course.make(name, root / name, solution=True) for name in course.ASSIGNMENTS}


def grade(folder, capsys, grader=None):
    """`kvt course grade folder --grader folder-grader`: (exit status, what it printed)."""
    grader = grader or folder.with_name(folder.name + "-grader")
    try:
        entry(["course", "grade", str(folder), "--grader", str(grader)])
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
    or one that grades the repository's kvt instead of the copy (every function would pass); a student
    copy that lacks what the README promises, ships kvt's tests and runs, or holds the answer key (the
    reference modules, the expected numbers, the test)."""
    folder, grader = course.make(name, tmp_path / name)
    assert grader == tmp_path / f"{name}-grader"
    a = course.ASSIGNMENTS[name]
    status, printed = grade(folder, capsys)
    assert status == 1 and score(printed) == (0, a.points), printed
    for f in a.functions:
        assert f"NotImplementedError: {f.name}: implement this (tutorial section {f.section})" in printed, printed
    for path in ("kvt/teach/course.py", "tutorial.md", "run.py", "requirements.txt", "weights/toy-s/model.safetensors",
                 "README.md"):
        assert (folder / path).exists(), f"{path} missing from the student copy"
    for path in ("expected.safetensors", f"test_{name}.py", "grading.py", "assignment.json"):
        assert (grader / path).exists(), f"{path} missing from the grader folder"
    assert all((grader / "reference" / f"{f.module}.py").exists() for f in a.functions)
    assert not any(folder.rglob("expected.safetensors")) and not (folder / "grading").exists()
    assert not (folder / "reference").exists() and not any(folder.rglob(f"test_{name}.py"))
    assert not (folder / "tests").exists() and not (folder / "runs").exists()
    readme = (folder / "README.md").read_text()
    assert all(f"`{f.name}`" in readme for f in a.functions) and "OMP_NUM_THREADS=1" in readme
    assert not (folder / "tests").exists() and not list(folder.rglob("exercises.py"))   # the exercises' answers: not there
    assert "greedy_layers" not in (folder / "kvt" / "teach" / "course.py").read_text()


@pytest.mark.parametrize("name", list(course.ASSIGNMENTS))
def test_reference_bodies_score_full_marks(name, solutions, capsys):
    """Guards: a case whose expected numbers are not reproducible in a fresh process (unseeded inputs,
    a tolerance below the reference's own rounding), and a swap to the reference that breaks the
    function under test (patching the wrong name, or a reference module that cannot load)."""
    status, printed = grade(solutions[name][0], capsys)
    assert status == 0 and score(printed) == (course.ASSIGNMENTS[name].points,) * 2, printed


def plant(solutions, tmp_path, name, file, old, new):
    """A copy of assignment `name`'s solution with one mistake: `old` replaced by `new` in `file`; and its
    grader folder."""
    folder = shutil.copytree(solutions[name][0], tmp_path / name)
    shutil.copytree(solutions[name][1], tmp_path / f"{name}-grader")
    text = (folder / file).read_text()
    assert not old or text.count(old) == 1, f"{old!r} is not in {file} once: update this test to the code"
    (folder / file).write_text(text.replace(old, new))
    return folder


def assert_costs_exactly(folder, function, capsys):
    """The mistake fails `function` alone: the score is full marks minus its points."""
    status, printed = grade(folder, capsys)
    a = next(a for a in course.ASSIGNMENTS.values() if function in [f.name for f in a.functions])
    points = next(f.points for f in a.functions if f.name == function)
    assert status == 1 and score(printed) == (a.points - points, a.points), printed
    assert [line.split()[3] for line in printed.splitlines() if "FAIL" in line] == [function], printed
    return printed


def test_strip_with_the_wrong_sign_costs_its_points(solutions, tmp_path, capsys):
    """Guards: a strip that rotates forward again (+sin) instead of back passing, or costing more than
    strip's own points."""
    folder = plant(solutions, tmp_path, "rope", "kvt/rope.py",
                   "rotate(y.to(work), cos, -sin)", "rotate(y.to(work), cos, sin)")
    assert_costs_exactly(folder, "rope.strip", capsys)


def overridden(solutions, tmp_path, name, file, code):
    """A copy of assignment `name`'s solution with `code` appended to `file` (a function redefined there)."""
    folder = plant(solutions, tmp_path, name, file, "", "")
    (folder / file).write_text((folder / file).read_text() + code)
    return folder


def test_a_failure_says_the_case_where_it_differs_and_a_hint(solutions, tmp_path, capsys):
    """Guards: a grader message that gives one number ("y differs by 5.2"), without the case's shapes,
    positions and RoPE recipe, without which channels or positions differ, or without a hint; and a
    plane check that cannot tell a wrong plane layout (neighbors (2i, 2i + 1)) from wrong angles."""
    folder = overridden(solutions, tmp_path, "rope", "kvt/rope.py", """

def rotate(x, cos, sin):  # planted: planes (2i, 2i + 1)
    half = x.shape[-1] // 2
    x1, x2, c, s = x[..., 0::2], x[..., 1::2], cos[..., :half], sin[..., :half]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).flatten(-2)


def strip(y, pos, inv_freq, scale=1.0):  # planted: the scale not divided out
    cos, sin = cos_sin(pos, inv_freq, scale, torch.promote_types(y.dtype, torch.float32))
    return rotate(y.to(cos.dtype), cos, -sin).to(y.dtype)
""")
    status, printed = grade(folder, capsys)                        # one grade, two mistakes: 6 of 12 lost
    assert status == 1 and score(printed) == (6, 12), printed
    assert [line.split()[3] for line in printed.splitlines() if "FAIL" in line] == ["rope.rotate", "rope.strip"]
    for words in ("y (2, 3, 5, 16) = (B, H, T, D)", "channels (D) all 16", "positions (2, 5) drawn from 0-2999",
                  "scale 1", "is your plane (2i, 2i + 1)?", "hint: plane i is channels (i, i + D/2)",
                  "scaled (2, 3, 5, 16) = (B, H, T, D)", "positions (T) all 5"):
        assert words in printed, f"{words!r} not in:\n{printed}"
    assert "every plane (i, i + D/2) is 1.562 times the reference's length: a scale" in printed, printed
    assert "scale 1.25" in printed and "hint: strip(y, p) rotates back by -p" in printed, printed


def test_the_student_copy_cannot_grade_itself(solutions, tmp_path, capsys):
    """Guards: a student copy whose own kvt/teach/grading.py decides the grade (an edited check that passes
    everything would then score full marks on stubs): the grader runs its own copy of the checks."""
    folder, grader = course.make("rope", tmp_path / "rope")
    mine = folder / "kvt" / "teach" / "grading.py"
    mine.write_text(mine.read_text().replace('    import pytest\n    student, grader = ', '    return\n    student, grader = '))
    status, printed = grade(folder, capsys)
    assert status == 1 and score(printed) == (0, 12), printed


def test_helpers_that_compute_an_answer_are_routed_through_it(tmp_path):
    """Guards: fast.strip_cos_sin, which computes rope.strip's answer (the inverse rotation), left readable
    in the rope student copy; and its routed replacement computing something else than the original (the
    YaRN scale multiplied where strip divides: every stripped key would be off by scale^2)."""
    folder, _ = course.make("rope", tmp_path / "rope")
    text = (folder / "kvt" / "fast.py").read_text()
    routed = ast.parse(text)
    node = next(n for n in routed.body if isinstance(n, ast.FunctionDef) and n.name == "strip_cos_sin")
    assert "cos_sin(" not in ast.get_source_segment(text, node).split('"""')[-1], \
        "fast.strip_cos_sin still computes strip's answer"
    from kvt import fast, rope
    namespace = {"rope": rope, "torch": torch}
    exec(compile(ast.Module([node], []), "routed", "exec"), namespace)
    cfg = grading.tiny(rope=grading.YARN)                              # scale 1.1218
    inv, scale = rope.frequencies(cfg)
    pos = torch.randint(0, 3000, (2, 5), generator=torch.Generator().manual_seed(0))
    want, got = fast.strip_cos_sin(pos, inv, scale, grading.f64), namespace["strip_cos_sin"](pos, inv, scale, grading.f64)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)   # float32's rounding of cos / scale


def test_ridge_without_centering_costs_eigens_points(solutions, tmp_path, capsys):
    """Guards: a ridge fit on the raw second moments x x^T / n (lambda added to an uncentered Gram
    matrix) passing; and that mistake costing weights' points too, though weights calls eigen in its
    case: it must be graded with the reference eigen."""
    folder = plant(solutions, tmp_path, "ridge", "kvt/ridge.py",
                   "cxx = s.gram().div_(s.n).sub_(mx[:, :, None] * mx[:, None, :])", "cxx = s.gram().div_(s.n)")
    assert_costs_exactly(folder, "ridge.eigen", capsys)


def test_scoring_off_by_one_costs_its_points(solutions, tmp_path, capsys):
    """Guards: scoring each continuation token with the logits at its own position (which predict the
    next token) instead of the position before it, passing."""
    folder = plant(solutions, tmp_path, "evals", "kvt/evals.py",
                   "logits, _ = model(cont[:, :-1], cache=cache.expand(n) if len(pairs) == 1 else cache.select(rows))\n"
                   "        pred = torch.cat([pred, logits], 1)",
                   "logits, _ = model(cont, cache=cache.expand(n) if len(pairs) == 1 else cache.select(rows))\n"
                   "        pred = logits")
    assert_costs_exactly(folder, "evals.loglikelihoods", capsys)


def test_mapped_keys_without_the_targets_rope_cost_applys_points(solutions, tmp_path, capsys):
    """Guards: Mapper.apply leaving mapped keys position-free passing, or costing handoff's points too
    (handoff calls apply: it must be graded with the reference apply)."""
    folder = plant(solutions, tmp_path, "mapper", "kvt/mapper.py",
                   "y = rope.apply(y, pos.to(d), tgt_inv, tgt_scale)", "y = y")
    assert_costs_exactly(folder, "mapper.Mapper.apply", capsys)


def section(tutorial, n):
    """The text of tutorial section n, from its heading to the next section's."""
    start = tutorial.index(f"\n## {n}. ")
    return tutorial[start:tutorial.find("\n## ", start + 1)]


def test_every_graded_function_has_its_code_a_case_and_a_tutorial_section():
    """Guards: a kvt function renamed or moved, or the tutorial renumbered, leaving an assignment that
    cannot be made or that sends students to a section that does not teach it (the course once cited
    section 7 for Mapper.apply, which it never explained, and section 5 for single_layer_r2, introduced
    in section 4); a graded function without a case description and hint for its failures;
    docs/course.md's tables drifting from the assignments' functions, points and sections."""
    tutorial, docs = (course.ROOT / "tutorial.md").read_text(), (course.ROOT / "docs" / "course.md").read_text()
    for a in course.ASSIGNMENTS.values():
        for f in a.functions:
            module = (course.KVT / course.path_of(f.module)).read_text()
            assert "raise NotImplementedError" in course.stub(module, [f]), f"{f.name} not found in kvt/{course.path_of(f.module)}"
            assert f.name in grading.CASES and f.name in grading.ABOUT, f"{f.name} has no case, or no ABOUT entry"
            assert f"\n## {f.section}. " in tutorial, f"{f.name}: tutorial.md has no section {f.section}"
            short = f.name.split(".", 1)[1]
            text = section(tutorial, f.section)
            assert f"`{short}" in text or f"`{f.name}" in text, f"tutorial section {f.section} never names `{short}`"
            assert f"| `{f.name}` | {f.points} | {f.section} |" in docs, \
                f"docs/course.md lacks {f.name}'s row with its points and section"
            assert f.section in a.sections, f"{f.name}'s section {f.section} is not in its assignment's reading"
        assert all(f"\n## {n}. " in tutorial for n in a.sections)
    for name, routes in course.GIVEAWAYS.items():                  # each routed function still exists
        for r in routes:
            source = (course.KVT / course.path_of(r.split(".")[0])).read_text()
            assert "    return 'routed'\n" in course.stub(source, [], {r: "    return 'routed'\n"}), r


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
    graded = [grading.Graded("m.f", 1, 3, ""), grading.Graded("m.K.g", 1, 5, "")]
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
    scoring = (course.KVT / "evals.py").read_text()
    stubbed = course.stub(scoring, [f for f in course.ASSIGNMENTS["evals"].functions if f.module == "evals"])
    assert "Off by one" in scoring and "Off by one" not in stubbed
    assert "@torch.no_grad()\ndef loglikelihoods(model, pairs, via=None):\n" in stubbed
    before, after = ({n.name: n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)}
                     for text in (scoring, stubbed))
    assert ast.get_docstring(after["loglikelihoods"]) == ast.get_docstring(before["loglikelihoods"])
    assert ast.dump(after["score_choices"]) == ast.dump(before["score_choices"])      # an ungraded function


def test_bad_input_is_one_line_and_exit_status_2(solutions, tmp_path, capsys):
    """Guards: a traceback (or a silent 0 / N score) for an unknown assignment, a missing folder, a folder
    that is not a student copy, a grader folder that is not one, or a make over an existing folder's files."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("mine")
    student, grader = solutions["rope"]
    cases = [(["make", "--assignment", "nope", "--out", str(tmp_path / "x")], "no assignment 'nope'"),
             (["make", "--assignment", "rope", "--out", str(tmp_path / "plain")], "not an empty folder"),
             (["make", "--assignment", "rope", "--out", str(tmp_path / "y"), "--grader", str(tmp_path / "plain")],
              "not an empty folder"),
             (["grade", str(tmp_path / "missing"), "--grader", str(grader)], "no such folder"),
             (["grade", str(tmp_path / "plain"), "--grader", str(grader)], "is not a kvt student copy"),
             (["grade", str(student), "--grader", str(tmp_path / "plain")], "is not a kvt grader folder")]
    for argv, words in cases:
        with pytest.raises(SystemExit) as e:
            entry(["course", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("kvt: ") and words in err and err.count("\n") == 1, err
    assert (tmp_path / "plain" / "notes.txt").read_text() == "mine" and not (tmp_path / "x").exists()
    assert not (tmp_path / "y").exists() and [p.name for p in tmp_path.iterdir()] == ["plain"]


def test_greedy_selection_never_loses_to_top_k_at_k_2():
    """Guards: exercise 5's greedy rule (the instructors' answer, calibrate's select=) picking the partner
    layer by its own single-layer R^2 (top-k again) or by the fit region's R^2, returning row indices
    instead of layer numbers, or unsorted layers; and calibrate ignoring `select`."""
    st = grading.layered_stats()                       # source layers numbered 1, 4, 7; planted dependencies
    for kind in ("k", "v"):
        top = ridge.select_layers(ridge.single_layer_r2(st, kind), st.src_layers, 2)
        greedy = exercises.greedy_layers(st, kind, 2)
        assert greedy.shape == (2, 2) and set(greedy.flatten().tolist()) <= set(st.src_layers), greedy
        assert bool((greedy[:, :-1] < greedy[:, 1:]).all()), greedy
        r2_top, r2_greedy = (ridge.fit_layers(st, kind, sel) for sel in (top, greedy))
        assert all(r2_greedy[t][2] >= r2_top[t][2] - 1e-12 for t in st.tgt_layers), (top, greedy)
    assert exercises.greedy_layers(st, "k", 2)[1].tolist() == [1, 4]   # planted: target 1 = f(layer 1) + g(layer 4)
    source, target = exercises.toy_model("toy-m"), exercises.toy_model("toy-s")
    calib = exercises.calibration_sequences(None, kvt.load_tokenizer(course.ROOT / "weights" / "toy-s"), 6, 64,
                                         documents=toy.corpus(200, seed=99))
    fixed = lambda stats, kind, k, lams: torch.tensor([[1]] * len(stats.tgt_layers))   # always source layer 1
    m, _ = calibrate(source, target, calib, scope="head", k=1, options=CalibrationOptions(select=fixed, progress=False))
    assert m.layers["k"].tolist() == [[1], [1]] and m.layers["v"].tolist() == [[1], [1]]


@pytest.mark.slow
def test_the_exercises_answers_hold_and_match_docs(capsys):
    """Guards: an exercise whose answer no longer holds on the shipped weights (a check fails), and
    docs/course.md's answers drifting from what `python -m tests.exercises` prints (numbers within test_tutorial's
    tolerance). A few minutes on one thread: every exercise calibrates on the toy family."""
    from test_tutorial import FENCE, compare
    assert exercises.answers(), capsys.readouterr().out
    printed = capsys.readouterr().out
    docs = (course.ROOT / "docs" / "course.md").read_text()
    block = next(m.group(2) for m in FENCE.finditer(docs) if m.group(2).startswith("exercise 1:"))
    assert compare(printed, block) is None, compare(printed, block)


# ---- the grader's own failures: one line, or a score that says why ---------------------------------------

def test_a_broken_assignment_json_is_one_line(solutions, tmp_path, capsys):
    """Guards: the grader's assignment.json that is not JSON, lacks "assignment" or is a list ending in a
    JSONDecodeError, KeyError or TypeError traceback."""
    for i, text in enumerate(['{oops', '{"solution": true}', '["rope"]']):
        grader = shutil.copytree(solutions["rope"][1], tmp_path / f"{i}-grader")
        (grader / "assignment.json").write_text(text)
        with pytest.raises(SystemExit) as e:
            entry(["course", "grade", str(solutions["rope"][0]), "--grader", str(grader)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "is not the file `kvt course make` writes" in err, err


def test_grading_without_pytest_says_what_to_install(solutions, monkeypatch, capsys):
    """Guards: without pytest installed a correct solution scoring 0 with "No module named pytest"."""
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pytest" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        entry(["course", "grade", str(solutions["rope"][0]), "--grader", str(solutions["rope"][1])])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip() == "kvt: the grader runs pytest, which is not installed; pip install pytest"


def test_an_endless_loop_is_stopped_and_scored(solutions, tmp_path, capsys):
    """Guards: a student's endless loop hanging the grader for ever (no timeout)."""
    folder = plant(solutions, tmp_path, "rope", "kvt/rope.py",
                   "rotate(y.to(work), cos, -sin)", "next(x for x in iter(int, 1) if x)")
    earned, total = course.grade(folder, tmp_path / "rope-grader", timeout=20)
    printed = capsys.readouterr().out
    assert earned == 0 and "not run: TimeoutError: the grader ran past 20 s" in printed, printed


def test_ctrl_c_during_grade_does_not_promise_a_resume(monkeypatch, solutions, capsys):
    """Guards: Ctrl-C during kvt course grade saying that a rerun resumes (a grade starts over)."""
    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(course, "grade", interrupted)
    with pytest.raises(SystemExit) as e:
        entry(["course", "grade", str(solutions["rope"][0]), "--grader", str(solutions["rope"][1])])
    err = capsys.readouterr().err
    assert e.value.code == 130 and "resume" not in err and "start over" in err, err
