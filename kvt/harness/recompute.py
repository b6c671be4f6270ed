"""Which mapped slots the target recomputes: the rules beside handoff.Recompute's plain one (kvt's options).

    budget = Recompute(frac=0.3, by="rank", basis=rank_basis(source, mapper, calib.fit))
    logits, cache = handoff(source, target, mapper, ids, recompute=budget)      # kvt/handoff.py

After the map, each rule scores the n mapped slots of a prompt, and the target recomputes the
ceil(frac * n) highest, one set shared by all layers (with the plain budget's last and first slots too):

    attention  the attention the source's last 32 queries gave each slot, summed over layers and heads
               (attention_mass): where the source looked while it finished the prompt
    suffix     the last slots (attention's baseline: no score)
    rank       RaReCache's rank disagreement (arXiv 2610.11358): how much of the mapped KV lies outside
               the subspace the map's own predictions filled on calibration. Per target layer l and kind
               (K, V), y_i is slot i's mapped vector, all KV heads side by side (Hkv * D; keys with the
               target's RoPE stripped, as the map predicts them); V_r (Hkv * D, r) are the top-r
               eigenvectors of sum y y^T over calibration's mapped tokens (rank_basis: the predictions'
               second moment, the side the map writes, not the source's side it reads); then
                   s_i = sum over l and kind of ||y_i||^2 - ||y_i V_r||^2
               (the second moment about zero, not the covariance about the mean: the score is the
               energy outside V_r measured from zero, and the top eigenvectors of the second moment are
               the r-dimensional subspace that holds the most of that energy)
    random     seeded random slots: the control a score must beat
    error      ORACLE, for reference only: the map's squared l2 error against the target's true KV at
               each slot, summed over layers and kinds; it runs the target's own prefill, so it saves
               nothing and no deployment can use it

Scores are per prompt, so these rules read one prompt at a time (batch 1: evals.transfer says so).
"""
import math
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from kvt import handoff, rope
from kvt.config import KvtError
from kvt.stats import KINDS

RULES = ("attention", "suffix", "rank", "random", "error")
ORACLES = ("error",)      # rules that read the target's true KV: a reference, not a repair
RULE_WORDS = {"attention": "most attended", "suffix": "last", "rank": "most rank-disagreeing", "random": "random",
              "error": "largest-error (oracle)"}   # how a report names the slots each rule takes
RANK = 128                # RaReCache's r
RANK_SEQS = 64            # calibration sequences rank_basis reads at most (the first ones of the fit region)


def attention_mass(cache, window=32):
    """(T,) the attention each slot of a batch-1 cache (made with queries=True) receives from the last
    `window` queries, summed over layers and heads: where the model looked while finishing the prompt."""
    T = cache.keys[0].shape[2]
    total = torch.zeros(T, device=cache.keys[0].device)
    for q, k in zip(cache.queries, cache.keys):                         # (1, H, T, D), (1, Hkv, T, D)
        q = q[:, :, -window:].float()                                   # (1, H, w, D): the last queries
        k = k.float().repeat_interleave(q.shape[1] // k.shape[1], 1)     # (1, H, T, D)
        scores = q @ k.transpose(2, 3) / q.shape[-1] ** 0.5              # (1, H, w, T)
        later = torch.arange(T, device=q.device)[None] > torch.arange(T - q.shape[2], T, device=q.device)[:, None]
        total += scores.masked_fill(later, float("-inf")).softmax(-1).sum((0, 1, 2)).to(total.device)
    return total


def vectors(cache, cfg, kind, l):
    """Layer l's mapped K or V of a target cache as one vector per slot, (B, T, Hkv * D) float64; keys with
    the target's RoPE (cfg's) stripped, as the map predicts them."""
    x = (cache.keys if kind == "k" else cache.values)[l].double()               # (B, Hkv, T, D)
    if kind == "k":
        inv, scale = rope.frequencies(cfg)
        x = rope.strip(x, cache.positions.to(x.device), inv, scale)
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)                                # (B, T, Hkv * D)


@torch.no_grad()
def rank_basis(source, mapper, seqs, r=RANK, batch_size=8):
    """RaReCache's subspaces: {kind: [V_r (Hkv * D, r) float64 per target layer], "cfg": the target's
    Config}, the top-r eigenvectors of the mapped predictions' second moment sum y y^T over the
    calibration sequences seqs (N, T) (one extra pass: the source's prefill and the map)."""
    cfg = mapper.tgt_cfg
    d = cfg.n_kv_heads * cfg.head_dim
    if not 0 < r < d:
        raise KvtError(f"recompute rank r={r}: the mapped KV vectors have {d} dimensions, and r = {d} or more keeps "
                       f"them all (every score 0); give r within 1..{d - 1} (--recompute-rank)")
    moment = {kind: [torch.zeros(d, d, dtype=torch.float64) for _ in range(cfg.n_layers)] for kind in KINDS}
    for i in tqdm(range(0, len(seqs), batch_size), desc="rank subspace", leave=False):
        _, src_cache = source(seqs[i:i + batch_size].to(next(source.parameters()).device), last=True)
        mapped = mapper.apply(src_cache)
        for kind in KINDS:
            for l in range(cfg.n_layers):
                y = vectors(mapped, cfg, kind, l).flatten(0, 1).cpu()              # (B * T, d)
                moment[kind][l] += y.T @ y                                         # (d, d)
    basis = {kind: [torch.linalg.eigh(m).eigenvectors[:, -r:] for m in moment[kind]] for kind in KINDS}  # ascending
    return {**basis, "cfg": cfg}


