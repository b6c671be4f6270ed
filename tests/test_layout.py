"""The layout shows the architecture: the method in kvt/, and around it the run harness (kvt/harness/),
the integrations (kvt/integrations/) and the teaching kit (kvt/teach/). The data flows one way: a module
imports only from modules of earlier stages of its own layer, or from earlier layers; the method imports
nothing from the layers around it."""
import ast
from pathlib import Path

import kvt

KVT = Path(kvt.__file__).parent
# Each layer in the order data flows; a module may import from earlier layers and from earlier modules of its own.
LAYERS = {
    "": ["config", "rope", "tokenizer", "weights", "cache", "model", "loading", "capture", "stats", "ridge", "mlp",
         "mapper", "fast", "calibrate", "handoff"],
    "harness": ["data", "dist", "files", "plan", "whiten", "attnfit", "calibration", "scoring", "toy", "diagnose",
                "answers", "tasks", "summary", "recompute", "evals", "figures", "bench", "settings", "records", "report",
                "pipeline", "repairs"],
    "integrations": ["hf", "lm_eval", "serving", "router"],
    "teach": ["family", "cascade", "course"],
    "cli": ["cli"],                          # kvt/cli.py, the installed `kvt` command: it reaches every layer
}
RANK = {(layer or "") + "." + m if layer not in ("", "cli") else m: (i, j)
        for i, (layer, mods) in enumerate(LAYERS.items()) for j, m in enumerate(mods)}


def name(f):
    """kvt/harness/plan.py -> "harness.plan"; kvt/rope.py -> "rope"."""
    rel = f.relative_to(KVT).with_suffix("")
    return ".".join(rel.parts)


def kvt_imports(f):
    """The kvt modules a file imports, as name() writes them."""
    out = set()
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvt":
            mod = node.module[4:]
            for a in node.names:
                full = f"{mod}.{a.name}" if mod else a.name
                out.add(full if full in RANK else mod)
        elif isinstance(node, ast.Import):
            out |= {a.name[4:] for a in node.names if a.name.startswith("kvt.")}
    return {m for m in out if m and m not in LAYERS}   # `from kvt import harness` names a folder, not a module


def modules():
    return [f for f in KVT.rglob("*.py") if f.stem != "__init__"]


def test_every_module_has_a_stage():
    """A new file lands in a layer and a stage: else nothing checks where it may import from."""
    missing = {name(f) for f in modules()} - set(RANK)
    assert not missing, f"place {sorted(missing)} in tests/test_layout.py's LAYERS"


def test_no_module_imports_a_later_stage():
    """A method file that imports the harness (a plan, a checkpoint, all_reduce) is no longer a one-hour read."""
    for f in modules():
        later = {m for m in kvt_imports(f) if m not in RANK or RANK[m] >= RANK[name(f)]}
        assert not later, f"kvt/{name(f)} imports {sorted(later)}, which come at or after it in the data flow"


def test_each_file_opens_with_what_it_is():
    for f in KVT.rglob("*.py"):
        doc = ast.get_docstring(ast.parse(f.read_text()))
        assert doc and len(doc) > 40, f"{f.relative_to(KVT.parent)} needs a docstring saying what it is"


def test_only_the_serving_connector_imports_vllm():
    """vLLM is an optional extra (kvt[vllm]): an `import vllm` anywhere else would make kvt's core need it."""
    for f in modules():
        names = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
        assert "vllm" not in names or name(f) == "integrations.serving", f"kvt/{name(f)} imports vllm"
