"""Past one device: 2-process calibration (gloo) equals one process, an interrupted 2-process run
resumes exactly, and a model and mapper split across devices give what the unsplit ones give."""
import json
import os
import shutil
import socket

import pytest
import torch
import torch.multiprocessing as mp
from conftest import calib_of, tiny_config
from torch.overrides import TorchFunctionMode

import kvt
from kvt.harness import dist
from kvt import fast
from kvt.harness.bench import random_mapper
from kvt.handoff import handoff
from kvt.harness.calibration import CalibrationOptions, accumulate_resumable, calibrate
from kvt.harness.files import load_mapper, load_stats, save_mapper
from kvt.loading import layer_devices, place
from kvt.stats import FIELDS, accumulate, new_stats

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = calib_of(torch.randint(0, 128, (18, 24), generator=torch.Generator().manual_seed(0)))  # 14 fit + 2 val: 8 batches of 2
SEEN = len(IDS.fit) + len(IDS.val)
FP32 = 1e-6  # 2 processes vs 1: each rank holds its own batches' float32 products (fast.Pending), so the
             # sums agree to float32 rounding (2e-7 here), not bit for bit; a rank counted twice or lost is O(1)


def pair():
    src = kvt.build_model(tiny_config("llama", n_layers=3), seed=1)
    tgt = kvt.build_model(tiny_config("llama", n_layers=2, dim=96, n_heads=6, ffn_dim=160), seed=2)
    return src, tgt


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


