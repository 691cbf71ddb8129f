"""The house rules a reorganization must keep: no import cycle anywhere (imports inside functions and under
TYPE_CHECKING count), no module over ~500 lines, the storage layer's first three modules usable without JAX, entry
points as thin as nanodo's, training that never imports planning, each config bound stated once, and a suite that
leaves the developer's home alone."""

import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from support.cli import ROOT

PACKAGES = ("configs", "data", "gpt2", "optim", "trainer", "planning", "tools", "benchmarks")
TOP_LEVEL = ("train", "eval", "plan", "errors", "fields")

# The house, from the ground up: a module imports from its own floor or below, never above. Programs (the entry
# points, `python -m data.prepare`, the tools and the benchmarks) stand on top and may use any floor.
FLOORS = [
    ("errors", "fields"),  # the ground: the application's errors, every config field's bound and check
    ("gpt2", "data"),  # the model (its parameters carry their facts) and the tokens
    ("optim",),  # optimizers and schedules: read the parameters' facts
    ("configs",),  # the training config: the sections below composed, the presets, the command line
    ("trainer",),  # training and evaluation runs
    ("planning",),  # plan.py's library: compiles the trainer's program for a topology
]
PROGRAMS = ("train", "eval", "plan", "tools", "benchmarks", "data.prepare.cli", "data.prepare.__main__")


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
    long = {p: n for p, n in sizes.items() if n > 500}  # test files too
    assert not long, long


def test_entry_points_only_parse_and_call_the_library():
    for script in ("train.py", "eval.py", "plan.py"):
        assert len((ROOT / script).read_text().splitlines()) <= 100, script


def test_the_storage_layer_below_the_run_directory_needs_no_jax():
    code = ("import sys; import trainer.storage.files, trainer.storage.retries, trainer.storage.lock;"
            " print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def floor_of(module: str) -> int:
    if any(module == p or module.startswith(p + ".") for p in PROGRAMS):
        return len(FLOORS)
    return next(i for i, names in enumerate(FLOORS) if module.split(".")[0] in names)


def test_no_import_runs_up_the_house():
    """The model imports nothing of the optimizer, the configs or the trainer; the configs nothing of the trainer;
    ... (FLOORS). Imports inside functions count."""
    trees = modules()
    upward = {f"{n} -> {m}" for n, tree in trees.items() for m in imports_of(n, tree, set(trees))
              if floor_of(m) > floor_of(n)}
    assert not upward, sorted(upward)


def test_every_module_has_a_floor():
    assert {floor_of(n) for n in modules()} <= set(range(len(FLOORS) + 1))
    assert floor_of("gpt2.config") < floor_of("optim.base") < floor_of("configs.base") < floor_of("trainer.run")


def test_training_never_imports_planning():
    """Planning (AOT compiles, the step-time model, the planner) is its own program over the training library, as
    MaxText's train_compile.py is; nothing a training or evaluation run executes reaches into it."""
    trees = modules()
    training = [n for n in trees if n.split(".")[0] in ("trainer", "gpt2", "data", "configs") or n in ("train", "eval")]
    reached = {n: sorted(m for m in imports_of(n, trees[n], set(trees)) if m.split(".")[0] in ("planning", "plan"))
               for n in training}
    assert not {n: m for n, m in reached.items() if m}


def bounded_fields() -> set[str]:
    """The names of every config field whose Field states a bound."""
    import dataclasses
    import typing

    from configs.base import Config
    from configs.eval import EvalConfig
    from fields import Field
    from configs.plan import PlanConfig
    from data.prepare.config import PrepareConfig
    from tools.export_hf import ExportConfig

    names, todo = set(), [Config, EvalConfig, PlanConfig, PrepareConfig, ExportConfig]
    while todo:
        cls = todo.pop()
        for name, hint in typing.get_type_hints(cls, include_extras=True).items():
            if dataclasses.is_dataclass(hint):
                todo.append(hint)
            elif any(isinstance(m, Field) and m.bound() for m in getattr(hint, "__metadata__", ())):
                names.add(name)
    return names


def range_checks(tree: ast.Module, fields: set[str]) -> list[tuple[int, str]]:
    """(line, field) of each `if` that compares one of `fields` with a number and raises or fails."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or not any(
                isinstance(n, ast.Raise) or (isinstance(n, ast.Call) and getattr(n.func, "id", "") == "fail")
                for stmt in node.body for n in ast.walk(stmt)):
            continue
        for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            sides = [cmp.left, *cmp.comparators]
            ordering = any(isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for op in cmp.ops)
            number = any(isinstance(s, ast.Constant) and isinstance(s.value, (int, float)) for s in sides)
            field = [s.attr for s in sides if isinstance(s, ast.Attribute) and s.attr in fields]
            if ordering and number and field:
                found.append((node.lineno, field[0]))
    return found


def test_each_config_bound_is_checked_only_by_its_field():
    """A range check of a config field (`if cfg.batch_size < 1: raise ...`) anywhere but in its Field is a second
    statement of the bound."""
    fields = bounded_fields()
    found = {name: range_checks(tree, fields) for name, tree in modules().items()
             if name not in ("fields", "tools.pod.cli")}  # the mechanism; the pod launcher's argparse flags
    assert not {name: lines for name, lines in found.items() if lines}


def test_the_range_check_finder_finds_one():
    code = "def f(cfg):\n    if cfg.train.batch_size < 1:\n        raise ValueError('x')\n    if cfg.steps > 0:\n" \
           "        print(cfg.steps)\n"
    assert range_checks(ast.parse(code), bounded_fields()) == [(2, "batch_size")]


def test_no_config_docstring_restates_a_fields_meaning():
    """The meaning of a field lives in its Field; a class docstring's `Attributes:` list would be a second copy."""
    import dataclasses

    from configs.base import Config
    from configs.eval import EvalConfig
    from data.prepare.config import PrepareConfig
    from tools.export_hf import ExportConfig

    sections = [type(getattr(Config(), f.name)) for f in dataclasses.fields(Config)
                if dataclasses.is_dataclass(getattr(Config(), f.name))]
    classes = [EvalConfig, PrepareConfig, ExportConfig, Config] + sections
    assert not [c.__name__ for c in classes if "Attributes:" in (c.__doc__ or "")]


def test_tests_reach_the_entry_points_only_through_main():
    """Library code is imported from the library; a test uses train.py / eval.py / plan.py only by calling `main`."""
    found = []
    for path in (ROOT / "tests").rglob("*.py"):
        tree = ast.parse(path.read_text())
        aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                   if a.name in ("train", "eval", "plan")}
        found += [f"{path.relative_to(ROOT)}: from {n.module} import {[a.name for a in n.names]}"
                  for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module in ("train", "eval", "plan")
                  and any(a.name != "main" for a in n.names)]
        found += [f"{path.relative_to(ROOT)}:{n.lineno}: {n.value.id}.{n.attr}" for n in ast.walk(tree)
                  if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
                  and n.attr != "main"]
    assert not found, found


def test_the_suite_runs_in_a_home_of_its_own():
    """`~` is the session's temporary home (tests/conftest.py) here and in every process the tests start."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.path.expanduser('~'))"], capture_output=True,
                           text=True, check=True).stdout.strip()
    assert child == os.path.expanduser("~") == os.environ["GPT2_NNX_TEST_HOME"]
    assert Path(child).parent == Path(tempfile.gettempdir())
