"""One vLLM engine with kvt's connector, for tests/test_vllm.py and docs/serving.md; run in a Python with vLLM.

    python -m tests.vllm_engines source weights/toy-s requests.json out.json
    python -m tests.vllm_engines target weights/toy-m requests.json out.json --mapper m.safetensors [--gate max_kl=0]
    python -m tests.vllm_engines ttft weights/toy-m requests.json out.json --mapper m.safetensors --repeats 5
    python -m tests.vllm_engines start weights/toy-m none.json out.json --mapper m.safetensors --prefix-caching
    python -m tests.vllm_engines layouts none none.json out.json
    python -m tests.vllm_engines gpu_layouts none none.json out.json

requests.json: a list of {"ids": [...], "save": path} (source) or {"ids": [...], "load": path or null} (target;
a source engine answers a load as "unsupported").
Each engine runs in its own process (vLLM keeps one KV connector per process), in --dtype (float32), eagerly, on the
CPU, with the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: on 2 shared cores a separate
engine process makes every step wait for the other). out.json: per request its greedy tokens, the
first step's top-20 logprobs and kv_transfer_params; for ttft, the median seconds to the first token of
each request with and without its load, measured alternately in this one engine.
"""
import argparse
import json
import os
import statistics
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def engine(model, mapper=None, role="kv_consumer", gate=None, prefix_caching=False, dtype="float32", block_size=None):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvt.integrations.serving import connector_config
    config = KVTransferConfig(**connector_config(mapper, role, **(gate or {})))
    extra = {"block_size": block_size} if block_size else {}
    return LLM(model=str(model), dtype=dtype, max_model_len=2048, enforce_eager=True, seed=0,
               enable_prefix_caching=prefix_caching, kv_transfer_config=config, **extra)


def layouts():
    """kvt's read_slots and write_slots against vLLM's own writer (cpu_attn_reshape_and_cache), for each
    CPU layout this machine's vLLM uses: per (layout, dtype, block size, head dim), whether read_slots
    reads back what vLLM wrote, and write_slots writes the same bytes."""
    import torch
    from vllm import _custom_ops as ops

    from kvt.integrations.serving import read_slots, slots, write_slots
    cases = [("vec", torch.float32), ("vec", torch.bfloat16)]
    if torch.cpu._is_amx_tile_supported():
        cases.append(("amx", torch.bfloat16))
    out = []
    for layout, dtype in cases:
        for bs, D in ((32, 64), (128, 128), (64, 32)):
            g = torch.Generator().manual_seed(bs + D)
            nb, H, n = 4, 2, 2 * bs + 7
            K, V = (torch.randn(n, H, D, generator=g).to(dtype) for _ in range(2))
            blocks = torch.randperm(nb, generator=g)[:3].tolist()
            block, offset = slots(blocks, n, bs)
            theirs, ours = (torch.zeros(nb, H, bs, 2 * D, dtype=dtype) for _ in range(2))
            kc, vc = theirs.view(nb, H, 2 * bs, D).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(K, V, kc, vc, block * bs + offset, layout, k_scale=1.0, v_scale=1.0,
                                           kv_cache_dtype="auto")
            k, v = read_slots(theirs, layout, block, offset)
            write_slots(ours, layout, block, offset, K, V)
            out.append({"layout": layout, "dtype": str(dtype), "block_size": bs, "head_dim": D,
                        "read": torch.equal(k, K) and torch.equal(v, V), "write": torch.equal(ours, theirs)})
    return out


