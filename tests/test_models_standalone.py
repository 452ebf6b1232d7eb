"""`models/` runs with torch and numpy alone (design.md, "Layout"): no pydantic, Ray, MLflow, Optuna or `study`.

The run checks go through a fresh interpreter whose first `sys.meta_path` finder refuses those packages (and their
submodules), so an import of any of them anywhere under `models/`, however indirect, fails the run. Uninstalling
them is not needed: the finder is asked before the installed packages are. The source checks read the import
statements of `models/` and of the tests that bench/gpu_check.sh runs on a machine that has torch, Triton, numpy
and pytest only.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("pydantic", "ray", "mlflow", "optuna", "study")

HOOK = f"""
import importlib.abc
import sys

BLOCKED = {BLOCKED!r}


class RefuseStudyPackages(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{{name}} is blocked: models/ must run on torch and numpy alone", name=name)
        return None


# A package imported before the hook (by a .pth file at start-up) would be served from sys.modules unseen.
preloaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
assert not preloaded, f"imported before the hook was installed: {{preloaded}}"
sys.meta_path.insert(0, RefuseStudyPackages())
"""


def _run(body: str) -> subprocess.CompletedProcess:
    script = HOOK + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_hook_refuses_every_study_package():
    # Without this, a hook that never fires would let the next test pass whatever models/ imports.
    result = _run(f"""
        refused = []
        for name in {BLOCKED!r} + ("pydantic.dataclasses", "ray.tune"):
            try:
                __import__(name)
            except ModuleNotFoundError as exc:
                assert "is blocked" in str(exc), exc
                refused.append(name)
        print(refused)
        assert len(refused) == {len(BLOCKED) + 2}, refused
    """)
    assert result.returncode == 0, result.stdout + result.stderr


def test_models_build_and_run_without_the_study_packages():
    result = _run("""
        import torch

        import models
        import models.geometry
        import models.stlt
        from models import build_model

        torch.manual_seed(0)
        vit = build_model({"preset": "vit_tiny_digits", "depth": 2, "mixer": "stlt", "stlt_nodes": 4})
        assert vit.mixer_kinds == ["stlt", "stlt"], vit.mixer_kinds
        out = vit(torch.randn(2, 1, 8, 8), return_features=True)
        assert out.logits.shape == (2, 10) and torch.isfinite(out.logits).all()
        split = models.geometry.variance_decomposition(out.tokens, torch.tensor([0, 1]))
        assert split["total_var"] > 0, split

        gpt = build_model({"preset": "gpt_tiny", "depth": 2, "k": 2})
        assert [block.mixer.laplacian_heads for block in gpt.blocks] == [2, 2]
        logits = gpt(torch.randint(0, 257, (2, 16)))
        assert logits.shape == (2, 16, 257) and torch.isfinite(logits).all()

        leaked = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
        assert not leaked, leaked
        print("models ran standalone")
    """)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "models ran standalone" in result.stdout


def _imported_modules(path: Path) -> list[str]:
    """Every absolute import in a file, at any depth (imports inside functions count too)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module)
    return names


def _outside(paths: list[Path], allowed: set[str]) -> dict[str, list[str]]:
    """Imports that are neither the standard library nor `allowed`, per file; test helpers (tests/<name>.py,
    imported as `name` or `tests.name`) are followed and checked too."""
    found, seen, queue = {}, set(), list(paths)
    while queue:
        path = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imported_modules(path):
            parts = name.split(".")
            helper = ROOT / "tests" / f"{parts[1] if parts[0] == 'tests' and len(parts) > 1 else parts[0]}.py"
            if parts[0] == "tests" or helper.exists():
                queue.append(helper)
            elif parts[0] not in allowed and parts[0] not in sys.stdlib_module_names:
                found.setdefault(str(path.relative_to(ROOT)), []).append(name)
    return found


def test_models_source_imports_only_torch_numpy_and_triton():
    files = sorted((ROOT / "models").rglob("*.py"))
    assert len(files) > 10
    assert _outside(files, {"torch", "numpy", "triton", "models"}) == {}


def test_the_gpu_check_tests_import_only_what_the_gpu_machine_has():
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    files = sorted({ROOT / name for name in re.findall(r"tests/test_\w+\.py", script)})
    assert len(files) >= 5 and all(f.exists() for f in files), files
    assert _outside([*files, ROOT / "tests" / "conftest.py"], {"torch", "numpy", "triton", "pytest", "models"}) == {}
