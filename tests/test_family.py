"""kvt/teach/family.py: pruning keeps what matters, healing distills, builds resume bit-exactly and load back."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import kvt
from kvt.teach import family
from kvt.harness import toy
from kvt.config import KvtError
from tests.conftest import ROOT, SHARED, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")
TOY = ROOT / "weights" / "toy-l"   # the parent of the end-to-end builds: trained, 4 layers, ffn 384


def tiny_parent(seed=0, n_layers=4):
    """A random 4-layer Llama of width 64 whose outputs are far from uniform (std 0.1)."""
    return kvt.build_model(tiny_config("llama", n_layers=n_layers, vocab_size=640, tie_embeddings=True),
                           seed=seed, std=0.1)


def fake_book(title, text):
    return (f"The Project Gutenberg EBook of {title}\r\nLICENSE HEADER\r\n"
            f"*** START OF THIS PROJECT GUTENBERG EBOOK {title} ***\r\n{text}\r\n"
            f"   *** END OF THE PROJECT GUTENBERG EBOOK {title} ***\r\nLICENSE FOOTER\r\n")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """toy-l as the parent, two Gutenberg-style books and WikiText-style files of toy text."""
    root = tmp_path_factory.mktemp("family")
    shutil.copytree(TOY, root / "parent")
    (root / "books").mkdir()
    for i in range(2):
        (root / "books" / f"{i}.txt").write_text(fake_book(f"BOOK {i}", "\n".join(toy.corpus(100, seed=10 + i))))
    (root / "books" / "SOURCES.txt").write_text("not a book")
    (root / "valid.txt").write_text("\n".join(toy.corpus(60, seed=20)))
    (root / "test.txt").write_text("\n".join(toy.corpus(60, seed=21)))
    return root


def argv(root, kind, out, *extra):
    """A small build: toy-l cut to 1 of 4 layers or 48 of 384 neurons (far from the parent: healing has work
    to do), healed for 10 steps of 4 x 64 tokens."""
    return ["build", "--parent", str(root / "parent"), "--kind", kind, "--out", str(out),
            "--keep", "1" if kind == "depth" else "48", "--heal-data", str(root / "books"),
            "--score-text", str(root / "valid.txt"), "--heldout-text", str(root / "test.txt"),
            "--tokens", "2560", "--batch", "4", "--seq-len", "64", "--lr", "1e-3", "--warmup", "2",
            "--save-every", "3", "--score-seqs", "4", "--score-len", "32", "--windows", "2", "--window-len", "64",
            "--threads", "1", *extra]


def build(args):
    return family.build(family.parse(args), log=lambda *a: None)


@pytest.fixture(scope="module")
def built(setup):
    """Unbroken builds of a depth and a width sibling: {kind: (sibling, record, folder)}."""
    out = {}
    for kind in ("depth", "width"):
        folder = setup / f"sibling-{kind}"
        out[kind] = (*build(argv(setup, kind, folder)), folder)
    return out


def test_gutenberg_book_is_only_the_book():
    """Bug: healing on Project Gutenberg's license text, or missing a book whose markers are spelled
    '***START OF' or indented (4 of the 20 shared books)."""
    book = family.gutenberg_book(fake_book("X", "Call me Ishmael.\r\nSome years ago."))
    assert book == "Call me Ishmael.\nSome years ago."
    assert family.gutenberg_book("***START OF THE EBOOK***\nbody\n  ***END OF THE EBOOK***\nlicense") == "body"
    with pytest.raises(KvtError, match="marker"):
        family.gutenberg_book("no markers here")


def test_depth_pruning_drops_an_identity_block():
    """Bug: ranking blocks the wrong way round (keeping the least influential), or copying parent layer
    l into sibling layer l instead of the kept layer keep[l]."""
    parent = tiny_parent()
    parent.model.layers[1].self_attn.o_proj.weight.data.zero_()   # block 1 now adds nothing:
    parent.model.layers[1].mlp.down_proj.weight.data.zero_()      # an identity on the residual stream
    ids = torch.randint(0, 640, (2, 32), generator=torch.Generator().manual_seed(0))
    influence = family.block_influence(parent, ids)
    assert influence[1].abs() < 1e-6 < influence[[0, 2, 3]].min(), influence
    keep = family.keep_layers(influence, 3)
    assert keep.tolist() == [0, 2, 3]
    sibling = family.prune(parent, "depth", keep)
    for new, old in enumerate(keep.tolist()):
        for (name, p), (_, q) in zip(sibling.model.layers[new].named_parameters(),
                                     parent.model.layers[old].named_parameters()):
            assert torch.equal(p, q), f"sibling layer {new} {name} is not parent layer {old}'s"
    torch.testing.assert_close(sibling(ids)[0], parent(ids)[0])  # dropping an identity changes nothing


def test_width_pruning_drops_dead_neurons():
    """Bug: keeping the least active neurons, or slicing down_proj by rows (its neurons are columns)."""
    parent = tiny_parent()
    F, dead = parent.config.ffn_dim, torch.arange(0, 128, 4)       # every 4th neuron of every layer
    for block in parent.model.layers:
        block.mlp.gate_proj.weight.data[dead] = 0                    # silu(0) * up = 0: the neuron is dead
    ids = torch.randint(0, 640, (2, 32), generator=torch.Generator().manual_seed(0))
    importance = family.neuron_importance(parent, ids)              # (L, F)
    assert (importance[:, dead] == 0).all()
    keep = family.keep_neurons(importance, F - len(dead))           # (L, 96)
    assert not torch.isin(keep, dead).any()
    sibling = family.prune(parent, "width", keep)
    assert sibling.config.ffn_dim == 96 and sibling.config.n_kv_heads == parent.config.n_kv_heads
    for l, (s, p) in enumerate(zip(sibling.model.layers, parent.model.layers)):
        assert torch.equal(s.mlp.gate_proj.weight, p.mlp.gate_proj.weight[keep[l]])
        assert torch.equal(s.mlp.down_proj.weight, p.mlp.down_proj.weight[:, keep[l]])
        assert torch.equal(s.self_attn.k_proj.weight, p.self_attn.k_proj.weight)
    torch.testing.assert_close(sibling(ids)[0], parent(ids)[0])    # dead neurons added nothing


def test_kl_is_parent_to_sibling():
    """Bug: KL(sibling || parent) instead of KL(parent || sibling), or a sum over the batch, not a mean per token."""
    g = torch.Generator().manual_seed(0)
    t, s = torch.randn(2, 3, 7, generator=g), torch.randn(2, 3, 7, generator=g)
    p, logq = t.softmax(-1), s.log_softmax(-1)
    expected = (p * (p.log() - logq)).sum(-1).mean()
    torch.testing.assert_close(family.kl_to(t, s), expected)
    assert family.kl_to(t, t).abs() < 1e-6


def test_healing_lowers_kl_to_the_parent(built):
    """Bug: a healing step that leaves the sibling where it was (the optimizer over the wrong model,
    a learning-rate schedule at zero) or pulls it away from the parent."""
    for kind, (_, record, _) in built.items():
        assert record["kl"]["after"] < 0.8 * record["kl"]["before"], (kind, record["kl"])
        assert record["ppl"]["after"] < record["ppl"]["before"], (kind, record["ppl"])
        assert record["heal"]["tokens"] == 2560 and record["heal"]["steps"] == 10
        assert min(v["mean"] for v in record["weight_change"].values()) > 0, "some kept tensors did not move"


def test_output_folder_loads_back(built):
    """Bug: a saved folder whose config.json does not describe the sibling (the parent's layer count or
    ffn_dim), a missing tokenizer, or weights that are not the healed ones."""
    ids = torch.randint(0, 640, (1, 24), generator=torch.Generator().manual_seed(1))
    for kind, (sibling, record, folder) in built.items():
        loaded = kvt.load_model(folder)
        assert (loaded.config.n_layers, loaded.config.ffn_dim) == ((1, 384) if kind == "depth" else (4, 48))
        assert torch.equal(loaded(ids)[0], sibling(ids)[0]), kind
        assert kvt.load_tokenizer(folder).fingerprint() == kvt.load_tokenizer(TOY).fingerprint()
        assert json.loads((folder / "family.json").read_text()) == record
        assert not (folder / family.STATE).exists()


def test_interrupted_build_resumes_bit_identical(setup, built, monkeypatch):
    """Bug: a resumed build that restarts AdamW's moments or the row order, so it ends elsewhere than
    an unbroken run."""
    out = setup / "interrupted"
    calls, step = {"n": 0}, family.distill_step

    def crash_on_fifth(*a):  # steps 1-4 run, the state is saved at step 3, step 5 dies
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return step(*a)
    monkeypatch.setattr(family, "distill_step", crash_on_fifth)
    with pytest.raises(KeyboardInterrupt):
        build(argv(setup, "depth", out))
    monkeypatch.setattr(family, "distill_step", step)
    assert (out / family.STATE).exists() and not (out / "family.json").exists()
    _, record = build(argv(setup, "depth", out))
    a, b = load_file(out / "model.safetensors"), load_file(built["depth"][2] / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    unbroken = built["depth"][1]
    assert {**record, "seconds": 0} == {**unbroken, "seconds": 0}


def test_bad_input_is_one_line(setup, tmp_path):
    """Bug: a traceback (or a silent fallback) for a missing parent, or for a rerun with other flags."""
    with pytest.raises(KvtError, match=r"^no checkpoint folder .*nope"):
        family.main(argv(setup, "depth", tmp_path / "x", "--parent", str(tmp_path / "nope")))
    with pytest.raises(KvtError, match="other flags"):
        build(argv(setup, "depth", setup / "sibling-depth", "--seed", "1"))


@pytest.mark.slow
def test_real_sibling_end_to_end(smollm2, tmp_path):
    """A reduced real build (3 healing steps), loaded by transformers, then a KV-transfer run from the
    sibling to its parent. Bug: a sibling that kvt builds but transformers or run.py cannot use."""
    out = tmp_path / "smollm2-135m-depth15"
    sibling, record = family.build(family.parse([
        "build", "--parent", str(smollm2), "--kind", "depth", "--out", str(out), "--tokens", "1536",
        "--batch", "1", "--seq-len", "512", "--warmup", "1", "--windows", "2", "--window-len", "256",
        "--score-seqs", "4", "--score-len", "256", "--threads", "2"]))
    assert record["n_layers"] == 15 and record["heal"]["steps"] == 3
    assert record["kl"]["after"] < record["kl"]["before"]
    tf = pytest.importorskip("transformers")
    ids = torch.tensor([kvt.load_tokenizer(out).encode("The quick brown fox jumps over the lazy dog.")])
    with torch.no_grad():
        expected = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
    err = (sibling(ids)[0] - expected).abs().max().item()
    assert err < 1e-3, f"max abs logit error vs transformers {err:.2e}"
    from kvt.harness import pipeline as run
    results = run.main(["--source", str(out), "--target", str(smollm2), "--tasks", "arc_easy", "--limit", "24",
                        "--calib", str(SHARED / "data" / "calib" / "wikitext-2"), "--calib-seqs", "20",
                        "--calib-len", "256", "--no-bench", "--data-dir", str(SHARED / "data"),
                        "--out", str(tmp_path / "run")])
    assert isinstance(results, dict) and results, results