def gpu_layouts():
    """kvt's "gpu" layout (serving.split_views) against how vLLM 0.32 lays out a GPU attention backend's KV, on
    CPU tensors: two layers' views of one buffer made by vLLM's own create_kv_cache_views for a
    FullAttentionSpec, in each physical KVCacheLayout a GPU backend may get; their shape as vLLM declares it
    (compute_layer_kv_cache_shape_bytes: (blocks, Hkv, block_size, 2 D) elements); kvt's write_slots into layer
    0, then read through FlashAttention's own view of a layer's KV (its forward: kv_cache.transpose(1, 2)
    .split(head_size, dim=-1), (blocks, block_size, Hkv, D) each) at reshape_and_cache_flash's slot index
    (block * block_size + offset). Per case: whether each written (block, offset, head) holds its key and
    value, nothing else moved (the rest of layer 0 and all of layer 1 still zero), and read_slots reads back."""
    import torch
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, compute_layer_kv_cache_shape_bytes,
                                            create_kv_cache_views)
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvt.integrations.serving import read_slots, slots, write_slots
    out = []
    for dtype in (torch.bfloat16, torch.float16):
        for bs, D in ((16, 64), (16, 128), (32, 80), (64, 128), (16, 256)):
            for layout in (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, KVCacheLayout.BLNHC, KVCacheLayout.BLHNC):
                nb, H, n = 5, 3, 2 * bs + 5
                spec = FullAttentionSpec(block_size=bs, num_kv_heads=H, head_size=D, dtype=dtype)
                shape = compute_layer_kv_cache_shape_bytes(spec, nb)               # (B, H, N, C bytes)
                page = shape[1] * shape[2] * shape[3]
                strides = (page * nb, page) if layout.is_layer_compact else (page, 2 * page)  # layer, block
                tensor = KVCacheTensor(size=2 * nb * page, layers=["l0", "l1"], layer_stride=strides[0],
                                       block_stride=strides[1])
                raw = torch.zeros(tensor.size, dtype=torch.int8)
                kv0, kv1 = create_kv_cache_views(raw, spec, nb, layout, tensor)     # (nb, H, bs, 2 D) each
                g = torch.Generator().manual_seed(bs + D)
                K, V = (torch.randn(n, H, D, generator=g).to(dtype) for _ in range(2))
                blocks = torch.randperm(nb, generator=g)[:3].tolist()
                block, offset = slots(blocks, n, bs)
                write_slots(kv0, "gpu", block, offset, K, V)
                key_cache, value_cache = kv0.transpose(1, 2).split(D, dim=-1)       # FlashAttention's view
                slot = block * bs + offset                                           # reshape_and_cache_flash's
                lands = (torch.equal(key_cache.flatten(0, 1)[slot], K) and torch.equal(value_cache.flatten(0, 1)[slot], V))
                k, v = read_slots(kv0, "gpu", block, offset)
                out.append({"dtype": str(dtype), "block_size": bs, "head_dim": D, "layout": layout.name,
                            "shape": list(kv0.shape), "declared": [shape[0], shape[1], shape[2],
                                                                    shape[3] // dtype.itemsize],
                            "contiguous": kv0.is_contiguous(), "lands": lands,
                            "only_there": int((kv0 != 0).sum()) == 2 * n * H * D and not kv1.any().item(),
                            "read": torch.equal(k, K) and torch.equal(v, V)})
    return out


def params(max_tokens, extra, logprobs=20):
    from vllm import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, extra_args=extra,
                          ignore_eos=True)


def run(llm, requests, max_tokens, role):
    from vllm.inputs import TokensPrompt

    from kvt.integrations.serving import kv_params
    prompts = [TokensPrompt(prompt_token_ids=r["ids"]) for r in requests]
    extras = [kv_params(save=r.get("save"), load=r.get("load")) for r in requests]
    outs = llm.generate(prompts, [params(max_tokens, e) for e in extras], use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": {str(t): lp.logprob for t, lp in o.outputs[0].logprobs[0].items()},
             "kv_transfer_params": o.kv_transfer_params} for o in outs]


def ttft(llm, requests, repeats):
    """Median seconds of generate(max_tokens=1) per request, with its load and without, alternating."""
    from vllm.inputs import TokensPrompt

    from kvt.integrations.serving import kv_params
    out = []
    for r in requests:
        times = {"with": [], "without": []}
        for i in range(repeats + 1):                                    # the first round warms up
            for what, extra in (("with", kv_params(load=r["load"])), ("without", kv_params())):
                t0 = time.perf_counter()
                o = llm.generate([TokensPrompt(prompt_token_ids=r["ids"])], params(1, extra, logprobs=None),
                                 use_tqdm=False)
                if i:
                    times[what].append(time.perf_counter() - t0)
                if what == "with":
                    verdict = o[0].kv_transfer_params["kvt"]
                    assert verdict["status"] == "applied" and verdict["slots"] == len(r["ids"]) - 1, verdict
        out.append({"tokens": len(r["ids"]), **{k: statistics.median(v) for k, v in times.items()}})
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["source", "target", "ttft", "start", "layouts", "gpu_layouts"])
    p.add_argument("model")
    p.add_argument("requests")
    p.add_argument("out")
    p.add_argument("--mapper")
    p.add_argument("--gate", nargs="*", default=[], help="diagnose.gate thresholds, name=value")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prefix-caching", action="store_true", help="start, target: with vLLM's prefix cache on")
    p.add_argument("--dtype", default="float32", help="the engine's dtype")
    p.add_argument("--block-size", type=int, help="start: the engine's KV block size")
    a = p.parse_args()
    requests = json.load(open(a.requests)) if a.what not in ("start", "layouts", "gpu_layouts") else []
    gate = {k: float(v) for k, v in (g.split("=") for g in a.gate)}
    if a.what == "start":                           # does the engine start? "started" or why not
        try:
            engine(a.model, a.mapper, prefix_caching=a.prefix_caching, dtype=a.dtype, block_size=a.block_size)
            result = "started"
        except Exception as e:  # vLLM wraps the connector's KvtError; its message is what we check
            result = str(e)
    elif a.what == "layouts":
        result = layouts()
    elif a.what == "gpu_layouts":
        result = gpu_layouts()
    elif a.what == "source":
        result = run(engine(a.model, role="kv_producer", dtype=a.dtype), requests, 1, "kv_producer")
    elif a.what == "target":
        result = run(engine(a.model, a.mapper, gate=gate, dtype=a.dtype, prefix_caching=a.prefix_caching), requests,
                     a.max_tokens, "kv_consumer")
    else:
        result = ttft(engine(a.model, a.mapper, dtype=a.dtype), requests, a.repeats)
    with open(a.out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(a.out + ".tmp", a.out)


if __name__ == "__main__":
    main()
