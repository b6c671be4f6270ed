"""data.py: seeded calibration sequences in disjoint regions from .txt, .jsonl and CodeAlpaca .json; tokenizer checks."""
import json

import pytest
import torch
from conftest import SHARED

import kvt
from kvt.config import KvtError
from kvt.harness.data import calibration_sequences, check_same_tokenizer, read_documents, split_text

pytestmark = pytest.mark.usefixtures("one_thread")

CALIB = SHARED / "data" / "calib"


class Chars:
    """A stand-in tokenizer: one token per character (ord), with a BOS of 0."""
    bos_id = 0

    def encode(self, text, special=False):
        return [ord(c) % 1000 + 1 for c in text]


def test_sequences_are_seeded_and_start_with_bos(tmp_path):
    for i in range(40):
        (tmp_path / f"{i:02d}.txt").write_text(f"document {i}: the quick brown fox jumps over the lazy dog. " * 20)
    a = calibration_sequences(tmp_path, Chars(), n=5, length=64, seed=1)
    assert a.fit.shape == (5, 64) and a.val.shape == a.diag.shape == (2, 64)
    assert a.fit.dtype == torch.long and (a.fit[:, 0] == 0).all() and (a.diag[:, 0] == 0).all()
    b = calibration_sequences(tmp_path, Chars(), n=5, length=64, seed=1)
    assert all(torch.equal(x, y) for x, y in zip((a.fit, a.val, a.diag), (b.fit, b.val, b.diag)))
    assert a.hash() == b.hash() != calibration_sequences(tmp_path, Chars(), n=5, length=64, seed=2).hash()


def test_regions_share_no_document_and_windows_never_overlap(tmp_path):
    """Every character of the text is unique, so two sequences share a token only if their windows
    overlap. Guards: windows drawn at random offsets of one joined text (the held-out sequences then
    repeat fit text, inflating held-out R^2, layer selection, lambda and the gate), and regions that
    split a document."""
    docs = ["".join(chr(0x4e00 + 1000 * d + j) for j in range(200)) for d in range(12)]
    for d, text in enumerate(docs):
        (tmp_path / f"{d:02d}.txt").write_text(text)
    class Unicode(Chars):
        def encode(self, text, special=False):
            return [ord(c) for c in text]
    calib = calibration_sequences(tmp_path, Unicode(), n=16, length=100, n_val=4, n_diag=4, seed=3)  # every window
    newline = ord("\n")                                    # the separator between joined documents
    regions = {name: [set(row[1:].tolist()) - {newline} for row in getattr(calib, name)]
               for name in ("fit", "val", "diag")}
    rows = [r for rs in regions.values() for r in rs]
    assert all(len(r) >= 97 for r in rows)
    assert all(not (a & b) for i, a in enumerate(rows) for b in rows[i + 1:]), "two windows overlap"
    doc_of = lambda tok: (tok - 0x4e00) // 1000  # noqa: E731
    docs_in = {name: {doc_of(t) for r in rs for t in r} for name, rs in regions.items()}
    assert not (docs_in["fit"] & docs_in["val"]) and not (docs_in["fit"] & docs_in["diag"])
    assert not (docs_in["val"] & docs_in["diag"])


def test_held_out_text_never_repeats_fit_text_on_wikitext(qwen):
    """Real text, real tokenizer: no 24-token span of a validation or diagnostics sequence occurs in a
    fit sequence (the old random-offset draw had 39 of 50 held-out sequences repeat fit text)."""
    calib = calibration_sequences(CALIB / "wikitext-2", qwen, n=150, length=256, seed=0)
    spans = {tuple(row[i:i + 24]) for row in calib.fit.tolist() for i in range(len(row) - 23)}
    shared = [row for row in calib.val.tolist() + calib.diag.tolist()
              if any(tuple(row[i:i + 24]) in spans for i in range(len(row) - 23))]
    assert not shared, f"{len(shared)} held-out sequences repeat a 24-token span of the fit sequences"


def test_wikitext_articles_and_gutenberg_license_are_split_off():
    docs = read_documents(CALIB / "wikitext-2" / "test.txt")
    assert len(docs) > 50 and docs[1].lstrip().startswith("= ") and docs[1].count("\n = ") >= 0
    book = split_text((CALIB / "gutenberg" / "11-0.txt").read_text(encoding="utf-8"))
    assert len(book) == 1 and "ALICE" in book[0][:200] and "START OF" not in book[0]
    assert "Project Gutenberg License" not in book[0] and "END OF" not in book[0]


