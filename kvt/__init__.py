"""kvt: cross-model KV cache transfer, as a readable reference (arXiv 2608.03893).

Stages, in the order data flows (a module never imports from a later one):
  config, dist, rope, tokenizer, data, weights                  checkpoints and text
  checkpoint                                                    kvt's own files: statistics, fits, mappers
  cache, model                                                  -> models
  scoring                                                       loglikelihood of continuations from a cache
  toy                                                           a tiny trained family for offline use
  family                                                        smaller siblings of a checkpoint: prune, heal
  capture, stats                                                position-free KV -> streamed statistics
  plan                                                          plan memory, disk and time before heavy work
  ridge, attnfit, mlp                                           fit (attnfit: attention-weighted, kvt's option)
  mapper                                                        apply a map (save, load)
  fast                                                          every speed trick: the fast twins of the above
  handoff                                                       hand a context over
  figures                                                       the layer R^2 map; diagnostics vs retention
  answers, tasks                                                answer metrics; the task registry and items
  summary, evals                                                records -> retention; conditions, the run loop
  bench                                                         measure speed
  cascade                                                       a small -> large cascade: accuracy against cost
  hf                                                            transformers interop: DynamicCache, transfer
  pipeline, cli                                                 everything end to end (run.py); the kvt command
  lm_eval                                                       kvt's conditions inside lm-evaluation-harness
  serving                                                       a vLLM KV connector: source engine -> target engine
  course                                                        assignments cut out of kvt, and their autograder
"""
__version__ = "0.2.0"

from kvt.config import KvtError, load_config, shape  # noqa: E402
from kvt.fast import generate  # noqa: E402  (greedy decoding; by default the fast twin, plain=True: model.generate)
from kvt.loading import build_model, load_model  # noqa: E402
from kvt.weights import save_model  # noqa: E402
from kvt.tokenizer import load_tokenizer  # noqa: E402
