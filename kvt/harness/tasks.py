"""Tasks: what kvt evaluates, one registry entry each (its data, its items, its kind and metrics).

    items = load_task("arc_easy", data_dir, limit=200)   # a seeded, stratified sample of Items
    register(Task("my_mc", load=my_loader))              # a user's own task (or run.py --task-file)

A Task names a loader, which turns the rows of its data files (`sources`, each the Hugging Face data
set it mirrors) into items; a kind, which says how a condition's model answers an item (the output
types of lm-evaluation-harness); the metrics its records carry; and the primary one, which
average_retention reads. Kinds:
  multiple_choice        one context, several continuations (Item.choices); the highest summed
                         loglikelihood wins: acc, and acc_norm (divided by the choice's length)
  multiple_input         several contexts (Item.choices) sharing one continuation (Item.continuation),
                         as WinoGrande: each option scores the continuation after its own context: acc
  generate_until         greedy text after the context, cut at a stop string (Item.until), scored by the
                         task's `score` (output, gold) -> {metric: value}; default: exact match, stripped
  loglikelihood_rolling  a text (Item.continuation) scored after a prefix (Item.context), as WikiText:
                         word_perplexity, byte_perplexity, bits_per_byte over the scored text
  coqa                   a conversation (Conversation) answered turn by turn: SQuAD F1 and EM
Each item also has a floor: the minimal prefix the `floor` condition reads instead of its context.

Built-in prompts follow lm-evaluation-harness v0.4 task yamls:
  hellaswag      validation; utils.preprocess ("[title]", brackets, double spaces); acc, acc_norm
  arc_easy,      test; "Question: {question}\\nAnswer:" + " {choice}"; acc, acc_norm
  arc_challenge
  mmlu           test; "The following are multiple choice questions (with answers) about {subject}.\\n\\n",
                 5 shots from dev (first_n, same subject) by default; " A".." D"; acc, acc_norm
  gsm8k          gsm8k-cot.yaml (version 3.0): the 8 standard chain-of-thought exemplars, "Q: ...\\nA:",
                 greedy until "Q:"; exact match after the strict and flexible filters (answers.py)
  coqa           coqa/utils.py prompt (story, then "Q: ...\\n\\nA: ...\\n\\n" with gold history), first
                 line of the greedy answer, SQuAD token F1 with the harness's leave-one-out over answers
  winogrande     winogrande_xl validation; the sentence up to its blank with each option as the two
                 contexts, the rest of the sentence as the shared continuation; acc
  toy_*          the toy family's generated tasks (kvt/harness/toy.py), no data files
load_task() gives a task's items in one fixed seeded order, stratified (MMLU by subject, HellaSwag and
CoQA by source), so the first N are a representative sample and a smaller N is a prefix of a larger one.
"""
import importlib.util
import json
import os
import random
import re
import sys
import traceback
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from kvt.harness import answers, toy
from kvt.config import KvtError


# ---------------------------------------------------------------------------------------- records

@dataclass(frozen=True)
class Source:
    """One data file of a task: its place under the data folder, the Hugging Face data set it mirrors
    (load_dataset(path, name, split=split), as an lm-eval yaml's dataset_path / dataset_name / split),
    and the fields every row needs."""
    file: str             # e.g. "arc_easy/test.jsonl"
    path: str             # e.g. "allenai/ai2_arc"
    split: str            # e.g. "test"
    name: str = None      # e.g. "ARC-Easy"
    fields: tuple = ()

    def load_dataset(self):
        """The `datasets` call whose rows this file holds, as text."""
        name = f', "{self.name}"' if self.name else ""
        return f'load_dataset("{self.path}"{name}, split="{self.split}")'

    def read(self, data_dir):
        """The rows of data_dir/file (jsonl), each checked for the fields."""
        path = Path(data_dir) / self.file
        if path.is_dir():
            raise KvtError(f"{path} is a folder; the task reads a jsonl file there, written with "
                           f"`datasets.{self.load_dataset()}.to_json('{path}')`")
        if not path.exists():
            raise KvtError(f"missing {path}: write it with `datasets.{self.load_dataset()}.to_json('{path}')`, "
                           f"or point --data-dir (or KVT_DATA) at a folder that has it, e.g. ../shared/data")
        rows = []
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise KvtError(f"{path}: byte {e.start} is not UTF-8 ({e.object[e.start:e.start + 1]!r}); write the file "
                           "again as UTF-8")
        for i, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise KvtError(f"{path}, line {i}: not valid JSON ({e.msg}); fix the line or write the file again")
            lacks = [k for k in self.fields if not isinstance(row, dict) or k not in row]
            if lacks:
                raise KvtError(f"{path}, line {i}: no field {', '.join(map(repr, lacks))}; write the file again "
                               f"with `datasets.{self.load_dataset()}.to_json(...)`")
            null = [k for k in self.fields if row[k] is None]
            if null:
                raise KvtError(f"{path}, line {i}: field {null[0]!r} is null; write the file again with "
                               f"`datasets.{self.load_dataset()}.to_json(...)`, or drop the line")
            rows.append(row)
        return rows


