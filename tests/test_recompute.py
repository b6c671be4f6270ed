"""kvt/harness/recompute.py: the rules that pick the slots a target recomputes (attention, suffix, rank,
random, the error oracle), each at budget 0 the plain handoff and at budget 1 the target's own prefill;
rank's scores against a dense float64 reference; rank's subspace taken from the map's predictions."""
import pytest
import torch
from conftest import calib_of, tiny_config

import kvt
from kvt import rope
from kvt.calibrate import calibrate
from kvt.handoff import handoff
from kvt.harness.recompute import RULES, Recompute, budget, rank_basis, rank_scores

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.randint(0, 128, (14, 24), generator=torch.Generator().manual_seed(0))
CALIB = calib_of(IDS)
PROMPT = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(9))


@pytest.fixture(scope="module")
def poor():
    """An unrelated pair (the map is far from exact), layer scope: source, target, mapper."""
    source = kvt.build_model(tiny_config("qwen3", n_layers=3), seed=0)
    target = kvt.build_model(tiny_config("qwen3", n_layers=3), seed=5)
    mapper, _ = calibrate(source, target, CALIB)
    return source, target, mapper


@pytest.fixture(scope="module")
def poor64():
    """The same pair's source and map in float64 (for the comparisons at 1e-9)."""
    source = kvt.build_model(tiny_config("qwen3", n_layers=3), seed=0).double()
    target = kvt.build_model(tiny_config("qwen3", n_layers=3), seed=5).double()
    mapper, _ = calibrate(source, target, CALIB)
    return source, mapper.to(dtype=torch.float64)


def rule(by, frac, source, target, mapper, r=8):
    return budget(frac=frac, by=by, source=source, target=target, mapper=mapper, calib_seqs=CALIB.fit, r=r, seed=3)


@pytest.mark.parametrize("by", RULES)
def test_every_rule_at_budget_0_is_the_plain_handoff_and_at_1_the_targets_prefill(poor, by):
    """frac = 0 hands over exactly as no budget does; frac = 1 recomputes every slot and scores as the target's
    own prefill (within 1e-4). Guards: a rule that recomputes at budget 0 (or skips slots at budget 1: a
    ceil/round that leaves one out, a top-k over fewer slots than the prompt has), a rule's score of the
    wrong length, or a rule whose scores are taken before the map (rank and error read the mapped cache)."""
    source, target, mapper = poor
    plain, _ = handoff(source, target, mapper, PROMPT)
    zero, _ = handoff(source, target, mapper, PROMPT, recompute=rule(by, 0.0, source, target, mapper))
    assert torch.equal(zero, plain), f"{by} at budget 0 differs from the plain handoff"
    own, own_cache = target(PROMPT)
    assert (plain[:, -1] - own[:, -1]).abs().max() > 1e-2, "the test needs a map that is not already exact"
    every = rule(by, 1.0, source, target, mapper)
    logits, cache = handoff(source, target, mapper, PROMPT, recompute=every)
    err = (logits[:, -1] - own[:, -1]).abs().max().item()
    assert err < 1e-4, f"{by} at budget 1: logits {err:.2e} from the target's own prefill"
    assert (cache.values[2] - own_cache.values[2]).abs().max() < 1e-4


def test_rules_pick_the_ceil_of_the_budget_by_their_scores():
    """Guards: round in place of ceil (0.25 of 10 slots is 3, not 2), 0.3 * 10 = 3.0000000000000004 read as 4,
    an unseeded random rule, or the plain budget's first and last slots dropped beside a rule's."""
    scores = torch.tensor([0.1, 5.0, 0.2, 3.0, 0.3, 0.0, 0.4, 0.5, 0.6, 0.7])
    assert Recompute(frac=0.2).slots(10, scores).tolist() == [1, 3]
    assert Recompute(frac=0.25, by="rank").slots(10, scores).tolist() == [1, 3, 9]
    assert Recompute(frac=0.3, by="rank").slots(10, scores).tolist() == [1, 3, 9]
    assert Recompute(frac=0.2, by="suffix").slots(10).tolist() == [8, 9]
    assert Recompute(frac=0.2, first=1, by="suffix").slots(10).tolist() == [0, 8, 9]
    ids = torch.zeros(1, 50, dtype=torch.long)
    a, b, c = (Recompute(frac=0.2, by="random", seed=s).choose(None, None, ids).tolist() for s in (1, 1, 2))
    assert a == b and a != c and len(a) == 10


