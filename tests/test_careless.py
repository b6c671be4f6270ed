"""kvt's newer surfaces tried as a careless user would, and absurd but parseable numbers.

Absurd but parseable numbers to run.py (a lambda of 1e308, a gate threshold no KL reaches, batch sizes of
10^9, lengths past max_position_embeddings), bad model_args to `python -m kvt.integrations.lm_eval`, `kvt plan` on
pairs and counts that mean nothing, `kvt course grade` on a tampered grader or a student copy that does
not parse, `kvt cascade` on a folder or on records of another run, and the Hugging Face cache with a
broken refs/main, a missing shard or links into blobs that are gone. Each case ends in one line that says
what is wrong and what to do (a KvtError, which the commands print as `kvt: ...` with exit status 2), or
runs as stated; each table's docstring names the bug its rows guard. The rows are in docs/refusals.md.
"""
import json
import os
import shutil

import pytest
import torch

import kvt
from kvt.harness import pipeline as run
from kvt.config import KvtError
from tests.conftest import QWEN3_CONFIG, ROOT, SHARED, calib_of, hub_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = ["--tasks", "toy_recall", "--limit", "4", "--calib-seqs", "12", "--calib-len", "40", "--k", "2", "--no-bench"]


def one_line(e, words):
    msg = str(e.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in: {msg}"
    return msg


def argv(tiny_pair, tmp, *extra):
    return ["--source", str(tiny_pair / "source"), "--target", str(tiny_pair / "twin"), "--out", str(tmp)] + ARGS + \
        list(extra)


# ---- run.py: absurd but parseable numbers -------------------------------------------------------------------

RUN_CASES = [
    ("lam 1e308", ["--lam", "1e308"], ["--lam 1e+308", "above 10000 the ridge shrinks the map to nearly zero",
                                      "give at most 10000"]),
    ("lam 1e5", ["--lam", "1e5"], ["--lam 100000", "give at most 10000"]),
    ("lam inf", ["--lam", "inf"], ["--lam inf", "positive number"]),
    ("nll-context not a number", ["--heldout", "toy", "--nll-context", "1k"], ["--nll-context '1k'", "e.g. 1024,4096"]),
    ("nll-context 0", ["--heldout", "toy", "--nll-context", "128,0"], ["--nll-context '128,0'", "at least 1 token"]),
    ("lam -0", ["--lam", "-0"], ["--lam -0.0", "positive number"]),
    ("max-kl negative", ["--max-kl", "-1"], ["--max-kl -1.0", "never negative"]),
    ("min-attn-cos 2", ["--min-attn-cos", "2"], ["--min-attn-cos 2.0", "within [-1, 1]"]),
    ("min-attn-cos -1.5", ["--min-attn-cos", "-1.5"], ["--min-attn-cos -1.5", "within [-1, 1]"]),
    ("batch-size 0", ["--batch-size", "0"], ["--batch-size 0", "at least 1"]),
    ("batch-size negative", ["--batch-size", "-5"], ["--batch-size -5", "at least 1"]),
    ("context 10^9", ["--context", "1000000000"], ["1000000000 tokens exceeds the models' limit of 1024", "--context"]),
    ("calib-len 10^9", ["--calib-len", "1000000000"], ["1000000000 tokens exceeds", "--calib-len"]),
    ("bench-lengths 10^9", ["--bench", "--bench-lengths", "1000000000"], ["1000000000 tokens exceeds",
                                                                          "shorter --bench-lengths"]),
    ("recompute-frac just above 1", ["--recompute-frac", "1.0000001"], ["--recompute-frac 1.0000001", "within [0, 1]"]),
    ("recompute-frac nan", ["--recompute-frac", "nan"], ["--recompute-frac nan", "within [0, 1]"]),
    ("recompute-last negative", ["--recompute-last", "-3"], ["--recompute-last -3", "at least 0"]),
    ("calib-seqs 10^9", ["--calib-seqs", "1000000000"], ["are asked for", "ask for fewer or shorter sequences"]),
]


@pytest.mark.parametrize("case", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_absurd_numbers_to_run_are_one_line(tiny_pair, tmp_path, case):
    """Guards: --lam 1e308 fitting a near-zero mapper that the gate then judged (and the run reported as if it
    were a fit), --max-kl -1 and --min-attn-cos 2 making a gate no mapper passes, or every one fail, without a
    word; --nll-context 1k ending, after calibration and every task, in a ValueError traceback. The other
    rows held already and guard their checks."""
    _, extra, words = case
    with pytest.raises(KvtError) as e:
        run.main(argv(tiny_pair, tmp_path / "out", *extra))
    one_line(e, words)


def test_absurd_sizes_run_as_stated(tiny_pair, tmp_path):
    """--batch-size 10^9 and --limit 10^9 run (a batch holds at most the items there are; a task has at most
    its items), --k 99 on a 3-layer source maps each target layer from all 3 layers and says k=3, and
    --recompute-frac 1 recomputes every slot: the transfer scores exactly as the target's own prefill.
    Guards an allocation of 10^9 rows, an IndexError past the last layer, and a recompute of "all" that
    leaves a slot mapped."""
    results = run.main(argv(tiny_pair, tmp_path / "big", "--batch-size", "1000000000", "--limit", "1000000000",
                            "--k", "99", "--recompute-frac", "1"))
    assert results["k_used"] == 3 and "k=3" in (tmp_path / "big" / "report.md").read_text()
    n = results["tasks"]["toy_recall"]["target"]["n"]
    assert n == len(results["items"]["toy_recall"]) > 4
    records = [json.loads(line) for f in (tmp_path / "big").glob("records-*") for line in f.read_text().splitlines()]
    by = {(r["condition"], r["id"]): r for r in records if "task" in r}
    for (cond, id_), r in by.items():
        if cond == "transfer":
            torch.testing.assert_close(r["lls"], by["target", id_]["lls"], rtol=1e-4, atol=1e-4)


# ---- python -m kvt.integrations.lm_eval: model_args -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lm(tiny_pair, tmp_path_factory):
    """KvtLM, and a mapper file fitted on toy-s -> toy-m (another pair than tiny_pair's)."""
    pytest.importorskip("lm_eval")
    from kvt.harness import toy
    from kvt.harness.data import calibration_sequences
    from kvt.integrations.lm_eval import KvtLM
    from kvt.harness.calibration import CalibrationOptions, calibrate
    from kvt.harness.files import save_mapper
    tok = kvt.load_tokenizer(ROOT / "weights" / "toy-m")
    calib = calibration_sequences(None, tok, 12, 40, documents=toy.corpus(100, seed=99))
    mapper, _ = calibrate(*(kvt.load_model(ROOT / "weights" / n) for n in ("toy-s", "toy-m")), calib, k=1,
                          options=CalibrationOptions(progress=False))
    path = tmp_path_factory.mktemp("lm") / "toy.safetensors"
    save_mapper(mapper, path)
    return KvtLM, path


S, T = "SRC", "TGT"
LM_CASES = [
    ("unknown key", f"source={S},target={T},conditon=transfer", ["unknown key 'conditon'", "kvt's keys are source"]),
    ("misspelt source key", f"srouce={S},target={T},condition=transfer", ["unknown key 'srouce'", "kvt's keys are"]),
    ("missing source", f"target={T},condition=transfer", ["need source=DIR,target=DIR", "condition=target needs only"]),
    ("missing target", f"source={S},condition=transfer", ["need source=DIR,target=DIR"]),
    ("nothing", "", ["need source=DIR,target=DIR"]),
    ("condition misspelt", f"source={S},target={T},condition=transfr", ["condition=transfr", "use one of target"]),
    ("recompute_frac 1.5", f"source={S},target={T},condition=transfer,recompute_frac=1.5",
     ["recompute_frac=1.5", "within [0, 1]"]),
    ("recompute_frac negative", f"source={S},target={T},condition=transfer,recompute_frac=-0.1",
     ["recompute_frac=-0.1", "within [0, 1]"]),
    ("recompute_frac text", f"source={S},target={T},condition=transfer,recompute_frac=abc",
     ["recompute_frac=abc", "give a number"]),
    ("recompute_frac nan", f"source={S},target={T},condition=transfer,recompute_frac=nan",
     ["recompute_frac=nan", "give a number"]),
    ("recompute_last negative", f"source={S},target={T},condition=transfer,recompute_last=-1",
     ["recompute_last=-1", "at least 0"]),
    ("recompute_last fraction", f"source={S},target={T},condition=transfer,recompute_last=2.5",
     ["recompute_last=2.5", "give an integer"]),
    ("recompute_by misspelt", f"source={S},target={T},condition=transfer,recompute_by=atention",
     ["recompute_by=atention", "attention, suffix"]),
    ("recompute without transfer", f"target={T},condition=target,recompute_frac=0.5",
     ["needs condition=transfer", "condition=target"]),
    ("mapper without transfer", f"source={S},target={T},mapper=MAPPER", ["needs condition=transfer"]),
    ("mapper missing", f"source={S},target={T},condition=transfer,mapper=NOFILE", ["no such file",
                                                                                   "leave mapper out to calibrate"]),
    ("mapper of another pair", f"source={S},target={T},condition=transfer,mapper=MAPPER",
     ["was fitted for another source model", "recalibrate for this pair"]),
    ("max_length 0", f"target={T},max_length=0", ["max_length=0", "at least 2"]),
    ("max_length past the models", f"target={T},max_length=100000000",
     ["max_length=100000000", "at most 1024 positions"]),
    ("dtype unknown", f"target={T},dtype=float8", ["dtype=float8", "float32, bfloat16 or float16"]),
    ("device unknown", f"target={T},device=tpu", ["unknown device 'tpu'"]),
    ("batch_size 0", f"target={T},batch_size=0", ["batch_size 0", "at least 1"]),
    ("rolling_context 0", f"target={T},rolling_context=0", ["rolling_context=0", "at least 1"]),
    ("rolling_context text", f"target={T},rolling_context=many", ["rolling_context=many", "give an integer"]),
    ("pair malformed", "pair=toy-s", ["--pair 'toy-s'", "e.g. qwen3-14b:32b"]),
    ("source not a folder", f"source=NOWHERE,target={T},condition=transfer", ["no checkpoint folder", "get it with"]),
    ("calib_seqs 0", f"source={S},target={T},condition=transfer,calib_seqs=0", ["calib_seqs=0", "at least 1"]),
]


@pytest.mark.parametrize("case", LM_CASES, ids=[c[0] for c in LM_CASES])
def test_bad_model_args_are_one_line(lm, tiny_pair, tmp_path, case):
    """Guards: an unknown or misspelt key (conditon=transfer) ending in a TypeError traceback; device= in
    model_args colliding with the harness's own --device (TypeError); recompute_frac=1.5, -0.1 or abc,
    recompute_last=-1 and max_length past the models accepted and failing (or silently clamped) only after
    the models loaded and a mapper was calibrated; a budget under condition=target silently ignored."""
    KvtLM, mapper = lm
    _, spec, words = case
    spec = (spec.replace("SRC", str(tiny_pair / "source")).replace("TGT", str(tiny_pair / "twin"))
            .replace("NOFILE", str(tmp_path / "nope.safetensors")).replace("MAPPER", str(mapper))
            .replace("NOWHERE", str(tmp_path / "nowhere")))
    with pytest.raises(KvtError) as e:
        KvtLM.create_from_arg_string(spec, {"batch_size": None, "max_batch_size": None, "device": "cpu"})
    one_line(e, words)


def test_model_args_device_wins_over_the_harness_default(lm, tiny_pair):
    """Guards: device=cpu in model_args with the harness's --device also set ending in "got multiple values
    for keyword argument 'device'"."""
    KvtLM, _ = lm
    m = KvtLM.create_from_arg_string(f"target={tiny_pair / 'twin'},device=cpu", {"device": "cuda:0", "batch_size": 2})
    assert m._device == torch.device("cpu") and m.batch_size == 2


# ---- kvt plan ------------------------------------------------------------------------------------------------

PLAN_CASES = [
    ("count 0", ["--count", "0"], ["--count 0: must be at least 1"]),
    ("count negative", ["--count", "-2"], ["--count -2: must be at least 1"]),
    ("count 10^5", ["--count", "100000"], ["--count 100000", "give at most 128"]),
    ("two families", ["--pair", "qwen3-14b:llama3.1-8b"], ["two families (qwen3, llama)", "name two models of one family"]),
    ("two families, llama first", ["--pair", "llama3.1-8b:qwen3-32b"], ["two families (llama, qwen3)"]),
    ("unknown size", ["--pair", "qwen3-14b:99b"], ["unknown model 'qwen3-99b'", "known: qwen3-0.6b"]),
    ("toy pair", ["--pair", "toy-s:m"], ["unknown model 'toy-s'", "known:"]),
    ("one model", ["--pair", "qwen3-14b"], ["--pair 'qwen3-14b'", "e.g. qwen3-14b:32b"]),
    ("unknown task", ["--tasks", "nope"], ["no token counts for 'nope'", "hellaswag"]),
    ("tasks empty", ["--tasks="], ["no token counts for ''"]),
    ("context past the positions", ["--context", "1000000000"], ["--context 1000000000", "at most 40960 positions"]),
    ("calib-len past the positions", ["--calib-len", "100000"], ["--calib-len 100000", "at most 40960 positions"]),
    ("k past the layers", ["--k", "99"], ["--k 99", "qwen3-14b has 40 layers", "give at most that"]),
    ("k past the candidates", ["--k", "8", "--candidates", "4"], ["--k 8", "has 4 layers to select from"]),
    ("candidates past the layers", ["--candidates", "99"], ["--candidates 99", "has 40 layers"]),
]


@pytest.mark.parametrize("case", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_plan_refuses_what_it_cannot_plan(case):
    """Guards: kvt plan planning a qwen3 -> llama pair (no shared tokenizer: no transfer exists), a context of
    10^9 tokens or --k 99 on a 40-layer source as if they could run, an unknown task priced at a made-up
    1,000 tokens, and --count 10^5 ending in "RuntimeError: Invalid device string: 'cuda:-128'"."""
    from kvt.harness import costs as plan
    _, args, words = case
    with pytest.raises(KvtError) as e:
        plan.main(args)
    one_line(e, words)


def test_plan_unknown_device_is_argparses_one_line(capsys):
    """An unknown --device is argparse's error (exit 2) naming the choices."""
    from kvt.harness import costs as plan
    with pytest.raises(SystemExit) as e:
        plan.main(["--device", "a100"])
    assert e.value.code == 2 and "invalid choice: 'a100' (choose from 'h100', 'h200')" in capsys.readouterr().err


# ---- kvt course ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def assignment(tmp_path_factory):
    """A made rope assignment (student copy, grader) with the reference bodies kept (--solution)."""
    from kvt.teach import course
    root = tmp_path_factory.mktemp("course")
    return course.make("rope", root / "s", solution=True)


def tampered(grader, tmp_path, change):
    copy = tmp_path / "grader"
    shutil.copytree(grader, copy)
    change(copy)
    return copy


COURSE_CASES = [
    ("grader missing", lambda s, g, t: (s, t / "nope"), ["is not a kvt grader folder", "give the -grader folder"]),
    ("grader is the student copy", lambda s, g, t: (s, s), ["is not a kvt grader folder"]),
    ("student copy missing", lambda s, g, t: (t / "nope", g), ["no such folder", "kvt.teach.course make"]),
    ("expected values edited", lambda s, g, t: (s, tampered(g, t, lambda c: (c / "expected.safetensors").write_bytes(
        (c / "expected.safetensors").read_bytes()[:-8] + b"\0" * 8))), ["expected.safetensors was changed or removed",
                                                                         "make the assignment again"]),
    ("test file removed", lambda s, g, t: (s, tampered(g, t, lambda c: (c / "test_rope.py").unlink())),
     ["test_rope.py was changed or removed"]),
    ("grader grading.py edited", lambda s, g, t: (s, tampered(g, t, lambda c: (c / "grading.py").write_text("x = 1\n"))),
     ["grading.py was changed or removed"]),
    ("assignment.json names another assignment", lambda s, g, t: (s, tampered(
        g, t, lambda c: (c / "assignment.json").write_text(json.dumps({**json.loads((c / "assignment.json").read_text()),
                                                                       "assignment": "ridge"})))),
     ["test_ridge.py was changed or removed"]),
    ("student syntax error", lambda s, g, t: (student_copy(s, t, "\ndef broken(:\n    pass\n"), g),
     ["rope.py, line", "invalid syntax", "fix it and grade again"]),
]


def student_copy(student, tmp_path, tail):
    copy = tmp_path / "student"
    shutil.copytree(student, copy)
    with open(copy / "kvt" / "rope.py", "a") as f:
        f.write(tail)
    return copy


@pytest.mark.parametrize("case", COURSE_CASES, ids=[c[0] for c in COURSE_CASES])
def test_course_grade_refuses_a_bad_folder(assignment, tmp_path, case):
    """Guards: a grader whose expected values, test or checks were edited (or whose assignment.json names
    another assignment) grading against other answers, or every function "not run" with pytest's
    file-not-found; a student copy with a syntax error scored 0 everywhere with "SyntaxError: invalid
    syntax" and no file or line."""
    from kvt.teach import course
    student, grader = assignment
    _, make, words = case
    folder, g = make(student, grader, tmp_path)
    with pytest.raises(KvtError) as e:
        course.grade(folder, g, timeout=120)
    one_line(e, words)


def test_course_grade_stops_an_endless_loop(assignment, tmp_path, capsys):
    """A student's rope.rotate that never returns: every function is scored 0 with the reason, not a hang.
    (Held already; guards the grader's timeout.)"""
    from kvt.teach import course
    student, grader = assignment
    copy = student_copy(student, tmp_path, "\n\ndef rotate(x, cos, sin):\n    while True:\n        pass\n")
    earned, _ = course.grade(copy, grader, timeout=20)
    out = capsys.readouterr().out
    assert earned == 0 and "TimeoutError: the grader ran past 20 s" in out, out


@pytest.mark.parametrize("args,words", [
    (lambda s, t: ["nope", t / "a"], ["no assignment 'nope'", "the assignments are rope"]),
    (lambda s, t: ["rope", s], ["already exists and is not an empty folder", "give a new one"]),
    (lambda s, t: ["rope", t / "no" / "such" / "a"], ["does not exist", "create it first"]),
], ids=["unknown assignment", "out not empty", "parent missing"])
def test_course_make_refuses_a_bad_request(assignment, tmp_path, args, words):
    from kvt.teach import course
    with pytest.raises(KvtError) as e:
        course.make(*args(assignment[0], tmp_path))
    one_line(e, words)


# ---- kvt cascade -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tiny_pair, tmp_path_factory):
    """Two finished runs on tiny_pair (one with a recompute budget) and one on the identity pair."""
    root = tmp_path_factory.mktemp("cascade")
    pair = ["--source", str(tiny_pair / "source"), "--target", str(tiny_pair / "twin")]
    run.main(pair + ARGS + ["--out", str(root / "plain")])
    run.main(pair + ARGS + ["--out", str(root / "rc"), "--recompute-frac", "0.5"])
    run.main(["--source", str(tiny_pair / "source"), "--target", str(tiny_pair / "source")] + ARGS
             + ["--recompute-frac", "0.5", "--out", str(root / "other")])
    (root / "empty").mkdir()
    return root


def records(folder):
    return str(next(folder.glob("records-*")))


CASCADE_CASES = [
    ("a folder with no records", lambda r: [str(r / "empty")], ["is a folder with no records-*.jsonl",
                                                                "give the records-*.jsonl"]),
    ("a run folder", lambda r: [str(r / "plain")], ["is a folder; give one of its records files", "records-"]),
    ("recompute records of another pair", lambda r: [records(r / "plain"), "--recompute", records(r / "other")],
     ["holds records of mapper", "another pair or settings", "of the same run"]),
    ("recompute records without a budget", lambda r: [records(r / "plain"), "--recompute", records(r / "plain")],
     ["without a recompute budget", "--recompute-frac"]),
    ("an empty records file", lambda r: [str(r / "records-x.jsonl")], ["holds no records"]),
]


@pytest.mark.parametrize("case", CASCADE_CASES, ids=[c[0] for c in CASCADE_CASES])
def test_cascade_refuses_records_it_cannot_use(runs, case):
    """Guards: a run folder given for its records file answered "no such records file" (it is there), and
    --recompute records of another pair (or of a run without a budget) paired by item id with this run's,
    a cascade of two pairs reported as one."""
    from kvt.teach import cascade
    (runs / "records-x.jsonl").write_text("")
    _, args, words = case
    with pytest.raises(KvtError) as e:
        cascade.main(args(runs))
    one_line(e, words)


def test_cascade_runs_on_the_same_runs_recompute(runs, capsys):
    from kvt.teach import cascade
    table = cascade.main([records(runs / "plain"), "--recompute", records(runs / "rc"), "--frac", "0.5"])
    assert table and "recompute" in table[0]["accuracy"]


# ---- the Hugging Face cache -----------------------------------------------------------------------------------

@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A fresh cache (HF_HUB_CACHE) holding a tiny Qwen/Qwen3-14B as `hf download` leaves it, nothing else
    found: returns (repo folder, snapshot)."""
    if not (SHARED / "tokenizers" / "qwen3" / "tokenizer.json").exists():
        pytest.skip(f"no Qwen3 tokenizer at {SHARED}/tokenizers/qwen3")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot, _ = hub_checkpoint(tmp_path / "hub", "Qwen/Qwen3-14B", dict(QWEN3_CONFIG, vocab_size=256), seed=0)
    return snapshot.parent.parent, snapshot


def blob_of(snapshot, name):
    return (snapshot / name).resolve()


HUB_CASES = [
    ("refs/main names a missing commit", lambda repo, snap: (repo / "refs" / "main").write_text("0" * 40),
     ["refs/main names '0000", "which is no snapshot", "download again with: hf download Qwen/Qwen3-14B"]),
    ("refs/main empty", lambda repo, snap: (repo / "refs" / "main").write_text(""),
     ["refs/main names ''", "hf download Qwen/Qwen3-14B"]),
    ("two snapshots, no refs/main", lambda repo, snap: ((repo / "refs" / "main").unlink(),
                                                        shutil.copytree(snap, repo / "snapshots" / "other", symlinks=True)),
     ["holds 2 snapshots and no refs/main", "hf download Qwen/Qwen3-14B"]),
    ("a shard missing from the snapshot", lambda repo, snap: (snap / "model-00002-of-00002.safetensors").unlink(),
     ["shard model-00002-of-00002.safetensors is missing", "download again with: hf download Qwen/Qwen3-14B"]),
    ("a shard's blob gone", lambda repo, snap: blob_of(snap, "model-00001-of-00002.safetensors").unlink(),
     ["shard model-00001-of-00002.safetensors is missing", "hf download Qwen/Qwen3-14B"]),
    ("config.json's blob gone", lambda repo, snap: blob_of(snap, "config.json").unlink(),
     ["config.json links to", "which is gone", "download again with: hf download Qwen/Qwen3-14B"]),
    ("tokenizer.json's blob gone", lambda repo, snap: blob_of(snap, "tokenizer.json").unlink(),
     ["tokenizer.json links to", "which is gone", "download"]),
    ("the index's blob gone", lambda repo, snap: blob_of(snap, "model.safetensors.index.json").unlink(),
     ["has no model.safetensors (nor an index)", "hf download Qwen/Qwen3-14B"]),
]


@pytest.mark.parametrize("case", HUB_CASES, ids=[c[0] for c in HUB_CASES])
def test_a_broken_hub_cache_is_one_line(hub, case):
    """Guards: an empty refs/main taking the snapshots/ folder itself for the checkpoint; refs/main naming a
    commit with no snapshot (or two snapshots and no refs/main) answered "no checkpoint ... get it with: hf
    download" as if nothing were there; links into blobs/ that are gone answered "no config.json: is this a
    Hugging Face checkpoint folder?"; and download hints for a snapshot reading `hf download <hub-repo>
    --local-dir .../snapshots/<commit>`."""
    repo, snapshot = hub
    _, spoil, words = case
    spoil(repo, snapshot)
    with pytest.raises(KvtError) as e:
        folder = run.resolve(run.parse_args(["--pair", "qwen3-14b:14b"]))[0]
        kvt.load_tokenizer(folder)
        kvt.load_model(folder)
    one_line(e, words)


def test_the_intact_cache_loads(hub):
    folder = run.resolve(run.parse_args(["--pair", "qwen3-14b:14b"]))[0]
    assert folder.resolve() == hub[1].resolve() and kvt.load_model(folder).config.n_layers == 2
