"""bench.py: it times what it says (a handoff, the median after a warm-up), both ways of holding a pair
time the same things, and the one cache per model it keeps stands for every shorter context."""
import pytest
import torch

import kvt
from kvt import bench as K
from kvt.harness import bench as B
from kvt.bench import token_ids, transfer_step
from kvt.harness.bench import bench, bench_lean, random_mapper
from kvt.handoff import handoff
from kvt.harness.recompute import Recompute
from kvt.harness.plan import forward_flops
from tests.conftest import tiny_config

SMALL, LARGE = tiny_config(n_layers=2), tiny_config(n_layers=3, dim=96)


def test_the_timed_transfer_is_a_handoff():
    """transfer_step on a crop of the longest context's cache gives the logits and cache of a handoff of
    the first n tokens. Guards: timing the mapper without the target's last-token step, or mapping a
    cache of the wrong length."""
    small, large = kvt.build_model(SMALL, seed=0), kvt.build_model(LARGE, seed=1)
    fwd = random_mapper(SMALL, LARGE, k=2)
    ids = token_ids([12, 24], SMALL.vocab_size, "cpu")
    _, cache = small(ids[:, :-1])
    logits, got = transfer_step(large, fwd, cache, ids, 12)
    want_logits, want = handoff(small, large, fwd, ids[:, :12])
    assert torch.allclose(logits, want_logits, atol=1e-5) and len(got) == len(want) == 12
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got.keys + got.values, want.keys + want.values))


def test_prefill_vs_transfer_times_the_targets_prefill_against_the_handoff(monkeypatch):
    """kvt.bench.prefill_vs_transfer, the readable bench: at each length it times the target's own prefill of n
    tokens and the handoff from the source's cache of n - 1 (a crop of one prefill), in the same rounds, and
    gives their ratio. Guards: timing the source's prefill instead of the target's, mapping the whole cache
    at every length, and a speedup that is not prefill / transfer."""
    small, large = kvt.build_model(SMALL, seed=0), kvt.build_model(LARGE, seed=1)
    fwd = random_mapper(SMALL, LARGE, k=2)
    seen, real_take_over, real_forward = [], K.take_over, type(large).forward
    monkeypatch.setattr(K, "take_over", lambda target, mapper, cache, *a, **kw:
                        seen.append(("transfer", target, len(cache))) or real_take_over(target, mapper, cache, *a, **kw))
    monkeypatch.setattr(type(large), "forward", lambda self, ids, *a, **kw:
                        seen.append(("forward", self, ids.shape[1])) or real_forward(self, ids, *a, **kw))
    rows = K.prefill_vs_transfer(small, large, fwd, lengths=(16, 24), repeats=2)
    assert [r["tokens"] for r in rows] == [16, 24]
    for r in rows:
        n = r["tokens"]
        assert len(r["target_prefill_s"].times) == len(r["transfer_s"].times) == 2       # after a warm-up round
        assert r["speedup"] == pytest.approx(r["target_prefill_s"] / r["transfer_s"])
        assert r["speedup_per_round"] == K.per_round(r["target_prefill_s"], r["transfer_s"])
        assert seen.count(("forward", large, n)) == 3                                  # the target's prefill, 3 rounds
        assert seen.count(("transfer", large, n - 1)) == 3                             # the handoff of n - 1 slots
    assert ("forward", small, 23) in seen and not [s for s in seen if s[0] == "forward" and s[1] is small and s[2] != 23]


def test_the_timed_mapping_is_the_transfer_before_its_last_step():
    """map_step gives the first n - 1 slots of transfer_step's cache, and every row carries its time.
    Guards: timing the mapping of a cache of another length, or a table without the column."""
    small, large = kvt.build_model(SMALL, seed=0), kvt.build_model(LARGE, seed=1)
    fwd = random_mapper(SMALL, LARGE, k=2)
    ids = token_ids([12, 24], SMALL.vocab_size, "cpu")
    _, cache = small(ids[:, :-1])
    mapped = B.map_step(large, fwd, cache, ids, 12)
    _, full = transfer_step(large, fwd, cache, ids, 12)
    assert len(mapped) == 11 and all(torch.equal(a, b[:, :, :11]) for a, b in zip(mapped.keys, full.keys))
    rows = bench(small, large, fwd, random_mapper(LARGE, SMALL, k=2), [16], repeats=1, names=("s", "l"))
    assert all(r["map_s"] > 0 for r in rows)


