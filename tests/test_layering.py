"""The layering of `study/`, read from the source with `ast` (nothing is imported): the import graph has no cycle,
`study/data` sits at the bottom, and each rule named in `study/bookkeeping.py` has that one owner."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "study"
# What `study/data` may import from above it: leaves of `study/` that import nothing from `study/` themselves.
DATA_MAY_IMPORT = frozenset({"study.errors", "study.schema"})


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
    from study import bookkeeping, loop, results, sync, trial
    from study.tracking import run_logger

    assert sync.TUNE_ADDED is bookkeeping.TUNE_ADDED
    assert run_logger.RAY_ONLY is bookkeeping.RAY_ONLY and run_logger.EPOCH is bookkeeping.EPOCH
    assert loop.BOOKKEEPING is bookkeeping.BOOKKEEPING and trial.BOOKKEEPING is bookkeeping.BOOKKEEPING
    assert results.TRIAL_IDENTITY is bookkeeping.TRIAL_IDENTITY  # the report names trials by results' `sampled`
    for old_name in ("TUNE_KEYS", "RAY_ONLY_KEYS"):
        assert not hasattr(sync, old_name) and not hasattr(run_logger, old_name)


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


def _walks_of_conditional_groups(path: Path) -> list[int]:
    """Lines that read a conditional group's condition (`.when`, `.active`) or loop over a space's groups
    (`.conditional` in what a `for` or a comprehension iterates)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("when", "active"):
            lines.append(node.lineno)
        if isinstance(node, ast.For | ast.comprehension) and any(
                isinstance(n, ast.Attribute) and n.attr == "conditional" for n in ast.walk(node.iter)):
            lines.append(node.iter.lineno)
    return sorted(lines)


def test_the_walk_of_conditional_groups_has_one_owner():
    """The sampler, `resolve`, the corner checks and the report all walk the space through
    `SearchSpace.parameters_to_sample` (define-by-run) or `SearchSpace.every_parameter`: only the space reads a
    group's condition or loops over its groups."""
    owners = {"study/space.py", "study/space_parameters.py"}
    walks = [f"{path.relative_to(REPO).as_posix()}:{line}" for path in MODULES.values()
             if path.relative_to(REPO).as_posix() not in owners for line in _walks_of_conditional_groups(path)]
    assert walks == []


def test_the_walk_reader_sees_each_way_of_walking_the_groups(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f(space, values):\n    for group in space.conditional:\n        if group.active(values):\n"
                      "            pass\n    return [g.when for i, g in enumerate(space.conditional)], "
                      "bool(space.conditional)\n")
    assert _walks_of_conditional_groups(sample) == [2, 3, 5, 5]


def _limit_checks(path: Path, fields: set[str]) -> list[int]:
    """Lines that hold one of `fields` to a number by hand: an `if` that compares it with a number and raises, or a
    call given both (`at_least(1, args.workers, ...)`)."""

    def named(node) -> bool:
        return (isinstance(node, ast.Name) and node.id in fields) or (isinstance(node, ast.Attribute)
                                                                      and node.attr in fields)

    def number(node) -> bool:
        return isinstance(node, ast.Constant) and type(node.value) in (int, float)

    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and any(isinstance(n, ast.Raise) for b in node.body for n in ast.walk(b)):
            compares = [n for n in ast.walk(node.test) if isinstance(n, ast.Compare)]
            if any(any(map(named, [c.left, *c.comparators])) and any(map(number, [c.left, *c.comparators]))
                   for c in compares):
                lines.append(node.lineno)
        if isinstance(node, ast.Call) and any(map(named, node.args)) and any(map(number, node.args)):
            lines.append(node.lineno)
    return sorted(lines)


def _calls(path: Path, names: set[str]) -> list[int]:
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and ast.unparse(node.func) in names]


def test_the_worker_limits_have_one_home():
    """How many workers a run may have and what each may hold are `Resources`' field constraints; the command line's
    worker flags are checked by them (errors.validate_flags), not by checks of their own."""
    from study.runspec import Resources

    fields = {"workers", "workers_per_trial", "cpus_per_worker", "gpus_per_worker"}
    by_hand = [f"{path.relative_to(REPO)}:{line}" for path in MODULES.values() for line in _limit_checks(path, fields)]
    assert by_hand == []
    for refused in ({"workers": 0}, {"cpus_per_worker": 0}, {"gpus_per_worker": -1}):
        with pytest.raises(ValueError, match=next(iter(refused))):
            Resources(**refused)


