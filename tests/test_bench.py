"""bench.py: both ways of timing a pair (both models held, or one at a time) give the same table, and
the one cache per model it keeps stands for every shorter context."""
import torch

import kvt
from kvt.bench import bench, bench_lean, random_mapper, token_ids
from tests.conftest import tiny_config

SMALL, LARGE = tiny_config(n_layers=2), tiny_config(n_layers=3, dim=96)


def test_bench_and_bench_lean_time_the_same_things():
    fwd, back = random_mapper(SMALL, LARGE, k=2), random_mapper(LARGE, SMALL, k=2, seed=1)
    held = bench(kvt.build_model(SMALL), kvt.build_model(LARGE), fwd, back, [16, 32], repeats=1, names=("s", "l"))
    built = []

    def build(name):
        built.append(name)
        return kvt.build_model(SMALL if name == "s" else LARGE)

    lean = bench_lean(build, ("s", "l"), fwd, back, [16, 32], repeats=1)
    assert built == ["s", "l", "s"]  # one model at a time: the small one is rebuilt for the way back
    for rows in (held, lean):
        assert [(r["direction"], r["tokens"]) for r in rows] == [("s -> l", 16), ("l -> s", 16), ("s -> l", 32), ("l -> s", 32)]
        for r in rows:
            assert r["transfer_s"] > 0 and abs(r["speedup"] - r["target_prefill_s"] / r["transfer_s"]) < 1e-12
        assert rows[0]["source_prefill_s"] == rows[1]["target_prefill_s"]  # one prefill per model and length


def test_the_longest_cache_cropped_is_each_shorter_one():
    """What lets bench keep one cache per model: the cache of ids[:, :n-1] is the first n-1 slots of the
    longest context's cache."""
    model, ids = kvt.build_model(SMALL), token_ids([8, 24], SMALL.vocab_size, "cpu")
    _, longest = model(ids[:, :-1])
    _, short = model(ids[:, :7])
    cropped = longest.crop(0, 7)
    for a, b in zip(cropped.keys + cropped.values, short.keys + short.values):
        assert torch.allclose(a, b, atol=1e-5)
    assert torch.equal(cropped.positions, short.positions)
