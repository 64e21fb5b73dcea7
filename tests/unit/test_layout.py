"""The package's shape, as docs/architecture.md describes it: subpackages depend in one direction, no import
circles, the math in algo/ imports nothing else from grpo, the engine never imports tasks/ (or trl), and lines
keep the configured length."""
import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "grpo"


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


# Each package may import only from packages of a lower rank (and itself), lazy imports included.
# The memory planner sits beside rollout/: it reads the settings and the policy's facts, and run/startup asks it
# for the decode sizes before anything loads; the runtime never calls it. grpo.generate is built on grpo.eval.
RANKS = {"grpo.errors": 0, "grpo.algo": 0, "grpo.settings": 1, "grpo.infra": 2, "grpo.policy": 3, "grpo.rollout": 4,
         "grpo.memory": 4, "grpo.run": 5, "grpo.trl_call": 6, "grpo.trainer": 7, "grpo.train": 8, "grpo.eval": 8,
         "grpo.export": 8, "grpo.plan": 8, "grpo.plot": 8, "grpo": 8, "grpo.tasks": 9,
         "grpo.generate": 9}


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_subpackages_depend_in_one_direction():
    graph = imports()
    assert {package_of(m) for m in graph} == set(RANKS), "a new package needs its place in RANKS"
    upward = [f"{m} -> {d}" for m, deps in graph.items() for d in deps if d.startswith("grpo")
              and package_of(d) != package_of(m) and RANKS[package_of(d)] >= RANKS[package_of(m)]]
    assert not upward, upward


def test_lines_stay_within_the_configured_length():
    """pyproject's ruff line-length holds for every Python file, so CI (which runs pytest, not ruff) keeps it."""
    limit = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["line-length"]
    long = [f"{path.relative_to(ROOT)}:{number} ({len(line)} characters)"
            for folder in ("grpo", "tests", "benchmarks", "recipes") for path in sorted((ROOT / folder).rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > limit]
    assert not long, f"lines longer than {limit}: " + ", ".join(long)


# Sizes that keep a module readable in one sitting: a module holding two jobs is split before it grows past
# MODULE_LINES, a function before FUNCTION_LINES; the trainer only orchestrates.
MODULE_LINES, FUNCTION_LINES, TRAINER_LINES = 350, 80, 200


def test_modules_and_functions_stay_small():
    large = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted(PACKAGE.rglob("*.py"))
             if (n := len(p.read_text().splitlines())) > MODULE_LINES]
    long = [f"{p.relative_to(ROOT)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
            for p in sorted(PACKAGE.rglob("*.py")) for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > FUNCTION_LINES]
    trainer = len((PACKAGE / "trainer.py").read_text().splitlines())
    assert not large and not long and trainer <= TRAINER_LINES, (large, long, trainer)


def test_the_trainer_neither_generates_nor_plans():
    """The trainer loops over batches it does not make (rollout/pipeline, run/ahead) and never calls the memory
    planner (run/startup does, before loading)."""
    deps = imports()["grpo.trainer"]
    assert not any(d.startswith("grpo.memory") for d in deps), deps
    source = (PACKAGE / "trainer.py").read_text()
    assert "sample_completions" not in source and "group_advantages" not in source