def default_data_dir():
    """$KVT_DATA, else data/ (tests and CI point it at ../shared/data)."""
    return os.environ.get("KVT_DATA", "data")


@dataclass
class Item:
    """One prompt, read by its kind (see the module docstring for which fields each kind uses)."""
    id: str                # unique within its task: records are keyed by (task, condition, id) and what
                           # was scored (records.item_key), so a changed item is scored again
    context: str           # everything before the answer, few-shot examples included (rolling: the prefix)
    gold: object = None    # choices: the right index; generation: the answer text
    choices: list = None   # multiple_choice: continuations without the leading space (the harness's
                           # doc_to_choice); multiple_input: the contexts
    floor: object = ""     # what the floor condition reads instead of the context (multiple_input: a
                           # list, one per context, or one string for all)
    until: tuple = ()      # generate_until: stop strings
    stratum: str = ""      # the group a sample keeps in proportion (MMLU subject, HellaSwag source)
    continuation: str = ""  # multiple_input: the shared continuation; rolling: the text scored


@dataclass
class Conversation:
    """One CoQA story and its turns; answers[t] lists the distinct gold answers of turn t."""
    id: str
    story: str
    questions: list
    answers: list = field(default_factory=list)
    stratum: str = ""      # the story's source: mctest, race, cnn, wikipedia, gutenberg


KINDS = {  # kind -> the metrics its records carry (what a task reports unless it names fewer)
    "multiple_choice": ("acc", "acc_norm"),
    "multiple_input": ("acc",),
    "generate_until": ("em",),  # the default score's; a task's own score names its own
    "loglikelihood_rolling": ("word_perplexity", "byte_perplexity", "bits_per_byte"),
    "coqa": ("f1", "em"),
}


