"""One decoder for three families: Qwen3, Llama 3 and Ministral 3 (dense, full attention, no biases).

    logits, cache = model(input_ids)               # prefill: (B, T) -> (B, T, V), Cache of T slots
    logits, cache = model(next_ids, cache=cache)   # continue from any Cache, e.g. a transferred one

They are the same pre-norm transformer (RMSNorm, GQA attention with RoPE, SwiGLU MLP) and differ in
three places, each marked with `<-- difference` below:
  1. Qwen3 applies an RMSNorm to every head of q and k before RoPE (q_norm, k_norm);
  2. RoPE frequencies: default (Qwen3), "llama3" scaling (Llama 3.1/3.2), YaRN (Ministral 3), see rope.py;
  3. Ministral 3 multiplies queries by a temperature that grows past 16K positions.
Module names follow the checkpoint's tensor names, so weights.py loads them without renaming.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from kvt import rope
from kvt.cache import empty
from kvt.config import Config, check_input


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()  # normalize in float32, as the reference does
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        H, Hkv, D, C = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim
        self.q_proj = nn.Linear(C, H * D, bias=False)
        self.k_proj = nn.Linear(C, Hkv * D, bias=False)
        self.v_proj = nn.Linear(C, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, C, bias=False)
        if cfg.qk_norm:  # <-- difference 1: Qwen3 normalizes each head of q and k
            self.q_norm = RMSNorm(D, cfg.norm_eps)
            self.k_norm = RMSNorm(D, cfg.norm_eps)
        self.H, self.Hkv, self.D = H, Hkv, D

    def forward(self, x, cos, sin, temperature, cache, l, attn_mask, slots=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.D)     # (B, T, H, D)
        k = self.k_proj(x).view(B, T, self.Hkv, self.D)   # (B, T, Hkv, D)
        v = self.v_proj(x).view(B, T, self.Hkv, self.D)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|Hkv, T, D)
        q, k = rope.rotate(q, cos, sin), rope.rotate(k, cos, sin)           # <-- difference 2 (in cos, sin)
        k, v = k.contiguous(), v.contiguous()  # a cache keeps each head's slots together, as the mapper reads them
        if temperature is not None:                                         # <-- difference 3: Ministral 3
            q = q * temperature.to(q.dtype)
        k, v = cache.update(l, k, v, slots)    # the cache update: after the cached slots (B, Hkv, S, D)
        y = cache.attend(q, k, v, attn_mask, causal=attn_mask is None and k.shape[2] == T)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.H * self.D)               # (B, T, H*D)
        return self.o_proj(y), q


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, *attn_args):
        a, q = self.self_attn(self.input_layernorm(x), *attn_args)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), q


class Decoder(nn.Module):  # the checkpoint's "model." prefix
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie()
        self.inv_freq, self.rope_scale = rope.frequencies(cfg)  # plain tensors, not state: (D/2,), float

    def tie(self):
        if self.config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, cache=None, mask=None, queries=False, positions=None, last=False, slots=None):
        """input_ids (B, T) long; cache: a Cache to continue from; mask (B, T) bool, False = left padding;
        positions (B, T) long: RoPE positions of these tokens (default: count on from the cache);
        last: compute logits for the last position only (all a server needs after prefill).
        slots (T,) long, ascending: recompute instead of append. The tokens already hold these slots of
        `cache`; their own K and V overwrite the cached ones there, in place (the cache must own its
        memory, as a mapped one does), and each attends to the cache's slots up to its own, the others
        as cached (selective recompute, handoff.py).
        Returns logits (B, T, V) (or (B, 1, V)) and a new Cache holding the old slots plus these T."""
        check_input(self.config, input_ids, cache, appends=slots is None)   # ids, cache, length (config.py)
        B, T = input_ids.shape
        dev = input_ids.device
        cache = cache if cache is not None else empty(self.config.n_layers, B, dev)
        mask_given, mask = mask, mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=dev)
        if slots is not None:
            return self._recompute(input_ids, cache, slots, queries, last)
        if cache.positions.shape[1]:  # next position: one past the last real slot of each row
            start = cache.positions.masked_fill(~cache.mask, -1).amax(1, keepdim=True) + 1  # (B, 1)
        else:
            start = torch.zeros(B, 1, dtype=torch.long, device=dev)
        pos = (start + mask.long().cumsum(1) - 1).clamp(min=0) if positions is None else positions  # (B, T)
        positions, key_mask = torch.cat([cache.positions, pos], 1), torch.cat([cache.mask, mask], 1)
        full = cache.full and mask_given is None               # no padding anywhere: known without a sync
        attn_mask = None  # None: a plain causal prefill, or one new token seeing every slot (decode)
        if not full or (len(cache) and T > 1):
            S = positions.shape[1]
            i = torch.arange(len(cache), S, device=dev)[:, None]   # (T, 1) query slots
            j = torch.arange(S, device=dev)[None]                  # (1, S) key slots
            attn_mask = ((j <= i) & key_mask[:, None]) | (j == i)  # (B, T, S); a pad still sees itself
            attn_mask = attn_mask[:, None]                         # (B, 1, T, S)

        new = cache.grow(positions, key_mask, full)                # every layer's update() extends it
        logits = self._layers(input_ids, pos, new, attn_mask, queries, last)
        return logits, new

    def _recompute(self, input_ids, cache, slots, queries, last):
        """forward(slots=...): the tokens at cache slots `slots` run again, writing their K and V there."""
        S = len(cache)
        i, j = slots[:, None], torch.arange(S, device=slots.device)[None]          # (T, 1) query, (1, S) key slots
        attn_mask = (((j <= i) & cache.mask[:, None]) | (j == i))[:, None]        # (B, 1, T, S)
        new = cache.grow(cache.positions, cache.mask, cache.full)                 # the same slots, rewritten
        logits = self._layers(input_ids, cache.positions[:, slots], new, attn_mask, queries, last, slots)
        return logits, new

    def _layers(self, input_ids, pos, cache, attn_mask, queries, last, slots=None):
        """Every layer over input_ids at RoPE positions pos (B, T), each writing its keys and values into
        cache (and, when asked, its queries into cache.queries): the logits."""
        x = self.model.embed_tokens(input_ids)                     # (B, T, C)
        cos, sin = rope.cos_sin(pos, self.inv_freq, self.rope_scale, x.dtype)  # (B, 1, T, D)
        temperature = rope.query_temperature(self.config, pos)     # (B, 1, T, 1) or None
        qs = []
        for l, block in enumerate(self.model.layers):
            d = block.input_layernorm.weight.device  # layers may live on different devices (see dist.py)
            x = x.to(d)
            m = attn_mask.to(d) if attn_mask is not None else None
            t = temperature.to(d) if temperature is not None else None
            x, q = block(x, cos.to(d), sin.to(d), t, cache, l, m, None if slots is None else slots.to(d))
            if queries:  # only when asked: every layer's queries held to the end cost as much as the KV
                qs.append(q)
        cache.queries = qs if queries else None
        x = self.model.norm(x[:, -1:] if last else x).to(self.lm_head.weight.device)
        return self.lm_head(x)                                     # logits (B, T, V)

