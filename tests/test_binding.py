"""A mapper made in code is bound to its pair's weights, and the binding sees every value (issue #64).

Two cases that passed before: README's "Using kvt from code" path (kvt.calibrate.calibrate, which
recorded no fingerprints) met a target of toy-m's config with 5% noise on every matrix, and a mapper met
toy-m with two values of model.layers.1.mlp.down_proj.weight moved by 1e-3, outside the 8 middle columns
the sampled id (weights.weights_fingerprint) reads. Every place that meets a mapper and a model refuses
both, in one line: kvt.integrations.hf.transfer, handoff and take_over, run.py's reuse of a mapper file
(pipeline.get_mapper), kvt.integrations.lm_eval, and the serving connector's check (weights.other_weights
on folder_digest, as KvtConnector.unfit_because runs it; the engines themselves: tests/test_vllm.py, slow).
"""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import kvt
from kvt import weights
from kvt.calibrate import calibrate
from kvt.config import KvtError
from kvt.handoff import handoff, take_over
from kvt.harness import toy
from kvt.harness.data import calibration_sequences
from kvt.harness.files import load_mapper, save_mapper
from kvt.weights import (SAMPLE_COLS, folder_digest, folder_fingerprint, model_digest, model_fingerprint,
                         other_weights, write_safetensors)
from tests.conftest import ROOT

pytestmark = pytest.mark.usefixtures("one_thread")

TOYS = ROOT / "weights"
EDITED = "model.layers.1.mlp.down_proj.weight"     # (96, 288): its sampled columns are 140..147
EDITS = (((7, 3), 1e-3), ((13, 5), -1e-3))


def noisy(model, scale=0.05, seed=0):
    """model with every matrix moved by noise of `scale` times its own spread, in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    return model


def two_values(model, name=EDITED):
    """model with two values of `name` moved by 1e-3, outside the sampled columns, in place."""
    with torch.no_grad():
        w = model.get_parameter(name)
        for (r, c), d in EDITS:
            w[r, c] += d
    return model


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """README's snippet's mapper (kvt.calibrate.calibrate on toy-s -> toy-m, its calibration), its file,
    toy-m's folder with the two-value edit, and a token prompt."""
    tok = kvt.load_tokenizer(TOYS / "toy-m")
    calib = calibration_sequences(None, tok, 40, 128, documents=toy.corpus(500, seed=99))
    mapper, _ = calibrate(kvt.load_model(TOYS / "toy-s"), kvt.load_model(TOYS / "toy-m"), calib)
    tmp = tmp_path_factory.mktemp("binding")
    save_mapper(mapper, tmp / "m.safetensors")
    kvt.save_model(two_values(kvt.load_model(TOYS / "toy-m")), tmp / "toy-m-edited")
    (tmp / "toy-m-edited" / "tokenizer.json").write_bytes((TOYS / "toy-m" / "tokenizer.json").read_bytes())
    ids = torch.tensor([tok.encode("the cities : ray lima , rosa rome , tom oslo . it is a rainy day . so tom")])
    return mapper, tmp / "m.safetensors", tmp / "toy-m-edited", ids


def one_line_refusal(e, side="target"):
    msg = str(e.value)
    assert "\n" not in msg and f"fitted on other {side} weights" in msg and f"pass the {side} it was fitted on" in msg, msg


def test_the_core_calibrate_records_the_pairs_weights(fitted):
    """Guards kvt.calibrate.calibrate making an unbound mapper (its meta held no fingerprints, and every
    check skipped it in silence): it records both ids of both models, as the harness's calibrate does."""
    mapper = fitted[0]
    s, t = kvt.load_model(TOYS / "toy-s"), kvt.load_model(TOYS / "toy-m")
    assert (mapper.meta["src_digest"], mapper.meta["tgt_digest"]) == (model_digest(s), model_digest(t))
    assert (mapper.meta["src_weights"], mapper.meta["tgt_weights"]) == (model_fingerprint(s), model_fingerprint(t))


def test_the_two_value_edit_escapes_the_sample_and_not_the_digest(fitted, monkeypatch):
    """The premise of the second case: the edit leaves the sampled id as it was (so a check by it passed),
    and the digest sees it, from the folder, at load and from the parameters; a mapper loaded from a file
    keeps it. Guards a digest that samples, one computed at load from other bytes than model_digest's, and
    a check that hashes a loaded model again (a check per request would read every weight)."""
    _, path, edited, _ = fitted
    c0 = (288 - SAMPLE_COLS) // 2
    assert all(not c0 <= c < c0 + SAMPLE_COLS for (_, c), _ in EDITS)
    clean = kvt.load_model(TOYS / "toy-m")
    assert folder_fingerprint(edited) == folder_fingerprint(TOYS / "toy-m") == model_fingerprint(clean)
    at_load = kvt.load_model(edited)
    with monkeypatch.context() as m:
        m.setattr(weights, "tensor_digest", lambda blocks: pytest.fail("a loaded model was hashed again"))
        hashed_at_load = model_digest(at_load)
    at_load.kvt_weights.clear()                                           # hashed again, from the parameters
    assert folder_digest(edited) == hashed_at_load == model_digest(at_load) != model_digest(clean)
    assert load_mapper(path).meta["tgt_digest"] == model_digest(clean)


