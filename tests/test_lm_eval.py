"""kvt.integrations.lm_eval: kvt's conditions as an lm-evaluation-harness model, against two oracles.

Under `target` the oracle is the harness's own `hf` model on the same checkpoint; under `transfer` it is
kvt's own evaluation (kvt.harness.evals.evaluate) of the same items. The tasks are harness tasks defined here
from local jsonl files (kvt implements none of them), run offline: the toy family by default, SmolLM2 and
a second transformers version behind the slow marker.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SHARED, calib_of, run_pytest, second_venv

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")          # the harness's hf model needs it
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import lm_eval  # noqa: E402
from lm_eval.loggers import EvaluationTracker  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import kvt  # noqa: E402
from kvt.harness import evals as E  # noqa: E402
from kvt.harness import tasks as T  # noqa: E402
from kvt.harness import toy  # noqa: E402
from kvt.config import KvtError  # noqa: E402
from kvt.harness.data import calibration_sequences  # noqa: E402
from kvt.integrations.lm_eval import KvtLM, cli, main, retention  # noqa: E402
from kvt.harness.calibration import CalibrationOptions, calibrate  # noqa: E402
from kvt.harness.files import save_mapper  # noqa: E402

TOY = ROOT / "weights"

MC = """task: toy_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {path}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list: [{{metric: acc}}]
"""
ROLL = """task: toy_roll
dataset_path: json
dataset_kwargs: {{data_files: {{test: {path}}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list: [{{metric: word_perplexity}}, {{metric: byte_perplexity}}, {{metric: bits_per_byte}}]
"""
GEN = """task: toy_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {path}}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: [",", "."], max_gen_toks: 6, do_sample: false}}
metric_list: [{{metric: exact_match}}]
"""


def write_task(folder, template, name, rows):
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(template.format(path=json.dumps(str(path))))


@pytest.fixture(scope="module")
def harness_tasks(tmp_path_factory):
    """Three harness tasks from local files, in the harness's three request types: toy_mc (toy_recall's
    first 8 items as multiple choice), toy_roll (3 texts of 3 toy documents each, perplexity) and toy_gen (toy_recall_gen's
    first 4, generated until "," or "."). Returns (folder, TaskManager, the kvt items of toy_mc and toy_gen)."""
    folder = tmp_path_factory.mktemp("harness_tasks")
    mc, gen = T.load_task("toy_recall", None, 8), T.load_task("toy_recall_gen", None, 4)
    write_task(folder, MC, "toy_mc", [{"id": i.id, "context": i.context, "choices": i.choices, "gold": i.gold}
                                      for i in mc])
    docs = toy.corpus(9, seed=5)
    write_task(folder, ROLL, "toy_roll", [{"text": "\n".join(docs[i:i + 3])} for i in (0, 3, 6)])
    write_task(folder, GEN, "toy_gen", [{"id": i.id, "context": i.context, "answer": i.gold} for i in gen])
    return folder, TaskManager(include_path=str(folder), include_defaults=False), {"toy_mc": mc, "toy_gen": gen}


def run(lm, harness_tasks, names=("toy_mc", "toy_roll", "toy_gen")):
    """{task: [resps of each doc, in doc order]} and {task: [doc of each]} from simple_evaluate."""
    res = lm_eval.simple_evaluate(model=lm, tasks=list(names), task_manager=harness_tasks[1], log_samples=True,
                                  bootstrap_iters=0)
    samples = {t: sorted(res["samples"][t], key=lambda s: s["doc_id"]) for t in names}
    return {t: [s["resps"] for s in ss] for t, ss in samples.items()}, {t: [s["doc"] for s in ss] for t, ss in samples.items()}


def lls(resps):
    """The loglikelihood of every request of every doc, flat (multiple choice: a (ll, greedy) per choice;
    rolling: one float)."""
    return [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for doc in resps for r in doc]


def max_err(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def toy_pair(one_thread, tmp_path_factory):
    """toy-s -> toy-m and a mapper fitted on a small toy calibration, saved as a file."""
    tok = kvt.load_tokenizer(TOY / "toy-m")
    calib = calibration_sequences(None, tok, 40, 128, documents=toy.corpus(500, seed=99))
    source, target = kvt.load_model(TOY / "toy-s"), kvt.load_model(TOY / "toy-m")
    mapper, _ = calibrate(source, target, calib, options=CalibrationOptions(progress=False))
    path = tmp_path_factory.mktemp("mapper") / "mapper.safetensors"
    save_mapper(mapper, path)
    return source, target, tok, mapper, path


def test_target_equals_the_harness_hf_model(harness_tasks, one_thread):
    """Under `target`, every loglikelihood equals the harness's own hf model's on the same checkpoint
    within 1e-3 (multiple choice, and rolling windows of 128 tokens, so a text spans two or three), and
    the generations are the same text. Guards tokenizing unlike the harness (the space before a choice,
    the prefix token of a rolling window) and an off-by-one in the windows."""
    hf = HFLM(pretrained=str(TOY / "toy-m"), dtype="float32", device="cpu", max_length=128, batch_size=4)
    ours, _ = run(KvtLM(target=str(TOY / "toy-m"), condition="target", max_length=128, device="cpu"), harness_tasks)
    theirs, _ = run(hf, harness_tasks)
    for task in ("toy_mc", "toy_roll"):
        err = max_err(lls(ours[task]), lls(theirs[task]))
        assert err < 1e-3, f"{task}: kvt target vs the harness's hf model, max |loglikelihood difference| {err:.2e}"
    assert ours["toy_gen"] == theirs["toy_gen"]


def test_transfer_equals_kvt_records_and_batch_sizes_agree(harness_tasks, toy_pair):
    """Under `transfer` (toy-s -> toy-m, a saved mapper), every choice's loglikelihood equals kvt's own
    evaluation record of the same item (kvt.harness.evals.evaluate, its transfer condition) and every generation
    its output; batch sizes 1 and 3 give the same numbers; transfer is not the target's own prefill, and
    is again once every slot is recomputed (recompute_frac=1, by rank: its subspaces from the run's
    calibration text). Guards a model that ignores the mapper, the source or the recompute budget (or the
    rank rule's), and scores that depend on the batch."""
    source, target, tok, mapper, path = toy_pair
    make = lambda bs: KvtLM(source=str(TOY / "toy-s"), target=str(TOY / "toy-m"), condition="transfer",  # noqa: E731
                            mapper=str(path), batch_size=bs, device="cpu")
    one, docs = run(make(1), harness_tasks, ("toy_mc", "toy_gen"))
    three, _ = run(make(3), harness_tasks, ("toy_mc", "toy_gen"))
    assert max_err(lls(one["toy_mc"]), lls(three["toy_mc"])) < 1e-5 and one["toy_gen"] == three["toy_gen"]
    conds = {"transfer": E.Condition(target, E.transfer(source, target, mapper)), "target": E.Condition(target)}
    items = harness_tasks[2]
    recs = {(r["task"], r["condition"], r["id"]): r for task in ("toy_recall", "toy_recall_gen")
            for r in E.evaluate(task, items["toy_mc" if task == "toy_recall" else "toy_gen"], tok, conds,
                                progress=False)}
    mine = [recs[("toy_recall", "transfer", d["id"])]["lls"] for d in docs["toy_mc"]]
    err = max_err(lls(one["toy_mc"]), [x for r in mine for x in r])
    assert err < 1e-4, f"harness transfer vs kvt's transfer records: max |loglikelihood difference| {err:.2e}"
    own = [x for d in docs["toy_mc"] for x in recs[("toy_recall", "target", d["id"])]["lls"]]
    assert max_err(lls(one["toy_mc"]), own) > 1e-3, "transfer gave the target's own loglikelihoods"
    assert [r[0][0] for r in one["toy_gen"]] == [recs[("toy_recall_gen", "transfer", d["id"])]["output"]
                                                 for d in docs["toy_gen"]]
    # a recompute budget of every slot is the target's own prefill again
    full, _ = run(KvtLM(source=str(TOY / "toy-s"), target=str(TOY / "toy-m"), condition="transfer", mapper=str(path),
                        recompute_frac=1.0, recompute_by="rank", recompute_rank=8, device="cpu"), harness_tasks,
                  ("toy_mc",))
    err = max_err(lls(full["toy_mc"]), own)
    assert err < 1e-4, f"transfer recomputing every slot vs the target's own prefill: {err:.2e}"


def test_exact_pair_keeps_everything_through_the_command(harness_tasks, tiny_pair, tmp_path, capsys):
    """The command end to end on an exact pair (a model and its function-preserving twin): `python -m
    kvt.integrations.lm_eval` writes the harness's results and samples under transfer, the harness's tracker the same
    under target, and `retention` pairs them by doc id: retention 100%, the same accuracy. Guards pairing
    by position instead of doc id, and a folder read under the wrong condition."""
    folder, tm, _ = harness_tasks
    src, tgt = tiny_pair / "source", tiny_pair / "twin"
    s, t = kvt.load_model(src), kvt.load_model(tgt)
    ids = torch.randint(0, s.config.vocab_size, (14, 32), generator=torch.Generator().manual_seed(0))
    mapper, _ = calibrate(s, t, calib_of(ids), scope="head", k=1, lam=1e-9, options=CalibrationOptions(progress=False))
    save_mapper(mapper, tmp_path / "m.safetensors")
    main(["--model_args", f"source={src},target={tgt},condition=transfer,mapper={tmp_path / 'm.safetensors'}",
          "--tasks", "toy_mc", "--include_path", str(folder), "--device", "cpu", "--batch_size", "2",
          "--output_path", str(tmp_path / "transfer"), "--log_samples"])
    assert list((tmp_path / "transfer").rglob("samples_toy_mc_*.jsonl")), "the harness wrote no samples file"
    tracker = EvaluationTracker(output_path=str(tmp_path / "target"))
    res = lm_eval.simple_evaluate(model=KvtLM(target=str(tgt), device="cpu"), tasks=["toy_mc"], task_manager=tm,
                                  log_samples=True, evaluation_tracker=tracker, bootstrap_iters=0)
    samples = res.pop("samples")
    tracker.save_results_aggregated(results=res, samples=samples)
    tracker.save_results_samples(task_name="toy_mc", samples=samples["toy_mc"])
    summary, _, pair = retention([str(tmp_path / "transfer"), f"target={tmp_path / 'target'}"])  # any order
    assert pair == ["source", "twin"]
    s = summary["lm_eval:toy_mc"]
    assert s["target"]["n"] == s["transfer"]["n"] == 8 and s["retention"]["acc"]["n"] == 8
    assert s["target"]["acc"] > 0 and s["retention"]["acc"]["ratio"] == 1.0
    main(["retention", f"target={tmp_path / 'target'}", str(tmp_path / "transfer")])
    assert "| lm_eval:toy_mc | acc |" in capsys.readouterr().out


def test_retention_pairs_by_doc_id(tmp_path):
    """Two hand-written harness folders: the transfer run lacks doc 1 and lists its docs in another order.
    Retention pairs doc 0 with doc 0 on the docs both have (0 and 2): 50%. Guards pairing by line order
    (which gives 100% here)."""
    for cond, acc in (("target", {0: 1.0, 1: 0.0, 2: 1.0}), ("transfer", {2: 0.0, 0: 1.0})):
        d = tmp_path / cond / "model"
        d.mkdir(parents=True)
        (d / "results_2026.json").write_text(json.dumps({"config": {"model": "kvt", "model_args": f"condition={cond}"}}))
        (d / "samples_t_2026.jsonl").write_text("".join(json.dumps(
            {"doc_id": i, "filter": "none", "metrics": ["acc"], "acc": a}) + "\n" for i, a in acc.items()))
    summary, _, _ = retention([str(tmp_path / "target"), str(tmp_path / "transfer")])
    assert summary["lm_eval:t"]["retention"]["acc"]["ratio"] == 0.5
    with pytest.raises(KvtError, match="target and a transfer"):
        retention([str(tmp_path / "target")])


def test_bad_model_args_are_one_line(tmp_path, capsys):
    """A condition kvt lacks, a missing target, an automatic batch size or dtype are refused with KvtError, which
    the command prints as one line `kvt: ...` with exit status 2."""
    with pytest.raises(KvtError, match="condition=bogus"):
        KvtLM(target=str(TOY / "toy-m"), condition="bogus")
    with pytest.raises(KvtError, match="need source"):
        KvtLM(condition="transfer", target=str(TOY / "toy-m"))
    with pytest.raises(KvtError, match="batch_size"):
        KvtLM(target=str(TOY / "toy-m"), batch_size="auto")
    with pytest.raises(KvtError, match="dtype=auto"):
        KvtLM(target=str(TOY / "toy-m"), dtype="auto")
    with pytest.raises(KvtError, match="plain=maybe"):
        KvtLM(target=str(TOY / "toy-m"), plain="maybe")
    with pytest.raises(SystemExit) as e:
        cli(["retention", str(tmp_path), str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("kvt: no results_") and len(err.splitlines()) == 1, err



def test_plain_reaches_the_condition(monkeypatch):
    """model_args plain=true (as the harness parses it: a bool) or KVT_PLAIN=1 decode on the plain path;
    by default the fast one. Guards: the switch parsed and dropped on its way to the condition."""
    arg = f"target={TOY / 'toy-m'}"
    assert not KvtLM.create_from_arg_string(arg).cond.plain
    assert KvtLM.create_from_arg_string(arg + ",plain=true").cond.plain
    monkeypatch.setenv("KVT_PLAIN", "1")
    assert KvtLM.create_from_arg_string(arg).cond.plain

# ---- slow: the real checkpoint, and the lowest declared transformers ------------------------------------

SMOLLM2 = ROOT / "weights" / "smollm2-135m"
DATA = SHARED / "data"


@pytest.mark.slow
def test_smollm2_target_equals_the_harness_hf_model(tmp_path):
    """SmolLM2-135M, offline from ../shared/data: an MMLU continuation variant (the answer's text after
    "Answer:", not a letter) and WikiText-2 pages (windows of 256 tokens): kvt's target equals the
    harness's hf model within 1e-3 per request."""
    if not (SMOLLM2 / "model.safetensors").exists():
        pytest.skip(f"no {SMOLLM2}/model.safetensors; python {SHARED}/tools/smollm2.py {SMOLLM2}")
    rows = [json.loads(line) for line in (DATA / "mmlu" / "test.jsonl").read_text().splitlines()[::700][:12]]
    path = tmp_path / "mmlu.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "mmlu.yaml").write_text(f"""task: mmlu_cont_local
dataset_path: json
dataset_kwargs: {{data_files: {{test: {json.dumps(str(path))}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question.strip()}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list: [{{metric: acc}}]
""")
    text = (DATA / "calib" / "wikitext-2" / "test.txt").read_text()[:6000]
    write_task(tmp_path, ROLL.replace("toy_roll", "wiki_local"), "wiki_local", [{"text": text[:3000]}, {"text": text[3000:]}])
    tm = TaskManager(include_path=str(tmp_path), include_defaults=False)
    names = ("mmlu_cont_local", "wiki_local")
    hf = HFLM(pretrained=str(SMOLLM2), dtype="float32", device="cpu", max_length=256, batch_size=4)
    ours, _ = run(KvtLM(target=str(SMOLLM2), condition="target", max_length=256, device="cpu", batch_size=4),
                  (None, tm), names)
    theirs, _ = run(hf, (None, tm), names)
    for task in names:
        err = max_err(lls(ours[task]), lls(theirs[task]))
        assert err < 1e-3, f"{task}: max |loglikelihood difference| {err:.2e}"


@pytest.mark.slow
def test_hf_interop_on_the_lowest_declared_transformers(tmp_path):
    """kvt.integrations.hf's tests on transformers 5.0.0, the lowest version kvt[hf] declares (the default run tests the
    installed one): guards reading the output's cache under one name only (5.0 calls it past_key_values,
    5.24 cache) and handing generate() position_ids (5.0 reuses them unchanged at every step). Needs PyPI;
    about 5 minutes on 2 shared cores."""
    py = second_venv(tmp_path, "transformers==5.0.0", "kernels==0.12.3")  # the kernels of its day: it imports the
    # one newer transformers need (0.19, seen through the .pth) and fails ("a revision or a version must be specified")
    run_pytest(py, "tests/test_hf.py")


@pytest.mark.slow
def test_lm_eval_on_the_lowest_declared_harness(tmp_path):
    """This file's default tests on lm-eval 0.4.10, the lowest version kvt[lmeval] declares (0.4.8 does not
    import beside transformers 5). Needs PyPI; about 3 minutes on 2 shared cores."""
    py = second_venv(tmp_path, "lm-eval==0.4.10")
    run_pytest(py, "tests/test_lm_eval.py", "-m", "not slow")
