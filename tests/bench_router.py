"""Escalation served as deployed: two vLLM servers, kvt's router, timed and scored through HTTP (docs/serving.md).

    python -m tests.bench_router --pair toy --lengths 256,1024,2000 --repeats 5
    python -m tests.bench_router --pair smollm2 --lengths 256,1024,2000 --repeats 5 --coqa 20 --turns 1,3,6

Starts `python -m kvt.integrations.router stack` (source and target servers with kvt's connector, the
router in front), the source's engine on the first core and the target's on the last (CPUS); once the
stack is stopped, a third server on the target's core: the target with vLLM's prefix cache on and no
connector (two engines bound to one core slowed each other's steps from 20 ms to up to 1 s here). Then:

- time to the first token (max_tokens 1, one request at a time), per prompt length, in turn, the median
  of --repeats after a warm-up round: (1) escalated through the router: the source prefills the prompt
  (from its prefix cache: it has served the conversation), saves its KV, the target maps T - 1 slots and
  runs the last token; (2) the target's own prefill of the same prompt, sent to it directly; then (3) the
  reference: the prefix-caching target, which has seen the prompt (its own rounds);
- mid-conversation handoff (--coqa N, the smollm2 pair): the prompt of turn t of N CoQA conversations
  (gold history, as the harness's coqa task), escalated through the router vs sent to the target
  directly, greedy answers of up to 32 tokens cut at the first newline, SQuAD F1 (coqa_f1) per turn.

The pairs: toy (toy-s -> toy-m, a mapper kvt fits here on the toy corpus; prompts from another seed of it)
and smollm2 (SmolLM2-135M onto itself, a head-scope mapper fitted here on 16 x 256 tokens of WikiText-2's
train split; prompts from CoQA stories). vLLM's Python: --python or KVT_VLLM_PYTHON.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import torch

import kvt
from kvt.harness import toy
from kvt.harness.answers import coqa_f1
from kvt.harness.calibration import CalibrationOptions, calibrate
from kvt.harness.data import calibration_sequences
from kvt.harness.diagnose import diagnose
from kvt.harness.files import save_mapper
from kvt.harness.tasks import coqa_segments, load_task
from kvt.integrations.router import free_port, stop, wait_healthy
from tests.conftest import ROOT, SHARED, SMOLLM2
from tests.test_router import ask

# the source on the first core, the target (and later the reference) on the last: engines bound to one core wait
# on each other (steps of 20 ms took up to 1 s with two of them on one core of a 2-core machine)
CPUS = ("0", str(os.cpu_count() - 1))
PAIRS = {"toy": (ROOT / "weights" / "toy-s", ROOT / "weights" / "toy-m"), "smollm2": (SMOLLM2, SMOLLM2)}


def fit_mapper(pair, out):
    """A mapper for the pair with the diagnostics the connector's gate reads; the tokenizer."""
    src, tgt = PAIRS[pair]
    ks, kt, tok = kvt.load_model(src), kvt.load_model(tgt), kvt.load_tokenizer(tgt)
    if pair == "toy":
        calib, scope = calibration_sequences(None, tok, 40, 128, documents=toy.corpus(1000, seed=99)), "layer"
    else:
        calib, scope = calibration_sequences(SHARED / "data" / "calib" / "wikitext-2", tok, 16, 256), "head"
    mapper, _ = calibrate(ks, kt, calib, scope=scope, options=CalibrationOptions(progress=False))
    mapper.meta.update(tokenizer=tok.fingerprint(), diagnostics=diagnose(ks, kt, mapper, calib.diag))
    save_mapper(mapper, out)
    return tok


def start(a, mapper, work, *extra):
    """The stack: the servers' and the router's URLs, and the stack's process (SIGTERM stops it all)."""
    src, tgt = PAIRS[a.pair]
    stack = subprocess.Popen([sys.executable, "-m", "kvt.integrations.router", "stack", "--source", str(src),
                              "--target", str(tgt), "--mapper", str(mapper), "--vllm-python", a.python,
                              "--kv-dir", str(work), "--dtype", a.dtype, "--port", str(free_port()),
                              "--source-cpus", CPUS[0], "--target-cpus", CPUS[1], *extra],
                             cwd=ROOT, stdout=subprocess.PIPE, text=True)
    urls = {}
    for line in stack.stdout:                       # "<name>  <url>  ...", the router last
        name, urls[name] = line.split()[:2]
        if name == "router":
            break
    return urls, stack