def worker(rank, world, port, tmp, phase, src, tgt):
    """One rank, set up as torchrun would set it up (the models come pickled: building them costs seconds)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    assert dist.init(["cpu"]) == ["cpu"] and dist.world() == world and dist.rank() == rank
    try:
        if phase == "calibrate":
            mapper, _ = calibrate(src, tgt, IDS, scope="layer", k=2, batch_size=2,
                                  options=CalibrationOptions(checkpoint=f"{tmp}/two", progress=False))
            save_mapper(mapper, f"{tmp}/two.rank{rank}.safetensors")
            everything = dist.gather(dist.shard(list(range(7))))
            if rank == 0:
                with open(f"{tmp}/gather.json", "w") as f:
                    json.dump(everything, f)
            else:
                assert everything is None
            try:  # every rank dies at its third batch (round 2): rounds 0 and 1 are checkpointed
                accumulate_resumable(DiesAfter(src, 2), tgt, IDS, new_stats(src.config, tgt.config, "head"), 2,
                                     f"{tmp}/resumed.safetensors", every=1, save_s=0, progress=False,
                                     add=fast.add_batches)
            except Interrupted:
                pass
        else:  # fresh processes: resume the interrupted run, and run it again unbroken
            for name in ("resumed", "whole"):
                accumulate_resumable(src, tgt, IDS, new_stats(src.config, tgt.config, "head"), 2,
                                     f"{tmp}/{name}.safetensors", every=1, save_s=0, progress=False,
                                     add=fast.add_batches)
    finally:
        dist.close()


def spawn(tmp, phase):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, str(tmp), phase, *pair()), nprocs=2)


def max_diff(a, b):
    """Largest difference between two Stats over every sum, relative to that sum's largest entry."""
    return max(((getattr(a.sums[n], f) - getattr(b.sums[n], f)).abs().max() /
                (1 + getattr(b.sums[n], f).abs().max())).item() for n in a.sums for f in FIELDS)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Runs the 2-process phases once for the tests below: calibrate, then resume in fresh processes."""
    tmp = tmp_path_factory.mktemp("dist")
    spawn(tmp, "calibrate")
    shutil.copy(tmp / "resumed.safetensors", tmp / "interrupted.safetensors")
    spawn(tmp, "resume")
    return tmp


def test_two_processes_calibrate_the_same_mapper_as_one(two_processes, tmp_path):
    src, tgt = pair()
    one, _ = calibrate(src, tgt, IDS, scope="layer", k=2, batch_size=2,
                       options=CalibrationOptions(checkpoint=tmp_path / "one", progress=False))
    pass2 = next(tmp_path.glob("one.pass2-*")).name.removeprefix("one.")
    for p in ("pass1", pass2):                                         # the statistics of both passes
        a, b = load_stats(two_processes / f"two.{p}"), load_stats(tmp_path / f"one.{p}")
        assert a.seen == b.seen == SEEN and a.src_layers == b.src_layers
        assert max_diff(a, b) < FP32, f"{p}: 2 processes vs 1, relative difference {max_diff(a, b):.1e}"
    two = [load_mapper(two_processes / f"two.rank{rank}.safetensors").tensors() for rank in (0, 1)]
    for name, t in one.tensors().items():                             # every rank fits the same mapper,
        assert torch.equal(two[0][name], two[1][name]), f"{name}: the ranks' mappers differ"
        err = (two[0][name].double() - t.double()).abs().max().item() / (1 + t.abs().max().item())
        assert err < 10 * FP32, f"{name}: relative difference {err:.1e} from one process"   # the solve amplifies


def test_gather_undoes_shard(two_processes):
    assert json.loads((two_processes / "gather.json").read_text()) == list(range(7))


def test_interrupted_two_process_run_resumes_exactly(two_processes, tmp_path):
    src, tgt = pair()
    assert load_stats(two_processes / "interrupted.safetensors").seen == 8   # 2 rounds of 2 batches of 2
    resumed, whole = (load_stats(two_processes / f"{n}.safetensors") for n in ("resumed", "whole"))
    assert resumed.seen == whole.seen == SEEN
    assert max_diff(resumed, whole) == 0, "resumed 2-process statistics differ from an unbroken 2-process run"
    one = accumulate_resumable(src, tgt, IDS, new_stats(src.config, tgt.config, "head"), 2, progress=False,
                               add=fast.add_batches)
    assert max_diff(resumed, one) < FP32, f"2 processes vs 1: relative difference {max_diff(resumed, one):.1e}"
    # the checkpoint holds totals and a resume point, so one process can finish what two began
    path = tmp_path / "s.safetensors"
    shutil.copy(two_processes / "interrupted.safetensors", path)
    finished = accumulate_resumable(src, tgt, IDS, new_stats(src.config, tgt.config, "head"), 2, path, every=1,
                                    save_s=0, progress=False, add=fast.add_batches)
    assert max_diff(finished, one) < FP32


def test_one_process_helpers_are_no_ops():
    t = torch.arange(3.0)
    assert dist.init(["cpu"]) == ["cpu"] and (dist.rank(), dist.world()) == (0, 1)
    assert dist.shard([1, 2, 3]) == [1, 2, 3] and dist.gather([4, 5]) == [4, 5]
    assert dist.all_reduce_(t) is t and t.tolist() == [0, 1, 2]


# ---- layer placement ----------------------------------------------------------------------------------

class Moves(TorchFunctionMode):
    """Records every Tensor.to that changes a tensor's device: (shape, from, to)."""
    def __init__(self):
        super().__init__()
        self.moves = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.to and isinstance(out, torch.Tensor) and out.device != args[0].device:
            self.moves.append((tuple(args[0].shape), str(args[0].device), str(out.device)))
        return out


def four_layer_pair():
    src = kvt.build_model(tiny_config("qwen3", n_layers=4, tie_embeddings=True), seed=0)
    tgt = kvt.build_model(tiny_config("qwen3", n_layers=4, dim=96, n_heads=6, ffn_dim=160), seed=1)
    mapper = random_mapper(src.config, tgt.config, "head", k=2)
    mapper.layers = {kind: torch.tensor([[0, 1], [0, 1], [0, 2], [0, 1]]) for kind in "kv"}  # (Lt, k)
    return src, tgt, mapper


