"""stats.py: streamed sums equal the batch computation; harness/calibration.py: resume is bit-identical;
plan.memory_plan adds up."""
from functools import partial

import pytest
import torch
from conftest import calib_of, tiny_config

import kvt
from kvt import stats
from kvt.capture import capture, features
from kvt.config import KvtError, shape
from kvt.harness.data import Calibration
from kvt.calibrate import calibrate
from kvt.harness import calibration
from kvt.harness.calibration import accumulate_resumable
from kvt.harness.files import resumable
from kvt import fast
from kvt.fast import Pending
from kvt.harness.plan import memory_plan
from kvt.harness.files import load_stats, save_stats
from kvt.stats import FIELDS, Sums, accumulate, new_stats

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair():
    src = kvt.build_model(tiny_config("llama", n_layers=3), seed=1)
    tgt = kvt.build_model(tiny_config("llama", n_layers=2, dim=96, n_heads=6, ffn_dim=160), seed=2)
    ids = torch.randint(0, 128, (12, 24), generator=torch.Generator().manual_seed(0))
    return src, tgt, calib_of(ids)


def all_equal(a, b):
    return all(torch.equal(getattr(a.sums[n], f), getattr(b.sums[n], f)) for n in a.sums for f in FIELDS)


@pytest.mark.parametrize("scope", ["head", "layer"])
def test_streamed_statistics_equal_the_batch_computation(pair, scope):
    """Guards: a wrong centering correction (the batch mean's share added back wrongly), batches that
    straddle the fit and validation regions, the diagnostics region leaking into the sums."""
    src, tgt, calib = pair
    stats = accumulate(src, tgt, calib, new_stats(src.config, tgt.config, scope), batch_size=3)
    for split, ids in (("fit", calib.fit), ("val", calib.val)):
        s, t = capture(src, ids), capture(tgt, ids)                         # everything in one batch
        for i, kind in enumerate("kv"):
            x = features(s[i], scope).flatten(2).double()                      # (G, N, F)
            y = features(t[i], scope).flatten(2).double()                      # (G, N, O)
            got = stats.part(kind, split)
            expected = {"xx": x.transpose(1, 2) @ x, "xy": x.transpose(1, 2) @ y, "sx": x.sum(1),
                        "sy": y.sum(1), "syy": (y * y).sum(1), "n": torch.tensor(float(x.shape[1]))}
            for f, e in expected.items():
                err = ((got.gram() if f == "xx" else getattr(got, f)) - e).abs().max().item()
                assert err <= 1e-9 * (1 + e.abs().max().item()), f"{kind}.{split}.{f}: max abs error {err:.2e}"


class Interrupted(Exception):
    pass


class DiesAfter:
    """A model that raises after `calls` forward passes: an interrupted calibration."""
    def __init__(self, model, calls):
        self.model, self.calls = model, calls

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kw):
        self.calls -= 1
        if self.calls < 0:
            raise Interrupted
        return self.model(*args, **kw)


def test_resume_is_bit_identical(pair, tmp_path):
    """Through the fast adder (fast.add_batches). Guards: a checkpoint that misses products still pending
    (Pending), and a resumed run that adds its pending products to the sums at other points than an
    unbroken run (with the same `every`)."""
    src, tgt, calib = pair
    whole = accumulate_resumable(src, tgt, calib, new_stats(src.config, tgt.config, "head"), batch_size=2, every=2,
                                 progress=False, add=fast.add_batches)
    path = tmp_path / "stats.safetensors"
    with pytest.raises(Interrupted):
        accumulate_resumable(DiesAfter(src, 3), tgt, calib, new_stats(src.config, tgt.config, "head"), 2, path,
                             every=2, save_s=0, progress=False, add=fast.add_batches)
    assert load_stats(path).seen == 4                                        # two rounds of a batch of two
    resumed = accumulate_resumable(src, tgt, calib, new_stats(src.config, tgt.config, "head"), 2, path, every=2,
                                   save_s=0, progress=False, add=fast.add_batches)
    assert resumed.seen == len(calib.fit) + len(calib.val) and all_equal(resumed, whole)
    assert all_equal(load_stats(path), whole)