@dataclass(frozen=True)
class Task:
    """One task. load(*rows, **options) gets the rows of each of `sources`, in order (nothing for a task
    that generates its items), and returns every item, in file order, with ids unique in the task."""
    name: str                  # as --tasks names it: no commas or spaces
    load: object               # (*rows, **options) -> [Item] ([Conversation] for kind coqa)
    kind: str = "multiple_choice"
    metrics: tuple = ()        # what summarize reports; () -> KINDS[kind]
    primary: str = ""          # the metric average_retention reads; "" -> metrics[0]
    sources: tuple = ()        # a Source per data file
    score: object = None       # generate_until: (output, gold) -> {metric: value}; None: stripped_match
    max_new_tokens: int = 32   # generate_until and coqa: the longest answer

    def __post_init__(self):
        def refuse(why):
            raise KvtError(f"task {self.name!r}: {why}")
        if not isinstance(self.name, str) or not self.name or re.search(r"[\s,]", self.name):
            refuse("a task name is a non-empty string without commas or spaces (run.py --tasks a,b)")
        if self.kind not in KINDS:
            refuse(f"unknown kind {self.kind!r}; kinds: {', '.join(KINDS)}")
        if not callable(self.load) or (self.score is not None and not callable(self.score)):
            refuse("load (and score, if given) must be functions")
        if not all(isinstance(m, str) for m in self.metrics) or not all(isinstance(s, Source) for s in self.sources):
            refuse("metrics are names (str), sources kvt.harness.tasks.Source records")
        set_ = partial(object.__setattr__, self)  # a frozen record: defaults are filled in once, here
        set_("metrics", tuple(self.metrics) or KINDS[self.kind])
        set_("primary", self.primary or self.metrics[0])
        if self.kind == "generate_until" and self.score is None:
            set_("score", answers.stripped_match)
        if self.kind != "generate_until" and not set(self.metrics) <= set(KINDS[self.kind]):
            refuse(f"a {self.kind} task reports some of {KINDS[self.kind]}, not {self.metrics}")
        if self.primary not in self.metrics:
            refuse(f"its primary metric {self.primary!r} is not one of its metrics {self.metrics}")

    def items(self, data_dir, **options):
        """Every item, in file order: the loader on the rows of each source under data_dir."""
        rows = [s.read(data_dir) for s in self.sources]
        try:
            items = self.load(*rows, **options)
        except KvtError:
            raise
        except Exception as e:  # a field of the wrong form, or the loader's own bug
            why = f"{type(e).__name__}: {' '.join(str(e).split())}"
            if not self.sources:
                raise KvtError(f"{self.name}: its loader raised {why}; fix the loader (it reads no data files)") from e
            files = ", ".join(f"{s.file} (datasets.{s.load_dataset()})" for s in self.sources)
            raise KvtError(f"{self.name}: its loader failed ({why}) on {files} in {data_dir}; "
                           "write the files again from those data sets") from e
        if not isinstance(items, (list, tuple)):
            raise KvtError(f"{self.name}: its loader returned {type(items).__name__}; it returns a list of "
                           f"{'Conversation' if self.kind == 'coqa' else 'Item'}s")
        if not items:
            where = f"its data files in {data_dir} hold no rows" if self.sources else "its loader returned []"
            raise KvtError(f"{self.name}: no items ({where}); give it at least one")
        return list(items)


# ---------------------------------------------------------------------------------------- loaders

def hellaswag_preprocess(text):
    """The harness's hellaswag/utils.py cleanup; brackets are artifacts of the WikiHow part."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag(rows):
    """Every item in file order: ActivityNet rows first, then WikiHow. `ind` repeats across the two
    sources (9,609 distinct of 10,042), so the id is "activitynet/24", "wikihow/1"."""
    items = []
    for row in rows:
        source = row["source_id"].split("~")[0]  # "activitynet~v_0bosp4-pyTM" -> "activitynet"
        ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
        items.append(Item(f"{source}/{row['ind']}", hellaswag_preprocess(row["activity_label"] + ": " + ctx),
                          int(row["label"]), [hellaswag_preprocess(e) for e in row["endings"]], stratum=source))
    return items


def arc(rows):
    items = []
    for row in rows:
        labels = row["choices"]["label"]
        items.append(Item(row["id"], f"Question: {row['question']}\nAnswer:", labels.index(row["answerKey"]),
                          list(row["choices"]["text"]), floor="Answer:"))
    return items


def _mmlu_question(row):
    letters = "".join(f"\n{l}. {c}" for l, c in zip("ABCD", row["choices"]))
    return f"{row['question'].strip()}{letters}\nAnswer:"


def mmlu(test, dev, shots=5):
    """Every test item in file order (sorted by subject); the shots are the subject's first dev items."""
    pool = {}
    for row in dev:
        pool.setdefault(row["subject"], []).append(row)
    items = []
    for i, row in enumerate(test):
        subject = row["subject"]
        header = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
        examples = "".join(_mmlu_question(d) + " " + "ABCD"[d["answer"]] + "\n\n" for d in pool[subject][:shots])
        items.append(Item(f"{subject}/{i}", header + examples + _mmlu_question(row), row["answer"],
                          ["A", "B", "C", "D"], floor="Answer:", stratum=subject))
    return items


