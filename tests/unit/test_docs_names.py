"""The docs cite modules and functions by name (`rollout/pipeline.Pipeline.make`, `grpo/run/ahead.py`): each
cited file must exist, and each dotted name after it must be defined there, so a rename cannot leave the docs
pointing at nothing."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `path/to/module.py`, or `path/to/module.Name.attr` (a module path, then names defined in it)
CITED = re.compile(r"`((?:[a-z_0-9]+/)+[a-z_0-9]+)(\.py|(?:\.[A-Za-z_][A-Za-z0-9_]*)+)[`(:\s]")

DATA_SUFFIXES = {"json", "jsonl", "md", "txt", "png", "gguf", "safetensors", "pt"}


def module_file(path: str) -> Path | None:
    for base in (ROOT, ROOT / "grpo"):
        if (base / f"{path}.py").is_file():
            return base / f"{path}.py"
    return None


def defines(tree: ast.AST, names: list[str]) -> bool:
    """Whether `names` (Class.method, function, CONSTANT) is defined at the module's top level and down."""
    scope = tree.body
    for name in names:
        found = None
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found = node
        if found is None:
            return False
        scope = getattr(found, "body", [])
    return True


def citations() -> list[tuple[str, str, list[str]]]:
    found = []
    for doc in DOCS:
        for path, rest in CITED.findall(doc.read_text()):
            names = [] if rest == ".py" else rest.lstrip(".").split(".")
            if names and names[0] in DATA_SUFFIXES:
                continue
            found.append((doc.name, path, names))
    return found


def test_the_docs_cite_files_and_names_that_exist():
    cited = citations()
    assert len(cited) > 100, "the pattern no longer finds the docs' citations"
    missing = []
    for doc, path, names in cited:
        file = module_file(path)
        if file is None:
            missing.append(f"{doc}: {path}.py does not exist")
        elif names and not defines(ast.parse(file.read_text()), names):
            missing.append(f"{doc}: {path}.py defines no {'.'.join(names)}")
    assert not missing, "\n".join(sorted(set(missing)))


def grpo_definitions() -> tuple[dict[str, list[ast.ClassDef]], dict[str, list[ast.Module]]]:
    """Every class of the package by name, and every module by its file's name (`models` -> policy/models.py)."""
    classes: dict[str, list[ast.ClassDef]] = {}
    modules: dict[str, list[ast.Module]] = {}
    for path in (ROOT / "grpo").rglob("*.py"):
        tree = ast.parse(path.read_text())
        modules.setdefault(path.stem, []).append(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(node)
    return classes, modules


# lowercase names the prose uses for objects (`batches.take(step)`), not for the modules of the same name
PROSE_OBJECTS = {"trainer", "batch", "batches", "plan", "source", "config", "generation", "updates", "state", "train"}
SHORT = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)[`(]")


def test_the_docs_cite_methods_and_functions_that_exist():
    """`Class.method` for a class of grpo's, `module.function` for a module of grpo's, as the prose cites them."""
    classes, modules = grpo_definitions()
    missing, checked = [], 0
    for doc in DOCS:
        for owner, name in SHORT.findall(doc.read_text()):
            if name == "py" or name in DATA_SUFFIXES:
                continue
            if owner in classes:
                trees: list = classes[owner]
            elif owner in modules and len(modules[owner]) == 1 and owner not in PROSE_OBJECTS:
                trees = modules[owner]
            else:
                continue
            checked += 1
            if not any(defines(tree, [name]) for tree in trees):
                missing.append(f"{doc.name}: {owner}.{name}")
    assert checked > 5, "the pattern no longer finds the docs' citations"
    assert not missing, "\n".join(sorted(set(missing)))