def start_reference(a, work):
    """The target alone with vLLM's prefix cache on, no connector: its URL and process."""
    tgt = PAIRS[a.pair][1]
    port, log = free_port(), work / "reference.log"
    ref = subprocess.Popen([a.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tgt), "--host",
                            "127.0.0.1", "--port", str(port), "--dtype", a.dtype, "--enforce-eager",
                            "--max-model-len", "2048", "--seed", "0", "--enable-prefix-caching"],
                           stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                           env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": CPUS[1]})
    url = f"http://127.0.0.1:{port}"
    wait_healthy("reference", ref, url, log, 600)
    return url, ref


def completion(url, ids, max_tokens, escalate=None):
    """(seconds, JSON answer) of a greedy completion of token ids."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
            **({"escalate": escalate} if escalate is not None else {})}
    t0 = time.perf_counter()
    status, out = ask(url, body)
    assert status == 200, out
    return time.perf_counter() - t0, out


def ttft(ways, prompts, repeats):
    """Per prompt: the median seconds of each way (name -> url, escalate), in turn, after a warm-up round."""
    rows = []
    for ids in prompts:
        times = {w: [] for w in ways}
        for i in range(repeats + 1):                  # the first round warms up (and fills both prefix caches)
            for w, (url, escalate) in ways.items():
                t, out = completion(url, ids, 1, escalate)
                if w == "escalated":
                    assert out["kvt"]["status"] == "applied", out["kvt"]
                if i:
                    times[w].append(t)
        rows.append({"tokens": len(ids), **{w: statistics.median(t) for w, t in times.items()}})
    return rows


def coqa(urls, tok, n, turns):
    """Per turn: mean F1 escalated and own, items scored, escalations applied."""
    convs = load_task("coqa", SHARED / "data", limit=n, turns=max(turns))
    out = []
    for t in turns:
        f1 = {"escalated": [], "own prefill": []}
        applied = 0
        for conv in convs:
            if len(conv.questions) < t:
                continue
            ids = tok.encode("".join(coqa_segments(conv)[:t]))
            if len(ids) > 2048 - 32:
                continue
            for way, url, esc in (("escalated", urls["router"], True), ("own prefill", urls["target"], None)):
                _, answer = completion(url, ids, 32, esc)
                text = answer["choices"][0]["text"].split("\n")[0].strip()
                f1[way].append(coqa_f1(conv.answers[t - 1], text))
                applied += way == "escalated" and answer["kvt"]["status"] == "applied"
        out.append({"turn": t, "items": len(f1["escalated"]), "applied": applied,
                    **{w: statistics.mean(v) for w, v in f1.items()}})
    return out


# vLLM's own serving benchmark client (`vllm bench serve`), called as its module: the `vllm` command of
# vllm-cpu 0.32.0 stops at start (it asks for the version of a package named "vllm")
BENCH = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
         "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
         "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def served(url):
    """The router's answers so far, by kvt status (GET /health)."""
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        return Counter(json.loads(r.read())["served"])


