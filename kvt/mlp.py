"""The MLP backstop: a 2-layer MLP (1,024 hidden units by default) per target layer, for when ridge is not enough.

Inputs are the selected source layers' position-free K (or V), all heads: (N, k * Hkv * D); outputs
the target layer's, all heads: (N, Hkv_t * D_t). Trained with AdamW on a bounded sample of calibration
tokens (the caller stores them; see mapper.add_mlp), with early stopping on held-out loss. As a
residual it learns what the ridge map leaves over (targets y - ridge(x)); otherwise it replaces it.
Inputs and outputs are standardized while training; the scalings are folded into the weights after,
so the stored MLP is plain:  y = gelu(x @ w1 + b1) @ w2 + b2.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def forward(p, x):
    """x (N, Fin) -> (N, Fout) with parameters p = {w1 (Fin, Hd), b1 (Hd,), w2 (Hd, Fout), b2 (Fout,)}."""
    return F.gelu(x @ p["w1"].to(x.dtype) + p["b1"].to(x.dtype)) @ p["w2"].to(x.dtype) + p["b2"].to(x.dtype)


def train(x_fit, y_fit, x_held, y_held, hidden=1024, lr=1e-3, weight_decay=0.01, batch=256,
          max_epochs=100, patience=5, seed=0):
    """Fit an MLP on (x_fit, y_fit), stopping when held-out MSE stops improving for `patience` epochs.

    x (N, Fin), y (N, Fout) float32. Returns (params of the best epoch, its held-out MSE in units of
    the outputs' variance: 1.0 is no better than predicting the mean)."""
    mx, sx = x_fit.mean(0), x_fit.std(0) + 1e-6                     # (Fin,)
    my, sy = y_fit.mean(0), y_fit.std(0) + 1e-6                     # (Fout,)
    xf, yf = (x_fit - mx) / sx, (y_fit - my) / sy
    xh, yh = (x_held - mx) / sx, (y_held - my) / sy
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's global RNG
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(xf.shape[1], hidden), nn.GELU(), nn.Linear(hidden, yf.shape[1])).to(xf.device)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    best, best_state, bad = float("inf"), None, 0
    for _ in range(max_epochs):
        with torch.enable_grad():
            for idx in torch.randperm(len(xf), generator=g).split(batch):
                loss = F.mse_loss(net(xf[idx]), yf[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
        with torch.no_grad():
            held = F.mse_loss(net(xh), yh).item()
        if held < best - 1e-6:
            best, bad = held, 0
            best_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
        else:
            bad += 1
            if bad >= patience:
                break
    w1, b1, w2, b2 = (best_state[k] for k in ("0.weight", "0.bias", "2.weight", "2.bias"))
    # fold the standardization in:  ((x - mx) / sx) W1^T + b1  and  (h W2^T + b2) * sy + my
    return {"w1": (w1 / sx).T.contiguous(), "b1": b1 - w1 @ (mx / sx),
            "w2": (w2.T * sy).contiguous(), "b2": b2 * sy + my}, best