def test_rate_limit_prices_the_map_at_the_prefills_flop_rate():
    """A map that runs exactly at the prefill's FLOP rate (its FLOPs' share of the prefill's time) leaves
    the rate limit equal to the measured speedup; one twice as slow, above it. Guards: pricing the map
    with the last step's FLOPs (plan.transfer_flops: a tiny model's last step is much of them) or leaving
    the last step's measured time out."""
    fwd, n, prefill, last = random_mapper(SMALL, LARGE, k=2), 16, 10.0, 0.4
    at_rate = prefill * 2 * fwd.n_params() * (n - 1) / forward_flops(LARGE, n, last=True)  # the map's FLOPs at that rate

    def row(map_s):
        return B.rows({"s": {n: K.Timing([1.0])}, "l": {n: K.Timing([prefill])}},
                      {("s", "l"): {n: K.Timing([map_s + last])}}, {("s", "l"): fwd}, "cpu",
                      mapping={("s", "l"): {n: K.Timing([map_s])}})[0]
    same, slow = row(at_rate), row(2 * at_rate)
    assert same["rate_limit"] == pytest.approx(same["speedup"])
    assert slow["rate_limit"] == pytest.approx(same["speedup"]) and slow["speedup"] < same["speedup"]


@pytest.mark.parametrize("tied", [False, True])
def test_last_step_bytes_are_what_one_token_reads(tied):
    """last_step_bytes is every byte a one-token step reads: the model's weights (the embedding one row
    only, unless tied, when it is the output layer too) and a cache's K and V of T slots, counted here
    from a built model and a real cache; last_gbs divides it by the last step's time. Guards: counting
    a tied embedding twice or an untied one whole, pricing the cache at T - 1 slots or fp32 bytes for
    bf16, or dividing by the whole transfer's time or by the medians' difference (last_step_s)."""
    cfg, T = tiny_config(n_layers=3, dim=96, tie_embeddings=tied), 16
    model = kvt.build_model(cfg, dtype=torch.bfloat16)
    _, cache = model(token_ids([T], cfg.vocab_size, "cpu"))
    weights = sum(p.nbytes for p in model.parameters())  # a tied table once
    embedding = 0 if tied else model.model.embed_tokens.weight.nbytes
    want = weights - embedding + sum(k.nbytes + v.nbytes for k, v in zip(cache.keys, cache.values))
    assert B.last_step_bytes(cfg, T, 2) == want
    fwd, prefill = random_mapper(SMALL, cfg, k=2), K.Timing([10.0, 10.0, 10.0])
    transfer, mapping = K.Timing([0.32, 0.5, 0.4]), K.Timing([0.3, 0.3, 0.38])  # last steps 0.02, 0.2, 0.02
    row = B.rows({"s": {T: prefill}, "l": {T: prefill}}, {("s", "l"): {T: transfer}}, {("s", "l"): fwd}, "cpu",
                 mapping={("s", "l"): {T: mapping}}, itemsize={("s", "l"): 2})[0]
    assert row["last_gbs"] == pytest.approx(want / 0.02 / 1e9)


def test_the_last_step_is_timed_round_by_round():
    """last_step_s takes each round's transfer minus that round's map: transfers 1.0, 2.0, 1.5 and maps
    0.9, 1.1, 1.4 give steps 0.1, 0.9, 0.1, median 0.1, where the difference of the medians (1.5 - 1.1)
    and pairs of sorted runs (0.1, 0.4, 0.6) both give 0.4. Guards: either of those."""
    assert B.last_step_s(K.Timing([1.0, 2.0, 1.5]), K.Timing([0.9, 1.1, 1.4])) == pytest.approx(0.1)


def test_copy_rate_counts_bytes_read_and_written():
    """copier's copy of 8 MiB copies and moves 16 MiB, what it reads and what it writes, and a row's
    copy_gbs divides that by the copy's time taken in turn with the transfer, as last_gbs counts every
    byte the last step reads. Guards: counting one side of the copy, float32 elements as bytes, or
    dividing by the transfer's time."""
    copy, moved = B.copier("cpu", mib=8)
    assert moved == 2 * 8 * 2**20 and copy().eq(1).all()
    fwd, n = random_mapper(SMALL, LARGE, k=2), 16
    row = B.rows({"s": {n: K.Timing([1.0])}, "l": {n: K.Timing([10.0])}}, {("s", "l"): {n: K.Timing([0.5])}},
                 {("s", "l"): fwd}, "cpu", copies={("s", "l"): {n: (K.Timing([0.25]), moved)}})[0]
    assert row["copy_gbs"] == pytest.approx(moved / 0.25 / 1e9)


