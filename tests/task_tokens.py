"""Tokens the headline run reads and writes per evaluated item, per task: the numbers behind the
evaluation row of `kvt plan` (kvt/harness/costs.py, EVAL_TOKENS).

    python -m tests.task_tokens --data-dir ../shared/data --tokenizer ../shared/tokenizers/qwen3

For each task, over a seeded sample of up to --limit items: the mean context tokens (multiple choice:
the context once plus every choice; generation: the prompt; CoQA: the story and every turn), and the
most tokens an item may generate (the task's max_new_tokens; CoQA: per answered turn).
"""
import argparse
import statistics

from kvt.harness import tasks
from kvt.tokenizer import load_tokenizer


def item_tokens(task, item, tok):
    """(context tokens read, most tokens generated) of one item."""
    t = tasks.get(task)
    if t.kind == "coqa":
        pieces = tasks.coqa_segments(item)
        return sum(len(tok.encode(p)) for p in pieces), t.max_new_tokens * (len(pieces) - 1)
    if t.kind == "generate_until":
        return len(tok.encode(item.context)), t.max_new_tokens
    return len(tok.encode(item.context)) + sum(len(tok.encode(" " + c)) for c in item.choices or []), 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--tokenizer", default="../shared/tokenizers/qwen3")
    ap.add_argument("--tasks", default="hellaswag,arc_easy,arc_challenge,mmlu,gsm8k,coqa")
    ap.add_argument("--limit", type=int, default=100)
    args = ap.parse_args(argv)
    tok = load_tokenizer(args.tokenizer)
    for task in args.tasks.split(","):
        rows = [item_tokens(task, it, tok) for it in tasks.load_task(task, args.data_dir, args.limit, seed=0)]
        read, gen = statistics.mean(r[0] for r in rows), statistics.mean(r[1] for r in rows)
        print(f"    \"{task}\": ({read:.0f}, {gen:.0f}),")


if __name__ == "__main__":
    main()
