"""A course kit: assignments cut out of kvt's own code, and an autograder for them (docs/course.md).

    python -m kvt.teach.course list                                  # the assignments, their functions and points
    python -m kvt.teach.course make --assignment rope --out DIR      # a student copy, and DIR-grader, the answer key
    python -m kvt.teach.course grade DIR --grader DIR-grader         # a score per function; exit 1 below full marks

`make` writes two folders. The student copy: kvt (the package, tutorial.md, run.py, requirements.txt,
and the toy checkpoints the tutorial's blocks read), in which the body of each graded function is one
line, `raise NotImplementedError("rope.strip: implement this (tutorial section 3)")`. The signature, the
docstring and comments standing before the first statement stay. The body (its first statement after
the docstring through end_lineno, found with ast) is cut out of the source text, since ast.unparse
would drop every comment. Comments inside the body go with it, because they give answers away
(scoring's off-by-one note), except standalone shape comments such as `# (B, Hkv, T, D)`. Other code
that computes a graded function's answer is cut the same way (GIVEAWAYS).

The grader folder, which stays with the instructor as a Gradescope autograder does: the reference
modules, the numbers each graded function must reproduce (grading.py's CASES, run on the reference code at
make time into GRADER/expected.safetensors), the test, and a copy of grading.py, whose `check` decides each
grade. `grade` runs GRADER's test with pytest in a subprocess on one thread, with the student copy first on
the path, one test per function (test_function[rope.strip]).

The tutorial's exercises' answers, for instructors, are outside the package and so outside every student
copy: `python -m tests.exercises` (tests/exercises.py).
"""
import argparse
import ast
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from xml.etree import ElementTree

import torch
from safetensors.torch import save_file

import kvt
from kvt.config import KvtError
from kvt.teach.grading import ASSIGNMENTS, CASES, KVT, ROOT, f64, path_of


# ---- make -------------------------------------------------------------------------------------------------

SHAPE = re.compile(r"\((B|G|N|T|n|H|Hkv|L|Ls|Lt), ")  # a shape comment: "# (B, Hkv, T, D)"

# Other kvt code that computes a graded function's answer: in the student copy its body is replaced by one
# that calls the graded functions, so it works exactly when they do (and shows nothing of how).
GIVEAWAYS = {
    "rope": {"fast.strip_cos_sin": """\
    pos = pos if pos.dim() == 2 else pos[None]                   # (student copy: routed through rope.strip,
    B, T, half = pos.shape[0], pos.shape[1], inv_freq.shape[0]   # which you write)
    e = torch.cat([torch.ones(half), torch.zeros(half)]).to(dtype).expand(B, 1, T, 2 * half)  # (B, 1, T, D)
    y = rope.strip(e, pos, inv_freq, scale)                       # (B, 1, T, D): [cos, -sin] / scale
    return y[..., :half].repeat(1, 1, 1, 2), y[..., half:].repeat(1, 1, 1, 2)
"""},
}


