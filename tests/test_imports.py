"""The import rules of docs/ARCHITECTURE.md ("What may import what"), read from the package's
source: each layer imports only the layers below it, type hints included, and no module reaches
itself again through the imports that run."""
from __future__ import annotations

import ast
from pathlib import Path

import liteinfer

PACKAGE = Path(liteinfer.__file__).parent
FRONT_END = {"processor", "output_processor", "detokenizer", "async_llm", "llm_engine"}
# What the front end may import of the core: what starts it (ARCHITECTURE.md).
STARTS_THE_CORE = {"engine.core", "engine.core_process"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> str:
    """The module's unit in the diagram: a package under liteinfer/, or one engine module."""
    parts = module.split(".")[1:]
    if not parts:
        return "liteinfer"
    return f"engine.{parts[1]}" if parts[0] == "engine" and len(parts) > 1 else parts[0]


def layer(u: str) -> int:
    """The diagram's rows, bottom first."""
    if u in {"config", "sampling_params", "outputs", "utils", "logger", "structured_output"}:
        return 0
    if u in {"models", "layers", "attention", "kernels", "loader"}:
        return 1
    if u == "engine.messages":
        return 2
    if u == "spec_decode" or (u.startswith("engine.") and u[7:] not in FRONT_END):
        return 3
    if u.startswith("engine."):
        return 4
    if u in {"entrypoints", "llm", "cli", "liteinfer"}:
        return 5
    assert u == "bench", f"{u} has no row in ARCHITECTURE.md's diagram"
    return 6


def imports(tree: ast.AST, with_type_hints: bool) -> set[str]:
    """The liteinfer modules a module imports (those inside `if TYPE_CHECKING:` only when
    `with_type_hints`), at its top or inside its functions."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
                    and not with_type_hints):
                continue
            if (isinstance(child, ast.ImportFrom) and child.level == 0 and child.module
                    and child.module.split(".")[0] == "liteinfer"):
                found.add(child.module)
                found.update(f"{child.module}.{alias.name}" for alias in child.names)
            elif isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.split(".")[0] == "liteinfer")
            visit(child)

    visit(tree)
    return found


def sources() -> dict[str, ast.AST]:
    return {module_name(p): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_module_imports_upward():
    modules = sources()
    wrong = []
    for name, tree in modules.items():
        here = unit(name)
        for target in imports(tree, with_type_hints=True) & modules.keys():
            there = unit(target)
            if here == there or here == "bench":
                continue
            if here == "cli" and there == "bench":  # `liteinfer bench` is `liteinfer-bench`
                continue
            if layer(there) > layer(here):
                wrong.append(f"{name} imports {target} (upward)")
            elif layer(here) >= 4 and layer(there) == 3 and there not in STARTS_THE_CORE:
                wrong.append(f"{name} imports {target} (the front end reaches into the core)")
            elif here == "spec_decode" and there.startswith("engine.") \
                    and there != "engine.messages":
                wrong.append(f"{name} imports {target} (speculation reads token ids only)")
    assert not wrong, "\n".join(wrong)


def circles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The circles a depth-first walk of `graph` (module -> the modules it imports) meets, each
    as the path that closes it."""
    state: dict[str, str] = {}
    found: list[list[str]] = []

    def walk(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in graph[name]:
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [name, target])
            elif target not in state:
                walk(target, path + [name])
        state[name] = "done"

    for name in graph:
        if name not in state:
            walk(name, [])
    return found


def test_no_import_circles():
    modules = sources()
    graph = {name: sorted(imports(tree, with_type_hints=False) & modules.keys() - {name})
             for name, tree in modules.items()}
    found = circles(graph)
    assert not found, "\n".join(" -> ".join(c) for c in found)


def test_the_rules_see_a_circle_and_an_upward_import():
    """The checks above find what they look for: an import under TYPE_CHECKING counts only with
    type hints, the engine sits above the kernels, and three modules importing in a ring form
    a circle where a chain does not."""
    tree = ast.parse("from liteinfer.engine.scheduler import Scheduler\n"
                     "if TYPE_CHECKING:\n    from liteinfer.models.llama import X\n")
    assert imports(tree, with_type_hints=False) == {"liteinfer.engine.scheduler",
                                                    "liteinfer.engine.scheduler.Scheduler"}
    assert "liteinfer.models.llama" in imports(tree, with_type_hints=True)
    assert layer(unit("liteinfer.engine.scheduler")) > layer(unit("liteinfer.kernels.gemv"))
    assert circles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c", "a"]]
    assert circles({"a": ["b"], "b": ["c"], "c": [], "d": ["a", "c"]}) == []
