"""kvt inside other people's tools: transformers models (hf), lm-evaluation-harness (lm_eval) and a vLLM
KV connector (serving). Each is an optional extra; the method and the harness never import them."""
