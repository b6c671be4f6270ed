"""Every command README.md, tutorial.md and docs/*.md show runs (a slow check). test_docs.shown_commands
finds them (inline `code` in prose aside: its docstring says why); RULES says, for each, either how it runs
here, offline, on the shipped toy weights or the SmolLM2 build, with smaller sizes where a flag allows, and
the line it must print and the files it must write, with its exit status (0, or 1 where the doc says so); or
why it is not run (the weights, GPU or network it needs, the hours it takes, and the test that runs the same
code), which is the test's skip reason (`-rs` lists them). A shown command that no rule matches fails, so a
command added to the docs cannot go unchecked (test_docs.test_commands_parse only parses the ```bash ones).

Where they run: `folder`, a stand-in for the repository in a temporary folder, so what a command writes
(runs/, docs/figures/, weights/<sibling>, hw1) lands there and the repository is never written to (each
run checks `git status`); ../shared beside it; HOME and the Hugging Face caches inside it, the hub offline.

Shared runs: a run is kept by its final argv and environment, so commands the smaller sizes make equal run
once (README.md:70 and docs/real-weights.md:50 are the same command; the three tests.bench_models commands
and the three SmolLM2 tests.bench_eval ones each become one). Besides, sharing by choice:
- the kvt.harness.bench commands (qwen3-0.6b:1.7b, and 1.7b:4b, which needs 16 GB) differ in scope, dtype, lengths,
  repeats, --both, --recompute, --json and OMP_NUM_THREADS; they share one run (BENCH: head scope, bf16,
  64 tokens, with --both and --recompute), since building the random models is most of the cost (6 GB,
  minutes on 2 cores) whatever the length; its JSON stands in where a later command reads another (figures
  scaling, cascade);
- the run.py commands on the SmolLM2 siblings (depth15 or ffn768, either direction) share one run of
  depth15 -> parent (SMOL_PAIR), on the sibling the family build command makes here with a healing budget
  of 256 tokens, one step (HEAL), instead of 0.5M (1-2 hours); the two build commands (depth, width) share
  that one build (each costs minutes even so; tests/test_family.py builds both kinds from a tiny model).

Time: 430 s wall, 386 + 27 s CPU, for `python -m pytest -m slow tests/test_commands.py -q --durations=40`
on 2 shared cores of an Intel Xeon (AMX), load average 4 to 6 from other jobs: 54 commands run (27 runs),
22 not run (two of the 54 failed at once then, on slips in RULES since fixed; their runs take seconds).
The dearest: README.md:70 (the sibling's build and its run) 188 s, the shared kvt.harness.bench run 60 s, the
SmolLM2 tests.bench_eval run 52 s, the tests.bench_models run 35 s; the rest 12 s or less each.
"""
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path

import pytest

from test_docs import LINKED, ROOT, shown_commands

pytestmark = pytest.mark.slow
SHARED = Path(os.environ.get("KVT_SHARED", ROOT.parent / "shared"))


@dataclass
class Run:
    """Run the command with `sizes` set (flag: value; True: a bare flag; None: the flag dropped), after the
    commands in `needs` (run by their own rules); it must exit with `status`, print a line matching `shows`, and write a
    file matching each glob in `writes` (relative to FOLDER). `edit` rewrites what a flag cannot (a placeholder)."""
    shows: str
    writes: tuple = ()
    sizes: dict = field(default_factory=dict)
    needs: tuple = ()
    edit: object = None  # argv -> argv
    status: int = 0
    env: bool = True  # whether the command's VAR=value prefix applies (False: shared with commands without it)


@dataclass
class NotRun:
    """Not run here, for this reason (a test named in it runs the same code)."""
    reason: str


TOY = {"--calib-seqs": "8", "--calib-len": "64", "--limit": "4", "--bench-lengths": "64"}
SMOL = {**TOY, "--tasks": "hellaswag,arc_easy", "--limit": "2", "--task-limit": None, "--candidates": "4", "--k": "2"}
SMOL_PAIR = {"--source": "weights/smollm2-135m-depth15", "--target": "weights/smollm2-135m", **SMOL,
             "--recompute-frac": None, "--no-bench": True, "--out": "runs/smol_depth15_to_parent"}