def rank_scores(cache, basis):
    """s (T,) float64: each slot's mapped energy outside the calibration subspaces (rank_basis), summed
    over layers, kinds and the batch's rows (batch 1 in evaluation)."""
    s, cfg = 0, basis["cfg"]
    for kind in KINDS:
        for l, V in enumerate(basis[kind]):
            y = vectors(cache, cfg, kind, l)                                       # (B, T, d)
            s = s + (y.pow(2).sum(-1) - (y @ V.to(y.device)).pow(2).sum(-1)).sum(0)
    return s


def error_scores(target, cache, ids):
    """ORACLE s (T,): the map's squared error against the target's own KV of ids (B, T), summed over
    layers, kinds, heads and the batch's rows."""
    _, true = target(ids.to(cache.keys[0].device), last=True)
    s = 0
    for mine, theirs in ((cache.keys, true.keys), (cache.values, true.values)):
        for m, t in zip(mine, theirs):                                             # (B, Hkv, T, D) each
            s = s + (m.double() - t.double().to(m.device)).pow(2).sum((0, 1, 3))
    return s


@dataclass(frozen=True)
class Recompute(handoff.Recompute):
    """handoff.Recompute's last and first slots, plus the fraction frac of the slots that rule `by` picks
    (see the module docstring). rank needs `basis` (rank_basis), error the `target`; random reads `seed`."""
    frac: float = 0.0      # this fraction of the slots (ceil(frac * n) of them), chosen by `by`
    by: str = "attention"  # one of RULES
    seed: int = 0          # random's
    basis: dict = field(default=None, compare=False, repr=False)    # rank's subspaces (rank_basis)
    target: object = field(default=None, compare=False, repr=False)  # error's: the target model

    def __bool__(self):
        return bool(self.last or self.first or self.frac)

    @property
    def queries(self):
        return self.frac > 0 and self.by == "attention"

    def check(self):
        if min(self.last, self.first, self.frac) < 0 or not self.frac <= 1 or self.by not in RULES:
            raise KvtError(f"recompute budget {self}: counts must be >= 0, the fraction within [0, 1], "
                           f"and by one of {', '.join(RULES)}")

    def choose(self, src_cache, cache, ids):
        """handoff.Recompute.choose: the slots of ids (B, n), scored after the map by rule `by`."""
        self.check()
        if self.frac and self.by == "rank" and self.basis is None:
            raise KvtError("recompute by rank needs the calibration subspaces: Recompute(..., basis=rank_basis(...))")
        if self.frac and self.by == "error" and self.target is None:
            raise KvtError("recompute by error (the oracle) needs the target: Recompute(..., target=target)")
        return self.slots(ids.shape[1], self.scores(src_cache, cache, ids) if self.frac else None)

    def slots(self, n, scores=None):
        """Ascending slot numbers (LongTensor) among n mapped slots: the plain budget's, and the
        ceil(frac * n) with the highest scores (n,) (by == "suffix": the last ones)."""
        self.check()
        chosen = set(range(max(0, n - self.last), n)) | set(range(min(self.first, n)))
        m = min(n, math.ceil(self.frac * n - 1e-9))                 # 1e-9: 0.3 * 10 is 3.0000000000000004
        if m:
            scores = torch.arange(n, dtype=torch.float64) if self.by == "suffix" else scores
            chosen |= set(scores.topk(m).indices.tolist())
        return torch.tensor(sorted(chosen), dtype=torch.long)

    def scores(self, src_cache, cache, ids):
        """(n,) the rule's score of each mapped slot (suffix: none)."""
        if self.by == "attention":
            return attention_mass(src_cache).cpu()
        if self.by == "rank":
            return rank_scores(cache, self.basis).cpu()
        if self.by == "random":
            return torch.rand(ids.shape[1], generator=torch.Generator().manual_seed(self.seed), dtype=torch.float64)
        if self.by == "error":
            return error_scores(self.target, cache, ids).cpu()
        return None


def rank_sequences(calib):
    """The calibration sequences (N, T) rank's subspaces are taken on: the first RANK_SEQS of the fit region."""
    return calib.fit[:RANK_SEQS]


def budget(last=0, first=0, frac=0.0, by="attention", *, source=None, target=None, mapper=None, calib_seqs=None,
           r=RANK, seed=0):
    """The Recompute a run asks for, with what its rule reads: rank's subspaces from calib_seqs (N, T) through
    source and mapper, error's target."""
    basis = None
    if frac and by == "rank":
        basis = rank_basis(source, mapper, calib_seqs, r)
    return Recompute(last, first, frac, by, seed, basis, target if by == "error" else None)