GSM8K_SHOTS = [  # gsm8k-cot.yaml fewshot_config.samples, in order
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are "
     "done, there will be 21 trees. How many trees did the grove workers plant today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must "
     "have been 21 - 15 = 6. The answer is 6."),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5."),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating "
     "35, they had 74 - 35 = 39. The answer is 39."),
    ("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops "
     "did Jason give to Denny?",
     "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8. "
     "The answer is 8."),
    ("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he "
     "have now?",
     "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. "
     "5 + 4 = 9. The answer is 9."),
    ("There were nine computers in the server room. Five more computers were installed each day, from monday "
     "to thursday. How many computers are now in the server room?",
     "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 "
     "computers were added. 9 + 20 is 29. The answer is 29."),
    ("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many "
     "golf balls did he have at the end of wednesday?",
     "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 "
     "more, he had 35 - 2 = 33 golf balls. The answer is 33."),
    ("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
     "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 "
     "dollars left. 23 - 15 is 8. The answer is 8."),
]
GSM8K_UNTIL = ("Q:", "</s>", "<|im_end|>")


def gsm8k(rows, shots=8):
    examples = "".join(f"Q: {q}\nA: {a}\n\n" for q, a in GSM8K_SHOTS[:shots])
    return [Item(str(i), examples + f"Q: {row['question']}\nA:", row["answer"].split("####")[-1].strip(),
                 floor="A:", until=GSM8K_UNTIL)
            for i, row in enumerate(rows)]


def coqa(rows, turns=10):
    """Conversations cut to their first `turns` turns (HF stanfordnlp/coqa or EleutherAI/coqa fields)."""
    convs = []
    for row in rows:
        text = lambda x: x["input_text"] if isinstance(x, dict) else x  # noqa: E731 (HF nests input_text)
        questions, first = text(row["questions"])[:turns], text(row["answers"])[:turns]
        extra = [text(a) for a in (row.get("additional_answers") or {}).values()]
        golds = []
        for t, a in enumerate(first):  # the harness's doc_to_target: distinct answers, case-insensitive
            golds.append([a])
            for other in extra:
                if t < len(other) and other[t].lower() not in map(str.lower, golds[t]):
                    golds[t].append(other[t])
        convs.append(Conversation(row["id"], row["story"], questions, golds, stratum=row.get("source", "")))
    return convs


def coqa_segments(conv):
    """Prompt pieces: piece 0 is the story and question 1, piece t appends gold answer t and question t+1,
    so pieces 0..t-1 make the harness prompt of turn t (1-based) and the cache grows by one piece a turn."""
    pieces = [f"{conv.story}\n\nQ: {conv.questions[0]}\n\nA:"]
    for t in range(1, len(conv.questions)):
        pieces.append(f" {conv.answers[t - 1][0]}\n\nQ: {conv.questions[t]}\n\nA:")
    return pieces


def winogrande(rows):
    """winogrande/preprocess_winogrande.py: the contexts are the sentence up to its blank "_" with each
    option in it, the continuation the rest of the sentence; answer "1" or "2". The floor of each
    context is its option alone: what the target prefers without the sentence the option completes."""
    items = []
    for i, row in enumerate(rows):
        blank, options = row["sentence"].index("_"), [row["option1"], row["option2"]]
        items.append(Item(str(i), "", {"1": 0, "2": 1}[row["answer"]], [row["sentence"][:blank] + o for o in options],
                          floor=options, continuation=row["sentence"][blank + 1:].strip()))
    return items


def toy_task(name, n=1000):
    """A task of the toy family (kvt/harness/toy.py): a fixed pool of n items generated from a fixed seed, no data
    files. The floor reads only the context's last clause (toy.question: the question without the facts)."""
    items = []
    for i, r in enumerate(toy.toy_tasks(name, n)):
        context = r.get("context", r.get("prompt"))
        if "choices" in r:
            items.append(Item(f"{name}/{i}", context, r["label"], [c.removeprefix(" ") for c in r["choices"]],
                              toy.question(context)))
        else:
            items.append(Item(f"{name}/{i}", context, r["answer"], floor=toy.question(context),
                              until=tuple(r["until"])))
    return items


# ---------------------------------------------------------------------------------------- registry

def _arc(subset):
    name = {"arc_easy": "ARC-Easy", "arc_challenge": "ARC-Challenge"}[subset]
    return Source(f"{subset}/test.jsonl", "allenai/ai2_arc", "test", name, ("id", "question", "choices", "answerKey"))


