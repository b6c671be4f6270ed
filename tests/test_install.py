"""kvt installs: `pip install .` and `pip install -e .` from a fresh clone give a `kvt` command that runs
from any folder, with the toy family it ships. Guards: a pyproject that misses a module or the toy
weights, a default path that only works from the repository root, a console script that fails, and a
test venv that sees the base interpreter's packages rather than those of the venv the suite runs in."""
import subprocess
import sys

import pytest

from tests.conftest import ROOT

ARGS = ["run", "--no-bench", "--limit", "3", "--calib-seqs", "6", "--calib-len", "64", "--tasks", "toy_recall"]


def sh(*cmd, cwd=None):
    p = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, cwd=cwd)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    return p.stdout


@pytest.mark.parametrize("editable", [False, True], ids=["install", "editable"])
def test_installed_kvt_runs_from_any_folder(tmp_path, editable):
    clone, env, elsewhere = tmp_path / "clone", tmp_path / "env", tmp_path / "elsewhere"
    sh("git", "clone", "-q", ROOT, clone)
    for f in ("kvt", "pyproject.toml", "run.py", "README.md"):              # the working tree, committed or not
        sh("cp", "-r", ROOT / f, clone)
    sh(sys.executable, "-m", "venv", env)
    # torch and friends from this interpreter, wherever it has them: its own site-packages in a user's venv
    # (--system-site-packages would expose the base interpreter's instead, without torch), the system's in CI
    found = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    (next(env.glob("lib/python*/site-packages")) / "parent-interpreter.pth").write_text("\n".join(found) + "\n")
    sh(env / "bin" / "pip", "install", "-q", "--no-deps", *(["-e"] if editable else []), clone)
    elsewhere.mkdir()
    out = sh(env / "bin" / "kvt", *ARGS, cwd=elsewhere)
    assert "toy_recall" in out and (elsewhere / "runs" / "toy-s_toy-m" / "results.json").exists()
    where = sh(env / "bin" / "python", "-c", "import kvt; print(kvt.__file__)", cwd=elsewhere)
    assert (str(clone) in where) == editable
    p = subprocess.run([env / "bin" / "kvt", "run", "--k", "0"], capture_output=True, text=True, cwd=elsewhere)
    assert p.returncode == 2 and p.stderr.startswith("kvt: --k 0")
