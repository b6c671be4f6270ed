"""The data flows one way: a kvt module imports only from modules of earlier stages (kvt/__init__.py)."""
import ast
from pathlib import Path

import kvt

KVT = Path(kvt.__file__).parent
ORDER = ["config", "dist", "rope", "tokenizer", "data", "weights", "checkpoint", "cache", "model", "scoring", "toy", "family",
         "capture", "stats", "plan", "ridge", "attnfit", "mlp", "mapper", "fast", "handoff", "figures",
         "answers", "tasks", "summary", "evals", "bench", "cascade", "hf", "pipeline", "cli", "lm_eval", "serving", "course"]


def kvt_imports(file):
    """Names of the kvt modules a file imports."""
    out = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvt"):
            out |= {node.module.split(".")[1]} if "." in node.module else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("kvt.")}
    return out


def test_every_module_has_a_stage():
    modules = {f.stem for f in KVT.glob("*.py")} - {"__init__"}
    assert modules <= set(ORDER), f"place {modules - set(ORDER)} in ORDER (and kvt/__init__.py's docstring)"


def test_no_module_imports_a_later_stage():
    for f in KVT.glob("*.py"):
        if f.stem == "__init__":
            continue
        later = {m for m in kvt_imports(f) if ORDER.index(m) >= ORDER.index(f.stem)}
        assert not later, f"kvt/{f.name} imports {sorted(later)}, which come at or after it in the data flow"


def test_each_file_opens_with_what_it_is():
    for f in KVT.glob("*.py"):
        doc = ast.get_docstring(ast.parse(f.read_text()))
        assert doc and len(doc) > 40, f"kvt/{f.name} needs a docstring saying what it is"


def test_only_the_serving_connector_imports_vllm():
    """vLLM is an optional extra (kvt[vllm]): an `import vllm` anywhere else would make kvt's core need it."""
    for f in KVT.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
        assert "vllm" not in names or f.stem == "serving", f"kvt/{f.name} imports vllm; only kvt/serving.py may"
