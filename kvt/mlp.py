"""The MLP backstop, one per target layer and kind, for when the ridge map is not enough.

The paper's form (harness/calibration.py's add_mlp(mode="replace"), `--mapper mlp`): the MLP replaces ridge, with two
hidden layers of 1,024 units each:  y = gelu(gelu(x w0 + b0) w1 + b1) w2 + b2, as stored.
kvt's own option (mode="residual", `--mapper ridge+mlp`): one hidden layer learning what ridge leaves
over (targets y - ridge(x)), added to the ridge map.

Inputs are the selected source layers' position-free K (or V), all heads: (N, k * Hkv * D); outputs
the target layer's, all heads: (N, Hkv_t * D_t). Trained with AdamW on a bounded sample of calibration
tokens (add_mlp), with early stopping on validation loss. Inputs and outputs are standardized
while training and the scalings are folded into the first and last layers after, so the stored MLP is
plain: parameters {"w0", "b0", "w1", "b1", ...}, w_i of shape (in, out).
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

PAPER_HIDDEN = (1024, 1024)  # two hidden layers of 1,024 units (the paper's backstop)


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


@dataclass(frozen=True)
class Schedule:
    """How train trains. The paper states no schedule: these defaults bound a CPU run of the paper's size
    to minutes per layer."""
    lr: float = 1e-3              # AdamW's learning rate
    weight_decay: float = 0.01
    batch: int = 1024             # tokens per step
    max_epochs: int = 30
    patience: int = 3             # epochs without a 1% gain in validation MSE before training stops
    seed: int = 0                 # of the initial weights and the batches' order


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
