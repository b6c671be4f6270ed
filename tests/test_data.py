"""data.py: seeded calibration sequences from .txt, .jsonl and CodeAlpaca .json; tokenizer checks."""
import json

import pytest
import torch
from conftest import SHARED

import kvt
from kvt.config import KvtError
from kvt.data import calibration_sequences, check_same_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

CALIB = SHARED / "data" / "calib"


class Chars:
    """A stand-in tokenizer: one token per character (ord), with a BOS of 0."""
    bos_id = 0

    def encode(self, text, special=False):
        return [ord(c) % 1000 + 1 for c in text]


def test_sequences_are_seeded_and_start_with_bos(tmp_path):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    a = calibration_sequences(tmp_path, Chars(), n=5, length=64, seed=1)
    assert a.shape == (5, 64) and a.dtype == torch.long and (a[:, 0] == 0).all()
    assert torch.equal(a, calibration_sequences(tmp_path, Chars(), n=5, length=64, seed=1))
    assert not torch.equal(a, calibration_sequences(tmp_path, Chars(), n=5, length=64, seed=2))


def test_jsonl_and_codealpaca_json(tmp_path):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": f"document {i} " * 30}) for i in range(20)))
    assert calibration_sequences(tmp_path / "d.jsonl", Chars(), n=3, length=50).shape == (3, 50)
    ids = calibration_sequences(CALIB / "codealpaca" / "code_alpaca_2k.json", Chars(), n=3, length=200)
    assert ids.shape == (3, 200)
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


@pytest.fixture(scope="module")
def qwen():
    return kvt.load_tokenizer(SHARED / "tokenizers" / "qwen3")


def test_real_tokenizer_on_wikitext(qwen):
    tok = qwen
    ids = calibration_sequences(CALIB / "wikitext-2", tok, n=4, length=128, seed=0)
    assert ids.shape == (4, 128) and len(tok.decode(ids[0].tolist())) > 200


def test_different_tokenizers_are_refused(qwen):
    check_same_tokenizer(qwen, qwen)
    with pytest.raises(KvtError) as e:
        check_same_tokenizer(qwen, kvt.load_tokenizer(SHARED / "tokenizers" / "llama3"))
    assert "tokenizers differ" in str(e.value) and "\n" not in str(e.value)
