"""The headline run, rehearsed on a CPU: the memory plan bounds what calibration and the bench hold
(scaled-down Qwen3 shapes), and the run's checkpoints, disk check and gate do what the plan assumes.

The measured peak is the process's resident memory (VmHWM after /proc/self/clear_refs) less what it held
before, after a warm-up run that loads every library and a malloc_trim that returns its freed memory,
with large blocks mapped on their own (mallopt) so that resident memory follows live tensors, as CUDA's
max_memory_allocated does: RSS counts pages touched, so it sits at or below
what was allocated, and the plan (kvt/harness/plan.py) must bound it: measured <= plan * (1 + MARGIN) + SLACK.
The plan must also not be loose: measured >= plan * TIGHT. Each measurement runs in a fresh Python
(`isolated`): resident memory is a figure of the whole process, and the tests run before it in the same
process leave the heap in a state that moves it by tens of MiB."""
import ctypes
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import calib_of, tiny_config

import kvt
from kvt.harness import pipeline
from kvt.harness.bench import bench, peak_memory_gb, random_mapper, reset_peak_memory
from kvt.config import KvtError, shape
from kvt.harness.calibration import CalibrationOptions, calibrate
from kvt.harness.plan import Options, disk_plan, plan

pytestmark = pytest.mark.usefixtures("one_thread")
MARGIN, SLACK, TIGHT = 0.05, 4 * 2**20, 0.4


def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


def scaled(width=256, heads=4, kv_heads=2, layers=3, vocab=512):
    """Qwen3-0.6B's shape (head dim 128, q/k norms) with fewer layers, heads and vocabulary."""
    base = shape("qwen3-0.6b")
    return dataclasses.replace(base, n_layers=layers, vocab_size=vocab, dim=width, n_heads=heads, n_kv_heads=kv_heads,
                               ffn_dim=2 * width)


LIBC = ctypes.CDLL("libc.so.6")


def isolated(call):
    """Run `call` (Python text calling this module's functions) in a fresh, one-thread Python, with large
    blocks mapped on their own (M_MMAP_THRESHOLD 64 KiB: resident memory follows live tensors, no heap
    keeps freed ones); an assertion there fails the test here, with its message."""
    here = Path(__file__).resolve().parent
    code = f"import torch; torch.set_num_threads(1); import test_headline as t; t.LIBC.mallopt(-3, 64 * 1024); t.{call}"
    p = subprocess.run([sys.executable, "-c", code], cwd=here.parent, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)]),
                            "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.stdout


def measured(fn):
    """Bytes of resident memory fn() adds at most, after a warm-up call (libraries loaded) whose freed
    memory the C allocator has handed back (malloc_trim), so that the second call's pages are new."""
    fn()
    LIBC.malloc_trim(0)
    reset_peak_memory("cpu")
    base = rss()
    fn()
    return peak_memory_gb("cpu") * 2**30 - base


def check_bound(got, planned, what):
    assert got <= planned * (1 + MARGIN) + SLACK, f"{what}: measured {got / 2**20:.0f} MiB > plan {planned / 2**20:.0f} MiB"
    assert got >= planned * TIGHT, f"{what}: plan {planned / 2**20:.0f} MiB is loose (measured {got / 2**20:.0f} MiB)"


def calibration_bound(scope, src_cfg, tgt_cfg, n=10, T=64, k=2):
    src, tgt = kvt.build_model(src_cfg, seed=0), kvt.build_model(tgt_cfg, seed=1)
    calib = calib_of(torch.randint(0, src_cfg.vocab_size, (n, T), generator=torch.Generator().manual_seed(0)))
    p = plan(src_cfg, tgt_cfg, Options(scope, k=k, context=T, dtype=torch.float32, devices=["cpu"], calib_len=T))
    planned = max(p.total(ph, "cpu") for ph in p.phases() if ph.startswith("calibration"))
    got = measured(lambda: calibrate(src, tgt, calib, scope=scope, k=k, options=CalibrationOptions(progress=False)))
    check_bound(got, planned, f"{scope}-scope calibration")
    return got, planned