def test_checkpoints_come_by_wall_time_and_once_complete(pair, tmp_path, monkeypatch):
    """A checkpoint is written at a flush point once `save_s` seconds have passed since the last one, and
    the complete pass once (not at every flush point: 28 saves of tens of GiB per pass on a real pair);
    final=False writes no complete pass. Guards: saving at every flush point again, or never by time."""
    src, tgt, calib = pair
    clock, saves = [0.0], []
    monkeypatch.setattr(calibration.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(calibration, "save_stats", lambda stats, path: saves.append(stats.seen))

    class Ticking:                                                          # 100 s per source forward pass
        def __init__(self, model):
            self.model = model

        def __getattr__(self, name):
            return getattr(self.model, name)

        def __call__(self, *args, **kw):
            clock[0] += 100
            return self.model(*args, **kw)

    n = len(calib.fit) + len(calib.val)                                     # 10 sequences, 5 rounds of 2
    accumulate_resumable(Ticking(src), tgt, calib, new_stats(src.config, tgt.config, "head"), 2, tmp_path / "s",
                         every=1, save_s=250, progress=False)
    assert saves == [6, n], saves                                           # 300 s in, then complete
    saves.clear()
    accumulate_resumable(Ticking(src), tgt, calib, new_stats(src.config, tgt.config, "head"), 2, tmp_path / "t",
                         every=1, save_s=250, final=False, progress=False)
    assert saves == [6], saves


def test_resume_refuses_other_data_plan_or_key(pair, tmp_path):
    """Guards: a checkpoint of other sequences, another plan or another pair (key) taken as this one's."""
    src, tgt, calib = pair
    path = tmp_path / "stats.safetensors"
    short = Calibration(calib.fit[:4], calib.val, calib.diag)
    accumulate_resumable(src, tgt, short, resumable(new_stats(src.config, tgt.config, "head"), "a"), path=path, progress=False)
    with pytest.raises(KvtError, match="other calibration sequences"):
        accumulate_resumable(src, tgt, calib, resumable(new_stats(src.config, tgt.config, "head"), "a"), path=path,
                             progress=False)
    with pytest.raises(KvtError, match="another calibration plan"):
        accumulate_resumable(src, tgt, short, resumable(new_stats(src.config, tgt.config, "layer"), "a"), path=path,
                             progress=False)
    with pytest.raises(KvtError, match="another pair or settings"):
        accumulate_resumable(src, tgt, short, resumable(new_stats(src.config, tgt.config, "head"), "b"), path=path,
                             progress=False)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(KvtError, match="unreadable.*delete it"):
        accumulate_resumable(src, tgt, short, resumable(new_stats(src.config, tgt.config, "head"), "a"), path=path, progress=False)


def test_statistics_add_like_tensors(pair):
    """The sums of two halves of the data, added (Sums.__add__), equal the sums over the whole, within
    float64 rounding (what all_reduce across ranks relies on). Guards: a sum that is not additive (a mean,
    a count kept once) or an add that drops a field."""
    src, tgt, calib = pair
    halves = [accumulate(src, tgt, Calibration(fit, val, calib.diag), new_stats(src.config, tgt.config, "head"))
              for fit, val in ((calib.fit[:3], calib.val[:1]), (calib.fit[3:], calib.val[1:]))]
    whole = accumulate(src, tgt, calib, new_stats(src.config, tgt.config, "head"))
    for name, s in whole.sums.items():
        added = halves[0].sums[name] + halves[1].sums[name]
        for f in FIELDS:
            a, b = getattr(added, f), getattr(s, f)
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12 * b.abs().max().item()), f"{name}.{f}"


def test_save_refuses_nan(pair, tmp_path):
    src, tgt, _ = pair
    stats = new_stats(src.config, tgt.config, "head")
    stats.part("k", "fit").sy[0, 0] = float("nan")
    with pytest.raises(KvtError) as e:
        save_stats(stats, tmp_path / "s.safetensors")
    assert "NaN" in str(e.value) and "\n" not in str(e.value)


def test_memory_plan_matches_allocated_statistics(pair):
    """Guards: a plan that leaves out the float32 products pending for K and V (a quarter of the sums)."""
    src, tgt, calib = pair
    for scope in ("head", "layer"):
        stats, pending, ids = new_stats(src.config, tgt.config, scope), {}, calib.fit[:1]
        fast.add_batch(stats, "fit", capture(src, ids), capture(tgt, ids), pending)   # float32 products held
        allocated = sum(t.numel() * t.element_size() for s in stats.sums.values() for t in s.tensors())
        allocated += sum(t.numel() * t.element_size() for p in pending.values() for t in p.buf.tensors())
        _, planned = memory_plan(src.config, tgt.config, scope, k=8, batch_tokens=0)[-1]  # the pass for this scope
        assert planned == allocated, f"{scope}: plan {planned} vs allocated {allocated}"


def test_memory_plan_for_a_real_pair():
    """qwen3-0.6b -> 1.7b: head-level statistics are small; layer scope needs the second, bigger pass."""
    src, tgt = shape("qwen3-0.6b"), shape("qwen3-1.7b")
    (_, head), = memory_plan(src, tgt, "head", batch_tokens=0)
    assert head == (4 * 8 + 2 * 4) * (8 * 3584 * 3584 * 2 + 8 * 3584 * 3 + 1)  # G=8, F=O=28*128; sums, pending
    rows = memory_plan(src, tgt, "layer", batch_tokens=0)
    assert rows[0][1] == head and rows[1][1] == (4 * 8 + 2 * 4) * (28672 * 28672 * 2 + 28672 * 3 + 1)  # G=1, F=O=28*8*128
    with pytest.raises(KvtError, match="--scope layer"):
        memory_plan(shape("qwen3-0.6b"), shape("llama3.2-1b"), "head")


