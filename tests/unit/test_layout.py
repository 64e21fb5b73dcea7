"""The package's shape, as ARCHITECTURE / the README's module table promise it: no import circles, the math in
algo/ imports nothing else from grpo, the engine never imports tasks/ (or trl), and modules stay small."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "grpo"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Every grpo module -> the grpo modules it imports (at any depth in the file, lazy imports included)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:  # `from . import x` may name a module
                    found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
        graph[name] |= {m for m in found if m.split(".")[0] in ("trl",)}
    return graph


def test_no_import_circles():
    graph = imports()
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in graph.get(node, ()):
            assert state.get(nxt) != 1, "import circle: " + " -> ".join(path + [nxt])
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])


def test_the_math_and_the_engine_keep_their_distance():
    graph = imports()
    for name, deps in graph.items():
        if name.startswith("grpo.algo"):
            assert all(d.startswith("grpo.algo") for d in deps), f"{name} imports {deps}"
        if not name.startswith("grpo.tasks"):
            assert not any(d.startswith(("grpo.tasks", "trl")) for d in deps), f"{name} imports {deps}"


def test_modules_stay_small():
    sizes = {p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert max(sizes.values()) <= 320, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
