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
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvt
from kvt import pipeline as run
from kvt.config import KvtError
from tests.conftest import ROOT, SHARED, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = ["--tasks", "toy_recall", "--limit", "6", "--calib-seqs", "12", "--calib-len", "40", "--k", "2", "--no-bench"]


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
    from kvt import toy
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
    got, want = (json.loads(line) for line in (records.read_text().splitlines()[-1], lines[-1]))
    assert records.read_text().splitlines()[:-1] == lines[:-1] and got.keys() == want.keys()
    for key, value in want.items():                          # numbers within float32 rounding, the rest equal
        numbers = isinstance(value, float) or isinstance(value, list) and value and isinstance(value[0], float)
        assert got[key] == (pytest.approx(value, rel=1e-5) if numbers else value), (key, got, want)
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


def test_ctrl_c_says_a_rerun_resumes(world, tmp_path):
    """Guards: a KeyboardInterrupt traceback that leaves the user unsure whether the work is lost."""
    args = argv(world, out=tmp_path / "run")
    args[args.index("--calib-seqs") + 1] = "400"                    # long enough to be interrupted
    p = subprocess.Popen([sys.executable, "run.py"] + args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                         text=True, cwd=ROOT)
    deadline = time.time() + 60
    while not list((tmp_path / "run").glob("stats-*")) and time.time() < deadline:  # calibrating by now
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    err = p.communicate(timeout=60)[1].strip().splitlines()
    assert p.returncode == 130 and err[-1] == "kvt: interrupted; run the same command again to resume where it stopped"


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
