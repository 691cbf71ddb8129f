"""The house rules a reorganization must keep: no import cycle anywhere (imports inside functions and under
TYPE_CHECKING count), no module over ~500 lines, the storage layer's first three modules usable without JAX, and
entry points as thin as nanodo's."""

import ast
import subprocess
import sys

from conftest import ROOT

PACKAGES = ("configs", "data", "gpt2", "trainer", "tools", "benchmarks")
TOP_LEVEL = ("train", "eval", "errors")


def modules() -> dict[str, ast.Module]:
    """Every module of the project by dotted name, parsed."""
    found = {name: ROOT / f"{name}.py" for name in TOP_LEVEL}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {name: ast.parse(path.read_text(), str(path)) for name, path in found.items()}


def imports_of(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its file (`from a.b import c` counts a.b.c when that is a
    module, else a.b)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                base = ".".join(name.split(".")[: -node.level] + ([base] if base else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {m for m in out if m in known and m != name}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_module_imports_itself_back():
    trees = modules()
    graph = {name: imports_of(name, tree, set(trees)) for name, tree in trees.items()}
    # a package's __init__ importing its own modules is not a cycle through them: leave packages out as targets
    graph = {n: {m for m in deps if not any(k.startswith(m + ".") for k in trees)} for n, deps in graph.items()}
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_is_over_500_lines():
    sizes = {}
    for package in (*PACKAGES, "tests"):
        for path in (ROOT / package).rglob("*.py"):
            sizes[str(path.relative_to(ROOT))] = len(path.read_text().splitlines())
    for name in TOP_LEVEL:
        sizes[f"{name}.py"] = len((ROOT / f"{name}.py").read_text().splitlines())
    long = {p: n for p, n in sizes.items() if n > 500 and not p.startswith("tests/")}
    assert not long, long


def test_entry_points_only_parse_and_call_the_library():
    for script in ("train.py", "eval.py"):
        assert len((ROOT / script).read_text().splitlines()) <= 100, script


def test_the_storage_layer_below_the_run_directory_needs_no_jax():
    code = ("import sys; import trainer.storage.files, trainer.storage.retries, trainer.storage.lock;"
            " print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
