"""Every function, class and file tutorial.md names in its prose exists where the tutorial says: a reader who
opens `fast.strip_cos_sin` or `kvt/fast.py` finds it there. (The tutorial's code blocks are run by
tests/test_tutorial.py; this checks the names around them, which nothing runs.)"""
import ast
import dataclasses
import importlib
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KVT = ROOT / "kvt"
MODULES = {f.stem: ".".join(f.relative_to(ROOT).with_suffix("").parts)   # stem -> module: "bench" -> "kvt.harness.bench"
           for f in KVT.rglob("*.py") if f.stem != "__init__"}


def classes():
    """Class name -> module, for every class a kvt file defines at its top level."""
    out = {}
    for m in MODULES:
        for node in ast.parse((ROOT / (MODULES[m].replace(".", "/") + ".py")).read_text()).body:
            if isinstance(node, ast.ClassDef):
                out[node.name] = MODULES[m]
    return out


def has(obj, name):
    """obj.name exists, as an attribute or as a dataclass field (`cache.keys`: a Cache's keys)."""
    return hasattr(obj, name) or (dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)})


def resolves(dotted, where):
    """The object `dotted` names exists: `module.name[.attr]`, `Class.attr`, or `kvt.name` (where: class -> module)."""
    head, *rest = dotted.split(".")
    if head == "kvt":
        obj = importlib.import_module("kvt")
        while rest and not hasattr(obj, rest[0]) and importlib.util.find_spec(f"{obj.__name__}.{rest[0]}"):
            obj = importlib.import_module(f"{obj.__name__}.{rest[0]}")   # kvt.harness.bench: a folder, then a file
            rest = rest[1:]
    elif head in MODULES:
        obj = importlib.import_module(MODULES[head])
    elif head in where:
        obj = getattr(importlib.import_module(where[head]), head)
    else:
        return None                                          # not a kvt name (torch.cat, a variable of a block)
    for name in rest:
        if not has(obj, name):
            return False
        obj = getattr(obj, name, None)
        if obj is None:                                      # a dataclass field: nothing deeper to check
            return True
    return True


def test_every_name_the_tutorial_gives_exists_where_it_says():
    """Guards: a function renamed or moved (bench.prefill_flops into plan.py, rope.rotate_into dropped) while
    the tutorial still sends readers to the old place."""
    text = (ROOT / "tutorial.md").read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)      # the blocks run in test_tutorial
    where, missing, checked = classes(), [], 0
    for dotted in re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`", prose):
        if dotted.endswith(".py"):
            ok = (KVT / dotted).exists() or (ROOT / dotted).exists()
        else:
            ok = resolves(dotted, where)
            if ok is None:
                continue
        checked += 1
        missing += [] if ok else [dotted]
    for path in re.findall(r"`((?:kvt|tests|docs)/[\w/]+\.(?:py|md))`", prose):
        checked += 1
        missing += [] if (ROOT / path).exists() else [path]
    for path, name in re.findall(r"`kvt/(\w+)\.py`'s `(\w+)`", prose):
        checked += 1
        missing += [] if hasattr(importlib.import_module(f"kvt.{path}"), name) else [f"kvt/{path}.py's {name}"]
    assert checked > 60, f"only {checked} names found: has the tutorial's way of citing code changed?"
    assert not missing, f"tutorial.md names what is not there: {sorted(set(missing))}"