def test_jsonl_and_codealpaca_json(tmp_path):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": f"document {i} " * 30}) for i in range(20)))
    assert calibration_sequences(tmp_path / "d.jsonl", Chars(), n=3, length=50).fit.shape == (3, 50)
    calib = calibration_sequences(CALIB / "codealpaca" / "code_alpaca_2k.json", Chars(), n=3, length=200)
    assert calib.fit.shape == (3, 200)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}))
    with pytest.raises(KvtError, match="'text' field"):
        calibration_sequences(tmp_path / "bad.jsonl", Chars(), n=1, length=4)


def test_too_short_or_missing_text_is_a_one_line_error(tmp_path):
    (tmp_path / "a.txt").write_text("too short")
    for args in ((tmp_path, 4, 100), (tmp_path / "nope", 1, 4), (tmp_path / "empty", 1, 4)):
        (tmp_path / "empty").mkdir(exist_ok=True)
        with pytest.raises(KvtError) as e:
            calibration_sequences(args[0], Chars(), n=args[1], length=args[2])
        assert "\n" not in str(e.value)


def test_a_corpus_too_small_says_how_many_windows_it_holds(tmp_path):
    for i in range(10):
        (tmp_path / f"{i}.txt").write_text("x" * 1000)
    with pytest.raises(KvtError, match=r"holds \d+ windows of 100 tokens.*--calib-seqs"):
        calibration_sequences(tmp_path, Chars(), n=200, length=100)


@pytest.fixture(scope="module")
def qwen():
    return kvt.load_tokenizer(SHARED / "tokenizers" / "qwen3")


def test_real_tokenizer_on_wikitext(qwen):
    tok = qwen
    ids = calibration_sequences(CALIB / "wikitext-2", tok, n=4, length=128, seed=0).fit
    assert ids.shape == (4, 128) and len(tok.decode(ids[0].tolist())) > 200


def test_different_tokenizers_are_refused(qwen):
    check_same_tokenizer(qwen, qwen)
    with pytest.raises(KvtError) as e:
        check_same_tokenizer(qwen, kvt.load_tokenizer(SHARED / "tokenizers" / "llama3"))
    assert "tokenizers differ" in str(e.value) and "\n" not in str(e.value)


class Counting(Chars):
    """Chars that counts the texts it encodes; `version` stands for its tokenizer.json (Tokenizer.hash)."""
    def __init__(self, version="a"):
        self.calls, self.version = 0, version

    def encode(self, text, special=False):
        self.calls += 1
        return super().encode(text, special)

    def hash(self):
        return self.version


def test_token_ids_are_cached_by_text_and_tokenizer(tmp_path):
    """Bug: the calibration text was tokenized again on every run and resume (minutes on the real corpus).
    With a cache folder, the second run encodes only the separator and gets the same sequences; other text
    or another tokenizer gets its own file; a torn file is made again; a refused request writes none."""
    text, cache = tmp_path / "text", tmp_path / "out"
    text.mkdir()
    for i in range(30):
        (text / f"{i:02d}.txt").write_text(f"document {i}: the quick brown fox jumps over the lazy dog. " * 12)
    first, tok = Counting(), Counting()
    a = calibration_sequences(text, first, n=5, length=64, seed=1, cache=cache)
    b = calibration_sequences(text, tok, n=5, length=64, seed=1, cache=cache)
    assert first.calls == 31 and tok.calls == 1, (first.calls, tok.calls)       # 30 documents + "\n\n"
    assert a.hash() == b.hash() == calibration_sequences(text, Chars(), n=5, length=64, seed=1).hash()
    assert len(list(cache.glob("calib-tokens-*.safetensors"))) == 1 and not list(cache.glob("*.tmp"))
    (text / "00.txt").write_text("another text " * 100)
    calibration_sequences(text, tok, n=5, length=64, seed=1, cache=cache)
    calibration_sequences(text, Counting("b"), n=5, length=64, seed=1, cache=cache)
    assert len(list(cache.glob("calib-tokens-*.safetensors"))) == 3
    torn = tmp_path / "torn"
    calibration_sequences(text, Counting(), n=5, length=64, seed=1, cache=torn)
    (f,) = torn.glob("calib-tokens-*.safetensors")
    f.write_bytes(f.read_bytes()[:50])                                              # a crash mid-copy
    again = Counting()
    c = calibration_sequences(text, again, n=5, length=64, seed=1, cache=torn)
    assert again.calls == 31 and f.stat().st_size > 50
    assert c.hash() == calibration_sequences(text, Chars(), n=5, length=64, seed=1).hash()
    with pytest.raises(KvtError, match="windows"):                                # a refused run writes nothing
        calibration_sequences(text, Counting(), n=500, length=64, seed=1, cache=tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_missing_calibration_folder_says_where_to_point(tiny_pair, tmp_path):
    """A real pair whose data folder lacks calib/: one line naming the folders it looked for and the two
    ways out (--data-dir / KVT_DATA, --calib), before any model is loaded, and no output folder left."""
    from kvt.harness.pipeline import main
    if not (SHARED / "data" / "arc_easy").exists():
        pytest.skip("no shared arc_easy data")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "arc_easy").symlink_to(SHARED / "data" / "arc_easy")
    with pytest.raises(KvtError) as e:
        main(["--source", str(tiny_pair / "source"), "--target", str(tiny_pair / "twin"), "--data-dir",
              str(tmp_path / "data"), "--tasks", "arc_easy", "--no-bench", "--out", str(tmp_path / "out")])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"no calibration text at {tmp_path / 'data' / 'calib' / 'wikitext-2'}")
    assert "--data-dir" in msg and "--calib" in msg and not (tmp_path / "out").exists(), msg


