"""A mapper knows the weights it was fitted on, not only their config.

The pair is tiny_pair's source and its function-preserving twin: one config, other weights, so the
configs' fingerprints cannot tell them apart. A mapper fitted source -> twin meets the swapped pair
(twin -> source) in each place a mapper meets models, and each refuses it in one line naming the side;
the right pair passes. The fingerprint itself (kvt.weights.weights_fingerprint) is the same for a
checkpoint folder and for that folder loaded in memory by kvt or by transformers, in float32 or bfloat16.
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import kvt
from kvt.config import KvtError
from kvt.harness.calibration import CalibrationOptions, calibrate, check_pair_weights
from kvt.harness.files import load_mapper, save_mapper
from kvt.weights import SAMPLE_COLS, fingerprint, folder_fingerprint, model_fingerprint, write_safetensors
from tests.conftest import ROOT, calib_of

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def fitted(tiny_pair, tmp_path_factory):
    """Models source and twin (one config), a mapper fitted source -> twin, and its file."""
    s, t = kvt.load_model(tiny_pair / "source"), kvt.load_model(tiny_pair / "twin")
    ids = torch.randint(0, s.config.vocab_size, (14, 32), generator=torch.Generator().manual_seed(0))
    mapper, _ = calibrate(s, t, calib_of(ids), scope="head", k=1, lam=1e-9, options=CalibrationOptions(progress=False))
    path = tmp_path_factory.mktemp("weights_check") / "m.safetensors"
    save_mapper(mapper, path)
    return s, t, mapper, path


def test_the_pair_shares_one_config_and_not_its_weights(fitted):
    """The premise: the config fingerprint (all kvt checked before) is one for the two models."""
    s, t, _, _ = fitted
    assert s.config.fingerprint() == t.config.fingerprint()
    assert model_fingerprint(s) != model_fingerprint(t)


@pytest.mark.parametrize("name", ["toy-m", "smollm2-135m"])
def test_a_folder_and_the_same_weights_in_memory_give_one_fingerprint(name):
    """Guards a fingerprint that depends on where the weights are read from: kvt's model and transformers'
    (whose names and tied head differ from the file's), in float32 and in bfloat16 (toy-m and SmolLM2 are
    float32 files: bfloat16 rounds them), must match the folder, or the right pair would be refused."""
    folder = ROOT / "weights" / name
    if not (folder / "model.safetensors").exists():
        pytest.skip(f"no {folder}")
    transformers = pytest.importorskip("transformers")
    want = folder_fingerprint(folder)
    for dtype in (torch.float32, torch.bfloat16):
        assert model_fingerprint(kvt.load_model(folder, dtype)) == want, f"kvt, {dtype}"
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        assert model_fingerprint(hf) == want, f"transformers, {dtype}"


def test_a_bf16_checkpoint_matches_in_float16_too(tiny_pair, tmp_path):
    """A bf16 checkpoint (as Qwen3's are) loaded in float16 (lm_eval's dtype=float16) keeps its id: every
    bf16 value at least float16's smallest normal is exact in float16, and smaller ones (here a sampled
    3e-8, which float16 flushes to 0) hash as 0. Guards hashing values that float16 cannot hold (a false
    refusal of the right pair under float16)."""
    model = kvt.load_model(tiny_pair / "source", torch.bfloat16)
    with torch.no_grad():
        w = model.model.layers[0].self_attn.k_proj.weight                # row 0, first middle column: sampled
        w[0, (w.shape[1] - SAMPLE_COLS) // 2] = 3e-8
    kvt.save_model(model, tmp_path / "bf16")
    want = folder_fingerprint(tmp_path / "bf16")
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        assert model_fingerprint(kvt.load_model(tmp_path / "bf16", dtype)) == want, dtype


def test_the_fingerprint_sees_one_changed_value_and_not_the_head(tiny_pair, tmp_path):
    """Guards a fingerprint that samples too little to tell a fine-tune (here: one sampled value of one
    layer moved by 1%) from its base, and one that reads the head or final norm, which shape no cache."""
    model = kvt.load_model(tiny_pair / "source")
    before = model_fingerprint(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(2) if not model.config.tie_embeddings else None
        model.model.norm.weight.mul_(2)
        assert model_fingerprint(model) == before
        w = model.model.layers[1].self_attn.k_proj.weight          # (Hkv*D, C): row 0 and the middle columns
        c = (w.shape[1] - SAMPLE_COLS) // 2
        w[0, c] *= 1.01
    assert model_fingerprint(model) != before


def test_one_edited_row_of_any_tensor_is_refused(fitted, tiny_pair, tmp_path):
    """Guards a fingerprint that samples a few rows of each tensor (4 of them, once): replacing one other
    row (toy-m's embedding row 20, in the report) left both fingerprints as they were, and run.py reused
    the mapper fitted on the original weights. Here every row of the embedding, then one row of every
    other decoder tensor, is replaced in turn: the model's id changes each time, and the edited source
    is refused by the mapper; saved, its folder's id and its files' id (run.py's key) change too."""
    s, t, mapper, _ = fitted
    model = kvt.load_model(tiny_pair / "source")
    before = model_fingerprint(model)
    edits = [("model.embed_tokens.weight", r) for r in range(model.config.vocab_size)]
    edits += [(n, p.shape[0] // 2) for n, p in model.named_parameters() if n.startswith("model.layers.")]
    with torch.no_grad():
        for name, row in edits:
            p = model.get_parameter(name)
            old = p[row].clone()
            p[row] = torch.randn(p[row].shape, generator=torch.Generator().manual_seed(row))
            assert model_fingerprint(model) != before, f"{name} row {row}"
            p[row] = old
        assert model_fingerprint(model) == before
        model.model.embed_tokens.weight[20] += 0.5
    with pytest.raises(KvtError, match=r"^the mapper was fitted on other source weights"):
        check_pair_weights(mapper, model, t)
    kvt.save_model(model, tmp_path / "edited")
    assert folder_fingerprint(tmp_path / "edited") == model_fingerprint(model) != folder_fingerprint(tiny_pair / "source")
    assert fingerprint(tmp_path / "edited") != fingerprint(tiny_pair / "source")


def test_the_fingerprint_reads_eight_values_a_row_a_block_at_a_time(monkeypatch, tiny_pair):
    """Guards a fingerprint that reads whole tensors from a checkpoint (a 32B one would be read into
    memory whole) or whose id depends on how its rows are blocked: every read is at most SAMPLE_COLS
    columns (or a 1-D tensor) and ROW_BLOCK values, and blocks of 5 rows give the id of whole tensors."""
    from kvt import weights
    want = weights.folder_fingerprint(tiny_pair / "source")
    shapes = []
    real = weights.weights_fingerprint

    def spy(named):
        class Slice:
            def __init__(self, s):
                self.s = s

            def get_shape(self):
                return self.s.get_shape()

            def __getitem__(self, i):
                x = self.s[i]
                shapes.append(tuple(x.shape))
                return x
        return real({n: Slice(s) for n, s in named.items()})
    monkeypatch.setattr(weights, "weights_fingerprint", spy)
    monkeypatch.setattr(weights, "ROW_BLOCK", 5 * 96)                         # 5 rows of width 96 a read
    assert weights.folder_fingerprint(tiny_pair / "source") == want
    matrices = [x for x in shapes if len(x) == 2]
    assert matrices and all(r <= 5 and c == SAMPLE_COLS for r, c in matrices), set(matrices)


def test_the_mapper_records_its_pairs_weights(fitted):
    s, t, mapper, path = fitted
    meta = json.loads(load_mapper(path).meta and safe_open(str(path), "pt").metadata()["meta"])
    assert (meta["src_weights"], meta["tgt_weights"]) == (model_fingerprint(s), model_fingerprint(t))


def test_check_weights_names_the_side(fitted):
    s, t, mapper, _ = fitted
    check_pair_weights(mapper, s, t)                                            # the right pair passes
    with pytest.raises(KvtError, match=r"^the mapper was fitted on other source weights .*; pass the source it was"):
        check_pair_weights(mapper, t, s)
    with pytest.raises(KvtError, match=r"^the mapper was fitted on other target weights .*; pass the target it was"):
        check_pair_weights(mapper, s, s)


def test_hf_transfer_refuses_the_swapped_pair(fitted, tiny_pair):
    """Guards kvt.integrations.hf.transfer with a mapper fitted source -> twin, given twin -> source (one config): it ran
    and returned a wrong cache without a word. The right pair passes."""
    transformers = pytest.importorskip("transformers")
    from kvt.integrations import hf
    _, _, mapper, _ = fitted
    hs, ht = (transformers.AutoModelForCausalLM.from_pretrained(tiny_pair / n, dtype=torch.float32)
              for n in ("source", "twin"))
    ids = torch.randint(0, hs.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    assert hf.transfer(hs, ht, mapper, ids)[hf.CACHE].get_seq_length() == 11
    with pytest.raises(KvtError) as e:
        hf.transfer(ht, hs, mapper, ids)
    msg = str(e.value)
    assert "\n" not in msg and "other source weights" in msg and "pass the source it was fitted on" in msg, msg


def test_lm_eval_refuses_the_swapped_pair(fitted, tiny_pair):
    """Guards `python -m kvt.integrations.lm_eval --model_args source=B,target=A,mapper=M` with M fitted A -> B (one
    config) evaluating a wrong transfer without a word. The right pair loads."""
    pytest.importorskip("lm_eval")
    from kvt.integrations.lm_eval import KvtLM
    _, _, _, path = fitted
    src, tgt = str(tiny_pair / "source"), str(tiny_pair / "twin")
    KvtLM(source=src, target=tgt, condition="transfer", mapper=str(path), device="cpu")
    with pytest.raises(KvtError, match=r"^mapper=.* was fitted on other source weights .*pass the source it was fitted"):
        KvtLM(source=tgt, target=src, condition="transfer", mapper=str(path), device="cpu")


def test_bench_refuses_a_mapper_of_other_weights(fitted):
    """Guards kvt.harness.bench timing a fitted mapper on models it was not fitted on (its rows would describe
    another pair). A random mapper (bench's own, no fingerprints) is not checked."""
    from kvt.harness import bench
    s, t, mapper, _ = fitted
    with pytest.raises(KvtError, match=r"^the mapper small -> large was fitted on other source weights"):
        bench.bench(t, s, mapper, lengths=[8], repeats=1)
    with pytest.raises(KvtError, match=r"^the mapper small -> large was fitted on other target weights"):
        bench.bench(s, s, mapper, lengths=[8], repeats=1)
    assert bench.bench(s, t, mapper, lengths=[8], repeats=1)


def test_pipeline_checks_a_reused_mapper_against_the_models(fitted, tmp_path):
    """The run folder's mapper is keyed by its checkpoints' file fingerprints; its weights are checked
    again when it is reused. Guards a mapper whose key matches (a hand-copied file, a key of an older
    kvt's file fingerprints) reused for other weights."""
    from kvt.harness import pipeline
    s, t, mapper, path = fitted
    args = pipeline.Settings(source=Path("S"), target=Path("T"), out=tmp_path)
    skey = {"format": "s", "source": "x", "target": "y"}
    name = pipeline.mapper_name(args, skey, s.config)
    t_ = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    inner = json.loads(meta["meta"])
    inner["key"] = pipeline.short_id(pipeline.mapper_key(args, skey))
    write_safetensors(t_, tmp_path / f"mapper-{name}.safetensors", {**meta, "meta": json.dumps(inner)})
    tok = type("Tok", (), {"fingerprint": lambda self: meta["tokenizer"]})()
    got, _ = pipeline.get_mapper(args, pipeline.Pair(s, t, tok, torch.float32), None, tmp_path, skey)
    assert got.meta["src_weights"] == model_fingerprint(s)
    with pytest.raises(KvtError, match=r"^mapper .* was fitted on other source weights"):
        pipeline.get_mapper(args, pipeline.Pair(t, s, tok, torch.float32), None, tmp_path, skey)


@pytest.mark.parametrize("older", ["no fingerprints", "4-row fingerprints"])
def test_an_older_mapper_loads_with_one_warning(fitted, tmp_path, capsys, older):
    """A mapper file from before weights fingerprints, or from before they saw every row (unprefixed, 4
    rows of each tensor: they differ for the very weights they were taken of), loads with one line saying
    its weights cannot be checked, and is then not checked. Guards refusing every older file as fitted on
    "other weights", or loading it silently."""
    s, t, _, path = fitted
    t_ = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    inner = {k: v for k, v in json.loads(meta["meta"]).items() if k not in ("src_weights", "tgt_weights")}
    if older == "4-row fingerprints":
        inner |= {"src_weights": "fd237113d9c5a28e", "tgt_weights": "08e229d748a6c3b1"}
    write_safetensors(t_, tmp_path / "old.safetensors", {**meta, "meta": json.dumps(inner)})
    capsys.readouterr()
    old = load_mapper(tmp_path / "old.safetensors")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: mapper") and "cannot be checked" in err[0], err
    assert ("older fingerprint" in err[0]) == (older == "4-row fingerprints"), err
    check_pair_weights(old, s, t)                                               # nothing to check against
    check_pair_weights(old, t, s)
    load_mapper(path)
    assert not capsys.readouterr().err, "a mapper with fingerprints warned"
