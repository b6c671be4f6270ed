"""Shared fixtures: where ../shared lives, tiny configs, and the real SmolLM2 checkpoint when built."""
import os
from pathlib import Path

import pytest

from kvt.config import Config

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("KVT_SHARED", ROOT.parent / "shared"))
SMOLLM2 = Path(os.environ.get("KVT_SMOLLM2", ROOT / "weights" / "smollm2-135m"))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long checks, run with -m slow")


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
