"""The toy family: a synthetic corpus where context matters, its tokenizer, and three small Qwen3 models.

`python run.py` with no arguments needs two models of one family that fit in the repo and train in
minutes on a laptop. This file makes them from nothing but a seed:

    python -m kvt.harness.toy train --out weights      # retrains weights/toy-{s,m,l}/, deterministically

  corpus(n, seed)           documents of templated text whose later words can only be predicted from
                            earlier ones: a roster ("the pets : anna cat , ben dog .") whose names come
                            back later followed by their values ("so ben dog , anna cat ."), copying,
                            counting and filler prose. Values are drawn uniformly, so without the
                            context a model is at chance on the recall questions.
  toy_tasks(name, n, seed)  evaluation records in the shapes the real tasks use (below).
  train_tokenizer(texts)    a byte-level BPE like Qwen3's, trained with `tokenizers`.
  train(...)                one member of FAMILY, trained by kvt's own model code with AdamW.
  grow(small, cfg)          a wider and/or deeper model that starts out computing what `small` does.

All members share the tokenizer, the KV-head count (Hkv=2) and the head dim (D=32), so any two of
them form a matched-KV pair; they differ in depth and width. toy-s is trained from scratch, toy-m is
grown from toy-s and trained on, toy-l grown from toy-m and trained on: a family with one lineage.

Task records (plain dicts, in the field names the evals use for real data sets):

  multiple choice, scored by the loglikelihood of each choice after the context (chance 1/len(choices)):
      {"context": "the pets : anna cat , ben dog , ... . we walk to the park . so ben",
       "choices": [" frog", " dog", " cat", " duck"], "label": 1}
      choices start with a space, as lm-evaluation-harness continuations do; the question is the
      context's last clause (question(): " so ben"), the "floor" condition scores the choices after it alone.
  exact match after greedy generation:
      {"prompt": "copy : cat red lima dog . again :", "answer": "cat red lima dog", "until": ["."]}
      generate until a string of `until` appears (or a few dozen tokens), cut it there, strip
      whitespace, compare with `answer`.

  TASKS: recall (MC, 4 choices), recall_gen (EM, the value), copy (EM, 6 words), count (MC, 6 choices).
"""
import argparse
import json
import os
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import kvt.evals
from kvt.config import Config, KvtError, at_least, command
from kvt.loading import build_model, load_model
from kvt.tokenizer import load_tokenizer
from kvt.weights import save_model

# ---------------------------------------------------------------------------------------------------
# The corpus. Every vocabulary word below becomes one token of the tokenizer (checked by a test).

NAMES = ("anna ben carl dora emma finn gina hugo ivan jane kate liam mia nora omar paul rosa sam tara "
         "uma vera walt yuri zoe alan beth cole dean ella gus hana ian jack kim leo max ned olga pia "
         "ray sue tom vic wes yara zack").split()                                          # 48 keys
ATTRIBUTES = {  # attribute -> its 12 values
    "colors": "red blue green yellow black white purple orange pink brown gray gold".split(),
    "cities": "paris rome tokyo cairo lima oslo delhi berlin madrid sydney boston dublin".split(),
    "pets": "cat dog fish bird horse mouse frog snake rabbit goat sheep duck".split(),
    "fruits": "apple pear plum grape lemon mango peach melon cherry banana kiwi lime".split(),
}
VALUES = [v for vs in ATTRIBUTES.values() for v in vs]
PLACES = "park lake shop school market garden river station library beach".split()
WEATHER = "warm cold sunny rainy windy quiet".split()
MAX_COUNT = 6


def _prose(rng):
    """One filler sentence: random and name-free, so it carries nothing a later question could use."""
    return rng.choice([
        f"we walk to the {rng.choice(PLACES)} .",
        f"the weather is {rng.choice(WEATHER)} today .",
        f"it is a {rng.choice(WEATHER)} day at the {rng.choice(PLACES)} .",
        f"the {rng.choice(PLACES)} is {rng.choice(WEATHER)} .",
    ])


def _pairs(pairs):
    return " , ".join(f"{name} {value}" for name, value in pairs)


def _roster(rng, names):
    """'the pets : anna cat , ben dog .' -> (text, [(name, value)], attribute); values drawn uniformly."""
    attribute = rng.choice(list(ATTRIBUTES))
    pairs = [(n, rng.choice(ATTRIBUTES[attribute])) for n in names]
    return f"the {attribute} : {_pairs(pairs)} .", pairs, attribute


