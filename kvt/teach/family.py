"""Smaller siblings of a checkpoint, made the way real families make theirs: prune, then heal by distillation.

    python -m kvt.teach.family build --parent weights/smollm2-135m --kind depth --out weights/smollm2-135m-depth15
    python -m kvt.teach.family build --parent weights/smollm2-135m --kind width --out weights/smollm2-135m-ffn768

A sibling shares the parent's tokenizer, width, KV heads and head dim, so the pair is matched-KV:
  depth  keeps the half of the layers with the highest block influence (ShortGPT, Men et al. 2024),
         BI_l = 1 - mean over tokens of cos(x_l, x_l+1), the block's input and output hidden states:
         a block that barely turns the residual stream is the one to drop. Chosen over "the loss
         increase when block l is skipped" because it takes one forward pass, not one per layer.
  width  keeps, in every layer, the MLP neurons with the largest mean |silu(gate(x)) * up(x)| over the
         calibration tokens (Minitron, Muralidharan et al. 2024); attention and KV are untouched.
Kept tensors start as exact copies of the parent's slices. Healing distills the parent into the
sibling: KL(parent || sibling) per token at temperature 1, the sibling under bf16 autocast, the parent
in fp32 under inference_mode; AdamW, linear warmup, cosine decay to lr/10, a seeded row order.

Text is kept apart, so nothing is tuned on what is measured:
  score     WikiText-2 valid.txt, 16 evenly spaced windows of 512 tokens
  heal      the Gutenberg books, the Project Gutenberg header and license stripped
  held out  WikiText-2 test.txt, 16 evenly spaced windows of 1,024, the same for every model:
            perplexity, and KL to the parent
  never     an evaluation task (arc, hellaswag, mmlu, gsm8k, coqa)

Resumable: every --save-every steps the sibling's weights, AdamW's moments and the step go to
OUT/heal-state.safetensors (written to .tmp, then renamed); rerunning the same command continues there
and ends with the bits of an unbroken run (one machine, one --threads). At the end OUT is a Hugging
Face checkpoint (config.json, model.safetensors, the parent's tokenizer files) plus family.json,
everything the build measured.
"""
import argparse
import json
import math
import os
import re
import shutil
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from tqdm import tqdm

from kvt.config import KvtError, at_least, command, config_from_dict, load_config
from kvt.harness.data import SKIP
from kvt.harness.plan import n_params
from kvt.loading import build_model, load_model
from kvt.tokenizer import load_tokenizer
from kvt.weights import fingerprint, save_model, write_safetensors

SHARED = Path(os.environ.get("KVT_SHARED", Path(__file__).resolve().parents[3] / "shared"))  # ../shared
CALIB = SHARED / "data" / "calib"
STATE = "heal-state.safetensors"


# ---------------------------------------------------------------------------------------------------
# Text

def gutenberg_book(text, name="book"):
    """The book inside a Project Gutenberg file: the lines strictly between '*** START OF' and '*** END OF'."""
    lines = text.splitlines()  # the files use CRLF; some markers are spelled '***START OF' or indented
    start = [i for i, line in enumerate(lines) if re.match(r"\*\*\*\s*START OF", line.strip())]
    end = [i for i, line in enumerate(lines) if re.match(r"\*\*\*\s*END OF", line.strip())]
    if not start or not end or end[0] < start[0]:
        raise KvtError(f"{name} has no '*** START OF' ... '*** END OF' marker lines; "
                       "--heal-data takes a folder of Project Gutenberg .txt files")
    return "\n".join(lines[start[0] + 1:end[0]]).strip()


def healing_stream(folder, tok):
    """(N,) token ids of every book in `folder` (sorted by name), stripped, tokenized, end to end."""
    files = [f for f in sorted(Path(folder).glob("*.txt")) if not f.name.startswith(SKIP)]
    if not files:
        raise KvtError(f"no Project Gutenberg .txt files in {folder}; point --heal-data at the books")
    ids = []
    for f in files:
        ids += tok.encode(gutenberg_book(f.read_text(encoding="utf-8"), f) + "\n\n", special=False)
    return torch.tensor(ids)