def test_roofline_prices_the_map_at_the_prefills_rate_and_the_last_step_at_the_copys():
    """A transfer whose map runs at the prefill's FLOP rate and whose last step reads its bytes at the
    copy's rate reaches 100% of the roofline, in every round (the rounds' prefills and copies differ);
    one whose last step takes twice that, less. Guards: the last step priced at its measured time (the
    rate limit, which hides its shortfall), or a round's fraction taken from another round's times."""
    cfg, fwd, n = LARGE, random_mapper(SMALL, LARGE, k=2), 16
    moved, last = 2 * 2**20, B.last_step_bytes(LARGE, n, 4)
    prefill, copy = K.Timing([10.0, 20.0, 12.0]), K.Timing([1e-3, 3e-3, 2e-3])
    share = 2 * fwd.n_params() * (n - 1) / forward_flops(cfg, n, last=True)              # map FLOPs / prefill FLOPs

    def row(slow):
        transfer = K.Timing([p * share + slow * last * c / moved for p, c in zip(prefill.times, copy.times)])
        return B.rows({"s": {n: prefill}, "l": {n: prefill}}, {("s", "l"): {n: transfer}}, {("s", "l"): fwd}, "cpu",
                      itemsize={("s", "l"): 4}, copies={("s", "l"): {n: (copy, moved)}})[0]
    at, slow = row(1), row(2)
    assert at["of_roofline"] == pytest.approx((1.0, 1.0, 1.0))
    assert slow["of_roofline"][0] < 1 and at["roofline"] == pytest.approx(12.0 / (12.0 * share + last * 2e-3 / moved))
    assert "roofline" in B.format_rows([at])


def test_both_paths_are_timed_in_the_same_rounds():
    """bench(both=True) times the plain path's transfer beside the fast one, and the table shows it;
    without it, no plain transfer is timed. Guards: the column left empty, the plain path's time taken
    from the fast path's runs, or the flag shadowed by a local name (the plain path timed always)."""
    small, large = kvt.build_model(SMALL, seed=0), kvt.build_model(LARGE, seed=1)
    rows = bench(small, large, random_mapper(SMALL, LARGE, k=2), None, [16], repeats=1, names=("s", "l"), both=True)
    assert rows[0]["plain_transfer_s"] > 0 and rows[0]["plain_transfer_s"] is not rows[0]["transfer_s"]
    assert "plain transfer s" in B.format_rows(rows)
    rows = bench(small, large, random_mapper(SMALL, LARGE, k=2), None, [16], repeats=1, names=("s", "l"))
    assert rows[0]["plain_transfer_s"] is None and "plain transfer s" not in B.format_rows(rows)


def test_the_timed_recompute_is_a_handoff_with_that_budget():
    """transfer_step with frac recomputes the last frac of the mapped slots, as handoff does with
    Recompute(frac=frac, by="suffix"); and the rows carry its time for each budget. Guards: timing a
    transfer that skips the recompute (it would be the plain transfer's logits), or dropping the column."""
    small, large = kvt.build_model(SMALL, seed=0), kvt.build_model(LARGE, seed=1)
    fwd = random_mapper(SMALL, LARGE, k=2)
    ids = token_ids([12, 24], SMALL.vocab_size, "cpu")
    _, cache = small(ids[:, :-1])
    logits, _ = transfer_step(large, fwd, cache, ids, 12, frac=0.25)
    want, _ = handoff(small, large, fwd, ids[:, :12], recompute=Recompute(frac=0.25, by="suffix"))
    plain, _ = transfer_step(large, fwd, cache, ids, 12)
    assert torch.allclose(logits, want, atol=1e-5) and not torch.allclose(logits, plain, atol=1e-3)
    rows = bench(small, large, fwd, None, [16], repeats=1, names=("s", "l"), fracs=[0.25])
    assert set(rows[0]["recompute_s"]) == {"0.25"} and rows[0]["recompute_s"]["0.25"] > 0


