"""run.py end to end on small models: the exact pair and the identity pair keep 100% of the target's
accuracy, and a stopped run resumes to the same results."""
import contextlib
import io
import json
import re
import shutil

import pytest
import torch

import kvt
from kvt.config import KvtError
from kvt.harness import pipeline as run
from kvt.harness.records import record_files
from kvt.harness.plan import USABLE
from tests.conftest import ROOT, SHARED

ARGS = ["--tasks", "toy_recall,toy_count", "--limit", "12", "--calib-seqs", "20", "--calib-len", "48", "--k", "2",
        "--lam", "1e-6", "--no-bench"]


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return tiny_pair


def per_item(results_dir, name):
    """(task, item id) -> the prediction of condition `name`."""
    recs = [json.loads(l) for f in results_dir.glob("records-*.jsonl") for l in f.read_text().splitlines()]
    return {(r["task"], r["id"]): r.get("pred", r.get("output")) for r in recs if r.get("condition") == name}


@pytest.mark.parametrize("target", ["twin", "source"])  # the exact pair, the identity pair
def test_transfer_keeps_every_answer(pair, target, tmp_path):
    out = tmp_path / "out"
    results = run.main(["--source", str(pair / "source"), "--target", str(pair / target), "--out", str(out)] + ARGS)
    assert results["diagnostics"]["kl"] < 1e-4
    assert results["gate"]["fit"]
    own, moved = per_item(out, "target"), per_item(out, "transfer")
    assert len(own) == 24 and own == moved  # every item: the same choice / the same generated text
    for task in ("toy_recall", "toy_count"):
        for metric, r in results["tasks"][task]["retention"].items():
            if results["tasks"][task]["target"][metric] > 0:
                assert r["ratio"] == pytest.approx(1.0), (task, metric)


