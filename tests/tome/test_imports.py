"""Imports inside ``tome/`` run one way: the graph of its modules, read from the source (function-level imports
included), has no cycle. Two modules that import each other are one module or three (docs/DEVELOPING.md,
"Layout")."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "tome"


def module_files() -> dict[str, Path]:
    """Every module of ``tome/`` by its dotted name (a package by its own name, for its ``__init__.py``)."""
    files = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``tome/`` that module ``name`` (at ``path``) imports anywhere in its source: relative
    imports resolved against its package, ``from X import y`` counted as ``X.y`` where that is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            submodules = [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in modules]
            found.update(submodules)
            if len(submodules) < len(node.names):  # names defined in the module (or package) itself
                found.add(source)
    return {module for module in found if module in modules and module != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in order, the first repeated at the end), or ``None``."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_modules_of_tome_import_one_another_one_way():
    found = cycle(import_graph())
    assert found is None, "import cycle in tome/: " + " -> ".join(found)


# The DiT host's modules by job, each importing only those before it (``tome/hosts/comfyui_dit.py``'s docstring).
DIT_LAYERS = ("comfyui", "dit_settings", "comfyui_dit_swap", "dit_families", "gpu_rule", "dit_tokens",
              "comfyui_dit_attention", "dit_token_cache", "comfyui_dit_block", "comfyui_dit")


def test_the_dit_host_is_split_by_job_each_module_importing_only_those_before_it():
    graph = import_graph()
    for i, name in enumerate(DIT_LAYERS):
        hosts = {module.removeprefix("tome.hosts.") for module in graph["tome.hosts." + name]
                 if module.startswith("tome.hosts.")}
        assert hosts <= set(DIT_LAYERS[:i]), (name, hosts - set(DIT_LAYERS[:i]))


@pytest.mark.parametrize("source", ["def f():\n    from .b import x\n",  # a function-level import counts
                                    "from . import b\n", "import tome.b\n"])
def test_a_cycle_is_found_wherever_the_import_stands(tmp_path, source):
    a = tmp_path / "a.py"
    a.write_text(source)
    b = tmp_path / "b.py"
    b.write_text("from .a import y\n")
    modules = {"tome.a": a, "tome.b": b}
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    assert cycle(graph) in (["tome.a", "tome.b", "tome.a"], ["tome.b", "tome.a", "tome.b"])
