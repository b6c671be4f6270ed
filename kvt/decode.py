"""Greedy decoding from a prefilled state, on any Cache (a model's own or a transferred one): what the
evaluation runs after a handoff. The plain loop; fast.generate is its twin (a reserved cache, tested equal).

    out = generate(target, logits[:, -1], cache, max_new_tokens=8, stop_ids=tok.stop_ids)
"""
import torch


@torch.no_grad()
def generate(model, logits, cache, max_new_tokens, stop_ids=(), stop=(), decode=None, logprobs=None):
    """Greedy decoding from a prefilled state: `logits` (B, V) are the last position's, `cache` holds
    the context (it is not modified: each step's cache follows it, cache.Cache.update).
    Stops a row at a token in stop_ids or once decode(row tokens) contains a stop string.
    Returns a list of B token lists, without the stop token; a stop string stays in the text (callers cut it).
    logprobs: a list of B empty lists, to be filled with the log-probability of each token returned."""
    B = logits.shape[0]
    out = [[] for _ in range(B)]
    done = [False] * B
    for step in range(max_new_tokens):
        nxt = logits.argmax(-1)                                    # (B,)
        if logprobs is not None:                                   # (B,): log softmax at the chosen token
            lp = (logits.float().gather(-1, nxt[:, None])[:, 0] - logits.float().logsumexp(-1)).tolist()
        for b, tok in enumerate(nxt.tolist()):                     # one device sync per step
            if done[b]:
                continue
            if tok in stop_ids:
                done[b] = True
                continue
            out[b].append(tok)
            if logprobs is not None:
                logprobs[b].append(lp[b])
            if stop and decode and any(s in decode(out[b]) for s in stop):
                done[b] = True
        if all(done) or step == max_new_tokens - 1:                # the last token needs no forward pass
            break
        logits, cache = model(nxt[:, None], cache=cache)
        logits = logits[:, -1]
    return out