def test_interrupted_run_resumes_to_the_same_results(pair, tmp_path):
    argv = ["--source", str(pair / "source"), "--target", str(pair / "twin")] + ARGS
    whole = run.main(argv + ["--out", str(tmp_path / "a")])
    run.main(argv + ["--out", str(tmp_path / "b")])
    records = next((tmp_path / "b").glob("records-*.jsonl"))
    lines = records.read_text().splitlines()
    records.write_text("\n".join(lines[:len(lines) // 3]) + "\n" + lines[len(lines) // 3][:20])  # stopped in mid-write
    (tmp_path / "b" / "results.json").unlink()
    resumed = run.main(argv + ["--out", str(tmp_path / "b")])
    same = json.dumps(resumed["tasks"], sort_keys=True) == json.dumps(whole["tasks"], sort_keys=True)
    assert same, "resumed results differ"  # (compared as JSON: an undefined retention is NaN in both)
    assert len(records.read_text().splitlines()) == len(lines)  # nothing scored twice


def test_retrained_weights_get_their_own_mapper(pair, tmp_path):
    """The same shape with other weights (a retrained or fine-tuned model) is a new pair to run.py: its
    mapper and records are not the old ones, which would be silently wrong."""
    target, out = tmp_path / "target", tmp_path / "out"
    shutil.copytree(pair / "twin", target)
    argv = ["--source", str(pair / "source"), "--target", str(target), "--out", str(out)] + ARGS
    run.main(argv)
    shutil.copy(pair / "source" / "model.safetensors", target / "model.safetensors")  # retrained: same shape
    again = run.main(argv)
    assert len(list(out.glob("mapper-*.safetensors"))) == 2 and len(list(out.glob("records-*.jsonl"))) == 2
    assert again["diagnostics"]["kl"] < 1e-4  # calibrated for the new weights (the identity pair now)


def test_one_edited_row_gets_its_own_mapper(pair, tmp_path):
    """Guards a run-folder key whose file fingerprint read 17 blocks of each file: replacing one row of the
    target's embedding (row 20, as in the report on toy-m) kept the key, and run.py reused the mapper and
    the records made with the original weights."""
    from safetensors.torch import load_file
    from kvt.weights import write_safetensors
    target, out = tmp_path / "target", tmp_path / "out"
    shutil.copytree(pair / "twin", target)
    argv = ["--source", str(pair / "source"), "--target", str(target), "--out", str(out)] + ARGS
    run.main(argv)
    tensors = load_file(target / "model.safetensors")
    tensors["model.embed_tokens.weight"][20] = torch.randn(tensors["model.embed_tokens.weight"].shape[1])
    write_safetensors(tensors, target / "model.safetensors", {"format": "pt"})
    run.main(argv)
    assert len(list(out.glob("mapper-*.safetensors"))) == 2 and len(list(out.glob("records-*.jsonl"))) == 2


def test_context_gain_on_a_text_the_target_cannot_model_is_no_ratio(tmp_path):
    """The toy pair on WikiText-2 (English: toy-m's NLL is about 20 nats, above uniform over its 640
    tokens) reported "context gain kept" -332% [-675, -202]: a ratio of noise. report.md and
    results.json now say why there is none, and keep the ratio on the toy corpus, which toy-m models."""
    text = SHARED / "data" / "calib" / "wikitext-2" / "test.txt"
    if not text.exists():
        pytest.skip(f"no {text}")
    out = tmp_path / "out"
    results = run.main(["--source", str(ROOT / "weights" / "toy-s"), "--target", str(ROOT / "weights" / "toy-m"),
                        "--out", str(out), "--tasks", "none", "--calib-seqs", "12", "--calib-len", "64", "--k", "2",
                        "--no-bench", "--heldout", str(text), "toy", "--nll-windows", "8"])
    english, toy_text = results["context_gain"]
    assert english["gain"] is None and "cannot model this text" in english["no_ratio"], english
    assert toy_text["no_ratio"] is None and toy_text["gain"] > 0.5, toy_text
    saved = json.loads((out / "results.json").read_text())["context_gain"]
    assert saved[0]["gain"] is None and saved[0]["no_ratio"] == english["no_ratio"]
    report = (out / "report.md").read_text()
    assert f"| no ratio: {english['no_ratio']} |" in report and f"| {100 * toy_text['gain']:.1f}% [" in report


def test_mismatched_pair_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        import subprocess, sys  # noqa: E401
        p = subprocess.run([sys.executable, "run.py", "--pair", "llama3.2-1b:llama3.1-8b", "--weights", str(tmp_path)],
                           capture_output=True, text=True, cwd=ROOT)
        raise SystemExit(p.stderr)
    msg = str(e.value).strip()
    assert msg.startswith("kvt: ") and len(msg.splitlines()) == 1, msg


def test_mapper_is_placed_where_the_target_keeps_each_layer(pair, tmp_path, monkeypatch):
    """run.py hands the transfer a mapper whose weights sit with each target layer. Guards: placing it
    only for more than one device, which leaves it on the CPU under one GPU, so every transfer copies
    its weights host to device again (and the bench times that copy)."""
    seen = []
    real = run.evals.transfer
    monkeypatch.setattr(run.evals, "transfer", lambda s, t, m, *a: seen.append((m, t)) or real(s, t, m, *a))
    run.main(["--source", str(pair / "source"), "--target", str(pair / "twin"), "--out", str(tmp_path)] + ARGS)
    mapper, target = seen[0]
    assert mapper.placed and mapper.devices() == kvt.loading.layer_devices(target)


def test_records_of_another_run_are_not_read_as_this_ones(tmp_path):
    """Guards: a glob on the records file's stem, which also matched the reverse direction's records
    (CoQA's way back), so they overwrote the forward ones and counted as done."""
    for name in ("records-a-1.jsonl", "records-a-1.rank0.jsonl", "records-a-1.rank1.jsonl", "records-a-1-reverse.jsonl",
                 "records-a-12.jsonl", "records-b-1.jsonl"):
        (tmp_path / name).write_text("{}\n")
    got = [f.name for f in record_files(tmp_path / "records-a-1.jsonl")]
    assert got == ["records-a-1.jsonl", "records-a-1.rank0.jsonl", "records-a-1.rank1.jsonl"]


def test_each_run_draws_its_retention_figure_or_says_nothing_without_matplotlib(pair, tmp_path, monkeypatch):
    """With matplotlib (the [plots] extra, installed in CI) a run writes retention.png and report.md links
    it; without it the run still ends, with the table alone. Guards: a figure that breaks a run where
    matplotlib is missing, or a report linking a PNG that was never written."""
    argv = ["--source", str(pair / "source"), "--target", str(pair / "twin")] + ARGS
    run.main(argv + ["--out", str(tmp_path / "with")])
    assert (tmp_path / "with" / "retention.png").stat().st_size > 1000
    assert "![retention](retention.png)" in (tmp_path / "with" / "report.md").read_text()
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)          # import matplotlib now fails
    run.main(argv + ["--out", str(tmp_path / "without")])
    assert not (tmp_path / "without" / "retention.png").exists()
    assert "retention.png" not in (tmp_path / "without" / "report.md").read_text()


def test_recompute_budgets_keep_their_own_records(pair, tmp_path):
    """The recompute budget is part of what keys the records, so resuming never mixes budgets. Guards:
    a rerun with another --recompute-* reading the first run's transfer records as done."""
    argv = ["--source", str(pair / "source"), "--target", str(pair / "twin"), "--out", str(tmp_path)] + ARGS
    plain = run.main(argv)
    wider = run.main(argv + ["--recompute-last", "3", "--recompute-first", "1"])
    assert len(list(tmp_path.glob("records-*.jsonl"))) == 2
    assert wider["settings"]["recompute_last"] == 3 and plain["settings"]["recompute_last"] == 0
    assert "recompute (kvt's option)" in (tmp_path / "report.md").read_text()


@contextlib.contextmanager
def calls(functions):
    """Count the calls of each function (name -> function) while inside, wherever it was imported to:
    sys.setprofile sees every Python frame by its code object (by identity: a copy of the same source
    is another function), whatever name the caller had for it."""
    import inspect
    import sys
    codes = {id(inspect.unwrap(f).__code__): name for name, f in functions.items()}   # the functions stay alive
    counts = dict.fromkeys(functions, 0)

    def seen(frame, event, arg):
        if event == "call" and id(frame.f_code) in codes:
            counts[codes[id(frame.f_code)]] += 1
    sys.setprofile(seen)
    try:
        yield counts
    finally:
        sys.setprofile(None)


def reading_order():
    """The functions of README's reading order that a run.py run of the method needs, by name."""
    from kvt import cache, calibrate, capture, decode, handoff, mapper, ridge, rope, stats
    return {"calibrate": calibrate.calibrate, "Sums.add_": stats.Sums.add_, "pick_layers": ridge.pick_layers,
            "fit_layers": ridge.fit_layers, "from_fits": mapper.from_fits, "Mapper.apply": mapper.Mapper.apply,
            "handoff": handoff.handoff, "take_over": handoff.take_over, "Cache.update": cache.Cache.update,
            "Cache.attend": cache.Cache.attend, "rope.strip": rope.strip, "rope.rotate": rope.rotate,
            "capture": capture.capture, "generate": decode.generate}


def fast_twins():
    from kvt import fast
    return {"fast.add_batches": fast.add_batches, "Pending.add_": fast.Pending.add_, "fast.apply": fast.apply,
            "fast.map_layer": fast.map_layer, "fast.reserve": fast.reserve, "Reserved.update": fast.Reserved.update}


def test_plain_runs_the_reading_order_and_says_so(pair, tmp_path, capsys):
    """run.py --plain calls every function of README's reading order that the method needs (the core's
    calibrate, Sums.add_, Mapper.apply, handoff, ...: the functions tutorial.md and the course teach) and
    no fast twin of kvt/fast.py; its first line and report.md name the plain path. Guards: run.py running a
    second calibration of its own (harness/calibration.py's used to: the core's calibrate ran 0 times), a
    fast twin standing in for Sums.add_ or Mapper.apply under --plain, a run that does not say which ran."""
    argv = ["--source", str(pair / "source"), "--target", str(pair / "twin"), "--out", str(tmp_path / "o")] + ARGS
    argv[argv.index("toy_recall,toy_count")] = "toy_recall,toy_recall_gen"       # a generating task: decoding too
    capsys.readouterr()
    with calls({**reading_order(), **fast_twins()}) as n:
        run.main(argv + ["--plain"])
    ran = {name: n[name] for name in reading_order()}
    assert all(ran.values()), f"functions of the reading order --plain never called: {ran}"
    assert not any(n[name] for name in fast_twins()), f"fast twins under --plain: { {t: n[t] for t in fast_twins()} }"
    assert capsys.readouterr().out.startswith("path: plain (--plain)"), "run.py's first line does not name the path"
    assert "path: plain (--plain)" in (tmp_path / "o" / "report.md").read_text()


def test_the_default_run_calls_the_core_calibrate_and_says_fast(pair, tmp_path, capsys):
    """The default run.py calibrates through kvt/calibrate.py's calibrate (once per mapper) and the handoff
    through kvt/handoff.py, with the fast twins in the inner loops, and says so first and in report.md.
    Guards: the command's calibration drifting back into a copy of the steps the core does not run."""
    argv = ["--source", str(pair / "source"), "--target", str(pair / "twin"), "--out", str(tmp_path / "o")] + ARGS
    argv[argv.index("toy_recall,toy_count")], argv[argv.index("12")] = "toy_recall", "4"   # the calibration counts
    capsys.readouterr()
    with calls({**reading_order(), **fast_twins()}) as n:
        run.main(argv)
    assert n["calibrate"] == 1 and n["handoff"] > 0 and n["fast.apply"] > 0 and n["Pending.add_"] > 0, n
    assert n["Sums.add_"] == 0 and n["Mapper.apply"] == 0, n
    assert capsys.readouterr().out.startswith("path: fast twins"), "run.py's first line does not name the path"
    assert "path: fast twins" in (tmp_path / "o" / "report.md").read_text()


@pytest.mark.parametrize("how", ["KVT_PLAIN=1"])   # --plain: test_plain_runs_the_reading_order_and_says_so
def test_plain_runs_no_fast_twin(pair, tmp_path, monkeypatch, how):
    """KVT_PLAIN=1 (as --plain) runs every step's plain path: calibration, diagnostics, handoff and
    decoding never reach a fast twin of kvt/fast.py (its switches, map_cache and generate, take the plain
    functions). Guards: the switch dropped on its way to a step (it used to be an environment variable
    each step read; now it is an argument run passes on)."""
    from kvt import fast

    def refused(*args, **kw):
        raise AssertionError("a fast twin ran under --plain")
    for name in ("apply", "add_batch", "reserve", "Reserved", "one_query_attention", "one_row_linears"):
        monkeypatch.setattr(fast, name, refused)
    if how == "KVT_PLAIN=1":
        monkeypatch.setenv("KVT_PLAIN", "1")
    argv = ["--source", str(pair / "source"), "--target", str(pair / "twin"), "--out", str(tmp_path / "o")] + ARGS
    argv[argv.index("toy_recall,toy_count")] = "toy_recall,toy_recall_gen"       # a generating task: decoding too
    results = run.main(argv + (["--plain"] if how == "--plain" else []))
    assert results["diagnostics"]["kl"] < 1e-4


# ---- what a newcomer reads: the console, report.md, the files' names (issue 55) ------------------------------

BAR = re.compile(r"\d+%\|")  # a tqdm progress bar


def test_a_run_says_little_before_its_work_and_names_its_mapper_by_the_k_it_used(pair, tmp_path):
    """A run prints at most 10 lines before the progress bar of its first statistics (after the memory plan),
    the plan in one line; its mapper's file carries the k it used (3: the source has 3 layers, k=8 asked),
    and a rerun finds and reuses that file. Guards: the whole 35-row plan printed before every run (33 rows of
    0.00 GiB on a toy pair); a mapper-...-k8-... file holding a k=3 mapper; a name that a rerun does not find."""
    argv = ["--source", str(pair / "source"), "--target", str(pair / "twin"), "--out", str(tmp_path)] + ARGS
    argv += ["--k", "8"]
    seen = io.StringIO()
    with contextlib.redirect_stdout(seen), contextlib.redirect_stderr(seen):   # one stream, in the order printed
        results = run.main(argv)
    text = seen.getvalue().replace("\r", "\n")
    plan_at = text.index("memory plan:")
    work = BAR.search(text, plan_at).start()                                   # the first bar after the plan
    said = [line for line in text[:work].splitlines() if line.strip() and not BAR.search(line)]
    assert len(said) <= 10, "\n".join(said)
    assert results["k_used"] == 3 and results["mapper"].startswith("layer-k3-ridge-")
    files = [f.name for f in tmp_path.glob("mapper-*.safetensors")]
    assert files == [f"mapper-{results['mapper']}.safetensors"]
    seen = io.StringIO()
    with contextlib.redirect_stdout(seen), contextlib.redirect_stderr(seen):
        again = run.main(argv)
    assert "reusing" in seen.getvalue() and again["mapper"] == results["mapper"]
    assert [f.name for f in tmp_path.glob("mapper-*.safetensors")] == files


def test_the_plan_in_full_when_asked_or_nearly_full_and_a_refusal_when_it_does_not_fit(pair, monkeypatch, capsys):
    """Guards: a one-line plan where a device is more than half full (the rows that say what fills it
    hidden), --show-plan ignored, or the refusal lost with the table."""
    cfg = kvt.load_config(pair / "source")

    def printed(**settings):
        s = run.Settings(source=pair / "source", target=pair / "twin", **settings)
        plans, cap = run.plan_memory(s, cfg, cfg, ("source", "twin"), False, [64], torch.float32, ["cpu"])
        return capsys.readouterr().out.splitlines(), plans["forward"]
    lines, p = printed()
    assert len(lines) == 1 and lines[0].startswith("memory plan: source -> twin needs ") and "--show-plan" in lines[0]
    assert len(printed(show_plan=True)[0]) == len(p.rows) + 6            # head, what it shows, columns, need, usable, verdict
    need = p.need()["cpu"]
    monkeypatch.setattr(run, "capacity", lambda devices: {"cpu": need / (0.6 * USABLE)})     # 60% full: every row
    assert len(printed()[0]) == len(p.rows) + 6
    monkeypatch.setattr(run, "capacity", lambda devices: {"cpu": need / (1.5 * USABLE)})     # does not fit
    with pytest.raises(KvtError, match="^memory plan does not fit"):
        printed()
    assert capsys.readouterr().out.splitlines()[-1] == "does NOT fit"


def test_report_leads_with_a_short_speed_table_and_says_what_each_section_shows(pair, tmp_path):
    """report.md's first speed table has at most 7 columns and a legend under it, the full one below; every
    section opens with a line saying what it shows. Guards: the 16-column table first, with no legend; a
    section (or table) that starts without a word on what it holds."""
    argv = ["--source", str(pair / "source"), "--target", str(pair / "twin"), "--out", str(tmp_path)] + ARGS
    argv[argv.index("--no-bench")] = "--bench"
    run.main(argv + ["--bench-lengths", "64", "--heldout", "toy", "--nll-windows", "2", "--nll-context", "32",
                     "--nll-next", "8"])
    lines = (tmp_path / "report.md").read_text().splitlines()
    speed = lines.index("## Prefill vs transfer (seconds, median)")
    first = next(i for i in range(speed, len(lines)) if lines[i].startswith("|"))
    assert lines[first].count("|") - 1 <= 7
    end = next(i for i in range(first, len(lines)) if not lines[i].startswith("|"))
    assert lines[end] == "" and lines[end + 1].startswith("target prefill s: ")       # its legend, right under it
    assert any(l.count("|") - 1 == 16 for l in lines[end:])                            # and every column below
    headers = [i for i, l in enumerate(lines) if l.startswith("## ") or l.startswith("### ")]
    assert len(headers) >= 5, [lines[i] for i in headers]
    for i in headers:
        says = lines[i + 2]
        assert lines[i + 1] == "" and says and says[0].isupper() and not says.startswith(("|", "```", "!")), lines[i]