def test_split_across_cpu_and_meta_keeps_each_layer_with_its_kv():
    """On cpu + meta (meta: a device without values, where mixing devices in one op is an error):
    every layer's KV, and the mapper's output for every target layer, stays with that layer, and the
    mapper's fast path moves each source layer's features at most once to a device that needs them
    (the plain path, Mapper.apply, keeps every layer with its KV too)."""
    src, tgt, mapper = four_layer_pair()
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    _, whole = src(ids)
    unsplit = fast.apply(mapper, whole)
    for m in (src, tgt):
        place(m, ["cpu", "meta"])
        assert [d.type for d in layer_devices(m)] == ["cpu", "cpu", "meta", "meta"]
    logits, cache = src(ids)
    assert logits.device.type == "meta" and [k.device.type for k in cache.keys] == ["cpu", "cpu", "meta", "meta"]
    placed = mapper.place(layer_devices(tgt))
    assert [w.device.type for w in placed.W["k"]] == ["cpu", "cpu", "meta", "meta"]
    plain = placed.apply(cache)
    assert [k.device.type for k in plain.keys] == [v.device.type for v in plain.values] == ["cpu", "cpu", "meta", "meta"]
    with Moves() as log:
        mapped = fast.apply(placed, cache)
    assert [k.device.type for k in mapped.keys] == ["cpu", "cpu", "meta", "meta"]
    assert [v.device.type for v in mapped.values] == ["cpu", "cpu", "meta", "meta"]
    assert mapped.positions.device.type == mapped.mask.device.type == "cpu"   # beside the target's embedding
    features = [m for m in log.moves if m[0] == (2, 2 * 10, 16)]             # (G, N, D): one source layer
    assert features == [((2, 20, 16), "cpu", "meta")] * 4, f"source features moved: {features}"  # layers 0, 1; K and V
    for l in (0, 1):                                                           # the layers with values: as unsplit
        assert torch.equal(mapped.keys[l], unsplit.keys[l]) and torch.equal(mapped.values[l], unsplit.values[l])
    logits, _ = tgt(ids[:, -1:], cache=mapped)                                 # the split target reads it as is
    assert logits.shape == (2, 1, 128) and logits.device.type == "meta"


def test_split_across_two_cpu_devices_gives_the_same_logits_cache_and_statistics():
    src, tgt, mapper = four_layer_pair()
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    logits, cache = src(ids)
    want_handoff, _ = handoff(src, tgt, mapper, ids)
    small = calib_of(IDS.fit[:8])
    stats = accumulate(src, tgt, small, new_stats(src.config, tgt.config, "head"), 2)
    for m in (src, tgt):
        place(m, ["cpu", "cpu"])
    placed = mapper.place(layer_devices(tgt))
    split_logits, split_cache = src(ids)
    assert torch.equal(split_logits, logits)
    assert all(torch.equal(a, b) for a, b in zip(split_cache.keys + split_cache.values, cache.keys + cache.values))
    mapped, want = placed.apply(split_cache), mapper.apply(cache)
    assert all(torch.equal(a, b) for a, b in zip(mapped.keys + mapped.values, want.keys + want.values))
    got_handoff, _ = handoff(src, tgt, placed, ids)
    assert torch.equal(got_handoff, want_handoff)
    split_stats = accumulate(src, tgt, small, new_stats(src.config, tgt.config, "head"), 2)
    assert max_diff(split_stats, stats) == 0


def test_placed_mapper_saves_and_counts_like_the_unplaced_one(tmp_path):
    _, tgt, mapper = four_layer_pair()
    placed = mapper.place(["cpu"] * 4)
    assert isinstance(placed.W["k"], list) and placed.n_params() == mapper.n_params()
    save_mapper(placed, tmp_path / "m.safetensors")
    back = load_mapper(tmp_path / "m.safetensors")
    assert all(torch.equal(back.tensors()[n], t) for n, t in mapper.tensors().items())