def test_head_scope_refuses_mismatched_kv(pair):
    src, tgt, calib = pair
    other = kvt.build_model(tiny_config("llama", n_kv_heads=1), seed=3)
    with pytest.raises(KvtError) as e:
        calibrate(src, other, calib, scope="head")
    assert "--scope layer" in str(e.value) and "\n" not in str(e.value)


def test_upper_part_of_the_gram_spans_chunks():
    """The fast path accumulates xx as its upper part in chunks of CHUNK features, then mirrors it onto the
    lower part (fast.mirror_): gram() and select() read the whole sum."""
    from kvt.fast import CHUNK, add_fast_
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 300, 2 * CHUNK + 76, generator=g, dtype=torch.float64)
    s = Sums.zeros(2, x.shape[2], 3)
    add_fast_(add_fast_(s, x[:, :100], x[:, :100, :3], torch.float64), x[:, 100:], x[:, 100:, :3], torch.float64)
    full = x.transpose(1, 2) @ x
    assert ((s.gram() - full).abs().max() <= 1e-10 * full.abs().max()), "gram() differs from x^T x"
    fi = torch.tensor([3, CHUNK - 1, CHUNK + 5, 2 * CHUNK + 70])                # crosses chunk boundaries
    assert torch.allclose(s.select(fi).gram(), full[:, fi][:, :, fi], rtol=1e-12, atol=1e-9)


def test_float32_products_stay_close_to_float64(pair):
    src, tgt, calib = pair
    run = lambda products: accumulate(src, tgt, calib, new_stats(src.config, tgt.config, "head"),  # noqa: E731
                                      add=partial(fast.add_batches, products=products))
    exact, quick = run(torch.float64), run(torch.float32)
    for name in exact.sums:
        for f in ("xx", "xy"):
            a, b = getattr(quick.sums[name], f), getattr(exact.sums[name], f)
            err = (a - b).abs().max().item() / b.abs().max().item()
            assert err < 1e-6, f"{name}.{f}: relative error {err:.1e} with float32 products"


def test_products_not_held_give_the_held_statistics(pair, monkeypatch):
    """As on a GPU (holds false): float32 products go into the float64 sums batch by batch and only the
    shift's share waits for the flush. Guards: that path adding the shift's share twice, or never."""
    src, tgt, calib = pair
    run = lambda: accumulate_resumable(src, tgt, calib, new_stats(src.config, tgt.config, "head"), 2,  # noqa: E731
                                       every=2, progress=False, add=fast.add_batches)
    held = run()
    monkeypatch.setattr(fast, "holds", lambda *args: False)
    direct = run()
    for name in held.sums:
        for f in FIELDS:
            a, b = getattr(direct.sums[name], f), getattr(held.sums[name], f)
            assert (a - b).abs().max() <= 1e-6 * b.abs().max(), f"{name}.{f}"


def test_float32_products_keep_float64_accuracy_on_features_with_a_large_mean():
    """Features with mean 100 and std 1: the ridge fit from float32 products is as accurate as from
    float64 ones, batch by batch (fast.add_fast_) and streamed (Pending: several batches on one shift, here
    drifting away from it). Guards: float32 products of uncentered features (their mean swamps their
    spread: a W error of 3.6e-2 against 1e-3), and a wrong correction for the shift."""
    from kvt import ridge
    g = torch.Generator().manual_seed(0)
    W = torch.randn(1, 16, 4, generator=g, dtype=torch.float64)
    def data(n):
        x = 100 + torch.randn(1, n, 16, generator=g, dtype=torch.float64)
        return x, x @ W + 0.05 * torch.randn(1, n, 4, generator=g, dtype=torch.float64)
    errs = {}
    for products in (torch.float64, torch.float32, "pending"):
        s = Sums.zeros(1, 16, 4)
        pending = Pending(s, torch.float32)                                 # as accumulate streams
        g.manual_seed(1)
        for i in range(8):                                                  # 8 batches of 1,024 tokens
            x, y = data(1024)
            if products == "pending":                                       # the mean drifts by 1 a batch,
                pending.add_(x.float() + i, (y + i * W.sum(1)).float())    # away from the first batch's
            else:
                fast.add_fast_(s, x.float(), y.float(), products)
        errs[products] = (ridge.solve(pending.flush_(), 1e-9)[0] - W).abs().max().item()
    assert errs[torch.float64] < 3e-3, errs
    assert errs[torch.float32] < 1.5 * errs[torch.float64] and errs["pending"] < 1.5 * errs[torch.float64], errs