def _recall(rng, names, n_filler):
    """A roster, filler prose, then some of its names again in a new order, each followed by its value.

    The value after a repeated name is the recall answer: a model finds the name's earlier occurrence
    and copies what followed it (associative recall, an induction-head task)."""
    roster, pairs, _ = _roster(rng, names)
    asked = rng.sample(pairs, rng.randint((len(pairs) + 1) // 2, len(pairs)))
    filler = [_prose(rng) for _ in range(n_filler)]
    return " ".join([roster] + filler + [f"so {_pairs(asked)} ."])


def _copy_words(rng, k):
    return [rng.choice(VALUES) for _ in range(k)]  # no names: a name is always a recall key


def _copy(rng):
    words = " ".join(_copy_words(rng, rng.randint(4, 10)))
    return f"copy : {words} . again : {words} ."


def _count(rng):
    """'count dog : dog cat dog . answer 2 .' - how often the first word appears in the list."""
    target, *others = rng.sample(ATTRIBUTES["pets"], 3)
    k = rng.randint(1, MAX_COUNT)
    items = [target] * k + [rng.choice(others) for _ in range(rng.randint(1, 6))]
    rng.shuffle(items)
    return f"count {target} : {' '.join(items)} . answer {k} ."


def document(rng):
    """One training document: a few segments of the kinds above, newline-separated."""
    parts, names = [], rng.sample(NAMES, len(NAMES))  # names are not reused within a document
    for _ in range(rng.randint(2, 4)):
        kind = rng.random()
        if kind < 0.55:
            n = rng.randint(2, 12)
            parts.append(_recall(rng, names[:n], rng.randint(0, 3)))
            names = names[n:]
        elif kind < 0.8:
            parts.append(_copy(rng))
        elif kind < 0.92:
            parts.append(_count(rng))
        else:
            parts.append(" ".join(_prose(rng) for _ in range(rng.randint(1, 4))))
    return "\n".join(parts)


def corpus(n, seed=0):
    """n documents (list of str), the same ones for the same seed."""
    rng = random.Random(seed)
    return [document(rng) for _ in range(n)]


# ---------------------------------------------------------------------------------------------------
# Evaluation tasks, generated on the fly (seed 1234 by default, disjoint in spirit from training seed 0:
# the generator draws fresh random facts, so no item is memorizable).

def _recall_item(rng, n_names=12, n_filler=3):
    """(context ending with a name asked again, its value, the attribute)."""
    roster, pairs, attribute = _roster(rng, rng.sample(NAMES, n_names))
    name, value = rng.choice(pairs)
    filler = [_prose(rng) for _ in range(n_filler)]
    return " ".join([roster] + filler + [f"so {name}"]), value, attribute


def _choices(rng, right, pool, k):
    """k choices including `right`, shuffled -> (choices with a leading space, label)."""
    options = [right] + rng.sample([v for v in pool if v != right], k - 1)
    rng.shuffle(options)
    return [" " + o for o in options], options.index(right)


def toy_tasks(name, n, seed=1234):
    """n records of task `name` (see the module docstring), the same for the same seed."""
    rng = random.Random(f"{name}-{seed}")
    out = []
    for _ in range(n):
        if name == "recall":
            context, value, attribute = _recall_item(rng)
            choices, label = _choices(rng, value, ATTRIBUTES[attribute], 4)
            out.append({"context": context, "choices": choices, "label": label})
        elif name == "recall_gen":
            context, value, _ = _recall_item(rng)
            out.append({"prompt": context, "answer": value, "until": [",", "."]})
        elif name == "copy":
            words = " ".join(_copy_words(rng, 6))
            out.append({"prompt": f"copy : {words} . again :", "answer": words, "until": ["."]})
        elif name == "count":
            text = _count(rng)
            context, k = text.rsplit(" answer ", 1)[0] + " answer", int(text.split()[-2])
            out.append({"context": context, "choices": [f" {i}" for i in range(1, MAX_COUNT + 1)], "label": k - 1})
        else:
            raise ValueError(f"unknown toy task {name!r}; known: {', '.join(TASKS)}")
    return out


TASKS = ("recall", "recall_gen", "copy", "count")


def question(context):
    """The context's last clause, after its last "." (" so ben", " again :"): what the floor condition
    reads instead of the whole context, the question without the facts it asks about."""
    return context.rsplit(".", 1)[-1]


# ---------------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE like Qwen3's (any text encodes), trained on the corpus until every word
# is a single token; its vocabulary is whatever that takes (a few hundred entries), at most VOCAB.

VOCAB = 1024
EOS = "<|endoftext|>"


def train_tokenizer(texts):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


# ---------------------------------------------------------------------------------------------------
# The family. Shared by all members: Hkv=2 KV heads of D=32, H=4 query heads, the tokenizer, the RoPE.

# toy-s is trained from scratch; each larger member is grown from the one before it (grow) and trained
# on, as a family that shares its lineage. Trained from scratch, 3- and 4-layer members had not learned
# recall within 2,100-2,800 steps, and separately trained members do not map onto each other (docs/measurements.md).
FAMILY = {  # name: (dim C, layers L, ffn_dim, grown from)
    "toy-s": (64, 2, 192, None),
    "toy-m": (96, 2, 288, "toy-s"),
    "toy-l": (128, 4, 384, "toy-m"),
}
SEQ, BATCH, LR = 256, 16, 5e-3     # tokens per row, rows per step, learning rate
CHECK, SOLVED, COOL, MAX_STEPS = 100, 0.95, 0.25, 4000   # see train()
GROW_STEPS = 1000                  # training steps of a grown member
N_DOCS = 20_000                    # training documents (about 3M tokens, seed 0)


def config(name, vocab_size, eos_id):
    dim, n_layers, ffn_dim, _ = FAMILY[name]
    return Config(family="qwen3", vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                  head_dim=32, ffn_dim=ffn_dim, norm_eps=1e-6, rope={"rope_type": "default", "rope_theta": 10000.0},
                  tie_embeddings=True, max_seq_len=4096, bos_token_id=None, eos_token_id=eos_id)


def token_stream(tok, texts):
    """All documents as one (N,) tensor of token ids, each followed by EOS, and (S,) the document starts."""
    eos = tok.token_to_id(EOS)
    ids = torch.tensor([i for enc in tok.encode_batch(texts) for i in enc.ids + [eos]])  # (N,)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), (ids == eos).nonzero()[:-1, 0] + 1])  # (S,)
    return ids, starts[starts < len(ids) - SEQ - 1]


@torch.no_grad()
def grow(small, cfg, seed=0):
    """A member of shape cfg that computes exactly what `small` computes: the start of a grown member.

    Wider (C, ffn_dim): small's weights fill the top-left block of each matrix. Whatever writes into a
    new residual dim or reads a new ffn unit (embedding columns, o_proj/down_proj rows, down_proj
    columns) starts at zero, so the new dims hold zeros; what reads them starts random, so training
    moves them. RMSNorm averages over C, so the copied norm weights are scaled by sqrt(C_small / C).
    Deeper: small's layers are spread evenly (2 -> 4: at 0 and 2); each new layer starts random with
    zero o_proj and down_proj, an identity on the residual stream until training changes it."""
    big = build_model(cfg, seed=seed)
    C, Fs = small.config.dim, small.config.ffn_dim
    scale = (C / cfg.dim) ** 0.5
    at = {i * cfg.n_layers // small.config.n_layers: i for i in range(small.config.n_layers)}  # new -> old
    big.model.embed_tokens.weight[:, C:] = 0
    big.model.embed_tokens.weight[:, :C] = small.model.embed_tokens.weight
    big.model.norm.weight.fill_(scale)[:C] = small.model.norm.weight * scale
    for j, block in enumerate(big.model.layers):
        attn, mlp = block.self_attn, block.mlp
        if j not in at:                                   # a new layer: identity at the start
            attn.o_proj.weight.zero_()
            mlp.down_proj.weight.zero_()
            continue
        old = small.model.layers[at[j]]
        for norm, old_norm in [(block.input_layernorm, old.input_layernorm),
                               (block.post_attention_layernorm, old.post_attention_layernorm)]:
            norm.weight.fill_(scale)[:C] = old_norm.weight * scale
        for name in ["q_proj", "k_proj", "v_proj"]:       # (H*D, C): read the residual stream
            getattr(attn, name).weight[:, :C] = getattr(old.self_attn, name).weight
        attn.q_norm.weight.copy_(old.self_attn.q_norm.weight)
        attn.k_norm.weight.copy_(old.self_attn.k_norm.weight)
        attn.o_proj.weight.zero_()[:C] = old.self_attn.o_proj.weight              # (C, H*D): writes
        mlp.gate_proj.weight[:Fs, :C] = old.mlp.gate_proj.weight                  # (ffn, C): reads
        mlp.up_proj.weight[:Fs, :C] = old.mlp.up_proj.weight
        mlp.down_proj.weight.zero_()[:C, :Fs] = old.mlp.down_proj.weight          # (C, ffn): writes
    return big


def train(cfg, ids, starts, encode, max_steps=MAX_STEPS, seed=0, log=print, init=None, teacher=None):
    """A kvt Transformer trained with AdamW on rows of SEQ tokens that begin at document starts, as the
    evaluation contexts do. encode: str -> token ids. Returns the model (eval mode) and a record of the run.

    Recall arrives suddenly, when the model forms induction heads (a phase change, after 1-2k steps
    here). So the schedule is: warm up, hold the learning rate until held-out recall reaches SOLVED
    (checked every CHECK steps), then cool down linearly for COOL of the steps taken so far.
    init: a model to train on instead of a random one (a grown member, already solved): its whole
    run of max_steps is the cooldown. teacher: a model whose next-token distributions the student
    learns (loss KL(teacher || student), no labels): distillation, sharing a teacher but no weights."""
    model = (init if init is not None else build_model(cfg, seed=seed)).train().requires_grad_(True)
    params = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]  # norms: no decay
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(seed)
    dev = toy_tasks("recall", 50, seed=seed + 1)     # held out: the evaluation uses seed 1234
    t0, solved_at, stop, step = time.time(), None if init is None else 0, max_steps, 0
    while step < stop:
        lr = LR * min(1.0, (step + 1) / 50)                                         # warmup, then hold
        if solved_at is not None:
            lr *= (stop - step) / (stop - solved_at)                                # linear cooldown to 0
        for group in opt.param_groups:
            group["lr"] = lr
        first = starts[torch.randint(0, len(starts), (BATCH,), generator=g)]       # (B,)
        rows = ids[first[:, None] + torch.arange(SEQ + 1)]                          # (B, SEQ+1)
        logits, _ = model(rows[:, :-1])                                             # (B, SEQ, V)
        if teacher is None:
            loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())    # logits[t] predict rows[t+1]
        else:
            with torch.no_grad():
                want = teacher(rows[:, :-1])[0].log_softmax(-1)                     # (B, SEQ, V)
            loss = F.kl_div(logits.log_softmax(-1).flatten(0, 1), want.flatten(0, 1), log_target=True,
                            reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % CHECK == 0:
            acc = choice_accuracy(model.eval(), encode, dev)
            model.train()
            log(f"{cfg.n_layers}x{cfg.dim} step {step:4d}  loss {loss.item():.3f}  held-out recall {acc:.2f}  "
                f"{time.time() - t0:.0f}s")
            if acc >= SOLVED and solved_at is None:
                solved_at, stop = step, min(max_steps, step + int(COOL * step))
    record = {"steps": step, "solved_at": solved_at, "seconds": round(time.time() - t0), "final_loss": round(loss.item(), 3)}
    return model.eval().requires_grad_(False), record


def choice_accuracy(model, encode, items, context=True):
    """Accuracy on multiple-choice records, scored as the evals score them (kvt.evals.score_choices:
    the choice with the highest loglikelihood after the context wins). context=False reads only the
    question (question()): the "floor" condition. encode: str -> token ids."""
    right = 0.0
    for it in items:
        ctx = it["context"] if context else question(it["context"])
        choices = [c.removeprefix(" ") for c in it["choices"]]  # score_choices puts the space back
        right += kvt.evals.score_choices(model, encode, ctx, choices, it["label"])["acc"]
    return right / len(items)


# ---------------------------------------------------------------------------------------------------
# Saving, in the Hugging Face layout, so transformers' AutoModelForCausalLM loads the folders too.

def _write(path, text):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save(model, tok, path):
    """config.json, model.safetensors, tokenizer.json and tokenizer_config.json in the folder `path`."""
    path = Path(path)
    save_model(model, path)
    hf = json.loads((path / "config.json").read_text())
    hf.update(rope_theta=model.config.rope["rope_theta"], dtype="float32")  # rope_theta: for transformers 4.x
    _write(path / "config.json", json.dumps(hf, indent=2) + "\n")
    _write(path / "tokenizer.json", tok.to_str())
    _write(path / "tokenizer_config.json", json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": EOS, "pad_token": EOS,
        "unk_token": None, "model_max_length": model.config.max_seq_len, "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(prog="kvt toy", description="Retrain the toy family from its seed.")
    p.add_argument("command", choices=["train"])
    p.add_argument("--out", default="weights", help="writes OUT/toy-s, OUT/toy-m, OUT/toy-l")
    p.add_argument("--members", nargs="+", choices=list(FAMILY), default=list(FAMILY))
    p.add_argument("--max-steps", type=int, default=MAX_STEPS, help="stop here if recall is not solved by then")
    p.add_argument("--grow-steps", type=int, default=GROW_STEPS, help="training steps of a grown member")
    p.add_argument("--seed", type=int, default=0, help="initialization and batch order (the corpus is always seed 0)")
    p.add_argument("--scratch", action="store_true", help="train even grown members from scratch (a lineage control)")
    p.add_argument("--teacher", type=Path, help="distill from this checkpoint's next-token distributions instead of "
                   "learning the corpus' tokens (with --scratch: a shared teacher without shared weights)")
    args = p.parse_args(argv)
    at_least("max-steps", args.max_steps, why=" (training steps)")
    at_least("grow-steps", args.grow_steps, why=" (training steps of a grown member)")
    torch.set_num_threads(1)  # matrices this small run faster on one thread, and one thread is reproducible
    texts = corpus(N_DOCS, seed=0)
    tok = train_tokenizer(texts)
    ids, starts = token_stream(tok, texts)
    vocab_size = -(-tok.get_vocab_size() // 64) * 64           # rounded up, as real checkpoints pad it
    print(f"corpus: {len(texts)} documents, {len(ids)} tokens; vocabulary {tok.get_vocab_size()} (model {vocab_size})")
    items, table, done = toy_tasks("recall", 200), [], {}
    for name in [m for m in FAMILY if m in args.members]:        # parents before the members grown from them
        path, parent, cfg = Path(args.out) / name, FAMILY[name][3], config(name, vocab_size, tok.token_to_id(EOS))
        init, steps = None, args.max_steps
        if parent is not None and not args.scratch:
            if parent not in done and not (Path(args.out) / parent / "model.safetensors").exists():
                raise KvtError(f"{name} is grown from {parent}: add {parent} to --members, or train it first")
            init, steps = grow(done.get(parent) or load_model(Path(args.out) / parent), cfg, args.seed), args.grow_steps
        teacher = load_model(args.teacher) if args.teacher else None
        model, record = train(cfg, ids, starts, lambda s: tok.encode(s).ids, max_steps=steps, seed=args.seed, init=init,
                              teacher=teacher)
        done[name] = model
        record["grown_from"] = None if args.scratch else parent
        record.update(seed=args.seed, teacher=str(args.teacher) if args.teacher else None)
        save(model, tok, path)
        encode = load_tokenizer(path).encode             # scored as every later user will read the folder
        acc, floor = choice_accuracy(model, encode, items), choice_accuracy(model, encode, items, context=False)
        record.update(params=sum(p.numel() for p in model.parameters()), recall=acc, recall_floor=floor,
                      recall_items=len(items))
        _write(path / "toy_train.json", json.dumps(record, indent=2) + "\n")  # what this run measured
        table.append((name, record))
    print(f"\n{'model':8} {'params':>8} {'steps':>6} {'train s':>8} {'loss':>6} {'recall':>7} {'floor':>6}")
    for name, r in table:
        print(f"{name:8} {r['params']:8d} {r['steps']:6d} {r['seconds']:8d} {r['final_loss']:6.3f} "
              f"{r['recall']:7.2f} {r['recall_floor']:6.2f}")
    print(f"recall: {len(items)} items, 4 choices (chance 0.25); floor = the question without the facts")


if __name__ == "__main__":
    command(main)  # as `kvt toy`: an error is one line
