"""Prefill and greedy decode speed, kvt vs transformers, on the same random weights, side by side in one process.

    python -m tests.bench_models [--shape qwen3-0.6b] [--tokens 1024,2048] [--decode 32] [--dtypes float32,bfloat16]
    python -m tests.bench_models --linear     # one token through each weight: torch's matmul vs torch.mv
    python -m tests.bench_models --profile 2 --tokens 2048 --dtypes float32   # where each prefill's time goes

Both models get identical weights (transformers' modules carry the checkpoint's names, and so do
kvt's) and the same input. Prefill: each model reads the whole context (logits for every position,
as transformers computes them). Decode: from each model's own cache of the context, `--decode` greedy
tokens, kvt through fast.generate (kvt's decoding, its fast twin), transformers through the same loop written on its forward (argmax,
feed back, its DynamicCache); the cache is rebuilt before each run, untimed. Every measurement is a
warm-up run, then `--repeats` timed runs alternating between the two; the table gives the medians,
min and max, and the ratio transformers / kvt (above 1: kvt is faster) twice: of the medians, and per
round (each round's two runs back to back; its median, min and max), with the processor it ran on.
transformers is a test dependency only.
"""
import argparse
import time

import torch
import transformers as tf
from torch.profiler import profile

import kvt
from kvt.bench import Timing, per_round
from kvt.harness.bench import hardware
from kvt.fast import generate, keep_freed_memory


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start  # CPU: ops are synchronous


def hf_decode(ref, logits, pkv, steps):
    """transformers' greedy loop, the same as kvt.generate's: argmax, feed back, `steps` forward calls."""
    nxt = logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps):
        out = ref(input_ids=nxt, cache=pkv, use_cache=True)
        nxt, pkv = out.logits[:, -1].argmax(-1, keepdim=True), out.cache
    return nxt


def race(kvt_fn, hf_fn, repeats, kvt_setup=lambda: None, hf_setup=lambda: None):
    """(kvt seconds, transformers seconds): lists of `repeats` timed runs of fn(setup()) after one
    warm-up each, the two alternating; the setups are not timed."""
    runs = {"kvt": [], "hf": []}
    for i in range(repeats + 1):
        for name, fn, setup in (("kvt", kvt_fn, kvt_setup), ("hf", hf_fn, hf_setup)):
            state = setup()
            t = timed(lambda: fn(state))
            if i:
                runs[name].append(t)
    return runs["kvt"], runs["hf"]


def row(what, name, tokens, k, h):
    """A table row: both sides' median (min-max), the ratio of the medians, and the ratio per round
    (bench.per_round: median, min-max of h[i] / k[i], the two runs of a round taken back to back)."""
    k, h = Timing(k), Timing(h)
    r = per_round(h, k)
    return (f"| {what} | {name} | {tokens} | {k:.3f} ({k.min:.3f}-{k.max:.3f}) | {h:.3f} ({h.min:.3f}-{h.max:.3f}) "
            f"| {h / k:.2f} | {r[0]:.2f} ({r[1]:.2f}-{r[2]:.2f}) |")


def profile_rows(kvt_fn, hf_fn, runs, top=8):
    """Where a prefill's time goes: `runs` profiled prefills per side, alternating, after a warm-up; for
    each, its wall time and the `top` operators by their own CPU time (torch.profiler)."""
    kvt_fn(), hf_fn()
    for _ in range(runs):
        for name, fn in (("kvt", kvt_fn), ("transformers", hf_fn)):
            with profile() as prof:
                t = timed(fn)
            print(f"{name}: {t:.3f} s")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top), flush=True)


def linear_rows(model, dtype, repeats):
    """Table rows: one token through each distinct weight shape of the model, F.linear (nn.Linear's own
    forward) against torch.mv (which kvt once took for one row), alternating; ratio = F.linear / mv."""
    shapes = {tuple(m.weight.shape): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}
    for (o, i), w in shapes.items():
        x = torch.randn(1, i, dtype=dtype)
        k, h = race(lambda _: torch.mv(w, x[0]), lambda _: torch.nn.functional.linear(x, w), repeats)
        ms = lambda t: [1e3 * s for s in t]  # noqa: E731
        print(row(f"one token, {o} x {i} weight ({w.numel() * w.element_size() / 2**20:.0f} MiB)", str(dtype)[6:],
                  1, ms(k), ms(h)), flush=True)


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--tokens", default="2048", help="context lengths, comma-separated")
    ap.add_argument("--decode", type=int, default=0, help="also time this many greedy tokens after each context")
    ap.add_argument("--no-prefill", action="store_true", help="time decode only")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--linear", action="store_true", help="time one token through each weight instead")
    ap.add_argument("--profile", type=int, default=0, help="profile this many prefills per side instead")
    args = ap.parse_args()
    keep_freed_memory()  # as kvt.harness.bench and run.py do; both sides alike
    sides = "torch.mv ms | F.linear ms" if args.linear else "kvt s | transformers s"
    print(f"{args.shape}: {hardware()}, transformers {tf.__version__}; median (min-max) of {args.repeats} "
          f"after a warm-up; ratio = {'F.linear / torch.mv' if args.linear else 'transformers / kvt'}")
    if not args.profile:  # a profile prints its own tables
        print(f"| what | dtype | tokens | {sides} | ratio | per round (min-max) |\n|---|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        ours = kvt.build_model(args.shape, dtype=dtype, seed=0)
        if args.linear:
            linear_rows(ours, dtype, args.repeats)
            continue
        ref = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(**ours.config.to_hf()), dtype=dtype)
        ref.load_state_dict(ours.state_dict(), strict=False)  # a tied lm_head is one tensor in both
        ref.eval()
        for T in map(int, args.tokens.split(",")):
            ids = torch.randint(0, ours.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
            # the same model? fp32 agrees to 4e-6; in bf16 each side is about 0.055 from the fp32 logits
            # (std 0.64) on this shape, and so as far from the other: rounding, not a different model
            tol = 1e-3 if dtype == torch.float32 else 0.15
            assert (ours(ids[:, :64])[0] - ref(ids[:, :64]).logits).abs().max() < tol, "models differ"
            if args.profile:
                profile_rows(lambda: ours(ids), lambda: ref(ids, use_cache=True), args.profile)
                continue
            if not args.no_prefill:
                k, h = race(lambda _: ours(ids), lambda _: ref(ids, use_cache=True), args.repeats)
                print(row("prefill", name, T, k, h), flush=True)
            if args.decode:
                steps = args.decode - 1                              # the first token comes from the prefill
                def hf_state():
                    out = ref(ids, use_cache=True)
                    return out.logits, out.cache
                k, h = race(lambda s: generate(ours, s[0][:, -1], s[1], args.decode),
                            lambda s: hf_decode(ref, s[0], s[1], steps), args.repeats,
                            kvt_setup=lambda: ours(ids, last=True), hf_setup=hf_state)
                print(row(f"decode {args.decode}", name, T, k, h), flush=True)
        del ours, ref


if __name__ == "__main__":
    main()
