"""Time to first token of a vLLM target engine with kvt's connector and without it (docs/serving.md).

    python -m tests.bench_serving --lengths 256,1024,2000 --repeats 5

On the toy pair toy-s -> toy-m: fits a mapper with kvt (as tests/test_vllm.py does), lets a source engine
save each prompt's KV, then in one target engine times generate(max_tokens=1) per prompt with its load
(the connector maps T - 1 slots, the target runs the last token) and without (the target's own prefill),
alternating, the median of --repeats after a warm-up round (tests/vllm_engines.py ttft). vLLM's Python:
--python, KVT_VLLM_PYTHON (e.g. ../venv-vllm/bin/python, docs/serving.md), or this one.
"""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

import kvt
from kvt.harness import toy
from kvt.harness.data import calibration_sequences
from kvt.harness.diagnose import diagnose
from kvt.harness.calibration import CalibrationOptions, calibrate
from kvt.harness.files import save_mapper
from tests.test_vllm import ROOT, engine


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="256,1024,2000")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--python", default=os.environ.get("KVT_VLLM_PYTHON", sys.executable))
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvt-serving-"))
    torch.set_num_threads(1)
    ks, kt = kvt.load_model(ROOT / "weights" / "toy-s"), kvt.load_model(ROOT / "weights" / "toy-m")
    tok = kvt.load_tokenizer(ROOT / "weights" / "toy-m")
    calib = calibration_sequences(None, tok, 40, 128, documents=toy.corpus(1000, seed=99))
    mapper, _ = calibrate(ks, kt, calib, options=CalibrationOptions(progress=False))
    mapper.meta["diagnostics"] = diagnose(ks, kt, mapper, calib.diag)
    save_mapper(mapper, tmp / "m.safetensors")
    text = tok.encode(" ".join(toy.corpus(200, seed=5)))
    lengths = [int(n) for n in a.lengths.split(",")]
    assert len(text) >= max(lengths), f"the toy text has {len(text)} tokens"
    requests = [{"ids": text[:n], "save": str(tmp / f"p{n}.kv"), "load": str(tmp / f"p{n}.kv")} for n in lengths]
    engine(a.python, "source", ROOT / "weights" / "toy-s", requests, tmp)
    rows = engine(a.python, "ttft", ROOT / "weights" / "toy-m", requests, tmp, "--mapper", str(tmp / "m.safetensors"),
                  "--repeats", str(a.repeats))
    print("| prompt tokens | TTFT with the connector (ms) | TTFT, own prefill (ms) | with / without |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {1e3 * r['with']:.1f} | {1e3 * r['without']:.1f} | {r['with'] / r['without']:.2f} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
