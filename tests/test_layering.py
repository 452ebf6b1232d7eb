"""The layering of `study/`, read from the source with `ast` (nothing is imported): the import graph has no cycle,
`study/data` sits at the bottom, and each rule named in `study/bookkeeping.py` has that one owner."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "study"
# What `study/data` may import from above it: leaves of `study/` that import nothing from `study/` themselves.
DATA_MAY_IMPORT = frozenset({"study.errors"})


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    at_module_level: bool  # False: inside a function, run on the first call


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(STUDY.rglob("*.py"))}


def _lazy_homes(package: str) -> dict[str, str]:
    """A package's names imported on first use (`_HOMES = {name: module}`, resolved by its `__getattr__`)."""
    for node in ast.parse(MODULES[package].read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_HOMES" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules of `study/` that running this import statement executes (the packages on the way included)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}".rstrip(".")
        names = []
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            if submodule in MODULES:
                names.append(submodule)
            elif base in MODULES and alias.name in _lazy_homes(base):
                names.append(_lazy_homes(base)[alias.name])
            else:
                names.append(base)
    found = []
    for name in names:
        parts = name.split(".")
        found += [".".join(parts[:i]) for i in range(2, len(parts) + 1) if ".".join(parts[:i]) in MODULES]
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _is_type_checking(node: ast.If) -> bool:
    return ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _edges(module: str) -> list[Edge]:
    tree = ast.parse(MODULES[module].read_text())
    edges = []

    def walk(node: ast.AST, at_module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue  # never run: annotations only
            if isinstance(child, ast.Import | ast.ImportFrom):
                # A module's own packages run before it whatever it imports: not edges.
                edges.extend(Edge(module, target, child.lineno, at_module_level)
                             for target in _targets(module, child) if not _within(module, target))
            inside_function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            walk(child, at_module_level and not inside_function)

    walk(tree, True)
    return edges


EDGES = [edge for module in MODULES for edge in _edges(module)]


def _cycle(edges: list[Edge]) -> list[str] | None:
    """A cycle of the graph, as the modules along it, or None (depth-first search)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_reader_sees_every_kind_of_import():
    # Known answers from files whose imports are plain to read: a lazy package name resolves to its home module,
    # a submodule import names the package on the way, a function-level import is marked as such.
    edges = {(e.source, e.target, e.at_module_level) for e in EDGES}
    assert ("study.trial", "study.data.load", True) in edges  # from study.data import load_task_data (lazy home)
    assert ("study.trial", "study.data", True) in edges
    assert ("study.loop", "study.tasks", True) in edges
    assert any(not at_module_level for _, _, at_module_level in edges)
    assert _cycle([Edge("a", "b", 1, True), Edge("b", "c", 1, False), Edge("c", "a", 1, True)]) == ["a", "b", "c", "a"]
    assert _cycle([Edge("a", "b", 1, True), Edge("a", "c", 1, True), Edge("b", "c", 1, True)]) is None


def test_the_import_graph_of_study_is_acyclic_at_module_level():
    cycle = _cycle([e for e in EDGES if e.at_module_level])
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_function_level_import_hides_a_cycle():
    """An import put inside a function to dodge a circular import: with it counted, the graph has a cycle."""
    cycle = _cycle(EDGES)
    if cycle is not None:
        hiding = [f"{e.source}:{e.line} imports {e.target}" for e in EDGES if not e.at_module_level
                  and (e.source, e.target) in set(zip(cycle, cycle[1:]))]
        pytest.fail("import cycle through function-level imports: " + " -> ".join(cycle) + "; " + "; ".join(hiding))


def test_study_data_imports_nothing_above_it():
    above = [f"{e.source}:{e.line} imports {e.target}" for e in EDGES if e.source.startswith("study.data")
             and not e.target.startswith("study.data") and e.target not in DATA_MAY_IMPORT]
    assert above == []
    for leaf in DATA_MAY_IMPORT:  # what data may import is itself a leaf of study/
        assert [e.target for e in EDGES if e.source == leaf] == []


def _string_constants(path: Path) -> list[tuple[int, str]]:
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def _collections_of_strings(path: Path) -> list[tuple[int, set[str]]]:
    """The set, tuple and list literals of a file whose elements are all strings, with two or more elements."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Set | ast.Tuple | ast.List) and len(node.elts) >= 2 and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            found.append((node.lineno, {e.value for e in node.elts}))
    return found


def test_the_keys_that_are_not_metrics_or_hyperparameters_are_spelled_out_once():
    from study import bookkeeping

    owned = (bookkeeping.TRIAL_IDENTITY, bookkeeping.BOOKKEEPING, bookkeeping.TUNE_ADDED)
    again = [f"{path.relative_to(REPO)}:{line} {sorted(keys)}" for path in MODULES.values()
             if path.name != "bookkeeping.py" for line, keys in _collections_of_strings(path)
             if any(keys <= keys_of_one_rule for keys_of_one_rule in owned)]
    assert again == []
    # derived from one definition: the loop's bookkeeping holds everything only Ray records
    assert bookkeeping.RAY_ONLY < bookkeeping.BOOKKEEPING and bookkeeping.EPOCH in bookkeeping.BOOKKEEPING


def test_every_reader_filters_by_the_owners_sets():
    from study import bookkeeping, loop, report, results, stages, sync, tracking

    assert sync.TUNE_ADDED is bookkeeping.TUNE_ADDED
    assert tracking.RAY_ONLY is bookkeeping.RAY_ONLY and tracking.EPOCH is bookkeeping.EPOCH
    assert loop.BOOKKEEPING is bookkeeping.BOOKKEEPING and stages.BOOKKEEPING is bookkeeping.BOOKKEEPING
    assert report.TRIAL_IDENTITY is bookkeeping.TRIAL_IDENTITY and results.TRIAL_IDENTITY is bookkeeping.TRIAL_IDENTITY
    for old_name in ("TUNE_KEYS", "RAY_ONLY_KEYS"):
        assert not hasattr(sync, old_name) and not hasattr(tracking, old_name)


def test_the_hub_image_catalogue_is_its_one_source_of_names():
    from study.data.config import HUB_PRESETS, HubImageConfig

    names = set(HUB_PRESETS) | {preset.hub_id for preset in HUB_PRESETS.values()}
    again = [f"{path.relative_to(REPO)}:{line} {value}" for path in MODULES.values()
             if path != STUDY / "data" / "config.py" for line, value in _string_constants(path) if value in names]
    assert again == []
    assert HubImageConfig.model_fields["name"].description.startswith(", ".join(HUB_PRESETS) + ", or")
    assert HubImageConfig(source="hf", name="cifar100").hub_id == HUB_PRESETS["cifar100"].hub_id
    assert HubImageConfig(source="hf", name="owner/name").preset is None


def test_the_task_kind_check_lives_where_the_run_spec_is_built():
    readers = {path.relative_to(REPO).as_posix() for path in MODULES.values()
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Attribute) and node.attr == "data_kind"}
    assert readers == {"study/runspec.py"}
