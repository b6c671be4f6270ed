"""The records of a run: one JSON line per item and condition, appended to OUT/records-<mapper>-<hash>.jsonl as
each is scored (run_tasks), keyed by what was scored (item_key), so an interrupted run resumes where it stopped
and a changed item is scored again. Under torchrun each rank writes a file of its own beside it.
"""
import dataclasses
import hashlib
import json

from kvt.config import KvtError
from kvt.harness import dist, evals, tasks

RECORDS_FORMAT = "kvt-records-3"                         # 3: keyed by what was scored (item_key)


def record_files(path):
    """The records of one run: `path` and, under torchrun, one file per rank beside it."""
    return [f for f in [path, *sorted(path.parent.glob(f"{path.stem}.rank*.jsonl"))] if f.exists()]


def read_records(path, header):
    """The records of a jsonl file written by open_records, after checking its header line; a torn last
    line (a crash in mid-write) is cut off, so the run redoes that record."""
    with open(path, "rb") as f:
        *lines, torn = f.read().split(b"\n")                      # torn: bytes after the last newline
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise KvtError(f"{path}: line {i + 1} is corrupt; delete the file to evaluate again, or use another --out")
    if torn:
        with open(path, "r+b") as f:
            f.truncate(sum(len(line) + 1 for line in lines))
    if rows and rows[0] != header:
        raise KvtError(f"{path} holds records of other settings or an older kvt ({json.dumps(rows[0])[:120]}); "
                       "delete it or use another --out")
    return rows[1:]


def open_records(path, header):
    """Append mode, with the header as the first line of a new file."""
    new = not path.exists() or path.stat().st_size == 0
    try:
        f = open(path, "a")
    except OSError as e:
        raise KvtError(f"cannot write to {path} ({e.strerror}); make it writable, or choose another --out")
    if new:
        f.write(json.dumps(header) + "\n")
        f.flush()
    return f


def item_key(task, item):
    """What a record scored, as a short hash: the item's fields that reach a model or a score (context,
    choices or continuation, gold, floor, stop strings; a conversation's story, questions and answers) and
    the task's settings that shape one (kind, metrics, longest answer, score function). A record is reused
    only under the same key, so an item whose data changed under the same id is scored again."""
    t = tasks.get(task)
    fields = {k: v for k, v in dataclasses.asdict(item).items() if k != "stratum"}
    score = t.score and f"{t.score.__module__}.{getattr(t.score, '__qualname__', type(t.score).__name__)}"
    what = {"item": fields, "kind": t.kind, "metrics": t.metrics, "score": score, "max_new_tokens": t.max_new_tokens}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def check_old_records(path):
    """Refuse the records of an older kvt beside this run's, keyed by item id alone: they may hold scores of
    items that have changed since, and this run would not know which."""
    for f in path.parent.glob(f"{path.name.rsplit('-', 1)[0]}-*.jsonl"):
        with open(f, "rb") as fh:
            first = fh.readline()
        try:
            fmt = json.loads(first).get("format")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(fmt, str) and fmt.startswith("kvt-records-") and fmt != RECORDS_FORMAT:
            raise KvtError(f"{f} holds records of an older kvt ({fmt}), keyed by item id alone, which cannot tell "
                           "whether an item changed since; delete it to evaluate again, or use another --out")


def run_tasks(items, tok, conds, path, header, batch_size):
    """Evaluate every task's items under conds, appending each record to a jsonl as it lands, so a
    stopped run resumes. Records are keyed by task, condition, item id and item_key (what was scored).
    Under torchrun each rank takes a share of the items still to do and writes its own file. Returns the
    records of exactly these items."""
    check_old_records(path)
    keys = {(task, it.id): item_key(task, it) for task, its in items.items() for it in its}
    done = {(r["task"], r["condition"], r["id"], r.get("key"))
            for f in record_files(path) for r in read_records(f, header)}
    mine = path if dist.world() == 1 else path.with_name(f"{path.stem}.rank{dist.rank()}.jsonl")
    with open_records(mine, header) as f:
        for task, its in items.items():
            todo = [it.id for it in its if any((task, c, it.id, keys[task, it.id]) not in done for c in conds)]
            mine_ids = set(dist.shard(todo))
            skip = {(c, it.id) for it in its for c in conds
                    if it.id not in mine_ids or (task, c, it.id, keys[task, it.id]) in done}
            for rec in evals.evaluate(task, its, tok, conds, done=skip, progress=dist.rank() == 0,
                                      batch_size=batch_size):
                f.write(json.dumps({**rec, "key": keys[task, rec["id"]]}) + "\n")
                f.flush()
    dist.barrier()
    return [r for f in record_files(path) for r in read_records(f, header)
            if keys.get((r["task"], r["id"])) == r.get("key")]
