"""What binding a mapper to its pair's weights costs (docs/refusals.md, "A mapper's weights"), on one checkpoint.

    python -m tests.bench_weights [--folder weights/smollm2-135m] [--repeats 3] [--threads 1]

Side by side in one process, each a warm-up run, then `--repeats` timed runs in turn (medians, min, max):
  - kvt's load_model in float32 and bfloat16, as it is (every decoder tensor hashed once it is in, in
    threads beside the copying: weights.load_weights) and the same load without the hashing;
  - the digest from a model's parameters (weights.model_digest with nothing kept: what a transformers
    model costs at its first check), kvt's and transformers' models, and from the folder
    (weights.folder_digest: the serving connector's, once an engine, the files in the page cache);
  - the sampled id from the folder and from the parameters (weights_fingerprint: 8 values a row);
  - a check of a mapper against a loaded model whose digests are kept (check_pair_weights: what handoff
    and take_over pay per request), beside a handoff of 128 tokens (a random map, bound to the model).
Then the cost a 14B checkpoint (Qwen3-14B's shape, bf16 on disk) would see: its decoder values at the
rate one thread hashed SmolLM2's (model_digest, bfloat16), beside its read at a stated disk rate. The
table names the processor.
"""
import argparse
import hashlib
import os
import time

import torch

import kvt
from kvt import weights
from kvt.config import load_config, shape
from kvt.bench import median_times
from kvt.handoff import handoff
from kvt.harness.bench import hardware, random_mapper
from kvt.harness.plan import n_params
from kvt.loading import _materialize, as_dtype, check_weights


def load_unhashed(path, dtype):
    """load_model without the digest: load_weights' loop without its hashing."""
    cfg = load_config(path)
    check_weights(cfg, path)
    model = _materialize(cfg, as_dtype(dtype), ["cpu"])
    with torch.no_grad():
        for name, (handle, key) in weights.check_checkpoint(model, path).items():
            weights._copy_in_chunks(model.get_parameter(name), handle.get_slice(key))
    return model


def fresh_digest(model):
    model.__dict__.pop("kvt_weights", None)              # nothing kept: every tensor hashed from its values
    return weights.model_digest(model)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", default="weights/smollm2-135m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--disk-gbs", type=float, default=2.0, help="the disk rate of the 14B model (GB/s)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    import transformers
    kt, kb = kvt.load_model(a.folder), kvt.load_model(a.folder, "bfloat16")
    hf = transformers.AutoModelForCausalLM.from_pretrained(a.folder, dtype=torch.float32)
    values = sum(p.numel() for _, p in weights._decoder_tensors(kt))
    mapper = random_mapper(kt.config, kt.config)
    mapper.meta = weights.weights_meta(kt, kt)                       # bound to SmolLM2 -> itself: checked
    ids = torch.randint(0, kt.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    fns = {
        "load_model float32 (hashing at load)": lambda: kvt.load_model(a.folder),
        "the same load without hashing": lambda: load_unhashed(a.folder, "float32"),
        "load_model bfloat16 (hashing at load)": lambda: kvt.load_model(a.folder, "bfloat16"),
        "the same load without hashing, bfloat16": lambda: load_unhashed(a.folder, "bfloat16"),
        "model_digest, nothing kept (kvt, float32)": lambda: fresh_digest(kt),
        "model_digest, nothing kept (kvt, bfloat16)": lambda: fresh_digest(kb),
        "model_digest, nothing kept (transformers, float32)": lambda: fresh_digest(hf),
        "folder_digest (page cache)": lambda: weights.folder_digest(a.folder),
        "folder_fingerprint (sampled id)": lambda: weights.folder_fingerprint(a.folder),
        "weights_fingerprint of the parameters (sampled id)": lambda: weights.weights_fingerprint(
            dict(weights._decoder_tensors(kt))),
        "check_pair_weights, digests kept (x100)": lambda: [weights.check_pair_weights(mapper, kt, kt)
                                                            for _ in range(100)],
        "handoff of 128 tokens, for scale (it checks both)": lambda: handoff(kt, kt, mapper, ids),
    }
    got = dict(zip(fns, median_times(list(fns.values()), "cpu", a.repeats)))   # a warm-up, then rounds in turn
    print(f"{a.folder}: {values / 1e6:.1f}M decoder values ({2 * values / 1e9:.2f} GB as bf16); "
          f"{hardware()}; median (min-max) of {a.repeats}")
    print(f"| {'step':<52} | seconds |")
    print(f"|{'-' * 54}|---------|")
    for name, t in got.items():
        print(f"| {name:<52} | {t:.3f} ({t.min:.3f}-{t.max:.3f}) |")
    at_load = got["load_model bfloat16 (hashing at load)"] - got["the same load without hashing, bfloat16"]
    rate = values / got["model_digest, nothing kept (kvt, bfloat16)"]     # one thread, one tensor after another
    cfg = shape("qwen3-14b")
    big = n_params(cfg)                                           # every value is read from disk
    hashed = big - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)   # the head is not hashed
    read = 2 * big / (a.disk_gbs * 1e9)
    print(f"hashing at load adds {at_load:.3f} s (bfloat16, its threads on {os.cpu_count()} cores); one thread hashes "
          f"{rate / 1e6:.0f}M bf16 values/s (model_digest), sha256 alone {sha_rate() / 1e9:.2f} GB/s")
    print(f"model, Qwen3-14B's shape ({big / 1e9:.1f}B values, {2 * big / 1e9:.1f} GB bf16, read at "
          f"{a.disk_gbs:g} GB/s: {read:.0f} s): hashing its {hashed / 1e9:.1f}B decoder values takes "
          f"{hashed / rate:.0f} s of one core's time, {hashed / rate / weights.HASH_THREADS:.0f} s on load_weights' "
          f"{weights.HASH_THREADS} threads, beside the read")


def sha_rate(n=64 << 20):
    """sha256's rate on this core, in bytes/s (the median of 3)."""
    data, ts = bytes(n), []
    for _ in range(3):
        t = time.perf_counter()
        hashlib.sha256(data).digest()
        ts.append(time.perf_counter() - t)
    return n / sorted(ts)[1]


if __name__ == "__main__":
    main()
