"""What kvt refuses: every bad input ends in one KvtError line that says what is wrong and what to do,
before heavy work where it can, and leaves an existing run folder as it was (its results unchanged).

Each row of CASES is a bad input to run.py (its arguments, or a file it reads made bad) and the words
its message must hold: what is wrong, and what to do. The rows run against a finished run folder,
DONE, whose files are compared byte for byte before and after. API misuse (token ids, caches, dtypes)
is checked below the table. A test of this file fails when a check is removed (the input then ends in
a traceback, silently wrong results, or a changed run folder), or when its message stops saying what to do.
"""
import hashlib
import json
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvt
from kvt.harness import pipeline as run
from kvt.harness.records import open_records
from kvt.config import KvtError
from tests.conftest import ROOT, SHARED, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = ["--tasks", "toy_recall", "--limit", "6", "--calib-seqs", "12", "--calib-len", "40", "--k", "2", "--no-bench",
        "--keep-stats"]


def snapshot(folder):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def world(tiny_pair, tmp_path_factory):
    """A finished run folder (DONE), a copy of the pair's checkpoints to break, and a small data folder."""
    root = tmp_path_factory.mktemp("refusals")
    done = root / "done"
    good = ["--source", str(tiny_pair / "source"), "--target", str(tiny_pair / "twin"), "--out", str(done)] + ARGS
    results = run.main(good)
    data = root / "data" / "arc_easy"
    data.mkdir(parents=True)
    rows = (SHARED / "data" / "arc_easy" / "test.jsonl").read_text().splitlines()[:5]
    (data / "test.jsonl").write_text("\n".join(rows) + "\n")
    (root / "afile").write_text("not a folder")
    (root / "small.txt").write_text("a few words, far fewer than one calibration sequence")
    return {"pair": tiny_pair, "root": root, "done": done, "good": good, "results": results}


def argv(world, *extra, source=None, target=None, out=None):
    w = world
    return (["--source", str(source or w["pair"] / "source"), "--target", str(target or w["pair"] / "twin"),
             "--out", str(out or w["done"])] + ARGS + list(extra))


def broken_checkpoint(world, name, change):
    """A copy of the twin checkpoint with `change(folder)` applied."""
    folder = world["root"] / name
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(world["pair"] / "twin", folder)
    change(folder)
    return folder


def edit_config(**kw):
    def change(folder):
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(kw)
        (folder / "config.json").write_text(json.dumps(cfg))
    return change


def drop_layer(folder):  # weights of 2 layers under a config of 3
    t = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in t.items() if ".layers.2." not in k}, folder / "model.safetensors")


def other_tokenizer(folder):
    from kvt.harness import toy
    toy.train_tokenizer(toy.corpus(50, seed=7)).save(str(folder / "tokenizer.json"))


def other_kv_shape(folder):
    torch.manual_seed(0)
    cfg = tiny_config(vocab_size=json.loads((folder / "config.json").read_text())["vocab_size"], n_layers=2, dim=96,
                      n_heads=4, n_kv_heads=1, head_dim=24, max_seq_len=1024)
    kvt.save_model(kvt.build_model(cfg), folder)