def test_median_time_drops_the_warm_up_and_takes_the_median(monkeypatch):
    """A fake clock: runs take 9 (warm-up), 1, 5 and 3 seconds. Guards: the warm-up counted (median of
    all four would be 4) or the mean taken (3)."""
    clock, durations = [0.0], iter([9.0, 1.0, 5.0, 3.0])
    monkeypatch.setattr(K.time, "perf_counter", lambda: clock[0])

    def run():
        clock[0] += next(durations)
    t = K.median_time(run, "cpu", repeats=3)
    assert t == 3.0 and (t.min, t.max) == (1.0, 5.0)


def test_median_times_takes_its_runs_in_turn(monkeypatch):
    """The prefill and the transfer are timed in turn, so a host that slows down mid-run moves both
    alike. Fake clock: a takes 1 s and b 2 s, times a factor that grows by 1 with every call. In turn
    their medians are 5 and 12; one after the other they would be 3 and 14. Guards: timing every run of
    one before the other (the ratio would move with the host, 4.7 instead of 2.4)."""
    clock, calls = [0.0], []

    def run(name, base):
        calls.append(name)
        clock[0] += base * len(calls)
    monkeypatch.setattr(K.time, "perf_counter", lambda: clock[0])
    a, b = K.median_times([lambda: run("a", 1.0), lambda: run("b", 2.0)], "cpu", repeats=3)
    assert calls == ["a", "b"] * 4 and (a, b) == (5.0, 12.0)


def test_per_round_divides_the_runs_of_each_round():
    """Round by round, a took 10, 30, 20 s and b 1, 3, 4 s: ratios 10, 10, 5. Guards: pairing the runs
    out of their rounds (sorted, the ratios would be 10, 6.7, 7.5: median 7.5) or dividing the medians
    (20 / 3 = 6.7)."""
    assert K.per_round(K.Timing([10.0, 30.0, 20.0]), K.Timing([1.0, 3.0, 4.0])) == (10.0, 5.0, 10.0)


def test_bench_and_bench_lean_time_the_same_things():
    """Guards: bench_lean building more than one model at a time, or timing a model's prefill twice."""
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


@pytest.mark.parametrize("scope", ["layer", "head"])
def test_random_mapper_has_the_shape_of_a_fitted_one(scope):
    """Timing a random mapper stands for timing a fitted one only if it does the same work. Guards: a
    layer-scope bench timing head-scope matmuls (8x fewer FLOPs)."""
    from kvt.harness.calibration import CalibrationOptions, calibrate
    from tests.conftest import calib_of
    small, large = kvt.build_model(SMALL, seed=0), kvt.build_model(LARGE, seed=1)
    fitted, _ = calibrate(small, large, calib_of(torch.randint(0, 128, (10, 16))), scope=scope, k=2, lam=1e-3,
                          options=CalibrationOptions(progress=False))
    rand = random_mapper(SMALL, LARGE, scope, k=2)
    assert {n: t.shape for n, t in rand.tensors().items()} == {n: t.shape for n, t in fitted.tensors().items()}


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


def test_random_mappers_keep_their_selections_on_the_host():
    """Guards: layer indices moved to the device with the weights, so that every apply reads them back
    with a host sync per read (.tolist() on a GPU tensor)."""
    m = random_mapper(SMALL, LARGE, k=2, dtype=torch.bfloat16, device="meta")
    assert m.W["k"].device.type == "meta" and m.W["k"].dtype == torch.bfloat16
    assert m.layers["k"].device.type == "cpu" and m.layers["v"].dtype == torch.long


def test_peak_memory_is_the_benchs_own():
    """peak_gb counts from the bench's start. Guards: the process's peak (here a 3 GiB tensor freed
    before the bench), which says nothing about the bench."""
    small, large = kvt.build_model(SMALL, seed=0), kvt.build_model(LARGE, seed=1)
    big = torch.ones(3 * 2**28)                                       # 3 GiB, touched (the bench holds ~1.3)
    del big
    before = B.peak_memory_gb("cpu")
    rows = bench(small, large, random_mapper(SMALL, LARGE, k=2), None, [16], repeats=1, names=("s", "l"))
    assert rows[0]["peak_gb"] < before - 0.5, (rows[0]["peak_gb"], before)