MMLU_FIELDS = ("subject", "question", "choices", "answer")
TASKS = {t.name: t for t in [  # name -> Task: the built-in tasks, then those a user registers
    Task("hellaswag", hellaswag, primary="acc_norm", sources=(Source(
        "hellaswag/validation.jsonl", "Rowan/hellaswag", "validation",
        fields=("ind", "activity_label", "ctx_a", "ctx_b", "endings", "label", "source_id")),)),
    Task("arc_easy", arc, primary="acc_norm", sources=(_arc("arc_easy"),)),
    Task("arc_challenge", arc, primary="acc_norm", sources=(_arc("arc_challenge"),)),
    Task("mmlu", mmlu, primary="acc", sources=(Source("mmlu/test.jsonl", "cais/mmlu", "test", "all", MMLU_FIELDS),
                                               Source("mmlu/dev.jsonl", "cais/mmlu", "dev", "all", MMLU_FIELDS))),
    Task("gsm8k", gsm8k, "generate_until", ("em_strict", "em_flexible"), score=answers.gsm8k_score, max_new_tokens=256,
         sources=(Source("gsm8k/test.jsonl", "openai/gsm8k", "test", "main", ("question", "answer")),)),
    Task("coqa", coqa, "coqa", max_new_tokens=64,
         sources=(Source("coqa/validation.jsonl", "EleutherAI/coqa", "validation",
                         fields=("id", "story", "questions", "answers")),)),
    Task("winogrande", winogrande, "multiple_input", sources=(Source(
        "winogrande/validation.jsonl", "allenai/winogrande", "validation", "winogrande_xl",
        ("sentence", "option1", "option2", "answer")),)),
    *[Task(f"toy_{t}", partial(toy_task, t), "multiple_choice", primary="acc") if t in ("recall", "count")
      else Task(f"toy_{t}", partial(toy_task, t), "generate_until") for t in toy.TASKS],
]}
BUILTIN = frozenset(TASKS)


_loading = None  # while load_task_file imports a file: {name: Task} of the tasks it gave, to refuse a name twice


def register(task):
    """Add a Task to the registry under its name, or replace a task registered before under that name (a
    task file imported again); a built-in task's name is refused, and so is one name given to two tasks of
    one task file. Returns the task."""
    if not isinstance(task, Task):
        raise KvtError(f"register() takes a kvt.harness.tasks.Task, not {type(task).__name__}")
    if task.name in BUILTIN and TASKS[task.name] is not task:
        raise KvtError(f"task {task.name!r} is built in; give your task another name")
    if _loading is not None:
        if _loading.setdefault(task.name, task) is not task:
            raise KvtError(f"two tasks are named {task.name!r} in one task file; give each its own name")
    TASKS[task.name] = task
    return task


def get(name):
    """The registered Task of that name."""
    if name not in TASKS:
        raise KvtError(f"unknown task {name!r}; known: {', '.join(TASKS)} (run.py --task-file adds your own)")
    return TASKS[name]


def load_task_file(path):
    """Import a Python file of the user's tasks: it calls register(Task(...)), or defines Task objects at
    its top level, which are registered here. Returns the names of the tasks it registered or defined."""
    path = Path(path)
    if not path.is_file():
        raise KvtError(f"--task-file {path}: no such file; give a Python file that defines kvt.harness.tasks.Task objects")
    before = dict(TASKS)
    name = f"kvt_task_file_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import does: dataclasses and pickling look the module up there
    global _loading
    _loading = {}
    try:
        spec.loader.exec_module(module)  # the user's code: its errors become one line naming the line
        defined = [t for t in vars(module).values() if isinstance(t, Task)]
        for task in defined:
            if TASKS.get(task.name) is not task or _loading.get(task.name, task) is not task:
                register(task)
    except KvtError:
        raise
    except SystemExit as e:
        raise KvtError(f"--task-file {path} called sys.exit({e.code!r}) while imported; a task file defines "
                       "tasks and returns") from None
    except SyntaxError as e:
        raise KvtError(f"--task-file {path}, line {e.lineno}: {e.msg}; fix the file") from None
    except Exception as e:
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path]
        raise KvtError(f"--task-file {path}{f', line {lines[-1]}' if lines else ''}: {type(e).__name__}: "
                       f"{' '.join(str(e).split())}; "
                       "fix the file (or install what it imports)") from None
    finally:
        _loading = None
    names = [n for n, t in TASKS.items() if before.get(n) is not t] + [t.name for t in defined if t.name not in BUILTIN]
    if not names:
        raise KvtError(f"--task-file {path} defines no task: call kvt.harness.tasks.register(Task(...)) or define Task objects")
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------------------------------- samples

