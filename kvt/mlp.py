"""The MLP backstop, one per target layer and kind, for when the ridge map is not enough.

    mapper, report = calibrate(source, target, calib, mapper="mlp")   # calibrate.py: ridge's selection, then add_mlp

mapper="mlp" (the paper's): the MLP replaces ridge, two hidden layers of 1,024 units each,
y = gelu(gelu(x w0 + b0) w1 + b1) w2 + b2 as stored; "ridge+mlp" (kvt's option): one hidden layer
learning what ridge leaves over (y - ridge(x)), added to the ridge map. Inputs: the selected source
layers' position-free K (or V), all heads (N, k * Hkv * D); outputs the target layer's (N, Hkv_t * D_t).
Trained with AdamW on a bounded sample of calibration tokens, stopping early on validation loss, on
standardized inputs and outputs whose scalings are folded into the first and last layers after.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from kvt.capture import capture, features
from kvt.config import KvtError, Schedule  # Schedule: how train() trains
from kvt.stats import KINDS

PAPER_HIDDEN = (1024, 1024)  # two hidden layers of 1,024 units (the paper's backstop)
HIDDEN = {"mlp": PAPER_HIDDEN, "ridge+mlp": (1024,)}  # calibrate's mapper= -> the MLP's hidden sizes


def n_layers(p):
    return len([name for name in p if name.startswith("w")])


def forward(p, x):
    """x (N, Fin) -> (N, Fout) through the MLP with parameters p (see the module docstring)."""
    last = n_layers(p) - 1
    for i in range(last + 1):
        x = x @ p[f"w{i}"].to(x.dtype) + p[f"b{i}"].to(x.dtype)
        if i < last:
            x = F.gelu(x)
    return x


def train(x_fit, y_fit, x_val, y_val, hidden=PAPER_HIDDEN, schedule=Schedule()):
    """Fit an MLP with hidden layers of the sizes in `hidden` (an int is one layer) on (x_fit, y_fit),
    stopping when validation MSE has not improved by 1% for `schedule.patience` epochs.

    x (N, Fin), y (N, Fout) float32. Returns (params of the best epoch, its validation MSE in units of
    the outputs' variance: 1.0 is no better than predicting the mean)."""
    hidden = (hidden,) if isinstance(hidden, int) else tuple(hidden)
    mx, sx = x_fit.mean(0), x_fit.std(0) + 1e-6                     # (Fin,)
    my, sy = y_fit.mean(0), y_fit.std(0) + 1e-6                     # (Fout,)
    xf, yf = (x_fit - mx) / sx, (y_fit - my) / sy
    xv, yv = (x_val - mx) / sx, (y_val - my) / sy
    sizes = (xf.shape[1],) + hidden + (yf.shape[1],)
    g = torch.Generator().manual_seed(schedule.seed)
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's global RNG
        torch.manual_seed(schedule.seed)
        layers = [nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:])]
    net = nn.Sequential(*[m for lin in layers[:-1] for m in (lin, nn.GELU())], layers[-1]).to(xf.device)
    opt = torch.optim.AdamW(net.parameters(), lr=schedule.lr, weight_decay=schedule.weight_decay)
    best, best_state, ref, bad = float("inf"), None, float("inf"), 0
    for _ in range(schedule.max_epochs):
        with torch.enable_grad():
            for idx in torch.randperm(len(xf), generator=g).split(schedule.batch):
                loss = F.mse_loss(net(xf[idx]), yf[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
        with torch.no_grad():
            val = F.mse_loss(net(xv), yv).item()
        if val < best:                                                  # keep the best epoch, however small the gain
            best = val
            best_state = [(lin.weight.detach().clone(), lin.bias.detach().clone()) for lin in layers]
        if val < ref * (1 - 1e-2):                                      # but only a 1% gain resets the patience
            ref, bad = val, 0
        else:
            bad += 1
            if bad >= schedule.patience:
                break
    p = {}
    for i, (w, b) in enumerate(best_state):
        p[f"w{i}"], p[f"b{i}"] = w.T.contiguous(), b
    # fold the standardization in: ((x - mx) / sx) w0 + b0, and (h w_last + b_last) * sy + my
    p["b0"] = p["b0"] - (mx / sx) @ p["w0"]
    p["w0"] = (p["w0"] / sx[:, None]).contiguous()
    last = len(best_state) - 1
    p[f"w{last}"], p[f"b{last}"] = (p[f"w{last}"] * sy).contiguous(), p[f"b{last}"] * sy + my
    return p, best


# ---- wiring: the MLPs of a fitted Mapper ------------------------------------------------------------------

def add_mlp(fitted, source, target, calib, mapper="mlp", hidden=None, schedule=Schedule(), train_mlp=None):
    """A copy of the ridge Mapper `fitted` with one MLP per target layer and kind on its selected layers:
    mapper="mlp" (the paper's) replaces ridge, "ridge+mlp" learns ridge's residual; hidden overrides the
    sizes (HIDDEN). Each trains (train, as `schedule` says) on a seeded sample of calib.fit's tokens of
    at most schedule.sample_bytes, stopping early on calib.val's. train_mlp(kind, l, train) -> (params, loss) runs
    each training (a long run checkpoints them, kvt/harness/calibration.py); default train()."""
    if mapper not in HIDDEN:
        raise KvtError(f"mapper {mapper!r} has no MLP; use one of {', '.join(HIDDEN)}")
    hidden = HIDDEN[mapper] if hidden is None else hidden
    data = {}  # the sampled features, drawn when the first MLP that is not checkpointed needs them
    out = fitted.to()
    out.mapper, out.mlp = mapper, {}
    for kind in KINDS:
        params = []
        for l in range(fitted.tgt_cfg.n_layers):
            def one(kind=kind, l=l):
                if not data:
                    n, scope, bar = schedule.sample_bytes, fitted.scope, schedule.progress
                    data["fit"] = sample_features(source, target, calib.fit, n, scope, progress=bar)
                    data["val"] = sample_features(source, target, calib.val, n // 10 + 1, scope, progress=bar)
                return train(*mlp_data(fitted, kind, l, *data["fit"][kind], mapper),
                             *mlp_data(fitted, kind, l, *data["val"][kind], mapper), hidden, schedule)
            params.append((train_mlp(kind, l, one) if train_mlp else one())[0])
        out.mlp[kind] = {name: torch.stack([p[name] for p in params]).cpu() for name in params[0]}
    out.meta["mlp_hidden"] = list(hidden) if not isinstance(hidden, int) else [hidden]
    return out


def sample_features(source, target, ids, max_bytes=2 * 2**30, scope="head", seed=0, progress=False):
    """Position-free K and V of a seeded random sample of the tokens of ids (S, T), within max_bytes
    (float32), evenly from every sequence: {kind: (x (G, N, Ls, Bx), y (G, N, Lt, By))}, what the MLP trains on."""
    s, t = source.config, target.config
    per_token = 4 * 2 * (s.n_layers * s.n_kv_heads * s.head_dim + t.n_layers * t.n_kv_heads * t.head_dim)
    per_seq = max(1, min(ids.shape[1], max_bytes // per_token // len(ids)))
    g = torch.Generator().manual_seed(seed)
    device, tgt_device = next(source.parameters()).device, next(target.parameters()).device
    parts = {kind: ([], []) for kind in KINDS}
    for seq in tqdm(ids, desc="MLP training features", unit="seq", disable=not progress):
        pick = torch.randperm(ids.shape[1], generator=g)[:per_seq].to(device)  # tokens kept from this sequence
        src, tgt = capture(source, seq[None].to(device)), capture(target, seq[None].to(tgt_device))
        for i, kind in enumerate(KINDS):
            parts[kind][0].append(features([x.to(device) for x in src[i]], scope)[:, pick].float())
            parts[kind][1].append(features([y.to(device) for y in tgt[i]], scope)[:, pick].float())
    return {kind: (torch.cat(xs, 1), torch.cat(ys, 1)) for kind, (xs, ys) in parts.items()}


def mlp_data(fitted, kind, l, xs, ys, mapper):
    """MLP inputs (N, k*Hkv*D) and targets (N, Hkv*D) for target layer l from sampled features
    xs (G, N, Ls, Bx) and ys (G, N, Lt, By); "ridge+mlp": targets minus the ridge map's prediction."""
    y = ys[:, :, l]                                                     # (G, N, By)
    if mapper == "ridge+mlp":
        y = y - fitted.map_layer(kind, l, list(xs.unbind(2)))
    return flat(xs[:, :, fitted.layers[kind][l]]), y.transpose(0, 1).reshape(y.shape[1], -1)


def flat(x):
    """Group layout (G, N, k, Bx) -> all heads of the k layers per token (N, k*Hkv*D), the MLP's input."""
    return x.permute(1, 2, 0, 3).reshape(x.shape[1], -1)            # (N, k, G, Bx) -> (N, k*G*Bx)


def unflat(y, G):
    """(N, Hkv*D) -> group layout (G, N, By)."""
    return y.view(y.shape[0], G, -1).transpose(0, 1)                 # (G, N, By)