@pytest.mark.parametrize("case", ["noise", "two values"])
def test_hf_transfer_refuses_other_target_weights(fitted, case):
    """README's snippet, as a user runs it (transformers models), with the target edited after loading:
    kvt.integrations.hf.transfer refuses it in one line. Guards the snippet's mapper being accepted by any
    target of toy-m's config (it was, with 5% noise on every matrix), and a check by sampled values
    (it passed the two-value edit). The right pair still transfers."""
    transformers = pytest.importorskip("transformers")
    from kvt.integrations import hf
    mapper, _, _, ids = fitted
    source, target = (transformers.AutoModelForCausalLM.from_pretrained(TOYS / n) for n in ("toy-s", "toy-m"))
    assert hf.transfer(source, target, mapper, ids)[hf.CACHE].get_seq_length() == ids.shape[1] - 1
    noisy(target) if case == "noise" else two_values(target)
    with pytest.raises(KvtError) as e:
        hf.transfer(source, target, mapper, ids)
    one_line_refusal(e)


@pytest.mark.parametrize("case", ["noise", "two values"])
def test_handoff_and_take_over_refuse_other_target_weights(fitted, case):
    """Guards handoff and take_over mapping onto any target of the right config: they checked nothing. The
    target is edited in place after it was loaded and hashed, so this also guards a digest kept on the
    model that is not hashed again when a tensor changes. The right pair hands off."""
    mapper, _, _, ids = fitted
    source, target = kvt.load_model(TOYS / "toy-s"), kvt.load_model(TOYS / "toy-m")
    handoff(source, target, mapper, ids)
    _, src_cache = source(ids[:, :-1], last=True)
    noisy(target) if case == "noise" else two_values(target)
    with pytest.raises(KvtError) as e:
        handoff(source, target, mapper, ids)
    one_line_refusal(e)
    with pytest.raises(KvtError) as e:
        take_over(target, mapper, src_cache, ids[:, -1:])
    one_line_refusal(e)
    with pytest.raises(KvtError) as e:
        handoff(two_values(kvt.load_model(TOYS / "toy-s"), "model.layers.0.mlp.down_proj.weight"), kvt.load_model(
            TOYS / "toy-m"), mapper, ids)
    one_line_refusal(e, "source")


def test_run_py_refuses_a_reused_mapper_on_the_edited_target(fitted, tmp_path):
    """run.py's path (pipeline.get_mapper) with a run folder's mapper whose key matches (a hand-copied
    file: the key hashes the files, so run.py itself would refit) meeting the two-value edit: refused.
    Guards the reuse check comparing the sampled ids."""
    from kvt.harness import pipeline
    _, path, edited, _ = fitted
    s, t = kvt.load_model(TOYS / "toy-s"), kvt.load_model(edited)
    args = pipeline.Settings(source=TOYS / "toy-s", target=edited, out=tmp_path)
    skey = {"format": "s", "source": "x", "target": "y"}
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    inner = json.loads(meta["meta"]) | {"key": pipeline.short_id(pipeline.mapper_key(args, skey))}
    write_safetensors(load_file(str(path)), tmp_path / f"mapper-{pipeline.mapper_name(args, skey, s.config)}.safetensors",
                      {**meta, "meta": json.dumps(inner)})
    tok = kvt.load_tokenizer(TOYS / "toy-m")
    pipeline.get_mapper(args, pipeline.Pair(s, kvt.load_model(TOYS / "toy-m"), tok, torch.float32), None, tmp_path, skey)
    with pytest.raises(KvtError, match=r"^mapper .* was fitted on other target weights") as e:
        pipeline.get_mapper(args, pipeline.Pair(s, t, tok, torch.float32), None, tmp_path, skey)
    one_line_refusal(e)


def test_lm_eval_refuses_the_edited_target(fitted):
    """Guards `python -m kvt.integrations.lm_eval --model_args source=toy-s,target=EDITED,mapper=M` evaluating
    a transfer onto weights the mapper was not fitted on. The right target loads."""
    pytest.importorskip("lm_eval")
    from kvt.integrations.lm_eval import KvtLM
    _, path, edited, _ = fitted
    KvtLM(source=str(TOYS / "toy-s"), target=str(TOYS / "toy-m"), condition="transfer", mapper=str(path), device="cpu")
    with pytest.raises(KvtError) as e:
        KvtLM(source=str(TOYS / "toy-s"), target=str(edited), condition="transfer", mapper=str(path), device="cpu")
    one_line_refusal(e)


def test_the_connectors_check_refuses_the_edited_folder(fitted):
    """The serving connector's weight check (KvtConnector.unfit_because: other_weights on its engine's
    folder_digest) finds the edited folder other weights, and toy-m's its own. Guards a check by the
    sampled id, which the edit keeps."""
    mapper, _, edited, _ = fitted
    for folder, want in ((TOYS / "toy-m", None), (edited, (mapper.meta["tgt_digest"], folder_digest(edited)))):
        got = other_weights(mapper.meta, "target", lambda: folder_digest(folder), lambda: folder_fingerprint(folder))
        assert got == want, folder


def test_a_mapper_built_by_hand_warns_once(fitted, capsys):
    """A mapper without fingerprints (built by hand) is handed off with one warning line naming what cannot
    be checked, once for it and its copies, not a silent skip and not a line per request."""
    from kvt.mapper import Mapper
    m = fitted[0]
    bare = Mapper(m.scope, m.src_cfg, m.tgt_cfg, m.layers, m.W, m.b)
    source, target = kvt.load_model(TOYS / "toy-s"), kvt.load_model(TOYS / "toy-m")
    ids = fitted[3]
    capsys.readouterr()
    handoff(source, target, bare, ids)
    handoff(source, target, bare.to(dtype=torch.float32), ids)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "records no fingerprints" in err[0] and "cannot be checked" in err[0], err