def sample_order(strata, seed=0):
    """A fixed order of items whose every prefix is a stratified sample: indices into `strata` (one label
    per item). Items are shuffled within each stratum; the order starts with one item of each stratum (in
    a seeded order, so a prefix of >= #strata items has them all), then at each step takes the next item
    of the stratum furthest below its quota p_s * n (n items after this step, p_s its share of all items;
    ties go to the earlier stratum of that first round). One stratum: a plain seeded shuffle."""
    rng = random.Random(seed)
    groups = {}  # stratum -> its item indices, shuffled
    for i, s in enumerate(strata):
        groups.setdefault(s, []).append(i)
    for s in sorted(groups):
        rng.shuffle(groups[s])
    names = sorted(groups)
    rng.shuffle(names)
    N, taken = len(strata), dict.fromkeys(names, 1)
    order = [groups[s][0] for s in names]
    while len(order) < N:
        n = len(order) + 1
        # deficit p_s * n - taken_s, times N to stay in integers
        s = max((s for s in names if taken[s] < len(groups[s])), key=lambda s: len(groups[s]) * n - taken[s] * N)
        order.append(groups[s][taken[s]])
        taken[s] += 1
    return order


def check_item(task, item):
    """Refuse, before any model runs, an item its kind cannot score (say a text passed as `gold` where
    a rolling task reads `continuation`: Item's later fields are best given by name)."""
    def refuse(why):
        raise KvtError(f"{task.name} item {getattr(item, 'id', item)!r}: {why}")
    if not isinstance(item, Conversation if task.kind == "coqa" else Item):
        refuse(f"a {task.kind} task's loader returns {'Conversation' if task.kind == 'coqa' else 'Item'}s")
    if task.kind != "coqa" and not isinstance(item.context, str):
        refuse(f"its context is {item.context!r}; a context is text (\"\" for none)")
    if task.kind in ("multiple_choice", "multiple_input"):
        if not item.choices or not isinstance(item.gold, int) or not 0 <= item.gold < len(item.choices):
            refuse("needs choices and gold, the index of the right one")
        bad = [i for i, c in enumerate(item.choices) if not isinstance(c, str) or not c.strip()]
        if bad:
            refuse(f"choice {bad[0]} is {item.choices[bad[0]]!r}; every choice is a non-empty string (write the "
                   "data again, or fix the task's loader)")
        if isinstance(item.floor, list) and len(item.floor) != len(item.choices):
            refuse(f"{len(item.floor)} floors for {len(item.choices)} choices")
    if task.kind in ("multiple_input", "loglikelihood_rolling") and not item.continuation:
        refuse(f"a {task.kind} item needs its continuation (Item(..., continuation=...))")


def load_task(name, data_dir, limit=None, seed=0, **options):
    """The first `limit` items of a task in its fixed seeded order (sample_order over the items' strata),
    so a smaller limit is a prefix of a larger one and a resumed run sees the same items.
    options go to its loader (mmlu: shots=0 for zero-shot; coqa: turns; toy tasks: n, the pool size)."""
    task = get(name)
    if limit is not None and limit < 1:
        raise KvtError(f"--limit {limit}: evaluate at least 1 item per task")
    items = task.items(data_dir, **options)
    if len({item.id for item in items}) != len(items):
        raise KvtError(f"{task.name}: item ids repeat in its data in {data_dir}; write the file again")
    for item in items:
        check_item(task, item)
    return [items[i] for i in sample_order([item.stratum for item in items], seed)[:limit]]