@pytest.mark.parametrize("scope", ["head", "layer"])
def test_plan_bounds_calibration(scope):
    """Guards: a resident tensor the plan leaves out (the fitted W kept on the device in float64, the
    ridge fit's eigendecomposition temporaries, the float32 products held on a CPU), or a plan so loose
    it says nothing."""
    isolated(f"calibration_bound({scope!r}, t.scaled(layers=3), t.scaled(layers=4))")


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["head", "layer"])
def test_plan_bounds_calibration_at_qwen3_width(scope):
    """The same at Qwen3-0.6B's full width (8 KV heads of 128: 1,024 features per layer), 3 and 4 layers."""
    isolated(f"calibration_bound({scope!r}, t.scaled(1024, 16, 8, 3), t.scaled(1024, 16, 8, 4))")


def test_plan_bounds_the_bench():
    """Guards: the bench's caches both ways, its mappers or its copy buffers left out of the plan."""
    isolated("bench_bound()")


def bench_bound():
    s, t = scaled(layers=3), scaled(layers=4)
    small, large = kvt.build_model(s, seed=0), kvt.build_model(t, seed=1)
    T = 512
    p = plan(s, t, Options("layer", k=2, context=T, dtype=torch.float32, devices=["cpu"], calibrate=False, bench=True))
    planned = max(p.total(ph, "cpu") for ph in p.phases() if ph.startswith("bench"))
    fwd, back = random_mapper(s, t, "layer", 2), random_mapper(t, s, "layer", 2, seed=1)
    got = measured(lambda: bench(small, large, fwd, back, [T], repeats=1, names=("s", "l")))
    check_bound(got, planned, "bench")


def test_plan_bounds_a_ridge_fit():
    """ridge.fit_layers of k = 2 source layers (1,024 features) onto one target layer out of sums over 4
    and 2 layers holds what plan.ridge_bytes counts: on a GPU beside a pass's statistics it is what
    tips the last groups over (about 4 GiB at Qwen3-32B's layer width). Guards: a count that leaves out
    eigh's matrices or the selections' intermediates."""
    isolated("ridge_fit_bound()")


def ridge_fit_bound():
    from kvt import ridge
    from kvt.harness.plan import ridge_bytes
    from kvt.stats import Stats, Sums
    g = torch.Generator().manual_seed(0)
    bx = by = 512
    parts = {}
    for name in ("k.fit", "k.val", "v.fit", "v.val"):
        x = torch.randn(1, 3000, 4 * bx, generator=g, dtype=torch.float64)
        parts[name] = Sums.zeros(1, 4 * bx, 2 * by).add_(x, x[:, :, :2 * by] + 0.1 * torch.randn(1, 3000, 2 * by, generator=g,
                                                                                        dtype=torch.float64))
        del x
    stats = Stats("layer", [0, 1, 2, 3], [0, 1], bx, by, parts)
    selected = torch.tensor([[0, 2], [1, 3]])
    got = measured(lambda: ridge.fit_layers(stats, "k", selected, (1e-3,)))
    check_bound(got, ridge_bytes(1, 4 * bx, 2 * by, 2 * bx, by), "ridge fit")


# ---- the run's files: statistics deleted once used, fits resumed, disk checked, the gate on the used mapper --

RUN_ARGS = ["--tasks", "toy_recall", "--limit", "4", "--calib-seqs", "12", "--calib-len", "40", "--k", "2", "--no-bench"]


def test_statistics_are_deleted_once_the_mapper_is_saved_unless_kept(tiny_pair, tmp_path):
    """Guards: statistics files left behind by every run (tens of GiB each on a real pair), or deleted
    although --keep-stats asked to keep them."""
    argv = ["--source", str(tiny_pair / "source"), "--target", str(tiny_pair / "twin")] + RUN_ARGS
    pipeline.main(argv + ["--out", str(tmp_path / "a")])
    assert not list((tmp_path / "a").glob("stats-*")) and len(list((tmp_path / "a").glob("mapper-*"))) == 1
    pipeline.main(argv + ["--out", str(tmp_path / "b"), "--keep-stats"])
    kept = {f.name.split(".", 1)[1].split("-")[0] for f in (tmp_path / "b").glob("stats-*")}
    assert kept == {"pass1", "pass2", "fit"}, kept