def windows(file, tok, n, length):
    """(n, length): n evenly spaced, non-overlapping token windows of `file`, the same on every call."""
    ids = torch.tensor(tok.encode(Path(file).read_text(encoding="utf-8"), special=False))  # (N,)
    if len(ids) < n * length:
        raise KvtError(f"{file} has {len(ids)} tokens, fewer than {n} x {length}; ask for fewer or shorter windows")
    starts = torch.arange(n) * ((len(ids) - length) // max(1, n - 1))             # (n,) first to last
    return ids[starts[:, None] + torch.arange(length)]                             # (n, length)


# ---------------------------------------------------------------------------------------------------
# Pruning: score, keep, slice

@torch.no_grad()
def block_influence(model, ids, batch=4):
    """(L,) ShortGPT block influence over the token rows ids (N, T): 1 - mean cos(block input, output)."""
    total = torch.zeros(model.config.n_layers, dtype=torch.float64)

    def hook(l):
        def add(block, args, out):  # args[0]: the block's input x (B, T, C); out[0]: its output
            total[l] += F.cosine_similarity(args[0], out[0], dim=-1).double().sum()
        return add
    handles = [block.register_forward_hook(hook(l)) for l, block in enumerate(model.model.layers)]
    try:
        for rows in ids.split(batch):
            model(rows, last=True)  # only the hidden states matter: skip the full logits
    finally:
        for h in handles:
            h.remove()
    return 1 - total / ids.numel()


@torch.no_grad()
def neuron_importance(model, ids, batch=4):
    """(L, ffn_dim) Minitron importance: mean |silu(gate(x)) * up(x)| of each MLP neuron over the tokens."""
    total = torch.zeros(model.config.n_layers, model.config.ffn_dim, dtype=torch.float64)

    def hook(l):
        def add(down_proj, args):  # args[0]: what down_proj reads, silu(gate(x)) * up(x), (B, T, ffn)
            total[l] += args[0].abs().double().sum((0, 1))
        return add
    handles = [block.mlp.down_proj.register_forward_pre_hook(hook(l)) for l, block in enumerate(model.model.layers)]
    try:
        for rows in ids.split(batch):
            model(rows, last=True)
    finally:
        for h in handles:
            h.remove()
    return total / ids.numel()


def keep_layers(influence, n):
    """(n,) the indices of the n most influential layers, in order."""
    return influence.topk(n).indices.sort().values


def keep_neurons(importance, n):
    """(L, n) every layer's n most important MLP neurons, in order."""
    return importance.topk(n, dim=1).indices.sort(dim=1).values


def parent_slice(parent_sd, name, kind, keep):
    """The parent's tensor that the sibling's parameter `name` starts as (kept layer, or kept neurons)."""
    if name.startswith("model.layers."):
        l = int(name.split(".")[2])
        if kind == "depth":  # sibling layer l is parent layer keep[l]
            return parent_sd[name.replace(f"layers.{l}.", f"layers.{int(keep[l])}.", 1)]
        if ".mlp." in name:  # gate_proj, up_proj (ffn, C): rows; down_proj (C, ffn): columns
            w = parent_sd[name]
            return w[:, keep[l]] if "down_proj" in name else w[keep[l]]
    return parent_sd[name]


@torch.no_grad()
def prune(parent, kind, keep):
    """The sibling: the parent's kept layers (depth; keep (n,)) or kept MLP neurons (width; keep (L, n))."""
    cfg = parent.config
    cfg = replace(cfg, n_layers=len(keep)) if kind == "depth" else replace(cfg, ffn_dim=keep.shape[1])
    sibling = build_model(cfg)
    sd = parent.state_dict()
    for name, p in sibling.named_parameters():  # a tied lm_head is embed_tokens: listed once
        p.copy_(parent_slice(sd, name, kind, keep))
    return sibling


# ---------------------------------------------------------------------------------------------------
# Healing

def lr_at(step, steps, lr, warmup):
    """Linear warmup over `warmup` steps, then cosine decay from lr to lr/10 at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - 1 - warmup)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t))))


def row_starts(n_tokens, steps, batch, seq_len, seed):
    """(steps, batch) offsets into the healing stream, drawn once from the seed: step s reads the same
    rows in every run, interrupted or not."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_tokens - seq_len, (steps, batch), generator=g)


def kl_to(teacher_logits, student_logits):
    """Mean over tokens of KL(teacher || student) at temperature 1, in float32: (B, T, V) x 2 -> ()."""
    t = teacher_logits.float().log_softmax(-1).flatten(0, 1)       # (B*T, V)
    s = student_logits.float().log_softmax(-1).flatten(0, 1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")  # sum_v p_t (log p_t - log p_s), per token


def distill_step(student, teacher, rows, opt, lr):
    """One AdamW step of the student toward the teacher's next-token distributions on rows (B, T).
    Returns the step's KL in nats per token."""
    with torch.inference_mode():
        target = teacher(rows)[0]                       # (B, T, V) fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = student(rows)[0]                       # (B, T, V) bf16
    loss = kl_to(target.clone(), logits)                # clone: inference tensors cannot be saved for backward
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
    opt.step()
    return loss.item()


def optimizer(student, lr):
    # healing, not pretraining: no weight decay pulls the parent's weights toward zero
    return torch.optim.AdamW(student.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def save_state(path, student, opt, step, keep, meta):
    """Write the healing state atomically, safetensors only: weights, AdamW moments, kept indices, step, meta."""
    tensors = {"keep": keep.contiguous()}
    for name, p in student.named_parameters():
        tensors["weight." + name] = p.detach().contiguous()
        if p in opt.state:  # empty before the first step
            tensors["exp_avg." + name] = opt.state[p]["exp_avg"]
            tensors["exp_avg_sq." + name] = opt.state[p]["exp_avg_sq"]
    write_safetensors(tensors, path, metadata={"step": str(step), "meta": json.dumps(meta)})


@torch.no_grad()
def load_state(path, lr):
    """(sibling, AdamW, step, keep, meta) from a file save_state wrote."""
    with safe_open(path, framework="pt") as f:
        step, meta = int(f.metadata()["step"]), json.loads(f.metadata()["meta"])
        sibling = build_model(config_from_dict(meta["config"])).train().requires_grad_(True)
        opt = optimizer(sibling, lr)
        names = set(f.keys())
        for name, p in sibling.named_parameters():
            p.copy_(f.get_tensor("weight." + name))
            if "exp_avg." + name in names:  # AdamW keeps its step as a float32 tensor
                opt.state[p] = {"step": torch.tensor(float(step)), "exp_avg": f.get_tensor("exp_avg." + name),
                                "exp_avg_sq": f.get_tensor("exp_avg_sq." + name)}
        return sibling, opt, step, f.get_tensor("keep"), meta


# ---------------------------------------------------------------------------------------------------
# Measuring

@torch.no_grad()
def heldout(model, parent, held):
    """Perplexity of model and of parent on the windows held (n, T), and model's mean per-token KL to parent."""
    nll, parent_nll, kl = 0.0, 0.0, 0.0
    for row in held[:, None]:                           # one window at a time: (1, T)
        logits, target = model(row)[0], parent(row)[0]  # (1, T, V); logits[t] predict row[t+1]
        nll += F.cross_entropy(logits[0, :-1], row[0, 1:], reduction="sum").item()
        parent_nll += F.cross_entropy(target[0, :-1], row[0, 1:], reduction="sum").item()
        kl += kl_to(target, logits).item() * row.shape[1]
    n, T = held.shape
    return {"ppl": math.exp(nll / (n * (T - 1))), "parent_ppl": math.exp(parent_nll / (n * (T - 1))),
            "kl": kl / (n * T)}


@torch.no_grad()
def weight_change(sibling, parent, kind, keep):
    """|W - W0|_F / |W0|_F of every sibling tensor from the parent slice W0 it started as, summarized per
    tensor kind (q_proj, ..., embed_tokens, norm) as the mean and max over layers."""
    sd, by_kind = parent.state_dict(), defaultdict(list)
    for name, p in sibling.named_parameters():
        w0 = parent_slice(sd, name, kind, keep)
        by_kind[name.split(".")[-2]].append(((p - w0).norm() / w0.norm()).item())
    return {k: {"mean": round(sum(v) / len(v), 5), "max": round(max(v), 5)} for k, v in by_kind.items()}


# ---------------------------------------------------------------------------------------------------
# The command

def _write(path, text):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _flags(args):
    """What decides the result: a rerun resumes only with the same, and the record keeps them."""
    keys = ("kind", "keep", "tokens", "batch", "seq_len", "lr", "warmup", "seed", "threads", "score_seqs",
            "score_len", "windows", "window_len")
    flags = {k: getattr(args, k) for k in keys}
    flags.update(parent=str(args.parent), heal_data=str(args.heal_data), score_text=str(args.score_text),
                 heldout_text=str(args.heldout_text))
    return flags


def _check_inputs(args):
    load_config(args.parent)  # a missing parent folder or config.json: a KvtError saying what to do
    for flag, path, what in [("--heal-data", args.heal_data, "folder of Project Gutenberg books"),
                             ("--score-text", args.score_text, "WikiText-2 valid.txt"),
                             ("--heldout-text", args.heldout_text, "WikiText-2 test.txt")]:
        if not Path(path).exists():
            raise KvtError(f"{flag} {path} does not exist; pass the {what} (or set KVT_SHARED)")
    if args.tokens < args.batch * args.seq_len:
        raise KvtError(f"--tokens {args.tokens} is less than one step of --batch x --seq-len tokens")


def build(args, log=print):
    """Prune the parent, heal the sibling (resuming OUT/heal-state.safetensors if there), save and measure.
    Returns (sibling, record); the record is also OUT/family.json."""
    _check_inputs(args)
    torch.set_num_threads(args.threads)
    out, flags = Path(args.out), _flags(args)
    if (out / "family.json").exists():
        return _built(out, flags, log)
    out.mkdir(parents=True, exist_ok=True)
    tok, parent = load_tokenizer(args.parent), load_model(args.parent)
    held = windows(args.heldout_text, tok, args.windows, args.window_len)             # (n, T)
    state = out / STATE
    t0 = time.time()
    if state.exists():
        sibling, opt, step, keep, meta = load_state(state, args.lr)
        if meta["flags"] != flags:
            raise KvtError(f"{state} was written by a build with other flags ({meta['flags']}); "
                           "rerun with those, or delete the file to start over")
        log(f"resuming {state} at step {step}")
    else:
        sibling, opt, step, keep, meta = _pruned(args, parent, tok, held, flags, log)
    record = meta["record"]
    spent = record["seconds"]

    stream = healing_stream(args.heal_data, tok)                                       # (N,)
    steps = args.tokens // (args.batch * args.seq_len)
    starts = row_starts(len(stream), steps, args.batch, args.seq_len, args.seed)      # (steps, B)
    bar = tqdm(total=steps, initial=step, desc=f"healing {out.name}", unit="step")
    while step < steps:
        rows = stream[starts[step][:, None] + torch.arange(args.seq_len)]             # (B, T)
        kl = distill_step(sibling, parent, rows, opt, lr_at(step, steps, args.lr, args.warmup))
        record["train_kl"].append(round(kl, 5))
        step += 1
        bar.update()
        bar.set_postfix(kl=f"{kl:.3f}")
        if step % args.save_every == 0 or step == steps:
            record["seconds"] = round(spent + time.time() - t0, 1)
            save_state(state, sibling, opt, step, keep, meta)
    bar.close()

    sibling.eval().requires_grad_(False)
    log(f"measuring the healed sibling on {held.numel()} held-out tokens")
    after = heldout(sibling, parent, held)
    record["ppl"]["after"], record["kl"]["after"] = after["ppl"], after["kl"]
    record.update(weight_change=weight_change(sibling, parent, args.kind, keep), **_how(args, len(stream), steps),
                  seconds=round(spent + time.time() - t0, 1), flags=flags)
    _save(out, sibling, parent.config, args.parent, record)
    state.unlink()
    log(table(out, record))
    return sibling, record


def _built(out, flags, log):
    """The sibling OUT already holds (built with these flags) and its record."""
    record = json.loads((out / "family.json").read_text())
    if record["flags"] != flags:
        raise KvtError(f"{out} holds a sibling built with other flags; choose another --out or delete it")
    log(f"{out} is built already (delete it to rebuild)\n{table(out, record)}")
    return load_model(out), record


def _pruned(args, parent, tok, held, flags, log):
    """A new build's first step: score the parent's blocks or MLP neurons, prune it to the sibling, and
    measure both on the held-out windows. Returns (sibling, optimizer, step 0, what was kept, meta)."""
    cfg, kind = parent.config, args.kind
    full = cfg.n_layers if kind == "depth" else cfg.ffn_dim
    if not 0 < args.keep < full:
        raise KvtError(f"--keep {args.keep}: a {kind} sibling keeps between 1 and {full - 1} "
                       f"{'layers' if kind == 'depth' else 'MLP neurons per layer'}")
    ids = windows(args.score_text, tok, args.score_seqs, args.score_len)           # (n, T)
    log(f"scoring {'blocks' if kind == 'depth' else 'MLP neurons'} of {args.parent} on {ids.numel()} tokens")
    if kind == "depth":
        influence = block_influence(parent, ids)
        keep = keep_layers(influence, args.keep)
        chosen = {"kept_layers": keep.tolist(), "block_influence": [round(b, 5) for b in influence.tolist()]}
    else:
        importance = neuron_importance(parent, ids)                                # (L, ffn)
        keep = keep_neurons(importance, args.keep)
        kept = importance.gather(1, keep).sum(1) / importance.sum(1)                # (L,)
        chosen = {"ffn_dim": args.keep, "parent_ffn_dim": cfg.ffn_dim,
                  "importance_kept": [round(k, 4) for k in kept.tolist()]}
    sibling = prune(parent, kind, keep).train().requires_grad_(True)
    opt = optimizer(sibling, args.lr)
    log(f"measuring parent and unhealed sibling on {held.numel()} held-out tokens")
    before = heldout(sibling, parent, held)
    record = {"kind": kind, **chosen, "n_layers": sibling.config.n_layers, "params": n_params(sibling.config),
              "parent_params": n_params(parent.config), "parent_fingerprint": fingerprint(args.parent),
              "ppl": {"parent": before["parent_ppl"], "before": before["ppl"]}, "kl": {"before": before["kl"]},
              "train_kl": [], "seconds": 0.0}
    meta = {"flags": flags, "config": sibling.config.to_hf(), "record": record}
    return sibling, opt, 0, keep, meta


def _how(args, stream_tokens, steps):
    """The record's account of how the sibling was made: healing, scoring and held-out text, threads, seed."""
    return dict(
        heal={"text": f"{Path(args.heal_data).name}: {stream_tokens} tokens, headers stripped",
              "tokens": steps * args.batch * args.seq_len, "steps": steps, "batch": args.batch,
              "seq_len": args.seq_len, "lr": args.lr, "warmup": args.warmup, "schedule": "cosine to lr/10"},
        score={"text": str(args.score_text), "windows": args.score_seqs, "length": args.score_len},
        heldout={"text": str(args.heldout_text), "windows": args.windows, "length": args.window_len},
        threads=torch.get_num_threads(), seed=args.seed, torch=torch.__version__)


def _save(out, sibling, cfg, parent_dir, record):
    """The sibling as a checkpoint folder: weights, config.json, the parent's tokenizer, and family.json last
    (its presence says the build is done)."""
    save_model(sibling, out)
    hf = json.loads((out / "config.json").read_text())
    hf.update(rope_theta=cfg.rope["rope_theta"], dtype="float32")  # rope_theta: for transformers 4.x
    _write(out / "config.json", json.dumps(hf, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(parent_dir) / name, out / (name + ".tmp"))
        os.replace(out / (name + ".tmp"), out / name)
    _write(out / "family.json", json.dumps(record, indent=2) + "\n")  # written last: the build is done


def table(out, r):
    """The numbers of a family.json, readably."""
    kept = (f"{r['n_layers']} of {len(r['block_influence'])} layers kept: {r['kept_layers']}" if r["kind"] == "depth"
            else f"MLP {r['parent_ffn_dim']} -> {r['ffn_dim']} neurons per layer, keeping "
                 f"{100 * min(r['importance_kept']):.0f}-{100 * max(r['importance_kept']):.0f}% of each layer's mean |act|")
    h = r["heal"]
    lines = [f"{out}: {r['kind']} sibling, {kept}",
             f"  {r['params'] / 1e6:.1f}M parameters (parent {r['parent_params'] / 1e6:.1f}M)",
             f"  healed on {h['tokens']:,} tokens ({h['steps']} steps x {h['batch']} x {h['seq_len']}) in "
             f"{r['seconds']:.0f} s on {r['threads']} thread(s), row-order seed {r['seed']}",
             f"  held out: {r['heldout']['windows']} x {r['heldout']['length']} tokens of {Path(r['heldout']['text']).name}",
             f"  {'':24} {'parent':>8} {'before':>8} {'after':>8}",
             f"  {'perplexity':24} {r['ppl']['parent']:8.2f} {r['ppl']['before']:8.2f} {r['ppl']['after']:8.2f}",
             f"  {'KL to parent (nats/tok)':24} {'':>8} {r['kl']['before']:8.4f} {r['kl']['after']:8.4f}",
             "  weight change |W - W0| / |W0| from the parent's slice, mean (max) over layers:"]
    items = [f"{k} {v['mean']:.4f} ({v['max']:.4f})" for k, v in r["weight_change"].items()]
    lines += ["    " + "  ".join(items[i:i + 4]) for i in range(0, len(items), 4)]
    return "\n".join(lines)


def parser():
    p = argparse.ArgumentParser(prog="kvt family", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["build"])
    p.add_argument("--parent", type=Path, required=True, help="the checkpoint folder to prune")
    p.add_argument("--kind", choices=["depth", "width"], required=True)
    p.add_argument("--out", type=Path, required=True, help="the sibling's checkpoint folder")
    p.add_argument("--keep", type=int, help="layers (depth) or MLP neurons per layer (width); default: half")
    p.add_argument("--tokens", type=int, default=2 ** 19, help="healing budget in tokens (default 524,288)")
    p.add_argument("--batch", type=int, default=2, help="rows per step")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per row")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate of the healing")
    p.add_argument("--warmup", type=int, default=16, help="warmup steps")
    p.add_argument("--seed", type=int, default=0, help="the healing row order")
    p.add_argument("--threads", type=int, default=2, help="torch threads (the result is bit-exact for one count)")
    p.add_argument("--save-every", type=int, default=16, help="steps between resumable checkpoints")
    p.add_argument("--heal-data", type=Path, default=CALIB / "gutenberg")
    p.add_argument("--score-text", type=Path, default=CALIB / "wikitext-2" / "valid.txt")
    p.add_argument("--score-seqs", type=int, default=16, help="scoring windows, evenly spaced over the text")
    p.add_argument("--score-len", type=int, default=512, help="tokens per scoring window")
    p.add_argument("--heldout-text", type=Path, default=CALIB / "wikitext-2" / "test.txt")
    p.add_argument("--windows", type=int, default=16, help="held-out windows, evenly spaced over the text")
    p.add_argument("--window-len", type=int, default=1024, help="tokens per held-out window")
    return p


def parse(argv=None):
    args = parser().parse_args(argv)
    for name, least in (("tokens", 1), ("batch", 1), ("seq-len", 2), ("warmup", 0), ("threads", 1), ("save-every", 1),
                        ("score-seqs", 1), ("score-len", 2), ("windows", 1), ("window-len", 2), ("keep", 1)):
        at_least(name, getattr(args, name.replace("-", "_")), least)
    if args.tokens < args.batch * args.seq_len:
        raise KvtError(f"--tokens {args.tokens}: fewer than one step of --batch {args.batch} x --seq-len {args.seq_len} "
                       "tokens; give more --tokens or shorter rows")
    if not (args.lr > 0 and args.lr < float("inf")):
        raise KvtError(f"--lr {args.lr}: the learning rate must be a positive number")
    if args.keep is None:
        cfg = load_config(args.parent)
        args.keep = (cfg.n_layers if args.kind == "depth" else cfg.ffn_dim) // 2
    return args


def main(argv=None):
    """kvt family build; a build that fails leaves no empty --out behind (one with a checkpoint stays: the
    rerun resumes from it)."""
    args = parse(argv)
    created = not args.out.exists()
    try:
        return build(args)
    except BaseException:
        if created and args.out.is_dir() and not any(args.out.iterdir()):
            args.out.rmdir()
        raise


if __name__ == "__main__":
    command(main, resumes=True)  # as `kvt family`: an error is one line