# (id, arguments: world -> argv, words the message must hold)
CASES = [
    ("k 0", lambda w: argv(w, "--k", "0"), ["--k 0", "at least 1"]),
    ("k -1", lambda w: argv(w, "--k", "-1"), ["--k -1", "at least 1"]),
    ("calib-len 1", lambda w: argv(w, "--calib-len", "1"), ["--calib-len 1", "at least 2"]),
    ("calib-len 0", lambda w: argv(w, "--calib-len", "0"), ["--calib-len 0", "at least 2"]),
    ("calib-seqs 0", lambda w: argv(w, "--calib-seqs", "0"), ["--calib-seqs 0", "at least 1"]),
    ("limit 0", lambda w: argv(w, "--limit", "0"), ["--limit 0", "at least 1"]),
    ("tasks empty", lambda w: argv(w, "--tasks="), ["--tasks is empty", "known"]),
    ("task limit malformed", lambda w: argv(w, "--task-limit", "toy_recall"), ["--task-limit 'toy_recall'", "TASK=N"]),
    ("unknown task", lambda w: argv(w, "--tasks", "piqa"), ["unknown task 'piqa'", "known"]),
    ("lam negative", lambda w: argv(w, "--lam", "-1"), ["--lam -1", "positive number"]),
    ("lam nan", lambda w: argv(w, "--lam", "nan"), ["--lam nan", "positive number"]),
    ("lam 0", lambda w: argv(w, "--lam", "0"), ["--lam 0", "positive number"]),
    ("gate nan", lambda w: argv(w, "--max-kl", "nan"), ["--max-kl", "number"]),
    ("candidates 1", lambda w: argv(w, "--candidates", "1"), ["--candidates 1", "at least 2"]),
    ("recompute negative", lambda w: argv(w, "--recompute-last", "-1"), ["--recompute-last -1", "at least 0"]),
    ("recompute fraction above 1", lambda w: argv(w, "--recompute-frac", "1.5"), ["--recompute-frac 1.5", "within [0, 1]"]),
    ("cuda without cuda", lambda w: argv(w, "--device", "cuda"), ["CUDA is not available", "--device cpu"]),
    ("unknown device", lambda w: argv(w, "--device", "tpu"), ["unknown device 'tpu'", "use cpu"]),
    ("unknown device in list", lambda w: argv(w, "--devices", "cpu,gpu7"), ["unknown device 'gpu7'", "use cpu"]),
    ("bench lengths not numbers", lambda w: argv(w, "--bench-lengths", "abc"), ["--bench-lengths 'abc'", "e.g. 512"]),
    ("bench lengths zero", lambda w: argv(w, "--bench-lengths", "0,512"), ["--bench-lengths '0,512'", "at least 2"]),
    ("bench beyond the models", lambda w: argv(w, "--bench", "--bench-lengths", "9999"),
     ["9999 tokens exceeds the models' limit of 1024", "shorter --bench-lengths"]),
    ("context beyond the models", lambda w: argv(w, "--context", "5000"), ["5000 tokens exceeds", "--context"]),
    ("calib-len beyond the models", lambda w: argv(w, "--calib-len", "2048"), ["2048 tokens exceeds", "--calib-len"]),
    ("out is a file", lambda w: argv(w, out=w["root"] / "afile"), ["is a file", "give a folder"]),
    ("out cannot be created", lambda w: argv(w, out=w["root"] / "afile" / "sub"), ["cannot create the output folder",
                                                                                    "choose another --out"]),
    ("source without target", lambda w: ["--source", str(w["pair"] / "source"), "--out", str(w["done"])],
     ["give both --source and --target"]),
    ("pair malformed", lambda w: ["--pair", "qwen3-14b", "--out", str(w["done"])], ["--pair 'qwen3-14b'", "e.g. qwen3-14b:32b"]),
    ("pair not downloaded", lambda w: ["--pair", "qwen3-0.6b:1.7b", "--weights", str(w["root"]), "--out", str(w["done"])],
     ["no checkpoint folder", "hf download Qwen/Qwen3-0.6B"]),
    ("head scope on other KV shapes", lambda w: argv(w, "--scope", "head", target=broken_checkpoint(w, "kv1", other_kv_shape)),
     ["not a matched-KV pair", "--scope layer"]),
    ("tokenizers differ", lambda w: argv(w, target=broken_checkpoint(w, "tok", other_tokenizer)),
     ["tokenizers differ", "sharing a tokenizer"]),
    ("calibration text missing", lambda w: argv(w, "--calib", str(w["root"] / "nope")), ["does not exist", "folder of them"]),
    ("calibration text too small", lambda w: argv(w, "--calib", str(w["root"] / "small.txt")),
     ["holds 0 windows of 40 tokens", "--calib-seqs"]),
    ("heldout text missing", lambda w: argv(w, "--heldout", str(w["root"] / "nope")),
     ["--heldout", "does not exist", "pass a text file"]),
    ("heldout folder without text", lambda w: argv(w, "--heldout", str(w["root"] / "data")),
     ["--heldout", "no .txt, .jsonl or .json files", "point --heldout at text files"]),
    ("heldout not text", lambda w: argv(w, "--heldout", str(w["pair"] / "source" / "model.safetensors")),
     ["--heldout", "is not text", "pass a text file"]),
    ("task data missing", lambda w: argv(w, "--tasks", "arc_easy", "--data-dir", str(w["root"] / "nodata")),
     ["missing", "arc_easy/test.jsonl", "to_json"]),
    ("more config layers than weights", lambda w: argv(w, target=broken_checkpoint(w, "more", edit_config(num_hidden_layers=4))),
     ["missing from the checkpoint", "model.layers.3.", "config.json says 4 layers"]),
    ("fewer config layers than weights", lambda w: argv(w, target=broken_checkpoint(w, "fewer", edit_config(num_hidden_layers=2))),
     ["tensors config.json does not describe", "model.layers.2.", "use the config.json that came with these weights"]),
    ("weights of fewer layers", lambda w: argv(w, target=broken_checkpoint(w, "lost", drop_layer)),
     ["missing from the checkpoint", "model.layers.2.", "download"]),
    ("zero layers", lambda w: argv(w, target=broken_checkpoint(w, "zero", edit_config(num_hidden_layers=0))),
     ["num_hidden_layers is 0", "positive integer"]),
    ("negative layers", lambda w: argv(w, target=broken_checkpoint(w, "neg", edit_config(num_hidden_layers=-2))),
     ["num_hidden_layers is -2", "positive integer"]),
    ("config missing a key", lambda w: argv(w, target=broken_checkpoint(w, "nokey", edit_config(hidden_size=None))),
     ["'hidden_size' missing or null", "use the config.json that came with"]),
    ("config not JSON", lambda w: argv(w, target=broken_checkpoint(w, "json", lambda f: (f / "config.json").write_text("{"))),
     ["is not valid JSON", "download the checkpoint again"]),
    ("no config", lambda w: argv(w, target=broken_checkpoint(w, "nocfg", lambda f: (f / "config.json").unlink())),
     ["no config.json", "Hugging Face checkpoint folder"]),
    ("truncated weights", lambda w: argv(w, target=broken_checkpoint(
        w, "trunc", lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:5000]))),
     ["unreadable or truncated", "download it again"]),
    ("tokenizer beyond the vocabulary", lambda w: argv(w, target=broken_checkpoint(w, "vocab", edit_config(vocab_size=100))),
     ["more than a model's vocabulary of 100", "use the tokenizer that came with these weights"]),
    ("tokenizer unreadable", lambda w: argv(w, target=broken_checkpoint(w, "badtok", lambda f: (f / "tokenizer.json").write_text("{]"))),
     ["not a readable tokenizer.json", "download"]),
    ("no tokenizer", lambda w: argv(w, target=broken_checkpoint(w, "notok", lambda f: (f / "tokenizer.json").unlink())),
     ["no tokenizer.json", "checkpoint folder should contain one"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_that_says_what_to_do(world, case):
    _, make, words = case
    before = snapshot(world["done"])
    with pytest.raises(KvtError) as e:
        run.main(make(world))
    msg = str(e.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in: {msg}"
    assert snapshot(world["done"]) == before, "a refused run changed the finished run folder"


# ---- bad files in the run folder: refused (or, a torn records line, repaired), the rest untouched ----------

def run_folder_copy(world, name):
    folder = world["root"] / name
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(world["done"], folder)
    return folder


def the(folder, pattern):
    return next(folder.glob(pattern))


def pickle_file(path):
    path.write_bytes(pickle.dumps({"W": [1.0, 2.0]}))


FILE_CASES = [
    ("truncated mapper", "mapper-*", lambda p, w: p.write_bytes(p.read_bytes()[:200]),
     ["not a readable mapper file", "delete it"]),
    ("empty mapper", "mapper-*", lambda p, w: p.write_bytes(b""), ["not a readable mapper file", "delete it"]),
    ("pickle as mapper", "mapper-*", lambda p, w: pickle_file(p), ["not a readable mapper file", "delete it"]),
    ("another run's mapper", "mapper-*", lambda p, w: shutil.copy(the(w["other"], "mapper-*"), p),
     ["made from other weights, data or settings", "delete it"]),
    ("records line corrupt", "records-*", lambda p, w: p.write_text(p.read_text().replace('"condition"', '{', 1)),
     ["line 2 is corrupt", "delete the file"]),
    ("records of other settings", "records-*",
     lambda p, w: p.write_text(the(w["other"], "records-*").read_text()), ["records of other settings", "another --out"]),
]


@pytest.fixture(scope="module")
def other(world):
    """A finished run of another pair (the identity pair), whose files a user might copy over."""
    out = world["root"] / "other"
    run.main(argv(world, target=world["pair"] / "source", out=out))
    return out


@pytest.mark.parametrize("case", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_bad_file_in_the_run_folder_is_refused_and_the_rest_kept(world, other, case):
    name, pattern, spoil, words = case
    folder = run_folder_copy(world, name.replace(" ", "_").replace("'", ""))
    bad = the(folder, pattern)
    spoil(bad, {**world, "other": other})
    before = snapshot(folder)
    with pytest.raises(KvtError) as e:
        run.main(argv(world, out=folder))
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    assert snapshot(folder) == before
    assert json.loads((folder / "results.json").read_text()) == json.loads((world["done"] / "results.json").read_text())


def test_statistics_of_another_pair_under_this_runs_name_are_refused(world, other):
    """Guards: a statistics checkpoint from another pair taken as a finished calibration, whose mapper
    would then be saved under this pair's name."""
    folder = run_folder_copy(world, "foreign_stats")
    the(folder, "mapper-*").unlink()                          # so the run calibrates and reads its statistics
    mine = the(folder, "stats-*.pass1")
    shutil.copy(the(other, "stats-*.pass1"), mine)
    with pytest.raises(KvtError, match="made for another pair or settings.*delete it"):
        run.main(argv(world, out=folder))
    mine.write_bytes(mine.read_bytes()[:300])
    with pytest.raises(KvtError, match="unreadable.*delete it"):
        run.main(argv(world, out=folder))


def test_a_torn_records_line_is_dropped_and_the_run_resumes(world):
    """A crash in mid-write leaves half a line at the end of the records: the rerun drops it, scores that
    item again, and ends with the same results. Guards: a JSONDecodeError on every rerun. The item is
    scored again in a batch of its own, so its loglikelihoods may differ from the first run's in float32's
    last bits (evaluation batches, docs/evaluation.md); everything else is the same."""
    folder = run_folder_copy(world, "torn")
    records = the(folder, "records-*")
    text = records.read_text()
    lines = text.splitlines()
    records.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:25])
    again = run.main(argv(world, out=folder))
    before, after = text.splitlines(), records.read_text().splitlines()
    assert after[:-1] == before[:-1], "a whole record was changed"
    # the item is scored again alone, not in its batch: its floats agree within float32's tolerance
    a, b = json.loads(after[-1]), json.loads(before[-1])
    floats = {k for k, v in b.items() if isinstance(v, float) or isinstance(v, list) and isinstance(v[0], float)}
    assert {k: v for k, v in a.items() if k not in floats} == {k: v for k, v in b.items() if k not in floats}
    torch.testing.assert_close({k: a[k] for k in floats}, {k: b[k] for k in floats}, rtol=1e-5, atol=1e-5)
    assert json.dumps(again["tasks"], sort_keys=True) == json.dumps(world["results"]["tasks"], sort_keys=True)


def test_bad_task_data_is_refused_before_calibration(world):
    """A malformed line or a missing field in a task's data file names the file and the line, and comes
    before any calibration (no statistics written). Guards: a JSONDecodeError or KeyError after the
    calibration hours."""
    data = world["root"] / "baddata"
    for spoil, words in [(lambda rows: rows[:2] + ["{not json"] + rows[3:], ["test.jsonl, line 3", "not valid JSON"]),
                         (lambda rows: rows[:1] + [json.dumps({k: v for k, v in json.loads(rows[1]).items()
                                                               if k != "answerKey"})] + rows[2:],
                          ["test.jsonl, line 2", "no field 'answerKey'", "to_json"])]:
        shutil.rmtree(data, ignore_errors=True)
        (data / "arc_easy").mkdir(parents=True)
        rows = (world["root"] / "data" / "arc_easy" / "test.jsonl").read_text().splitlines()
        (data / "arc_easy" / "test.jsonl").write_text("\n".join(spoil(rows)) + "\n")
        out = world["root"] / "baddata_run"
        with pytest.raises(KvtError) as e:
            run.main(argv(world, "--tasks", "arc_easy", "--data-dir", str(data), out=out))
        assert all(w in str(e.value) for w in words), str(e.value)
        assert not out.exists(), "a failed run left a folder behind"


def test_a_smaller_limit_reports_only_its_own_items(world):
    """A second run into the same folder with a smaller --limit describes its own items, not the earlier
    run's (which stay in the records for a later run to reuse). Guards: summarizing every record found."""
    folder = run_folder_copy(world, "smaller")
    args = argv(world, out=folder)
    args[args.index("--limit") + 1] = "3"
    results = run.main(args)
    assert results["tasks"]["toy_recall"]["target"]["n"] == 3
    assert results["items"]["toy_recall"] == world["results"]["items"]["toy_recall"][:3]


def test_a_task_limit_overrides_the_limit_for_its_task(world):
    folder = run_folder_copy(world, "task_limit")
    results = run.main(argv(world, "--task-limit", "toy_recall=2", out=folder))
    assert results["tasks"]["toy_recall"]["target"]["n"] == 2


def test_results_json_is_strict_and_typed(world):
    text = (world["done"] / "results.json").read_text()
    results = json.loads(text, parse_constant=lambda c: pytest.fail(f"results.json holds {c}"))
    s = results["settings"]
    assert isinstance(s["k"], int) and isinstance(s["calib_seqs"], int) and s["lam"] is None and s["bench"] is False
    assert results["k_used"] == 2 and isinstance(results["items"]["toy_recall"][0], str)


# ---- exit status, Ctrl-C ----------------------------------------------------------------------------------

def test_user_errors_exit_2_with_one_line(world, tmp_path):
    p = subprocess.run([sys.executable, "run.py"] + argv(world, "--k", "0"), capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and p.stderr.startswith("kvt: --k 0") and len(p.stderr.strip().splitlines()) == 1, p.stderr
    p = subprocess.run([sys.executable, "run.py", "--scope", "wide"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2  # argparse's own errors exit 2 too


# The run as `python run.py` starts it, but with a pause point the test controls: the SIGINT a user's Ctrl-C
# sends is raised from inside the calibration, as its second batch of source KV is captured (calibration.capture,
# which the loop looks up at every batch), so the interrupt always lands mid-calibration (a signal sent from
# outside raced the run, which could finish first). SIGINT's handler is set as an interactive shell leaves
# it, whatever the test runner's own disposition (a background job inherits SIGINT ignored).
INTERRUPTED_RUN = """
import signal, sys
import kvt.harness.calibration as calibration
from kvt.cli import entry
signal.signal(signal.SIGINT, signal.default_int_handler)
capture, batches = calibration.capture, []
def capture_then_ctrl_c(*args, **kwargs):
    batches.append(1)
    if len(batches) == 2:
        signal.raise_signal(signal.SIGINT)
    return capture(*args, **kwargs)
calibration.capture = capture_then_ctrl_c
entry(["run", *sys.argv[1:]])
"""


def test_ctrl_c_says_a_rerun_resumes(world, tmp_path):
    """Guards: a KeyboardInterrupt traceback that leaves the user unsure whether the work is lost."""
    p = subprocess.run([sys.executable, "-c", INTERRUPTED_RUN] + argv(world, out=tmp_path / "run"),
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    err = p.stderr.strip().splitlines()
    assert "calibration stats" in p.stderr, p.stderr[-2000:]                  # interrupted where the test put it
    assert p.returncode == 130 and err[-1] == "kvt: interrupted; run the same command again to resume where it stopped", p.stderr[-2000:]


# ---- the Python API: ids, caches and dtypes checked where they enter ----------------------------------------

@pytest.fixture(scope="module")
def model():
    return kvt.build_model(tiny_config(n_layers=2))


@pytest.mark.parametrize("ids,words", [
    (torch.zeros(1, 4), ["integer token ids", "torch.float32"]),
    (torch.zeros(4, dtype=torch.long), ["shape (batch, tokens)", "ids[None]"]),
    (torch.zeros(0, 4, dtype=torch.long), ["shape (batch, tokens)", "(0, 4)"]),
    (torch.zeros(1, 0, dtype=torch.long), ["shape (batch, tokens)", "(1, 0)"]),
    (torch.tensor([[1, 2, 128]]), ["token id 128 is outside the model's vocabulary of 128", "this model's tokenizer"]),
    (torch.tensor([[-1, 2]]), ["token id -1 is outside", "this model's tokenizer"]),
    ([[1, 2]], ["integer token ids", "list"]),
], ids=["float", "1-D", "no rows", "no tokens", "beyond the vocabulary", "negative", "a list"])
def test_bad_token_ids_are_refused(model, ids, words):
    with pytest.raises(KvtError) as e:
        model(ids)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("layers,heads,dim,rows,words", [
    (3, 2, 16, 1, ["the cache has 3 layers", "this model 2 of 2 x 16", "mapper"]),
    (1, 2, 16, 1, ["the cache has 1 layers", "this model 2 of 2 x 16"]),
    (2, 1, 16, 1, ["2 layers of 1 KV heads x 16", "this model 2 of 2 x 16"]),
    (2, 2, 8, 1, ["of 2 KV heads x 8"]),
    (2, 2, 16, 3, ["the cache holds 3 rows, the input 1"]),
], ids=["more layers", "fewer layers", "other KV heads", "other head dim", "other batch"])
def test_a_cache_from_another_model_is_refused(model, layers, heads, dim, rows, words):
    """Guards: a cache with more layers than the model running silently on its first ones, and one with
    fewer raising IndexError deep inside the forward pass."""
    other = kvt.build_model(tiny_config(n_layers=layers, n_kv_heads=heads, head_dim=dim, n_heads=4))
    _, cache = other(torch.zeros(rows, 5, dtype=torch.long))
    with pytest.raises(KvtError) as e:
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_load_model_takes_dtype_names_and_refuses_others(tiny_pair):
    assert next(kvt.load_model(tiny_pair / "source", dtype="bfloat16").parameters()).dtype == torch.bfloat16
    with pytest.raises(KvtError, match="'float8' is not one kvt runs models in; use one of float32"):
        kvt.load_model(tiny_pair / "source", dtype="float8")


# ---- records are keyed by what they scored; the adversarial pass's silent cases ----------------------------

def arc_folder(world, name, change=lambda row: row, n=5):
    """A data folder of the first n ARC-Easy rows, each row passed through change(row)."""
    folder = world["root"] / name
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "arc_easy").mkdir(parents=True)
    rows = [change(json.loads(r)) for r in (SHARED / "data" / "arc_easy" / "test.jsonl").read_text().splitlines()[:n]]
    (folder / "arc_easy" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def calib_text(world):
    """A calibration text for runs of real tasks on the tiny pair (which otherwise read DATA/calib)."""
    path = world["root"] / "calib.jsonl"
    if not path.exists():
        from kvt.harness import toy
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in toy.corpus(200, seed=99)))
    return str(path)


def next_label(row):
    labels = row["choices"]["label"]
    return {**row, "answerKey": labels[(labels.index(row["answerKey"]) + 1) % len(labels)]}


def test_a_rerun_on_changed_data_scores_the_changed_items_again(world):
    """Guards: records keyed by (task, condition, item id) alone, so a rerun into the same --out on data
    whose answer keys moved under the same ids reported the old scores (acc 40% where a fresh --out
    gives 0%)."""
    a, b = arc_folder(world, "arc_a"), arc_folder(world, "arc_b", next_label)
    out = world["root"] / "arc_run"
    shutil.rmtree(out, ignore_errors=True)
    arc = ["--tasks", "arc_easy", "--limit", "5", "--calib", calib_text(world)]
    first = run.main(argv(world, *arc, "--data-dir", str(a), out=out))["tasks"]["arc_easy"]
    again = run.main(argv(world, *arc, "--data-dir", str(b), out=out))["tasks"]["arc_easy"]
    fresh = run.main(argv(world, *arc, "--data-dir", str(b), out=world["root"] / "arc_fresh"))["tasks"]["arc_easy"]
    for cond in ("target", "source", "floor", "transfer"):
        assert again[cond] == fresh[cond], (cond, again[cond], fresh[cond])
    assert first["target"]["acc"] != fresh["target"]["acc"] or first["target"]["acc_norm"] != fresh["target"]["acc_norm"]
    assert run.main(argv(world, *arc, "--data-dir", str(a), out=out))["tasks"]["arc_easy"] == first  # A again: reused


TWO_CHOICES = '''
from kvt.harness.tasks import Item, Task
GOLD = {gold}
task = Task("mine", load=lambda: [Item(str(i), f"Question {{i}}: which?", GOLD, ["yes", "no"], "Answer:")
                                  for i in range(5)])
'''


@pytest.fixture
def registry(monkeypatch):
    """A copy of the task registry for one test: the tasks its task files register are gone after it."""
    from kvt.harness import tasks
    monkeypatch.setattr(tasks, "TASKS", dict(tasks.TASKS))
    return tasks.TASKS


def test_a_task_file_whose_gold_changed_is_scored_again(world, registry):
    """Guards: a task file's gold changed under the same item ids, and the rerun into the same --out kept
    the old scores. Two choices, gold flipped: every item's acc must flip, so acc becomes 1 - acc."""
    out = world["root"] / "gold_run"
    shutil.rmtree(out, ignore_errors=True)
    f = world["root"] / "mine.py"
    accs = []
    for gold in (0, 1):
        f.write_text(TWO_CHOICES.format(gold=gold))
        accs.append(run.main(argv(world, "--task-file", str(f), "--tasks", "mine", "--calib", calib_text(world),
                                  out=out))["tasks"]["mine"])
    for cond in ("target", "source", "floor", "transfer"):
        assert accs[1][cond]["acc"] == pytest.approx(1 - accs[0][cond]["acc"]), cond


def test_empty_choices_are_refused(world):
    """Guards: rows whose choices are all "" reused the old scores on a rerun, and on a fresh --out
    ended in a ZeroDivisionError in acc_norm (divided by the choice's length)."""
    empty = arc_folder(world, "arc_empty", lambda r: {**r, "choices": {**r["choices"], "text": [""] * 4}})
    with pytest.raises(KvtError, match=r"choice 0 is ''; every choice is a non-empty string"):
        run.main(argv(world, "--tasks", "arc_easy", "--data-dir", str(empty), "--calib", calib_text(world),
                      out=world["root"] / "empty_run"))
    assert not (world["root"] / "empty_run").exists()


def test_records_of_an_older_kvt_are_refused(world):
    """Guards: records of the older format (keyed by item id alone) read as if they held this data's
    scores. They are refused with what to do, and the folder is left as it was."""
    folder = run_folder_copy(world, "old_records")
    records = the(folder, "records-*")
    lines = records.read_text().splitlines()
    header = json.loads(lines[0])
    old = [json.dumps({**header, "format": "kvt-records-2"})] + [
        json.dumps({k: v for k, v in json.loads(line).items() if k != "key"}) for line in lines[1:]]
    (folder / records.name.replace(".jsonl", "x.jsonl")).write_text("\n".join(old) + "\n")
    before = snapshot(folder)
    with pytest.raises(KvtError, match=r"records of an older kvt \(kvt-records-2\).*delete it to evaluate again"):
        run.main(argv(world, out=folder))
    assert snapshot(folder) == before


HEAD = "import sys\nfrom kvt.harness.tasks import Item, Task, register\n"
MC = "Item(str(i), 'Question: which?', 0, ['yes', 'no'], 'Answer:')"
GEN = "lambda: [Item('1', 'Q: which?\\nA:', 'yes', floor='A:', until=('\\n',))], 'generate_until', max_new_tokens=2"
# (id, the task file's text after HEAD, words the message must hold): each a traceback or a silent run before
TASK_FILES = [
    ("syntax error", "def (:\n", ["line 3", "fix the file"]),
    ("missing import", "import no_such_module_kvt\n", ["line 3", "ModuleNotFoundError", "install what it imports"]),
    ("raises at import", "x = 1 / 0\n", ["line 3", "ZeroDivisionError", "fix the file"]),
    ("sys.exit", "sys.exit(0)\n", ["called sys.exit(0)", "defines tasks and returns"]),
    ("choices not text", "T = Task('bad', lambda: [Item('1', 'Q', 0, [1, 2], 'A')])\n",
     ["choice 0 is 1", "non-empty string"]),
    ("context None", "T = Task('bad', lambda: [Item('1', None, 0, ['a', 'b'], 'A')])\n", ["its context is None", "text"]),
    ("loader raises", "def load():\n    raise RuntimeError('boom')\nT = Task('bad', load)\n",
     ["its loader raised RuntimeError: boom", "fix the loader"]),
    ("loader KeyError", "T = Task('bad', lambda: [{}['question']])\n", ["its loader raised KeyError", "fix the loader"]),
    ("loader returns None", "T = Task('bad', lambda: None)\n", ["its loader returned NoneType", "a list of Items"]),
    ("loader returns []", "T = Task('bad', lambda: [])\n", ["bad: no items", "its loader returned []"]),
    ("two tasks of one name", f"A = Task('bad', lambda: [{MC} for i in range(2)])\nB = Task('bad', lambda: [])\n",
     ["two tasks are named 'bad'", "its own name"]),
    ("registered twice", f"register(Task('bad', lambda: [{MC} for i in range(2)]))\nregister(Task('bad', lambda: []))\n",
     ["two tasks are named 'bad'", "its own name"]),
    ("score raises", f"T = Task('bad', {GEN}, score=lambda out, gold: {{'em': 1 / 0}})\n",
     ["its score function raised ZeroDivisionError", "fix it"]),
    ("score not a number", f"T = Task('bad', {GEN}, score=lambda out, gold: {{'em': 'yes'}})\n",
     ["returned {'em': 'yes'}", "a number"]),
]


@pytest.mark.parametrize("case", TASK_FILES, ids=[c[0] for c in TASK_FILES])
def test_a_bad_task_file_is_one_line(world, registry, case):
    """Guards: a task file's own errors (syntax, imports, a loader or score raising or returning the wrong
    thing, sys.exit) ending in a traceback, an empty table with exit 0, or a record that crashes the next
    run; a loader's KeyError reported as "no data files"; two tasks of one name where the last one won."""
    _, text, words = case
    f = world["root"] / "bad_tasks.py"
    f.write_text(HEAD + text)
    with pytest.raises(KvtError) as e:
        run.main(argv(world, "--task-file", str(f), "--tasks", "bad", "--calib", calib_text(world),
                      out=world["root"] / "bad_task_run"))
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    assert "write the files again" not in msg  # the loader, not data, is at fault
    assert not list((world["root"] / "bad_task_run").glob("records-*")) or "score" in case[0]


def test_one_task_name_in_two_task_files_is_refused(world, registry):
    """Guards: the same task name in two --task-file, where the last one silently won."""
    for name in ("one.py", "two.py"):
        (world["root"] / name).write_text(HEAD + f"T = Task('same', lambda: [{MC} for i in range(2)])\n")
    with pytest.raises(KvtError, match=r"task 'same' is defined in both .*one.py and .*two.py; give each its own name"):
        run.main(argv(world, "--task-file", str(world["root"] / "one.py"), "--task-file", str(world["root"] / "two.py"),
                      "--tasks", "same", out=world["root"] / "same_run"))


def spoil_rows(how):
    def change(folder):
        path = folder / "arc_easy" / "test.jsonl"
        if how == "empty":
            path.write_text("")
        elif how == "null":
            rows = path.read_text().splitlines()
            path.write_text("\n".join(rows[:1] + [json.dumps({**json.loads(rows[1]), "question": None})] + rows[2:]))
        elif how == "latin-1":
            path.write_bytes(path.read_bytes().replace(b"Which", b"Wh\xefch", 1))
        elif how == "folder":
            path.unlink()
            path.mkdir()
    return change


@pytest.mark.parametrize("how,words", [
    ("empty", ["arc_easy: no items", "hold no rows"]),
    ("null", ["test.jsonl, line 2: field 'question' is null", "drop the line"]),
    ("latin-1", ["is not UTF-8", "write the file again as UTF-8"]),
    ("folder", ["test.jsonl is a folder", "to_json"]),
])
def test_bad_data_files_are_one_line(world, how, words):
    """Guards: an empty data file (exit 0, an empty table), a null field (scored as the text "None"), a
    Latin-1 byte (UnicodeDecodeError) and a folder where the file should be (IsADirectoryError)."""
    folder = arc_folder(world, f"data_{how}")
    spoil_rows(how)(folder)
    with pytest.raises(KvtError) as e:
        run.main(argv(world, "--tasks", "arc_easy", "--data-dir", str(folder), out=world["root"] / "data_run"))
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    assert not (world["root"] / "data_run").exists()


def test_a_misspelled_task_limit_is_refused(world):
    """Guards: --task-limit toy_recal=1 (no such task in the run) silently ignored."""
    with pytest.raises(KvtError, match=r"--task-limit toy_recal=1: 'toy_recal' is not a task of this run \(toy_recall\)"):
        run.main(argv(world, "--task-limit", "toy_recal=1"))


def test_a_records_file_kvt_cannot_open_is_one_line(tmp_path):
    """Guards: a read-only records file ending in a PermissionError traceback when a finished run's records
    open for append (a folder in its place fails the same way, root included). The folder itself is
    checked up front: tests/test_robustness.py."""
    with pytest.raises(KvtError, match="cannot write to .*make it writable, or choose another --out"):
        open_records(tmp_path, {})


# ---- plan, bench, cascade: their arguments and files ---------------------------------------------------------

@pytest.mark.parametrize("module,args,words", [
    ("plan", ["--k", "0"], ["--k 0: must be at least 1"]),
    ("plan", ["--context", "0"], ["--context 0: must be at least 1"]),
    ("plan", ["--batch", "-3"], ["--batch -3: must be at least 1"]),
    ("plan", ["--count", "0"], ["--count 0: must be at least 1"]),
    ("bench", ["--lengths", "abc"], ["--lengths 'abc'", "e.g. 512,1024"]),
    ("bench", ["--recompute", "abc"], ["--recompute 'abc'", "fractions of the prompt in (0, 1]"]),
    ("bench", ["--k", "0", "--lengths", "4", "--repeats", "1"], ["--k 0: must be at least 1"]),
    ("bench", ["--repeats", "0"], ["--repeats 0: must be at least 1"]),
    ("bench", ["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "tpu"], ["--device", "use"]),
    ("cascade", ["R", "--tokens", "0"], ["--tokens 0: must be at least 1"]),
    ("cascade", ["R", "--tokens", "-5"], ["--tokens -5: must be at least 1"]),
    ("cascade", ["R", "--frac", "5"], ["--frac 5.0", "within [0, 1]"]),
    ("cascade", ["R", "--k", "0"], ["--k 0: must be at least 1"]),
    ("cascade", ["R", "--shapes", "qwen3-1.7b:0.6b"], ["qwen3-1.7b is not smaller than qwen3-0.6b", "small model first"]),
    ("cascade", ["DONE/results.json"], ["is not a records file", "not its results.json"]),
    ("cascade", ["DONE/missing.jsonl"], ["no such records file", "records-*.jsonl"]),
    ("cascade", ["R", "--bench", "DONE/missing.json"], ["--bench", "no such file", "kvt bench --lengths 4096 --json"]),
    ("cascade", ["R", "--bench", "DONE/results.json"], ["is not a kvt bench --json file", "kvt bench --lengths"]),
], ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_plan_bench_and_cascade_arguments_are_one_line(world, module, args, words):
    """Guards: plan saying "fits" for --k 0, --context 0 or --batch -3 (-30 GiB) and a traceback for --count 0;
    bench tracebacks for --lengths abc, --recompute abc, --k 0 (after minutes of work) and CUDA that is not
    there; cascade accepting --tokens 0, --frac 5, --k 0 or a large:small --shapes, and tracebacks on a
    results.json, a missing records file, a missing or broken --bench file."""
    import importlib
    from kvt.cli import COMMANDS
    done = world["done"]
    args = [str(the(done, "records-*")) if a == "R" else a.replace("DONE", str(done)) for a in args]
    with pytest.raises(KvtError) as e:
        importlib.import_module(f"kvt.{COMMANDS[module]}").main(args)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_cascade_refuses_a_cut_or_corrupt_records_file(world):
    """Guards: kvt cascade reading a records file cut short (447 of 800 items) or with a corrupt middle
    line without a word, over the items that happened to be there."""
    from kvt.teach import cascade
    folder = run_folder_copy(world, "cascade_cut")
    records = the(folder, "records-*")
    lines = records.read_text().splitlines()
    cascade.read(records)                                             # the whole file reads
    records.write_text("\n".join(lines[:-4]) + "\n")                  # the last item cut off, at a line boundary
    with pytest.raises(KvtError, match=r"holds 5 of the 6 items .*results.json lists; the file was cut short"):
        cascade.read(records)
    records.write_text("\n".join(lines[:-2]) + "\n")                  # an item without all its conditions
    with pytest.raises(KvtError, match=r"1 items lack a condition .*run it again with the same settings"):
        cascade.read(records)
    records.write_text("\n".join(lines[:3] + ["{corrupt"] + lines[4:]) + "\n")
    with pytest.raises(KvtError, match=r"line 4: not a record \(corrupt\)"):
        cascade.read(records)
    records.write_text("\n".join(lines) + "\n" + lines[-1][:20])      # a torn last line is skipped
    assert len(cascade.read(records)) == len(lines) - 1


# ---- figures, toy, family, and the kvt command itself -------------------------------------------------------

@pytest.mark.parametrize("args,words", [
    (["gate"], ["figures gate reads files", "results.json files"]),
    (["scaling"], ["figures scaling reads files", "kvt bench --json files"]),
    (["gate", "DONE/missing.json"], ["missing.json: no such file", "give a results.json"]),
    (["scaling", "DONE/results.json"], ["is not a kvt bench --json file", "lacks"]),
    (["gate", "RECORDS"], ["is not a results.json of a finished kvt run", "JSONDecodeError"]),
    (["recompute", "DONE"], ["is not a results.json", "IsADirectoryError"]),
    (["r2", "--k", "0"], ["--k 0: must be at least 1"]),
], ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_figures_arguments_and_files_are_one_line(world, args, words):
    """Guards: kvt figures gate with no files ending in exit 0 and a table of nan; tracebacks for a
    missing file, a results.json given to scaling, a records .jsonl given to gate, and r2 --k 0."""
    from kvt.harness import figures
    done = world["done"]
    args = [str(the(done, "records-*")) if a == "RECORDS" else a.replace("DONE", str(done)) for a in args]
    with pytest.raises(KvtError) as e:
        figures.main(args)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_figures_r2_finds_the_toy_family_where_kvt_finds_it(monkeypatch, tmp_path):
    """Guards: kvt figures r2 after `pip install .` looking for the toy weights in site-packages/weights
    (they install in <prefix>/share/kvt/weights, which kvt.config.find_weights looks in)."""
    from kvt import config
    from kvt.harness import figures
    seen = []
    monkeypatch.setattr(config, "find_weights", lambda name, weights=None: seen.append(name) or tmp_path / name)
    with pytest.raises(KvtError, match="no checkpoint folder"):
        figures.main(["r2"])
    assert seen == ["toy-s", "toy-m"]


def test_toy_and_family_arguments_are_one_line(tmp_path):
    """Guards: kvt toy train --max-steps 0 ending in UnboundLocalError, and kvt family build --seq-len 0 in a
    ZeroDivisionError after a minute of work."""
    from kvt.teach import family
    from kvt.harness import toy
    with pytest.raises(KvtError, match=r"--max-steps 0: must be at least 1"):
        toy.main(["train", "--max-steps", "0", "--out", str(tmp_path)])
    fam = ["build", "--parent", str(ROOT / "weights" / "toy-m"), "--kind", "depth", "--out", str(tmp_path / "sib")]
    for extra, words in [(["--seq-len", "0"], "--seq-len 0: must be at least 2"),
                         (["--tokens", "10"], "--tokens 10: fewer than one step"), (["--lr", "0"], "--lr 0.0")]:
        with pytest.raises(KvtError, match=words):
            family.main(fam + extra)
    assert not (tmp_path / "sib").exists()


def test_a_failed_family_build_removes_the_out_it_created(tmp_path):
    """Guards: a kvt family build refused after it made --out (a --keep beyond the parent's layers)
    leaving an empty folder behind."""
    from kvt.teach import family
    shared = SHARED / "data" / "calib"
    if not (shared / "wikitext-2" / "valid.txt").exists():
        pytest.skip("no ../shared/data/calib")
    with pytest.raises(KvtError, match="--keep 99"):
        family.main(["build", "--parent", str(ROOT / "weights" / "toy-m"), "--kind", "depth", "--out",
                     str(tmp_path / "sib"), "--keep", "99", "--score-seqs", "1", "--score-len", "8", "--windows", "1",
                     "--window-len", "8"])
    assert not (tmp_path / "sib").exists()


def kvt_cli(capsys, *args):
    """`kvt ARGS` in this process: (exit status, stdout, stderr)."""
    from kvt import cli
    with pytest.raises(SystemExit) as e:
        cli.entry(list(args))
        sys.exit(0)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_the_kvt_command_says_how_to_use_it(capsys):
    """Guards: `kvt --help` and a bare `kvt` printing the command list to stderr with no usage line and
    no hint about `kvt <command> --help`; subcommands calling themselves `kvt` or `python -m kvt.harness.toy`;
    cascade, figures, family and toy exiting 1 on user errors where the rest exit 2."""
    code, out, err = kvt_cli(capsys, "--help")
    assert code == 0 and out.startswith("usage: kvt <command>") and "kvt <command> --help" in out and not err
    code, out, err = kvt_cli(capsys)
    assert code == 2 and err.startswith("usage: kvt <command>")
    code, out, err = kvt_cli(capsys, "nope")
    assert code == 2 and err.strip() == ("kvt: unknown command 'nope'; the commands are run, bench, plan, toy, family, "
                                         "figures, cascade, course (kvt --help)")
    for cmd in ("run", "bench", "plan", "toy", "family", "figures", "cascade"):
        code, out, err = kvt_cli(capsys, cmd, "--help")
        assert code == 0 and out.startswith(f"usage: kvt {cmd} "), (cmd, out[:80])
    for args in (["cascade", "nope.jsonl"], ["figures", "gate"], ["toy", "train", "--max-steps", "0"],
                 ["family", "build", "--parent", "x", "--kind", "depth", "--out", "y", "--seq-len", "0"]):
        code, out, err = kvt_cli(capsys, *args)
        assert code == 2 and err.startswith("kvt: ") and len(err.strip().splitlines()) == 1, (args, err)


def test_plan_and_bench_options_have_help(monkeypatch):
    """Guards: most plan and bench options without a word of help."""
    import argparse

    from kvt.harness import bench, plan
    given, add = [], argparse.ArgumentParser.add_argument
    monkeypatch.setattr(argparse.ArgumentParser, "add_argument",
                        lambda self, *a, **kw: given.append((a[0], kw.get("help"))) or add(self, *a, **kw))
    for module in (plan, bench):
        with pytest.raises(SystemExit), pytest.MonkeyPatch.context() as m:
            m.setattr(sys, "stdout", open("/dev/null", "w"))
            module.main(["--help"])
    assert len(given) > 20 and not [name for name, text in given if not text], given


def test_every_file_of_a_run_is_readable_by_all(world):
    """Guards: mapper and statistics files written 0600 (safetensors' own mode) where the rest are 0644."""
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in world["done"].iterdir() if f.is_file()}
    assert any(n.startswith("mapper-") for n in modes) and any(n.startswith("stats-") for n in modes), modes
    assert set(modes.values()) == {"0o644"}, modes


def test_the_report_says_why_it_has_no_figure(world, monkeypatch):
    """Guards: report.md naming no retention figure, without a word, when matplotlib is not installed."""
    from kvt.harness import figures
    monkeypatch.setattr(figures, "pyplot", lambda say=False: None)
    folder = run_folder_copy(world, "no_matplotlib")
    (folder / "retention.png").unlink(missing_ok=True)
    run.main(argv(world, out=folder))
    report = (folder / "report.md").read_text()
    assert "no retention figure: matplotlib is not installed; pip install kvt[plots]" in report
    assert "![retention]" not in report and not (folder / "retention.png").exists()


def test_python_dash_m_ends_errors_as_kvt_does():
    """Guards: `python -m kvt.teach.cascade` (as README and the tutorial run it) ending a KvtError in a traceback,
    or exiting 1 where `kvt cascade` exits 2."""
    p = subprocess.run([sys.executable, "-m", "kvt.teach.cascade", "nope.jsonl"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and p.stderr.strip() == ("kvt: nope.jsonl: no such records file; give the records-*.jsonl "
                                                      "of a finished kvt run"), p.stderr