def test_heldout_windows_are_disjoint_evenly_spaced_slices_of_the_text():
    """heldout_windows: `count` windows, each a run of the text's own ids, none overlapping another, spread
    over the whole text; fewer when the text holds fewer. Guards: windows that overlap (a stride under
    their length) or that all come from the text's start."""
    from kvt.harness.data import heldout_windows
    docs = ["".join(chr(33 + c) for c in torch.randint(0, 90, (2500,), generator=torch.Generator().manual_seed(d)).tolist())
            for d in range(2)]                                                # two documents, 50 windows' worth
    ids = Chars().encode(docs[0]) + Chars().encode(docs[1])
    w = heldout_windows(None, Chars(), 8, 100, documents=docs)
    starts = [100 * (i * 50 // 8) for i in range(8)]                         # every 6th or 7th window slot
    assert w.shape == (8, 100) and all(w[i].tolist() == ids[s:s + 100] for i, s in enumerate(starts))
    assert heldout_windows(None, Chars(), 80, 100, documents=docs).shape == (50, 100)


def test_heldout_text_that_is_calibration_text_is_refused(tmp_path):
    """--heldout inside a --calib folder (WikiText-2 test.txt under the default calib/wikitext-2) is one line,
    before any calibration: its windows would score text the mapper was fitted on."""
    import argparse
    from kvt.harness.pipeline import heldout_texts
    (tmp_path / "test.txt").write_text("text")
    args = argparse.Namespace(heldout=[str(tmp_path / "test.txt")], calib=[tmp_path])
    with pytest.raises(KvtError, match="is calibration text too"):
        heldout_texts(args)
    args.calib = [tmp_path / "valid.txt"]
    assert heldout_texts(args)[0][0] == "test.txt"


def test_heldout_takes_a_text_file_whatever_its_name_and_names_its_option(tmp_path):
    """A --heldout file without a .txt extension was refused as "no .txt, .jsonl or .json files ...; point
    the calibration corpus at text files": a message about another option, and a refusal of plain text.
    A file named on its own is text whatever its name (for --calib too); what is refused names the option
    the path came from, and the refusal comes before calibration (heldout_texts reads the text)."""
    import argparse
    from kvt.harness.pipeline import heldout_texts
    (tmp_path / "book").write_text("A plain text with no extension. " * 40)
    (tmp_path / "notes.md").write_text("Markdown is text too. " * 40)
    args = argparse.Namespace(heldout=[str(tmp_path / "book"), str(tmp_path / "notes.md")], calib=[tmp_path / "c"])
    (name, docs), (_, md) = heldout_texts(args)
    assert name == "book" and docs == ["A plain text with no extension. " * 40] and md[0].startswith("Markdown")
    assert read_documents(tmp_path / "book") == docs                              # --calib reads it too
    (tmp_path / "empty").mkdir()
    (tmp_path / "model.bin").write_bytes(b"\x08\x00\x00\x00{}" + bytes(range(256)))
    for path, words in ((tmp_path / "empty", "point --heldout at text files"), (tmp_path / "model.bin", "is not text"),
                        (tmp_path / "nope", "does not exist")):
        args.heldout = [str(path)]
        with pytest.raises(KvtError) as e:
            heldout_texts(args)
        msg = str(e.value)
        assert msg.startswith(f"--heldout {path}") and words in msg and "calibration" not in msg, msg
    with pytest.raises(KvtError, match=r"^--calib .*empty: no .txt, .jsonl or .json files .*point --calib at text"):
        calibration_sequences(tmp_path / "empty", Chars(), n=2, length=100)