HEAL = {"--kind": "depth", "--out": "weights/smollm2-135m-depth15", "--tokens": "256", "--seq-len": "128",
        "--batch": "2", "--score-seqs": "2", "--score-len": "128", "--windows": "2", "--window-len": "128"}
BENCH = {"--pair": "qwen3-0.6b:1.7b", "--scope": "head", "--lengths": "64", "--repeats": "1",
         "--dtype": "bfloat16", "--both": True, "--recompute": "0.1", "--lean": None, "--json": "runs/bench.json"}
DEPTH15 = "python -m kvt.teach.family build --parent weights/smollm2-135m --kind depth --out weights/smollm2-135m-depth15"
RECOMPUTE = ("python run.py --pair toy-s:l --scope head --no-bench --out runs/rc_s_l_head_0",  # budget 0 and 10%
             "python run.py --pair toy-s:l --scope head --no-bench --recompute-frac 0.1 "
             "--out runs/rc_s_l_head_attention_0.10")
SMOL_RUN = ("python run.py --source weights/smollm2-135m-depth15 --target weights/smollm2-135m "
            "--data-dir ../shared/data --calib ../shared/data/calib/wikitext-2 --no-bench")  # = README.md:70's run
SOLVED = "python -m kvt.teach.course make --assignment NAME --out /tmp/c/NAME --solution"
EVAL_AGREE = r"^batch \d+ vs 1: largest loglikelihood difference \S+"
WROTE_RUN = r"^wrote \S+report\.md and \S+results\.json$"
ANY_BENCH = "python -m kvt.harness.bench --pair qwen3-0.6b:1.7b --scope head"


def bench_json(argv):
    """argv reading BENCH's JSON where it reads another kvt bench --json file."""
    return [a if not re.match(r"runs/bench-.*\.json", a) else BENCH["--json"] for a in argv]


IN_CI = "CI's own pytest runs (.ci/run: the default run, then -m slow) run this file"

