"""kvt: cross-model KV cache transfer, as a readable reference (arXiv 2608.03893).

The layout shows the architecture (tests/test_layout.py checks that the data flows one way):
  kvt/          the method, in the order to read it (README, "Reading order"): rope, cache, model,
                capture, stats, ridge, mlp, mapper, calibrate, handoff; then evals (an item's loglikelihood
                and exact-match scoring) and bench (prefill against transfer, timed); beside them the
                plumbing (config, tokenizer, weights, loading) and fast.py, every speed trick as a tested twin
  harness/      what turns the method into a command: calibration text, kvt's own files, the memory plan,
                the calibration a command runs (checkpoints, resume, several GPUs), diagnostics and the
                gate, tasks, retention, the bench, run.py's pipeline
  integrations/ transformers (hf), lm-evaluation-harness (lm_eval), a vLLM KV connector (serving)
  teach/        course assignments and their autograder, pruned siblings (family), a cascade
  cli.py        the installed `kvt` command
"""
__version__ = "0.3.0"  # 0.3: the harness, integrations and teaching kit moved into folders

from kvt.config import KvtError, load_config, shape  # noqa: E402
from kvt.fast import generate  # noqa: E402  (greedy decoding; by default the fast twin, plain=True: decode.generate)
from kvt.loading import build_model, load_model  # noqa: E402
from kvt.weights import save_model  # noqa: E402
from kvt.tokenizer import load_tokenizer  # noqa: E402
