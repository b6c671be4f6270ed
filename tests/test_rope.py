"""RoPE: strip is the exact inverse of apply, and keys moved to new positions equal a real prefill there."""
import pytest
import torch

import kvt
from kvt import rope
from tests.conftest import tiny_config

RECIPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 16,
             "mscale": 1.0, "mscale_all_dim": 0.5},  # scale != 1, so strip must divide it out
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_strip_inverts_apply(recipe):
    """strip is apply's exact inverse in float64. Guards: strip computing float64 keys in float32 (an
    error of about 1e-7, which a float64 statistics pipeline would then carry), or not dividing out
    YaRN's scale."""
    cfg = tiny_config(rope=RECIPES[recipe])
    inv_freq, scale = rope.frequencies(cfg)
    x = torch.randn(3, 2, 20, cfg.head_dim, dtype=torch.float64)
    pos = torch.randint(0, 30000, (3, 20))  # offset, non-contiguous, per row
    err = (rope.strip(rope.apply(x, pos, inv_freq, scale), pos, inv_freq, scale) - x).abs().max()
    assert err < 1e-12, f"{recipe}: strip(apply(x)) differs from x by {err:.1e}"
    if recipe == "yarn":
        assert scale != 1.0


def test_apply_is_a_rotation_by_position_difference():
    """<apply(q, m), apply(k, n)> depends only on m - n: the property attention relies on."""
    inv_freq, _ = rope.frequencies(tiny_config())
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)
    def dot(m, n):
        return (rope.apply(q, torch.tensor([m]), inv_freq) * rope.apply(k, torch.tensor([n]), inv_freq)).sum()
    assert torch.allclose(dot(10, 3), dot(107, 100), atol=1e-5)


@pytest.mark.parametrize("family,recipe", [("qwen3", "default"), ("llama", "llama3"), ("ministral3", "yarn")])
def test_relocation_equals_prefill_at_shifted_positions(family, recipe):
    """Keys stripped at positions p and re-applied at p + s equal a genuine prefill at p + s, every layer
    (attention sees only position differences, so everything but the keys' rotation is unchanged)."""
    model = kvt.build_model(tiny_config(family, rope=RECIPES[recipe]), seed=0, std=0.2)
    ids = torch.randint(0, 128, (2, 12))
    p = torch.arange(12).expand(2, 12)
    _, at_p = model(ids, positions=p)
    _, at_ps = model(ids, positions=p + 1000)
    for l in range(model.config.n_layers):
        free = rope.strip(at_p.keys[l], p, model.inv_freq, model.rope_scale)
        moved = rope.apply(free, p + 1000, model.inv_freq, model.rope_scale)
        err = (moved - at_ps.keys[l]).abs().max()
        assert err < 1e-4, f"layer {l}: relocated keys differ from a prefill at p + 1000 by {err:.1e}"


def test_yarn_without_original_max_position_embeddings():
    """A YaRN or llama3 config without original_max_position_embeddings falls back to the top-level
    one, else max_position_embeddings, as transformers does. Guards: a KeyError deep in rope._yarn."""
    from kvt.config import config_from_dict
    hf = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
          "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}
    cfg = config_from_dict(hf)
    assert cfg.rope["original_max_position_embeddings"] == 4096
    inv, scale = rope.frequencies(cfg)
    assert inv.shape == (8,) and scale > 1
    cfg = config_from_dict({**hf, "original_max_position_embeddings": 1024})
    assert cfg.rope["original_max_position_embeddings"] == 1024