ENV = r"(?:[A-Z_]+=\S+ )*"  # a command's VAR=value prefix, which a pattern may leave out
RULES = [  # (pattern the command must match in full after any ENV, what is done); the first that matches
    (r"pip install .*", NotRun("installs packages: needs the network (.ci/run installs them)")),
    (r"bash \.ci/run", NotRun("is CI itself: installs from the network, then runs the test suite, this file too")),
    (r"python -m pytest .*", NotRun(IN_CI)),
    (r"python run\.py", Run(WROTE_RUN, ("runs/*/report.md", "runs/*/results.json"), TOY)),
    (r"python run\.py --tasks none --no-bench",   # the mapper the router's stack takes (docs/serving.md)
     Run(WROTE_RUN, ("runs/toy-s_toy-m/mapper-*.safetensors",), {"--calib-seqs": "10", "--calib-len": "64"})),
    # (not TOY's 8 sequences: `python run.py` above fits that mapper in the same folder, and this one reused it)
    (r"python run\.py --pair qwen3-14b:32b .*|torchrun .*",
     NotRun("needs weights/qwen3-14b and weights/qwen3-32b (about 92 GB, downloaded) and GPUs; "
            "docs/headline-run.md:202 rehearses the same path on random weights of 3 and 4 layers")),
    (r"python run\.py --source weights/qwen3-0\.6b .*",
     NotRun("needs weights/qwen3-0.6b and weights/qwen3-1.7b from the Hugging Face hub (no network here)")),
    (r"python run\.py --source DIR .*",
     NotRun("a template: DIR, my_tasks.py and data/pets are the reader's; tests/test_tasks.py::"
            "test_every_kind_runs_through_run_main runs a --task-file of every kind through run.py")),
    (r"python run\.py --source weights/smollm2-135m(-depth15|-ffn768)? "
     r"--target weights/smollm2-135m(-depth15|-ffn768)? .*",
     Run(WROTE_RUN, ("runs/smol_depth15_to_parent/results.json",), SMOL_PAIR, needs=(DEPTH15,))),
    (r"python run\.py --pair toy-s:l --scope head --no-bench .*",
     Run(WROTE_RUN, ("runs/rc_s_l_head_*/results.json",), TOY)),
    (r"python -m kvt\.harness\.bench --pair qwen3-(0\.6b:1\.7b|1\.7b:4b) .*",
     Run(r"^qwen3-0\.6b:1\.7b, head scope, k=8, bfloat16 on .*peak memory", ("runs/bench.json",), BENCH, env=False)),
    (r"python -m kvt\.harness\.figures scaling .*",
     Run(r"^wrote \S+\.png$", ("docs/figures/scaling-qwen3-0.6b-1.7b.png",), needs=(ANY_BENCH,), edit=bench_json)),
    (r"python -m kvt\.harness\.figures recompute .*",
     Run(r"^wrote \S+\.png$", ("docs/figures/recompute-toy-s-l-head.png",), needs=RECOMPUTE)),
    (r"python -m kvt\.harness\.figures gate .*", Run(r"^gate fitted on all runs", ("docs/figures/gate-evidence.png",),
                                            needs=("python run.py", *RECOMPUTE, SMOL_RUN))),
    (r"python -m kvt\.harness\.repairs --source weights/toy-s --target weights/toy-m .*",
     Run(r"^wrote runs/repairs-\S+/report\.md", ("runs/repairs-*/report.md", "runs/repairs-*/repairs.json"),
         {"--calib-seqs": "8", "--limit": "2", "--agree-prompts": "2", "--budgets": "0,0.5"})),
    (r"python -m kvt\.harness\.repairs --source weights/smollm2-135m\S* .*",
     NotRun("needs the -32k SmolLM2 siblings (docs/real-weights.md: minutes each to build) and about half an hour "
            "on 2 cores; tests/test_repairs.py::test_the_side_by_side_command_at_a_small_size runs the same code "
            "on the toy pair")),
    (r"python -m kvt\.harness\.figures r2 --pair toy-m:l --k 1", Run(r"^toy-m -> toy-l: validation R\^2 of each target layer")),
    (r"python -m kvt\.teach\.cascade .*",
     Run(r"^cascade over \d+ items", sizes={"--tokens": BENCH["--lengths"]}, needs=RECOMPUTE + (ANY_BENCH,),
         edit=bench_json)),
    (r"python -m kvt\.teach\.family build --parent weights/smollm2-135m --kind (depth|width) --out \S+",
     Run(r"^weights/smollm2-135m-\S+: (depth|width) sibling, (.*\n)*  perplexity ", sizes=HEAL,
         writes=("weights/smollm2-135m-*/model.safetensors", "weights/smollm2-135m-*/family.json"))),
    (r"python -m kvt\.harness\.toy train --out weights",
     Run(r"^toy-s +\d+ +20 ", ("toy/toy-s/model.safetensors",),
         {"--out": "toy", "--members": "toy-s", "--max-steps": "20"})),
    (r"(kvt plan|python -m kvt\.harness\.costs) .*",
     Run(r"^(memory plan: \S+ -> \S+ on \d+ x H[12]00 |qwen3-14b:32b: GiB the fullest device needs)")),
    (r"python -m kvt\.teach\.course list", Run(r"^rope: .*, 12 points$")),
    (r"python -m kvt\.teach\.course make --assignment rope --out hw1",
     Run(r"^wrote hw1 .*; grade with: python -m kvt\.teach\.course grade hw1 --grader hw1-grader$",
         ("hw1/kvt/rope.py", "hw1-grader/test_rope.py"))),
    (r"python -m kvt\.teach\.course make --assignment NAME --out /tmp/c/NAME --solution",
     Run(r"^wrote rope-solved \(the student copy", ("rope-solved/README.md", "rope-solved-grader/test_rope.py"),
         {"--out": "rope-solved"},
         edit=lambda argv: [a.replace("NAME", "rope") for a in argv])),
    (r"python -m kvt\.teach\.course grade hw1 --grader hw1-grader",  # a fresh student copy: below full marks, exit 1
     Run(r"^ +\d+ / 12 +total$", status=1, needs=("python -m kvt.teach.course make --assignment rope --out hw1",))),
    (r'/usr/bin/time -f "%e s wall, %U \+ %S s CPU" python -m kvt\.teach\.course grade /tmp/c/NAME '
     r'--grader /tmp/c/NAME-grader',
     Run(r"^ +12 / 12 +total$(.*\n)*.* s wall, .* s CPU", needs=(SOLVED,),
         edit=lambda argv: [a.replace("/tmp/c/NAME", "rope-solved") for a in argv])),
    (r"OMP_NUM_THREADS=1 python -m tests\.exercises",
     NotRun("all five exercises, minutes on one thread: tests/test_course.py::"
            "test_the_exercises_answers_hold_and_match_docs runs them and compares them with the block below it; "
            "docs/course.md:10 runs exercise 1 through the command here")),
    (r"python -m tests\.exercises",
     Run(r"^exercise 1: .*\n(.*\n)*  holds: ", sizes={"--exercise": "1"})),
    (r"python -m tests\.bench_models .*",
     Run(r"^\| decode 2 \| float32 \| 64 \| ", sizes={"--tokens": "64", "--decode": "2", "--repeats": "1",
                                                      "--dtypes": "float32"})),
    (r"python -m tests\.bench_weights .*",
     Run(r"^\| check_pair_weights, digests kept \(x100\) +\| ", sizes={"--folder": "weights/toy-m", "--repeats": "1"})),
    (r"python -m tests\.bench_fast apply .*", Run(r"^\| fast\.apply \(tiles of \d+\) \| ", sizes={"--tokens": "64", "--repeats": "1"})),
    (r"python -m tests\.bench_eval( --repeats 3)?", Run(EVAL_AGREE, sizes={"--repeats": "1", "--limit": "4"})),
    (r"python -m tests\.bench_eval --source weights/smollm2-135m .*",
     Run(EVAL_AGREE, sizes={"--tasks": "arc_easy", "--limit": "2", "--repeats": "1", "--batches": "1,2",
                                 "--max-new-tokens": None, "--dtype": None})),
    (r"python -m tests\.gpu_check --device cpu --small --only headline --out /tmp/gpu",
     NotRun("every task of the paper through run.py on 3 and 4 layers of Qwen3-0.6B's width and vocabulary: "
            "1,314 s on 2 cores (docs/headline-run.md) and no smaller size; run.py's path runs here on the toy "
            "family (README.md:19) and on SmolLM2 (README.md:70)")),
    (r"python -m kvt\.integrations\.lm_eval (.*source=DIR.*|.*--tasks TASK .*|retention out/.*)",
     NotRun("a template (DIR, TASK, out/ are the reader's); docs/lm-eval.md:90-92 show it filled in for SmolLM2 "
            "(not run either, below)")),
    (r"bash docs/lm-eval/smollm2-self\.sh (target|transfer)",
     NotRun("three harness tasks on SmolLM2 with a mapper calibrated on 16 x 256 tokens: minutes each on 2 cores "
            "and no size flag; tests/test_lm_eval.py::test_exact_pair_keeps_everything_through_the_command runs "
            "python -m kvt.integrations.lm_eval end to end")),
    (r"python -m kvt\.integrations\.lm_eval retention runs/lmeval-smollm2-self/.*",
     NotRun("reads the folders of docs/lm-eval.md:90-91, not run here (above); tests/test_lm_eval.py::"
            "test_retention_pairs_by_doc_id runs retention")),
    (r"python -m tests\.bench_fits run --out runs/fits-toy .*",
     Run(r"^\| toy-s -> toy-m \| head-attn \| toy corpus \(seed 98\) 128: ", ("runs/fits-toy/*/results.json",),
         edit=lambda argv: [a if argv[i - 1] != "--pairs" else "toy-s:m" for i, a in enumerate(argv)]  # one pair,
         + ["--calib-seqs", "8", "--calib-len", "64", "--limit", "4", "--nll-windows", "2"])),   # sizes to run.py
    (r"python -m tests\.bench_fits table runs/fits-toy",
     Run(r"^\| toy-s -> toy-m \| paper \| ", needs=("python -m tests.bench_fits run --out runs/fits-toy --pairs "
                                                   "toy-s:m,toy-m:s,toy-m:l,toy-l:m,toy-s:l,toy-l:s -- --heldout toy "
                                                   "--no-bench",))),
    (r"python -m kvt\.teach\.family build --parent weights/smollm2-135m --kind (depth|width) --out \S+-32k --tokens 32768 "
     r"--threads 1",
     NotRun("the family build of docs/real-weights.md:15-16 with a 32K-token budget (30 minutes each on 2 cores); "
            "that command runs here at 256 tokens, and tests/test_family.py builds both kinds")),
    (r"python run\.py --source weights/smollm2-135m-depth15-32k .*|python -m tests\.bench_fits table runs/fits-smollm2",
     NotRun("needs the 32K-healed sibling (above); the same three fits run here on toy-s -> toy-m through "
            "tests.bench_fits (its rule), and the SmolLM2 run.py path on the 256-token sibling")),
    (r"python -m venv \.\./venv-vllm",
     NotRun("vLLM's own environment, installed from the network (docs/serving.md); tests/test_vllm.py's slow "
            "tests build the same one (or take KVT_VLLM_PYTHON) and run the connector in it")),
    (r"python -m kvt\.integrations\.router stack .*",
     NotRun("starts two vLLM servers: needs vLLM's environment (docs/serving.md); tests/test_router.py::"
            "test_the_stack_on_the_toy_pair runs this command on a mapper from the run.py command before it")),
    (r"python -m kvt\.integrations\.router serve .*",
     NotRun("routes until stopped, for two vLLM servers already running; tests/test_router.py routes through "
            "the same server against fake ones")),
    (r"python -m tests\.bench_router .*",
     NotRun("starts the vLLM stack for minutes (KVT_VLLM_PYTHON); tests/test_router.py::"
            "test_the_stack_on_the_toy_pair starts the same stack and sends the same escalated requests")),
    (r"python -m tests\.bench_serving .*",
     NotRun("needs that vLLM environment (KVT_VLLM_PYTHON); tests/test_vllm.py::"
            "test_target_engine_equals_kvt_handoff runs the same engines through the connector")),
    (r"python tests/test_tutorial\.py > /tmp/tutorial\.py",  # the script is its output: not written to /tmp
     Run(r"^# ---- tutorial\.md:\d+$", edit=lambda argv: argv[:2])),
]