def load(a, urls, work):
    """`vllm bench serve` against the router: --load random prompts of 150 to 450 tokens (its random dataset,
    input 300, range ratio 0.5; seed 0), 16 streamed greedy output tokens each, 4 at a time; prompts of
    --escalate-at tokens or more escalate by the router's rule. Its result JSON, and the router's answers
    during the run by kvt status."""
    before = served(urls["router"])
    cmd = [a.python, "-c", BENCH, "--backend", "vllm", "--base-url", urls["router"], "--endpoint", "/v1/completions",
           "--model", "toy", "--tokenizer", str(PAIRS[a.pair][1]), "--dataset-name", "random",
           "--random-input-len", "300", "--random-range-ratio", "0.5", "--random-output-len", "16",
           "--num-prompts", str(a.load), "--max-concurrency", "4", "--ignore-eos", "--temperature", "0", "--seed", "0",
           "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99", "--save-result",
           "--result-dir", str(work), "--result-filename", "load.json"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(r.stdout[-2500:])
    return json.loads((work / "load.json").read_text()), served(urls["router"]) - before, " ".join(cmd[3:])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pair", choices=sorted(PAIRS), default="toy")
    p.add_argument("--lengths", default="256,1024,2000")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--coqa", type=int, default=0, help="CoQA conversations to score (0: none)")
    p.add_argument("--turns", default="1,3,6")
    p.add_argument("--python", default=os.environ.get("KVT_VLLM_PYTHON", sys.executable))
    p.add_argument("--load", type=int, default=0, help="only a load run of this many requests, by vLLM's own "
                                                      "benchmark client (vllm bench serve) through the router")
    p.add_argument("--escalate-at", type=int, default=300, help="the router's --escalate-at in the load run")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvt-bench-router-"))
    torch.set_num_threads(1)
    tok = fit_mapper(a.pair, work / "m.safetensors")
    lengths = [int(n) for n in a.lengths.split(",")]
    if a.pair == "toy":
        text = tok.encode(" ".join(toy.corpus(200, seed=5)))
    else:
        text = tok.encode("\n\n".join(c.story for c in load_task("coqa", SHARED / "data", limit=40)))
    assert len(text) >= max(lengths), f"the prompt text has {len(text)} tokens"
    cpu = re.search(r"Model name:\s*(.+)", subprocess.run(["lscpu"], capture_output=True, text=True).stdout)
    prompts = [text[:n] for n in lengths]
    if a.load:
        return load_table(a, work, cpu)
    urls, stack = start(a, work / "m.safetensors", work)
    try:
        rows = ttft({"escalated": (urls["router"], True), "own prefill": (urls["target"], None)}, prompts, a.repeats)
        scores = coqa(urls, tok, a.coqa, [int(t) for t in a.turns.split(",")]) if a.coqa else []
    finally:
        stack.terminate()
        stack.wait(120)
    url, ref = start_reference(a, work)              # alone: two engines on one core slow each other down
    try:
        for row, ref_row in zip(rows, ttft({"reference": (url, None)}, prompts, a.repeats)):
            row["reference"] = ref_row["reference"]
    finally:
        stop([ref])
    print(f"\n{a.pair} pair, {a.dtype}, vLLM's CPU build, {os.cpu_count()} cores of {cpu.group(1) if cpu else '?'}; "
          f"median of {a.repeats} after a warm-up, one request at a time")
    print("| prompt tokens | escalated through the router (ms) | target's own prefill (ms) | escalated / own "
          "| reference: prefix cache, seen prompt (ms) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {1e3 * r['escalated']:.1f} | {1e3 * r['own prefill']:.1f} | "
              f"{r['escalated'] / r['own prefill']:.2f} | {1e3 * r['reference']:.1f} |")
    if scores:
        print(f"\nCoQA, first {a.coqa} conversations (seeded order), F1 of greedy answers (32 tokens, first line)")
        print("| turn | items | escalations applied | F1 escalated | F1 target's own prefill |")
        print("|---|---|---|---|---|")
        for s in scores:
            print(f"| {s['turn']} | {s['items']} | {s['applied']} | {s['escalated']:.3f} | {s['own prefill']:.3f} |")
    print(json.dumps({"ttft": rows, "coqa": scores}))


def load_table(a, work, cpu):
    urls, stack = start(a, work / "m.safetensors", work, "--escalate-at", str(a.escalate_at))
    try:
        result, tally, cmd = load(a, urls, work)
    finally:
        stack.terminate()
        stack.wait(120)
    answered = sum(tally.values())
    escalated = answered - tally["source"]
    print(f"\n{a.pair} pair, {a.dtype}, vLLM's CPU build, {os.cpu_count()} cores of {cpu.group(1) if cpu else '?'}; "
          f"vllm bench serve {cmd}")
    print("| requests | completed | failed | escalated (applied / fallback) | TTFT p50 (ms) | TTFT p99 (ms) "
          "| output tokens/s | duration (s) |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {a.load} | {result['completed']} | {result.get('failed', a.load - result['completed'])} | "
          f"{escalated} of {answered} ({escalated / max(answered, 1):.0%}; {tally['applied']} / "
          f"{tally['fallback_reprefill']}) | {result['p50_ttft_ms']:.1f} | {result['p99_ttft_ms']:.1f} | "
          f"{result['output_throughput']:.1f} | {result['duration']:.1f} |")
    print(json.dumps({"bench": {k: v for k, v in result.items() if not isinstance(v, list)}, "served": tally}))


if __name__ == "__main__":
    main()