def stub(source, functions, routed=None):
    """source with the body of each Graded function replaced by a NotImplementedError (module docstring),
    and of each function named in `routed` {"module.function": new body} by that body."""
    lines, tree, cuts = source.splitlines(keepends=True), ast.parse(source), []
    for name, new_body in [(f.name, None) for f in functions] + list((routed or {}).items()):
        node = tree
        for part in name.split(".")[1:]:
            node = next(n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
        first = node.body[1 if ast.get_docstring(node) is not None else 0]  # the first statement after the docstring
        if new_body is not None:
            cuts.append((first.lineno - 1, node.end_lineno, [new_body]))
            continue
        section = next(f.section for f in functions if f.name == name)
        body = lines[first.lineno - 1:node.end_lineno]
        shapes = [line for line in body if line.strip().startswith("#") and SHAPE.search(line)]
        error = f'raise NotImplementedError("{name}: implement this (tutorial section {section})")\n'
        cuts.append((first.lineno - 1, node.end_lineno, shapes + [" " * first.col_offset + error]))
    for start, end, new in sorted(cuts, reverse=True):              # from the bottom up: line numbers stay valid
        lines[start:end] = new
    return "".join(lines)


TEST = '''"""The grader of assignment {name!r}: one test per graded function, against the reference's numbers
(expected.safetensors). `python -m kvt.teach.course grade STUDENT --grader THIS_FOLDER` runs it, with the
student copy first on the path and KVT_STUDENT naming it."""
import importlib.util
import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent
spec = importlib.util.spec_from_file_location("kvt_course_grader", HERE / "grading.py")  # this folder's copy of
grader = importlib.util.module_from_spec(spec)                                         # the checks, not the
spec.loader.exec_module(grader)                                                        # student's


@pytest.mark.parametrize("function", [f.name for f in grader.ASSIGNMENTS[{name!r}].functions])
def test_function(function, monkeypatch):
    grader.check(os.environ["KVT_STUDENT"], HERE, {name!r}, function, monkeypatch)
'''

ONE_THREAD = """Run everything here on one thread (`export OMP_NUM_THREADS=1`, or `torch.set_num_threads(1)` first
thing in Python): the models are tiny, and on a shared or busy machine torch's threads wait for each other
(on a loaded 2-core machine the tutorial's section 7 block took 248 s with torch's default threads and
10.6 s with one). `grade` runs its tests on one thread already."""


def readme(name, solution):
    a = ASSIGNMENTS[name]
    rows = "\n".join(f"| `{f.name}` | `kvt/{path_of(f.module)}` | {f.points} | {f.section} | {f.teaches} |"
                     for f in a.functions)
    todo = ("This copy holds the reference solution (made with --solution)." if solution else
            "Each function below raises NotImplementedError until you write its body; its signature and docstring "
            "say what it takes and returns.")
    return f"""# kvt course, assignment `{name}`: {a.title}

Read {a.reading} (tutorial.md) beside the code. {todo}

{ONE_THREAD}

| function | file | points | tutorial section | what it teaches |
|---|---|---|---|---|
{rows}

Grade your work from this folder with the grader folder your instructor keeps (or, studying alone, the
`-grader` folder that `make` wrote beside this one: it holds the reference code, so reading it is reading
the answers):

    python -m kvt.teach.course grade . --grader GRADER_FOLDER

It prints one line per function (exit status 0 at full marks only). Each function is graded on its own:
while one is tested, the other functions of this table are the reference ones, so a mistake costs only its
own points. A failure says what the grader ran (shapes, positions, the RoPE recipe and scale), where your
output differs from the reference's (which rows, heads, positions, channels), and a hint for that case.
"""


def make(name, out, grader=None, solution=False):
    """Write assignment `name`: the student copy to the new folder `out`, the grader to `grader` (default:
    `out` + "-grader"), each built beside its place and then renamed. Returns (out, grader)."""
    if name not in ASSIGNMENTS:
        raise KvtError(f"no assignment {name!r}; the assignments are {', '.join(ASSIGNMENTS)}")
    out = Path(out)
    grader = Path(grader) if grader else out.with_name(out.name + "-grader")
    for folder in (out, grader):
        if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            raise KvtError(f"{folder} already exists and is not an empty folder; give a new one")
        if not folder.parent.is_dir():
            raise KvtError(f"{folder.parent} does not exist; create it first")
    if not (ROOT / "tutorial.md").exists():
        raise KvtError(f"make needs a working copy of kvt (a clone): there is no tutorial.md beside {KVT}")
    a = ASSIGNMENTS[name]
    tmp = [Path(tempfile.mkdtemp(prefix=f".{f.name}.", dir=f.parent)) for f in (out, grader)]
    student, key = tmp
    try:
        for t in tmp:
            t.chmod(0o755)                                       # mkdtemp's 0o700 would hide it from a class
        shutil.copytree(KVT, student / "kvt", ignore=shutil.ignore_patterns("__pycache__"))
        for f in ("tutorial.md", "run.py", "requirements.txt"):
            shutil.copy(ROOT / f, student / f)
        for w in sorted((ROOT / "weights").glob("toy-*")):       # the tutorial's blocks load the toy family
            shutil.copytree(w, student / "weights" / w.name)
        (key / "reference").mkdir()
        routed = {} if solution else GIVEAWAYS.get(name, {})
        for module in dict.fromkeys([f.module for f in a.functions] + [r.split(".")[0] for r in routed]):
            source = (KVT / path_of(module)).read_text()
            (key / "reference" / f"{module}.py").write_text(source)
            if not solution:
                mine = [f for f in a.functions if f.module == module]
                (student / "kvt" / path_of(module)).write_text(
                    stub(source, mine, {r: b for r, b in routed.items() if r.split(".")[0] == module}))
        expected = {}
        for f in a.functions:                                    # the reference's numbers: this kvt's own code
            try:
                outputs = CASES[f.name]()
            except NotImplementedError:
                raise KvtError(f"{f.name} is a stub in {KVT}; run make from kvt's own working copy") from None
            expected.update({f"{f.name}/{k}": torch.as_tensor(v).detach().to(f64).contiguous()
                             for k, v in outputs.items()})
        save_file(expected, key / "expected.safetensors")
        (key / "expected.safetensors").chmod(0o644)              # safetensors writes it 0o600
        shutil.copy(KVT / "teach" / "grading.py", key / "grading.py")     # the checks the test runs, out of the student's hands
        (key / f"test_{name}.py").write_text(TEST.format(name=name))
        info = json.dumps({"assignment": name, "solution": solution, "kvt_version": kvt.__version__,
                           "sha256": grader_hashes(key)}) + "\n"
        (key / "assignment.json").write_text(info)
        (key / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")  # stops pytest's search here
        (student / "README.md").write_text(readme(name, solution))
        for t, folder in zip(tmp, (out, grader)):
            if folder.exists():
                folder.rmdir()
            os.replace(t, folder)
    except BaseException:
        for t in tmp:
            shutil.rmtree(t, ignore_errors=True)
        raise
    return out, grader


# ---- grade ------------------------------------------------------------------------------------------------

def grader_hashes(grader):
    """{file name: sha256} of a grader folder's files (its reference/ ones as reference/NAME), assignment.json
    aside: make records them, grade checks them (a changed or missing file would grade against other answers)."""
    files = [f for f in sorted(Path(grader).rglob("*")) if f.is_file() and f.name != "assignment.json"
             and "__pycache__" not in f.parts]
    return {f.relative_to(grader).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def check_student_syntax(folder):
    """Refuse, in one line naming the file and line, a student copy whose kvt/ does not parse: every graded
    function would fail alike with "SyntaxError" and no word of where."""
    for f in sorted((Path(folder) / "kvt").glob("*.py")):
        try:
            ast.parse(f.read_bytes(), str(f))
        except SyntaxError as e:
            raise KvtError(f"{f}, line {e.lineno}: {e.msg}; fix it and grade again (python -c 'import kvt' from "
                           "the folder shows it too)") from None
        except ValueError as e:                                  # null bytes
            raise KvtError(f"{f}: {e}; fix it and grade again") from None


def grade(folder, grader, timeout=600):
    """Run an assignment's grader on a student copy; print the score table; return (points earned, possible).
    timeout: seconds the grader may run (a student's endless loop then fails every function, saying why)."""
    folder, grader = Path(folder), Path(grader)
    if not folder.is_dir():
        raise KvtError(f"{folder}: no such folder (make one: python -m kvt.teach.course make --assignment NAME --out DIR)")
    if not (folder / "kvt" / "__init__.py").exists():
        raise KvtError(f"{folder} is not a kvt student copy (no kvt/ in it); give the folder `make` wrote with --out")
    info = grader / "assignment.json"
    if not info.exists() or not (grader / "expected.safetensors").exists():
        raise KvtError(f"{grader} is not a kvt grader folder (no assignment.json and expected.safetensors in it); "
                       "give the -grader folder `make` wrote")
    try:
        name = json.loads(info.read_text())["assignment"]
    except (ValueError, KeyError, TypeError, IndexError):  # not JSON, or not the object `make` writes
        name = None
    if not isinstance(name, str):
        raise KvtError(f"{info} is not the file `kvt course make` writes (no \"assignment\" name); make the "
                       "assignment again")
    if importlib.util.find_spec("pytest") is None:
        raise KvtError("the grader runs pytest, which is not installed; pip install pytest")
    if name not in ASSIGNMENTS:
        raise KvtError(f"{grader} grades assignment {name!r}, which this kvt does not know ({', '.join(ASSIGNMENTS)})")
    made = json.loads(info.read_text()).get("sha256")              # None: a grader of an older kvt, unchecked
    if made is not None:
        have = grader_hashes(grader)
        changed = sorted(f for f in set(made) | {f"test_{name}.py"} if have.get(f) != made.get(f, "absent"))
        if changed:
            raise KvtError(f"{grader}: {changed[0]} was changed or removed since `kvt course make` wrote it (or "
                           f"assignment.json was); make the assignment again")
    check_student_syntax(folder)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder.resolve()), os.environ.get("PYTHONPATH", "")]),
           "KVT_STUDENT": str(folder.resolve()),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}   # tiny cases: more threads only wait for each other
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "results.xml"
        try:
            run = subprocess.run([sys.executable, "-m", "pytest", "-q", f"--junitxml={xml}", f"test_{name}.py"],
                                 cwd=grader, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:  # pytest killed: its report, if any, is cut short
            run = subprocess.CompletedProcess([], 1, "", f"E   TimeoutError: the grader ran past {timeout} s and was "
                                                         "stopped (a loop that never ends?)")
        results = {}  # graded function -> None (passed) or the lines of what failed
        for tc in ElementTree.parse(xml).iter("testcase") if xml.exists() else []:  # test_function[<graded name>]
            bad = next((tc.find(tag) for tag in ("failure", "error", "skipped") if tc.find(tag) is not None), None)
            message = None if bad is None else bad.get("message") or "failed"
            if message and "full report in element text" in message and bad.text:  # pytest >= 9.2 cuts the
                message = bad.text.strip()                                         # attribute to its first lines
            results[tc.get("name").partition("[")[2][:-1]] = message
    output = (run.stdout + run.stderr).strip().splitlines()
    errors = [line[1:].strip() for line in output if line.startswith("E ")]   # pytest's lines of the error,
    errors = [e for e in errors if "Error:" in e] + errors                      # the exception's own first
    why_not_run = "not run: " + next(iter(errors), output[-1] if output else "pytest printed nothing")
    a, earned = ASSIGNMENTS[name], 0
    print(f"assignment {name}: {a.title} ({a.reading})")
    for f in a.functions:
        failure = results.get(f.name, why_not_run)
        earned += 0 if failure else f.points
        first, *more = failure.splitlines() if failure else ["pass"]
        result = "FAIL  " + first.removeprefix("Failed: ").removeprefix(f"{f.name}: ") if failure else "pass"
        print(f"  {0 if failure else f.points:>2} / {f.points:<2} {f.name:<24} {result}")
        for line in more:                                        # where it differs, the case, a hint
            print(f"          {line}")
    print(f"  {earned:>2} / {a.points:<2} total")
    return earned, a.points



def main(argv=None):
    ap = argparse.ArgumentParser(prog="kvt course", description="Assignments cut out of kvt, and their autograder.")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the assignments, their functions and points")
    m = sub.add_parser("make", help="write a student copy of kvt with the assignment's functions stubbed")
    m.add_argument("--assignment", required=True, help=", ".join(ASSIGNMENTS))
    m.add_argument("--out", required=True, help="a new folder: the student copy")
    m.add_argument("--grader", help="a new folder: the grader, the answer key (default: OUT-grader)")
    m.add_argument("--solution", action="store_true", help="keep the reference bodies (to check the grader)")
    g = sub.add_parser("grade", help="run an assignment's grader on a student copy; exit status 1 below full marks")
    g.add_argument("folder", help="the student copy")
    g.add_argument("--grader", required=True, help="the grader folder make wrote beside it")
    args = ap.parse_args(argv)
    if args.command == "list":
        for name, a in ASSIGNMENTS.items():
            print(f"{name}: {a.title} ({a.reading}), {a.points} points")
            for f in a.functions:
                print(f"  {f.points} {f.name:<24} section {f.section}: {f.teaches}")
    elif args.command == "make":
        out, grader = make(args.assignment, args.out, args.grader, args.solution)
        print(f"wrote {out} (the student copy: {out / 'README.md'} says what to do) and {grader} (the grader, "
              f"for the instructor); grade with: python -m kvt.teach.course grade {out} --grader {grader}")
    elif args.command == "grade":
        earned, total = grade(args.folder, args.grader)
        if earned < total:
            sys.exit(1)


if __name__ == "__main__":
    from kvt.cli import entry
    entry(["course", *sys.argv[1:]])