def dense_scores(source, mapper, seqs, prompt, r):
    """The reference: every calibration token's mapped vector stacked densely in float64, the second moment's
    top-r eigenvectors, and each prompt slot's squared norm after the projector I - V V^T."""
    cfg = mapper.tgt_cfg
    inv, scale = rope.frequencies(cfg)

    def rows(ids):                                   # {(kind, l): (N, Hkv * D)} of the mapped cache of ids
        _, c = source(ids, last=True)
        m = mapper.apply(c)
        out = {}
        for l in range(cfg.n_layers):
            k = rope.strip(m.keys[l].double(), m.positions, inv, scale)
            for kind, x in (("k", k), ("v", m.values[l].double())):
                out[kind, l] = torch.stack([torch.cat([x[b, h, t] for h in range(x.shape[1])])
                                            for b in range(x.shape[0]) for t in range(x.shape[2])])
        return out

    calib, mine, s = rows(seqs), rows(prompt), torch.zeros(prompt.shape[1], dtype=torch.float64)
    for key, Y in calib.items():
        _, vecs = torch.linalg.eigh(Y.T @ Y)
        V = vecs[:, -r:]
        P = torch.eye(Y.shape[1], dtype=torch.float64) - V @ V.T
        s += (mine[key] @ P).pow(2).sum(-1)
    return s


def test_rank_scores_equal_a_dense_float64_reference(poor64):
    """rank's streamed subspaces and scores match a dense reference within 1e-9 relative. Guards: the
    second moment summed over part of the calibration (a batch dropped), the bottom eigenvectors taken
    for the top, keys scored with RoPE on, or heads laid side by side in another order per slot."""
    source, mapper = poor64
    basis = rank_basis(source, mapper, CALIB.fit, r=8, batch_size=3)
    _, c = source(PROMPT, last=True)
    got = rank_scores(mapper.apply(c), basis)
    want = dense_scores(source, mapper, CALIB.fit, PROMPT, 8)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-9, f"rank scores {err:.2e} from the dense reference"
    assert want.min() > 0


def test_rank_subspace_comes_from_the_maps_predictions_not_its_inputs(poor64):
    """A map whose every prediction lies in a 4-dimensional subspace (its W and b projected onto it) leaves
    nothing outside the r = 8 subspace rank_basis finds: every score is ~0 on a prompt calibration never
    saw. Guards: V_r taken from the source's KV (the inputs the map reads), which fills all 32 dimensions."""
    source, mapper = poor64
    m = mapper.to(dtype=torch.float64)                                          # a copy
    gen = torch.Generator().manual_seed(4)
    for kind in ("k", "v"):
        By = m.W[kind].shape[-1]
        U = torch.linalg.qr(torch.randn(By, 4, generator=gen, dtype=torch.float64))[0]   # (By, 4)
        m.W[kind] = m.W[kind] @ U @ U.T
        m.b[kind] = m.b[kind] @ U @ U.T
    basis = rank_basis(source, m, CALIB.fit, r=8)
    _, c = source(PROMPT, last=True)
    mapped = m.apply(c)
    energy = sum(x.double().pow(2).sum() for x in mapped.keys + mapped.values).item()
    s = rank_scores(mapped, basis)
    assert s.abs().max().item() < 1e-9 * energy, f"scores {s.abs().max():.2e} outside a subspace holding every prediction"


def test_rank_refuses_an_r_that_keeps_every_dimension(poor):
    """Guards: r at or past the vector width (every score 0, the rule silently a first-slots rule)."""
    source, _, mapper = poor
    with pytest.raises(kvt.KvtError, match="r=32.*within 1..31"):
        rank_basis(source, mapper, CALIB.fit, r=32)