def rule_for(command):
    """The first rule whose pattern matches the command; None when none does."""
    return next((what for pattern, what in RULES if re.fullmatch(ENV + f"(?:{pattern})", command)), None)


def sized(argv, sizes):
    """argv with each flag of sizes dropped (with its value), then appended with the new value."""
    argv = list(argv)
    for flag, value in sizes.items():
        if flag in argv:
            i = argv.index(flag)
            del argv[i:i + 1 + (i + 1 < len(argv) and not argv[i + 1].startswith("--"))]
        if value is not None:
            argv += [flag] if value is True else [flag, value]
    return argv


def expanded(word, root):
    """[word], or the paths under root it matches when it is a glob (runs/*/results.json), as a shell does."""
    found = sorted(str(path.relative_to(root)) for path in root.glob(word)) if "*" in word else []
    return found or [word]


@pytest.fixture(scope="session")
def folder(tmp_path_factory):
    """A stand-in for the repository: its entries linked, docs/ copied and weights/ a folder of links (so
    that what a command writes there stays here), no runs/; ../shared beside it."""
    base = tmp_path_factory.mktemp("commands")
    (base / "shared").symlink_to(SHARED)
    (base / "home").mkdir()
    root = base / "repo"
    root.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "docs", "weights", "runs") and not entry.name.startswith("."):
            (root / entry.name).symlink_to(entry)
    (root / "docs").mkdir()
    for entry in (ROOT / "docs").iterdir():
        if entry.name == "figures":  # a folder of its own: figures are written there
            (root / "docs" / "figures").mkdir()
        else:
            (root / "docs" / entry.name).symlink_to(entry)
    (root / "weights").mkdir()
    for entry in (ROOT / "weights").iterdir():
        (root / "weights" / entry.name).symlink_to(entry)
    return root


