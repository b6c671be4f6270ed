"""The one real checkpoint we have: SmolLM2-135M (Llama architecture), and the real tokenizers."""
import math

import pytest
import torch

import kvt
from tests.conftest import ROOT, SHARED

PARAGRAPH = ("The quick brown fox jumps over the lazy dog. Paris is the capital and most populous city of "
             "France. It is located on the Seine River, in the north of the country.")


def test_logits_match_transformers(smollm2):
    tf = pytest.importorskip("transformers")
    ids = torch.tensor([kvt.load_tokenizer(smollm2).encode(PARAGRAPH)])
    assert ids.shape[1] == 37  # as the checkpoint's README says
    ref = tf.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(ids).logits
    logits, _ = kvt.load_model(smollm2)(ids)
    err = (logits - expected).abs().max().item()
    assert err < 1e-3, f"max abs logit error {err:.2e}"  # 30 layers, logits of magnitude ~30


def test_loss_as_documented(smollm2):
    """../shared/models/smollm2-135m-instruct/README.md: loss 2.3499 on this paragraph (transformers, fp32)."""
    ids = torch.tensor([kvt.load_tokenizer(smollm2).encode(PARAGRAPH)])
    logits, _ = kvt.load_model(smollm2)(ids)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()  # logits[i] predict ids[i+1]
    assert abs(loss - 2.3499) < 1e-3, loss


def test_wikitext_perplexity(smollm2):
    """Perplexity on the first 4,096 tokens of WikiText-2 test, in 4 windows of 1,024 (printed; run -s)."""
    tok = kvt.load_tokenizer(smollm2)
    text = (SHARED / "data" / "calib" / "wikitext-2" / "test.txt").read_text()
    ids = torch.tensor(tok.encode(text[:40000])[:4096]).view(4, 1024)
    model = kvt.load_model(smollm2)
    nll = []
    for row in ids:  # one window at a time keeps memory small
        logits, _ = model(row[None])
        nll.append(torch.nn.functional.cross_entropy(logits[0, :-1], row[1:], reduction="sum"))
    ppl = math.exp(sum(nll).item() / (4 * 1023))
    print(f"\nSmolLM2-135M (Q4_1-dequantized) WikiText-2 test perplexity, 4x1024 tokens: {ppl:.2f}")
    assert 5 < ppl < 40, ppl  # a working 135M model; a broken one is in the hundreds or thousands


@pytest.mark.parametrize("name,hello", [("qwen3", [9707, 1879]), ("llama3", [128000, 9906, 1917])])
def test_real_tokenizers(name, hello):
    tok = kvt.load_tokenizer(SHARED / "tokenizers" / name)
    assert tok.encode("Hello world") == hello  # Llama 3 adds <|begin_of_text|>, Qwen3 nothing
    text = "Cross-model KV transfer: 7 × 8 = 56, naïve café, 日本語, tabs\tand\nnewlines."
    assert tok.decode(tok.encode(text, special=False)) == text
    assert tok.fingerprint() != kvt.load_tokenizer(SHARED / "tokenizers" / ("llama3" if name == "qwen3" else "qwen3")).fingerprint()


PEAK_SCRIPT = """
import sys, threading, time, torch, kvt
def anon():  # resident anonymous memory: what loading allocates (the mapped file's pages are not counted)
    for line in open('/proc/self/status'):
        if line.startswith('RssAnon:'):
            return int(line.split()[1]) * 1024
peak, done = [anon()], []
def watch():
    while not done:
        peak.append(anon()); time.sleep(0.0005)
kvt.load_model(sys.argv[3], dtype=getattr(torch, sys.argv[2]))  # warm-up: torch's one-time allocations
base = anon(); threading.Thread(target=watch, daemon=True).start()
model = kvt.load_model(sys.argv[1], dtype=getattr(torch, sys.argv[2]))
done.append(1); time.sleep(0.01)
size = sum(p.numel() * p.element_size() for p in model.parameters())
print((max(peak) - base) / size)
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loading_peak_memory(smollm2, dtype):
    """Loading holds at most ~1.2x the model's size in its dtype: no second copy of the weights."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(smollm2), dtype, str(ROOT / "tests" / "golden" / "qwen3")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    ratio = float(out.stdout.strip().splitlines()[-1])
    assert ratio <= 1.2, f"peak memory while loading is {ratio:.2f}x the model's size"
