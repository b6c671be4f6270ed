"""Shared fixtures: where ../shared lives, tiny configs, and the real SmolLM2 checkpoint when built."""
import os
from pathlib import Path

import pytest
import torch

import kvt
from kvt.config import Config

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("KVT_SHARED", ROOT.parent / "shared"))
SMOLLM2 = Path(os.environ.get("KVT_SMOLLM2", ROOT / "weights" / "smollm2-135m"))


def tiny_config(family="qwen3", **kw):
    """A 2-layer model of width 64, 4 heads, 2 KV heads of dim 16: runs in milliseconds."""
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    base = dict(family=family, vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                ffn_dim=128, norm_eps=1e-6, rope=rope, max_seq_len=512)
    return Config(**{**base, **kw})


@pytest.fixture(scope="session")
def smollm2():
    """Path of the real SmolLM2-135M checkpoint (built by ../shared/tools/smollm2.py); skips when absent."""
    if not (SMOLLM2 / "model.safetensors").exists():
        pytest.skip(f"no {SMOLLM2}/model.safetensors; build it: python {SHARED}/tools/smollm2.py {SMOLLM2}")
    return SMOLLM2


# ---- mapper fixtures (issue 3) -------------------------------------------------------------------------

def plane_rotation(angles):
    """(D, D) rotation by angles[i] in each RoPE plane (i, i + D/2): it commutes with RoPE."""
    half = len(angles)
    c, s = angles.cos(), angles.sin()
    R = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
    i = torch.arange(half)
    R[i, i], R[i, i + half], R[i + half, i], R[i + half, i + half] = c, -s, s, c
    return R


@torch.no_grad()
def function_preserving_twin(model, seed=0):
    """A model computing the same function as `model` whose KV is a different, exact linear function of it.

    Per layer and KV head h: values mixed by an invertible M_h (undone in o_proj), and q and k rotated
    by R_h within each RoPE plane (q.k unchanged; R_h commutes with RoPE, and with Qwen3's q/k RMSNorm
    when its weights are equal within each plane, as build_model's are). So the twin's position-free
    K is R_h k and its V is M_h v: a head-scope mapper can reproduce its cache exactly."""
    cfg = model.config
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    g = torch.Generator().manual_seed(seed)
    sd = {name: t.double().clone() for name, t in model.state_dict().items()}
    for l in range(cfg.n_layers):
        p = f"model.layers.{l}.self_attn."
        for name in ("q_norm.weight", "k_norm.weight"):
            if p + name in sd:
                assert torch.equal(sd[p + name][:D // 2], sd[p + name][D // 2:]), "norm weights must pair up"
        for h in range(Hkv):
            M = torch.eye(D, dtype=torch.float64) + 0.3 * torch.randn(D, D, generator=g, dtype=torch.float64) / D ** 0.5
            R = plane_rotation(torch.rand(D // 2, generator=g, dtype=torch.float64) * 6.283)
            rows = slice(h * D, (h + 1) * D)
            sd[p + "v_proj.weight"][rows] = M @ sd[p + "v_proj.weight"][rows]
            sd[p + "k_proj.weight"][rows] = R @ sd[p + "k_proj.weight"][rows]
            for i in range(h * H // Hkv, (h + 1) * H // Hkv):               # the query heads of KV head h
                q = slice(i * D, (i + 1) * D)
                sd[p + "q_proj.weight"][q] = R @ sd[p + "q_proj.weight"][q]
                sd[p + "o_proj.weight"][:, q] = sd[p + "o_proj.weight"][:, q] @ torch.linalg.inv(M)
    twin = kvt.build_model(cfg, dtype=next(model.parameters()).dtype)
    twin.load_state_dict({name: t.to(twin.state_dict()[name].dtype) for name, t in sd.items()})
    return twin


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tiny models on one thread: on a shared machine, threads waiting for a busy core
    make millisecond ops take tens of milliseconds. Restores the thread count after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def calib_of(ids, val=2, diag=2):
    """A data.Calibration of random ids (n, T): the last `diag` rows for diagnostics, the `val` rows before
    them for validation, the rest to fit (data.calibration_sequences draws these from text)."""
    from kvt.data import Calibration
    n = len(ids) - val - diag
    return Calibration(ids[:n], ids[n:n + val], ids[n + val:])


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """Checkpoint folders source/ and twin/: a random tiny model and its function-preserving twin (an
    exact linear KV map away), sharing one toy tokenizer: run.py end to end in seconds."""
    from kvt import toy
    root = tmp_path_factory.mktemp("pair")
    tok = toy.train_tokenizer(toy.corpus(300))
    cfg = tiny_config(vocab_size=tok.get_vocab_size(), n_layers=3, dim=96, n_heads=4, head_dim=24, max_seq_len=1024)
    source = kvt.build_model(cfg, seed=0, std=0.1)
    for name, model in (("source", source), ("twin", function_preserving_twin(source, seed=1))):
        kvt.save_model(model, root / name)
        tok.save(str(root / name / "tokenizer.json"))
    return root