def test_layer_passes_resume_from_their_fits_and_drop_their_statistics(tmp_path):
    """keep_stats=False: each layer-level pass leaves its fits (small) and no statistics, and a rerun
    fits the same mapper from those and the first pass without running the models again. Guards: a
    complete layer pass written to disk (36 GiB each on Qwen3 14B -> 32B), or its fits not reused."""
    cfg = tiny_config("llama", n_layers=3)
    source = kvt.build_model(cfg, seed=0)
    target = kvt.build_model(tiny_config("llama", n_layers=3), seed=1)
    calib = calib_of(torch.randint(0, 128, (14, 24), generator=torch.Generator().manual_seed(0)))
    options = CalibrationOptions(group=1, checkpoint=tmp_path / "s", key="a", keep_stats=False, progress=False)
    first, _ = calibrate(source, target, calib, scope="layer", k=2, options=options)
    assert (tmp_path / "s.pass1").exists() and not list(tmp_path.glob("s.pass2-*"))
    assert len(list(tmp_path.glob("s.fit-*"))) >= 2

    class Dead:                                   # a model that must not run: everything comes from files
        config = source.config

        def parameters(self):
            return source.parameters()

        def named_parameters(self):                # its weights' fingerprint, recorded in the mapper
            return source.named_parameters()

        def __call__(self, *a, **kw):
            raise AssertionError("the models ran again")

    again, _ = calibrate(Dead(), target, calib, scope="layer", k=2, options=options)
    for name, t in first.tensors().items():
        assert torch.equal(again.tensors()[name], t), name
    with pytest.raises(KvtError, match="made for another pair or settings.*delete it"):
        calibrate(Dead(), target, calib, scope="layer", k=2, options=dataclasses.replace(options, key="b"))


def test_a_folder_short_of_disk_is_refused_in_one_line(tiny_pair, tmp_path, monkeypatch):
    """Guards: an OSError deep in a calibration (hours in) on a disk too small for its checkpoints."""
    free = type("Usage", (), {"free": 1000})
    monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda path: free)
    argv = ["--source", str(tiny_pair / "source"), "--target", str(tiny_pair / "twin"), "--out", str(tmp_path / "o")]
    with pytest.raises(KvtError) as e:
        pipeline.main(argv + RUN_ARGS)
    assert "has 0.0 GB free and calibration needs up to" in str(e.value) and "\n" not in str(e.value)


def test_the_gate_judges_the_mapper_as_evaluation_uses_it(tiny_pair, tmp_path, monkeypatch):
    """Diagnostics and the gate see the mapper cast to the evaluation dtype. Guards: diagnosing the
    float32 mapper while evaluation and the bench use it in bfloat16."""
    seen = []
    real = pipeline.diagnose
    monkeypatch.setattr(pipeline, "diagnose", lambda s, t, m, ids, **kw: seen.append(m.W["k"].dtype) or real(s, t, m, ids, **kw))
    argv = ["--source", str(tiny_pair / "source"), "--target", str(tiny_pair / "twin"), "--out", str(tmp_path / "o")]
    results = pipeline.main(argv + RUN_ARGS + ["--dtype", "bfloat16"])
    assert seen == [torch.bfloat16] and results["diagnostics"]["kl"] >= 0


def test_the_headline_plan_meets_its_goals():
    """kvt plan --pair qwen3-14b:32b --device h200: every mapper (CoQA's way back too) fits one H200 with
    8% to spare in every phase, writes at most 100 GB at once and is estimated under 2 hours; the 32K
    prefill estimate lands within 15% of the paper's 6.98 s. Guards: a plan that stopped counting a
    resident tensor it once did, or defaults that no longer meet the goals."""
    from kvt.harness.costs import headline_times, rehearsal
    src, tgt = shape("qwen3-14b"), shape("qwen3-32b")
    text, got = rehearsal(src, tgt, ("qwen3-14b", "qwen3-32b"), Options(context=32768))
    assert got["spare"] >= 0.08 and got["disk"] <= 100e9 and got["seconds"] < 2 * 3600, got
    prefill, _ = headline_times(src, tgt)
    assert abs(prefill / 6.98 - 1) < 0.15
    assert "qwen3-32b -> qwen3-14b" in text                   # the reverse mapper is planned too