def test_the_evaluation_rules_have_one_home():
    """study/evals/spec.py owns the `evaluate:` entry and its rules; the command line checks its flags as an entry,
    the task modules take their names from it, and only the sandbox decides whether model-written code may run."""
    from study import precheck, runspec, space
    from study.evals import cli, gsm8k, humaneval, load, sandbox, spec

    assert humaneval.TASK is spec.HUMANEVAL and gsm8k.TASK is spec.GSM8K_CHAT
    assert runspec.Evaluations is spec.Evaluations and space.check_evaluation is spec.check_evaluation
    assert cli.EvaluationSpec is spec.EvaluationSpec and load.check_evaluated_task is spec.check_evaluated_task
    assert precheck.check_code_execution is spec.check_code_execution
    owner = STUDY / "evals" / "spec.py"
    spelled_again = [f"{path.relative_to(REPO)}:{line} {value!r}" for path in MODULES.values() if path != owner
                     for line, value in _string_constants(path)
                     if value in spec.OWN_TASKS or "greedy samples" in value or "evaluate language models" in value]
    assert spelled_again == []
    by_hand = [f"{path.relative_to(REPO)}:{line}" for path in MODULES.values()
               if path.is_relative_to(STUDY / "evals") and path != owner
               for line in _limit_checks(path, {"num_samples", "temperature", "limit", "num_fewshot"})]
    assert by_hand == []
    code_execution = [f"{path.relative_to(REPO)}:{line}" for path in MODULES.values() if path.name != "sandbox.py"
                      for line in _calls(path, {"CodeExecutionNotAllowed", "isolation.require"})]
    assert code_execution == []
    with pytest.raises(sandbox.CodeExecutionNotAllowed, match="--tasks humaneval"):
        spec.check_humaneval_allowed(["mmlu", spec.HUMANEVAL], False, "--")


def test_the_limit_reader_sees_each_way_of_checking_by_hand(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f(args, r):\n    if args.workers < 1:\n        raise ValueError\n"
                      "    if r.gpus_per_worker > 0:\n        return 1\n    at_least(1, args.workers, 'x')\n"
                      "    if cpus_per_worker is not None and not cpus_per_worker > 0:\n        raise ValueError\n")
    assert _limit_checks(sample, {"workers", "gpus_per_worker", "cpus_per_worker"}) == [2, 6, 7]


def test_the_schemas_share_one_strict_base_and_one_validator_idiom():
    """Strictness (unknown keys refused, values frozen) is set once, in study/schema.py; validators are written as
    decorated methods, not `field_validator(...)(classmethod(lambda ...))`."""
    owner = STUDY / "schema.py"
    configs = [f"{path.relative_to(REPO)}:{node.lineno}" for path in MODULES.values() if path != owner
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Call) and ast.unparse(node.func) == "ConfigDict"
               and any(k.arg == "extra" and getattr(k.value, "value", None) == "forbid" for k in node.keywords)]
    assert configs == []
    lambdas = [f"{path.relative_to(REPO)}:{node.lineno}" for path in MODULES.values()
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Call) and ast.unparse(node.func) == "classmethod"
               and any(isinstance(a, ast.Lambda) for a in node.args)]
    assert lambdas == []


def _module_level_environment_changes(path: Path) -> list[int]:
    """Lines of statements run on import (outside functions and classes) that change os.environ."""
    changes = []

    def is_environ(node) -> bool:
        return ast.unparse(node) in ("os.environ", "environ")

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
                continue
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and (
                    (is_environ(child.func.value) and child.func.attr in ("setdefault", "update", "pop", "clear"))
                    or ast.unparse(child.func) == "os.putenv"):
                changes.append(child.lineno)
            if isinstance(child, ast.Assign | ast.AugAssign | ast.Delete) and any(
                    isinstance(t, ast.Subscript) and is_environ(t.value)
                    for t in getattr(child, "targets", None) or [getattr(child, "target", None)]):
                changes.append(child.lineno)
            walk(child)

    walk(ast.parse(path.read_text()))
    return changes


def test_no_module_of_study_or_models_changes_the_environment_on_import():
    modules = [*MODULES.values(), *sorted((REPO / "models").rglob("*.py"))]
    changes = [f"{path.relative_to(REPO)}:{line}"
               for path in modules for line in _module_level_environment_changes(path)]
    assert changes == []


def test_the_environment_reader_sees_each_way_of_changing_it(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('import os\nos.environ.setdefault("A", "1")\nos.environ["B"] = "2"\nif True:\n'
                      '    os.putenv("D", "4")\ndef f():\n    os.environ["C"] = "3"\n')
    assert _module_level_environment_changes(sample) == [2, 3, 5]


def test_importing_tracking_leaves_the_environment_alone_and_a_run_logger_sets_the_client_up():
    """In a fresh interpreter: importing study.tracking's modules makes no change to os.environ from the project's own
    code (each change is put down to the innermost module outside `os`: Ray's and MLflow's own imports set some); the
    first RunLogger gives the process the MLflow client settings, keeping the one the user set."""
    script = """
import json, os, sys
changes, original = [], os._Environ.__setitem__
def recording(self, key, value):
    frame = sys._getframe(1)
    while frame.f_globals.get("__name__") in ("os", "_collections_abc"):
        frame = frame.f_back
    changes.append([key, frame.f_globals.get("__name__")])
    original(self, key, value)
os._Environ.__setitem__ = recording
os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "7"
changes.clear()
import study.tracking.run_logger as run_logger, study.tracking.runs, study.tracking.store
from study.mlflow_settings import MLFLOW_CLIENT_SETTINGS
on_import = list(changes)
run_logger.RunLogger(run_logger.TrackingTarget("", "0", "t", "t", "s"), {}, "")
print(json.dumps({"on_import": on_import, "after_logger": {k: os.environ.get(k) for k in MLFLOW_CLIENT_SETTINGS}}))
"""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    ours = [(key, module) for key, module in found["on_import"] if module.split(".")[0] in ("study", "models")]
    assert ours == []
    from study.mlflow_settings import MLFLOW_CLIENT_SETTINGS

    assert found["after_logger"] == {**MLFLOW_CLIENT_SETTINGS, "MLFLOW_HTTP_REQUEST_TIMEOUT": "7"}
