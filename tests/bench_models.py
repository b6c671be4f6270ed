"""Prefill speed, kvt vs transformers, on the same random weights, side by side in one process.

    python -m tests.bench_models [--shape qwen3-0.6b] [--tokens 2048] [--repeats 3]

Both models get identical weights (transformers' modules carry the checkpoint's names, and so do
kvt's), the same input, a warm-up run, then alternate timed runs; the table reports medians and the
ratio transformers / kvt (above 1: kvt is faster). transformers is a test dependency only.
"""
import argparse
import statistics
import time

import torch
import transformers as tf

import kvt


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start  # CPU: ops are synchronous; on CUDA add torch.cuda.synchronize()


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, transformers {tf.__version__}, {torch.get_num_threads()} threads")
    print(f"| shape | dtype | tokens | kvt s | transformers s | transformers / kvt |\n|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        ours = kvt.build_model(args.shape, dtype=dtype, seed=0)
        ref = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(**ours.config.to_hf()), dtype=dtype)
        ref.load_state_dict(ours.state_dict(), strict=False)  # a tied lm_head is one tensor in both
        ref.eval()
        ids = torch.randint(0, ours.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        assert (ours(ids[:, :64])[0] - ref(ids[:, :64]).logits).abs().max() < 1e-2, "models differ"
        runs = {"kvt": [], "hf": []}
        for i in range(args.repeats + 1):  # first round is the warm-up
            t_kvt, t_hf = timed(lambda: ours(ids)), timed(lambda: ref(ids, use_cache=True))
            if i:
                runs["kvt"].append(t_kvt)
                runs["hf"].append(t_hf)
        k, h = statistics.median(runs["kvt"]), statistics.median(runs["hf"])
        print(f"| {args.shape} | {name} | {args.tokens} | {k:.2f} | {h:.2f} | {h / k:.2f} |", flush=True)
        del ours, ref


if __name__ == "__main__":
    main()