def git_status():
    return subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout


RAN = {}  # (argv, env) -> (exit status, stdout and stderr, files written): a run shared by equal commands


def execute(command, root):
    """Run a command as its rule says (its needs first); returns (exit status, output, files written)."""
    rule = rule_for(command)
    assert isinstance(rule, Run), f"{command!r} is needed by another command but has no rule that runs it"
    for need in rule.needs:
        status, output, _ = execute(need, root)
        assert status == rule_for(need).status, f"needed first: {need}\n{output[-3000:]}"
    prefix = re.match(ENV, command).group(0)  # OMP_NUM_THREADS=1 ...: set for this command only
    env = dict(w.split("=", 1) for w in prefix.split()) if rule.env else {}
    argv = [w for w in shlex.split(command[len(prefix):]) if not w.startswith("[") and not w.endswith("]")]
    argv = sized(argv, rule.sizes)  # (above: an option shown in [brackets] is left out)
    argv = rule.edit(argv) if rule.edit else argv
    key = (tuple(argv), tuple(sorted(env.items())))
    if key not in RAN:
        home = root.parent / "home"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("KVT_", "HF_", "OMP_"))}
        env = {**base, "HOME": str(home), "HF_HOME": str(home / "hf"), "XDG_CACHE_HOME": str(home / "cache"),
               "MPLCONFIGDIR": str(home / "mpl"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "PYTHONDONTWRITEBYTECODE": "1", **env}
        run = [sys.executable, *argv[1:]] if argv[0] == "python" else \
              [sys.executable, "-m", "kvt.cli", *argv[1:]] if argv[0] == "kvt" else argv
        run = [w for word in run for w in expanded(word, root)]
        start = time.time()
        p = subprocess.run(run, cwd=root, env=env, capture_output=True, text=True, timeout=900)
        written = [str(path.relative_to(root)) for path in root.rglob("*")
                   if path.is_file() and not path.is_symlink() and path.stat().st_mtime >= start]
        RAN[key] = (p.returncode, p.stdout + p.stderr, written)
    return RAN[key]


SHOWN = [(doc, n, c) for doc in LINKED for n, c in shown_commands(doc)]
IDS = [f"{d.name}:{n}" + "+" * [(e, m) for e, m, _ in SHOWN[:i]].count((d, n)) for i, (d, n, _) in enumerate(SHOWN)]


@pytest.mark.parametrize("doc, line, command", SHOWN, ids=IDS)
def test_shown_command_runs(doc, line, command, folder):
    """A documented command that crashes (`kvt course answers` did, with a TypeError), exits non-zero, or no
    longer prints the line or writes the file its doc promises fails here; so does a shown command that no
    rule in RULES accounts for, and one that writes into the repository."""
    rule = rule_for(command)
    assert rule is not None, f"{doc.name}:{line}: {command}\nno rule in tests/test_commands.py RULES: add one"
    if isinstance(rule, NotRun):
        pytest.skip(f"not run: {rule.reason}")
    before = git_status()
    status, output, written = execute(command, folder)
    assert git_status() == before, f"{command} changed the repository:\n{git_status()}"
    assert status == rule.status, f"{doc.name}:{line}: {command}\nexit status {status}\n{output[-4000:]}"
    assert re.search(rule.shows, output, re.M), f"{doc.name}:{line}: no {rule.shows!r} in\n{output[-4000:]}"
    missing = [g for g in rule.writes if not any(fnmatch(w, g) for w in written)]
    assert not missing, f"{doc.name}:{line}: {command}\nwrote nothing matching {missing}; wrote {written}"


def test_every_rule_is_used():
    """A rule left behind after its command left the docs (or a pattern that no longer matches) fails here."""
    needed = [n for _, rule in RULES if isinstance(rule, Run) for n in rule.needs]
    used = {id(rule_for(c)) for c in [c for _, _, c in SHOWN] + needed}
    unused = [p for p, r in RULES if id(r) not in used]
    assert not unused, unused
