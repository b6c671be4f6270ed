"""transformers interop: a DynamicCache <-> a kvt Cache, and a handoff between two transformers models.

    import kvt, kvt.integrations.hf
    from kvt.calibrate import calibrate
    from transformers import AutoModelForCausalLM

    tok = kvt.load_tokenizer("weights/toy-m")                     # calib: data.calibration_sequences(...)
    mapper, _ = calibrate(kvt.load_model("weights/toy-s"), kvt.load_model("weights/toy-m"), calib)  # fit with kvt
    source, target = (AutoModelForCausalLM.from_pretrained(f"weights/{n}") for n in ("toy-s", "toy-m"))
    ids = torch.tensor([tok.encode("the cities : ray lima , rosa rome , tom oslo . it is a rainy day . so tom")])
    state = kvt.integrations.hf.transfer(source, target, mapper, ids)   # the source prefills ids[:, :-1], kvt maps its cache
    out = target.generate(ids, **state, max_new_tokens=8, do_sample=False)   # the target runs ids[:, -1] on
    tok.decode(out[0, ids.shape[1]:].tolist())                  # ' oslo , leo oslo , alan rome .'

Both libraries store the same thing: per layer post-RoPE keys and values (B, Hkv, T, D). A DynamicCache
does not record positions or padding (transformers keeps them in position_ids and attention_mask), so
to_kvt takes them as arguments; to_hf drops them.

The handoff protocol is kvt's (handoff.py): the target runs the last prompt token itself. generate()
counts the slots already in the cache (T - 1) and runs only the input ids after them (the last one), at
positions it counts from the attention mask, as kvt counts them. (Passing position_ids instead would
break transformers 5.0, whose generate() reuses them unchanged at every step.)
transformers is imported here only, and only when this file is.
"""
import torch

from kvt import fast
from kvt.cache import Cache
from kvt.config import KvtError, config_from_dict
from kvt.mapper import Mapper
from kvt.config import check_ids
from kvt.weights import check_pair_weights

try:
    from transformers import DynamicCache
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError as e:  # a test and interop dependency, never a requirement of kvt itself
    raise KvtError(f"kvt.integrations.hf needs transformers ({e}); pip install transformers") from None

# The name of the cache in a model's output and in generate()'s keywords: transformers 5.0 says
# past_key_values, later 5.x releases (5.24) say cache (past_key_values there is deprecated). Tested: 5.0, 5.24.
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def to_kvt(dynamic_cache, positions=None, mask=None):
    """A kvt Cache holding a DynamicCache's tensors (no copy). positions (B, T) long: where RoPE put
    each key (default 0..T-1 in every row: an unpadded prefill); mask (B, T) bool, False = left padding
    (default all True)."""
    layers = getattr(dynamic_cache, "layers", None)
    if not isinstance(dynamic_cache, DynamicCache) or not layers or any(
            layer.keys is None or layer.is_sliding for layer in layers):
        raise KvtError("to_kvt needs a filled DynamicCache of full-attention layers (sliding windows are not "
                       "implemented); prefill the model with use_cache=True first")
    keys = [layer.keys for layer in layers]                    # L x (B, Hkv, T, D), post-RoPE
    values = [layer.values for layer in layers]
    B, _, T, _ = keys[0].shape
    if positions is None:
        positions = torch.arange(T, device=keys[0].device).expand(B, T)   # (B, T)
    full = mask is None
    if mask is None:
        mask = torch.ones(B, T, dtype=torch.bool, device=keys[0].device)
    return Cache(keys, values, positions, mask.bool(), full=full)


def to_hf(cache):
    """A DynamicCache holding a copy of a kvt Cache's keys and values (positions and mask stay behind:
    pass them to transformers as position_ids and attention_mask)."""
    return DynamicCache(zip(cache.keys, cache.values))   # each layer filled by concatenating onto empty: a copy


def kvt_config(model):
    """The kvt Config of a transformers model (its config, read as kvt reads a config.json)."""
    return config_from_dict({**model.config.to_dict(), "architectures": [type(model).__name__]})


def check_pair(source, target, mapper):
    """The transformers models must be the pair the mapper was fitted for, in config and in weights
    (weights.check_pair_weights: every value, hashed once a model); else one line saying which differs."""
    for what, model, cfg in (("source", source, mapper.src_cfg), ("target", target, mapper.tgt_cfg)):
        have = kvt_config(model).fingerprint()
        if have != cfg.fingerprint():
            raise KvtError(f"the mapper was fitted for another {what} model (fingerprint {cfg.fingerprint()}, this "
                           f"{type(model).__name__} {have}); pass the pair it was fitted for or calibrate this one")
    check_pair_weights(mapper, source, target)


@torch.no_grad()
def transfer(source, target, mapper, input_ids, attention_mask=None, plain=False):
    """A kvt handoff between transformers models: the source prefills input_ids[:, :-1] (B, T - 1), the
    mapper maps its cache to the target's, and the target is left to run the last prompt token itself.

    attention_mask (B, T), 0 = left padding, or None. Returns generate()'s keyword arguments:
    {CACHE: DynamicCache of T - 1 slots, "attention_mask": (B, T) long}, so
    target.generate(input_ids, **state, ...) runs input_ids[:, -1] on the mapped cache and gives the
    tokens kvt's handoff + kvt.generate give. The cache is used once: generate appends to it. plain:
    fast.map_cache's (Mapper.apply rather than its fast twin)."""
    if not isinstance(mapper, Mapper):
        raise KvtError(f"mapper must be a kvt Mapper (kvt.calibrate.calibrate or load_mapper), not {type(mapper).__name__}")
    check_pair(source, target, mapper)
    check_ids(input_ids, min(mapper.src_cfg.vocab_size, mapper.tgt_cfg.vocab_size))  # (B, T) ids both models know
    B, T = input_ids.shape
    mask = torch.ones(B, T, dtype=torch.bool) if attention_mask is None else attention_mask.bool().cpu()
    if mask.shape != (B, T):
        raise KvtError(f"attention_mask is {tuple(mask.shape)}, input_ids {(B, T)}; pass one mask entry per token")
    if not mask[:, -1].all():
        raise KvtError("attention_mask pads on the right (a row ends in padding); tokenize with padding_side='left': "
                       "the target runs every row's last prompt token")
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)                 # (B, T) as kvt and generate() count (pads: any)
    state = {"attention_mask": mask.long().to(target.device)}
    if T == 1:                                                     # nothing to hand over
        return {CACHE: DynamicCache(), **state}
    src = source(input_ids[:, :-1].to(source.device), use_cache=True, logits_to_keep=1,
                 attention_mask=None if attention_mask is None else mask[:, :-1].long().to(source.device),
                 position_ids=pos[:, :-1].to(source.device))
    src_cache = to_kvt(getattr(src, CACHE), pos[:, :-1].to(source.device), mask[:, :-1].to(source.device))  # T - 1 slots
    devices = [next(layer.parameters()).device for layer in target.get_decoder().layers]  # each layer's cache there
    mapped = fast.map_cache(mapper, src_cache, devices, target.dtype, plain=plain)
    return {CACHE: to_hf(mapped), **state}
