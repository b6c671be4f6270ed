"""Regenerate the parity goldens: tiny random checkpoints of each family, and transformers' outputs.

    python tests/golden/make_golden.py      # needs transformers (a test-only dependency)

Each case is a folder tests/golden/<case>/ holding config.json + model.safetensors as
transformers' save_pretrained writes them, and expected.safetensors with transformers' logits and
every layer's K and V for a prefill of 16 tokens followed by a continuation of 8 from its cache.
tests/test_models.py loads the folder in kvt and compares; with transformers installed it also
recomputes the expectations live.
"""
import sys
from pathlib import Path

import torch
import transformers as tf
from safetensors.torch import save_file

HERE = Path(__file__).parent
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
YARN = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}


def llama3(factor):
    return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


CASES = {  # name: (model class, config)
    "qwen3": (tf.Qwen3ForCausalLM, lambda: tf.Qwen3Config(**SMALL)),
    "llama3-factor8": (tf.LlamaForCausalLM, lambda: tf.LlamaConfig(**SMALL, rope_parameters=llama3(8.0))),
    "llama3-factor32-tied": (tf.LlamaForCausalLM,
                             lambda: tf.LlamaConfig(**SMALL, rope_parameters=llama3(32.0), tie_word_embeddings=True)),
    "ministral3-yarn": (tf.Ministral3ForCausalLM, lambda: tf.Ministral3Config(**SMALL, rope_parameters=YARN)),
    "mistral3-multimodal": (tf.Mistral3ForConditionalGeneration, lambda: tf.Mistral3Config(
        text_config=tf.Ministral3Config(**SMALL, rope_parameters=YARN).to_dict(),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=32, patch_size=16))),
}
PREFILL, CONTINUE = 16, 8


def hf_model(name):
    cls, config = CASES[name]
    torch.manual_seed(0)
    model = cls(config()).eval()
    with torch.no_grad():  # larger weights than the default init, so the outputs are far from uniform
        for n, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.3 * torch.randn_like(p))
    return model


@torch.no_grad()
def hf_outputs(model, ids):
    """transformers' logits for ids (prefill of PREFILL, then the rest from its cache) and final K, V."""
    first = model(ids[:, :PREFILL], use_cache=True)
    second = model(ids[:, PREFILL:], cache=first.past_key_values, use_cache=True)
    out = {"ids": ids, "logits": torch.cat([first.logits, second.logits], 1)}
    for l, layer in enumerate(second.past_key_values.layers):
        out[f"keys.{l}"], out[f"values.{l}"] = layer.keys, layer.values
    return out


def case_ids():
    return torch.randint(0, SMALL["vocab_size"], (2, PREFILL + CONTINUE), generator=torch.Generator().manual_seed(1))


def main():
    for name in CASES if len(sys.argv) < 2 else sys.argv[1:]:
        model = hf_model(name)
        model.save_pretrained(HERE / name)
        (HERE / name / "generation_config.json").unlink(missing_ok=True)
        save_file({k: v.contiguous() for k, v in hf_outputs(model, case_ids()).items()}, HERE / name / "expected.safetensors")
        print(name)


if __name__ == "__main__":
    main()
